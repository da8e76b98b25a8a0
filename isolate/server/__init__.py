"""``isolate-run serve``: an OpenSandbox-compatible HTTP server over ``isolate.Sandbox``.

The OpenSandbox SDKs (``opensandbox`` on PyPI and the tools built on it)
speak a lifecycle API (``/v1/sandboxes``) and, per sandbox, an execution
API; this package serves both from one process, each sandbox an unnamed
native ``isolate.Sandbox``. Needs the ``server`` extra (starlette, uvicorn,
python-multipart): ``pip install 'isolate[server]'``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import sys
from collections.abc import Sequence

from ..cli.flags import EXIT_SETUP, UsageError, UsageParser
from ..model.errors import IsolationError, PolicyError
from ..model.policy import Policy
from ..model.units import whole_number

__all__ = ["create_app", "serve_main"]


def create_app(api_key: str, profiles: dict[str, Policy] | None = None, any_image: Policy | None = None,
               backend: str | None = None, volume_roots: Sequence[str] = (), warm: int = 0) -> object:
    """The ASGI application (starlette), for embedding or tests."""
    from .app import create_app as _create
    from .state import ServerState
    from .volumes import check_roots

    state = ServerState(api_key, profiles if profiles is not None else {"default": Policy()}, any_image,
                        backend, volume_roots=check_roots(volume_roots), warm=warm)
    state.start_pool()
    return _create(state)


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or len(port) > 5 or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:8080)")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def _profile(text: str) -> Policy:
    return Policy() if text == "default" else Policy.load(text)


def _api_key(options: argparse.Namespace) -> tuple[str | None, str]:
    """The API key and where it came from: ``--api-key``, ``--api-key-file`` or ``$ISOLATE_API_KEY``."""
    if options.api_key is not None and options.api_key_file is not None:
        raise ValueError("--api-key and --api-key-file: give one")
    if options.api_key is not None:
        return options.api_key, "--api-key"
    if options.api_key_file is not None:
        from ..model.files import read_input_file

        path = options.api_key_file
        try:
            if os.stat(path).st_mode & 0o077:
                raise ValueError(f"--api-key-file {path}: others may read it; chmod 600 it")
            data = read_input_file(path, limit=4096)
        except OSError as exc:
            raise ValueError(f"--api-key-file {path}: {exc.strerror}") from None
        lines = data.decode(errors="replace").splitlines()
        return (lines[0].strip() if lines else ""), "--api-key-file"
    if os.environ.get("ISOLATE_API_KEY"):
        return os.environ["ISOLATE_API_KEY"], "ISOLATE_API_KEY"
    return None, ""


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="isolate-run serve",
        description="Serve the OpenSandbox lifecycle and execution APIs over isolate sandboxes. "
                    "An image name selects a policy profile: 'default' (isolate's defaults) always, "
                    "--image NAME=FILE for more, --profile FILE for any other name.")
    parser.add_argument("--listen", type=_listen, default=("127.0.0.1", 8080), metavar="HOST:PORT",
                        help="where to listen (default 127.0.0.1:8080)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="the key clients send in OPEN-SANDBOX-API-KEY (default: $ISOLATE_API_KEY, else a new "
                             "random key, printed); on the command line every local user can read it in the "
                             "process list: prefer --api-key-file or the variable")
    parser.add_argument("--api-key-file", metavar="FILE",
                        help="read the key from FILE (its first line; the file readable by its owner only)")
    parser.add_argument("--profile", metavar="FILE",
                        help="a TOML policy for every image name not given by --image ('default': isolate's "
                             "defaults); without it, other names are refused")
    parser.add_argument("--image", action="append", default=[], metavar="NAME=FILE",
                        help="the image NAME runs under the TOML policy FILE ('default' for isolate's defaults); "
                             "repeatable")
    parser.add_argument("--volume-root", action="append", default=[], metavar="DIR",
                        help="create requests may mount host paths below DIR as volumes (read-only or read-write, "
                             "as asked); repeatable; without it, host volumes are refused")
    parser.add_argument("--volume-store", metavar="DIR",
                        help="where named (pvc) volumes are kept, a directory each (default: the state "
                             "directory's opensandbox-volumes)")
    parser.add_argument("--warm", type=whole_number, default=0, metavar="N",
                        help="keep N sandboxes started in the shape of the SDK's default create (the default "
                             "profile, 1 CPU, 2 GiB, no env, volumes or snapshot): such a create takes a fresh one "
                             "(never reused) and another starts in the background (default 0)")
    parser.add_argument("--max-sandboxes", type=whole_number, default=64, metavar="N",
                        help="sandboxes kept at once; more creates are refused with 429 (default 64)")
    parser.add_argument("--max-commands", type=whole_number, default=1024, metavar="N",
                        help="commands running at once over all sandboxes; one sandbox runs at most a quarter "
                             "of them (and 256); more are refused with 429 (default 1024)")
    parser.add_argument("--best-effort", action="store_true",
                        help="create sandboxes whose resourceLimits this host cannot enforce (e.g. no cgroup for "
                             "this user) instead of refusing them; the sandbox's status message says what is not "
                             "enforced")
    parser.add_argument("--state-dir", metavar="DIR",
                        help="where the server records its sandboxes, which outlive it (a restart, a crash): a server "
                             "started again with the same DIR serves them again; a directory of the server's user "
                             "that no one else may write (made 0700 if missing; default: one in the server user's "
                             "runtime directory, which a reboot empties)")
    parser.add_argument("--end-on-exit", action="store_true",
                        help="a stop of the server (SIGTERM, Ctrl-C) ends every sandbox instead of leaving them to the "
                             "next server of its state directory (a crash still leaves them)")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="place each sandbox on a node of this Ray cluster (its head's HOST:PORT, or 'auto'); "
                             "needs the ray extra and isolate on every node")
    return parser


def _join_cluster(address: str) -> bool:
    """Connect to the Ray cluster sandboxes are placed on; False (and one line said) when it cannot."""
    try:
        from ..ray import connect
    except ImportError as exc:
        print(f"isolate-run serve: --ray: {exc.name} is missing; install the extra: pip install 'isolate[ray]'",
              file=sys.stderr)
        return False
    try:
        alive = connect(address)
    except Exception as exc:  # Ray's own errors: no cluster there, a version mismatch
        print(f"isolate-run serve: --ray {address}: cannot join the cluster: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return False
    print(f"isolate-run serve: sandboxes go to the {alive} nodes of the Ray cluster at {address}", flush=True)
    return True


def serve_main(argv: Sequence[str]) -> int:
    try:  # a bad option: one line and isolate-run's own status (125), as every subcommand's, never usage and 2
        options = build_parser().parse_args(list(argv))
        # An empty value is refused, never taken for no option (--profile "" dropped the profile in silence).
        empty = sorted(name for name, value in vars(options).items() if value == "" or (
            isinstance(value, list) and "" in value))
        if empty:
            raise UsageError(f"--{empty[0].replace('_', '-')}: an empty value; give one, or leave the option out")
    except UsageError as exc:
        print(f"isolate-run serve: {exc} (see isolate-run serve --help)", file=sys.stderr)
        return EXIT_SETUP
    try:
        import uvicorn

        from .app import create_app as _create
        from .restore import restore
        from .state import ServerState
    except ImportError as exc:
        print(f"isolate-run serve: {exc.name} is missing; install the extra: pip install 'isolate[server]'",
              file=sys.stderr)
        return 125
    try:
        profiles = {"default": Policy()}
        for item in options.image:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise PolicyError(f"--image {item!r}: expected NAME=FILE", "image")
            profiles[name] = _profile(path)
        any_image = _profile(options.profile) if options.profile else None
        from .volumes import check_roots

        volume_roots = check_roots(options.volume_root)
        volume_store = check_roots([options.volume_store], "--volume-store")[0] if options.volume_store else None
        if options.best_effort:
            profiles = {name: policy.replace(best_effort=True) for name, policy in profiles.items()}
            any_image = any_image.replace(best_effort=True) if any_image is not None else None
    except (PolicyError, OSError) as exc:
        print(f"isolate-run serve: {exc}", file=sys.stderr)
        return 125
    if options.max_commands < 1:
        print("isolate-run serve: --max-commands: at least 1", file=sys.stderr)
        return 125
    from . import state as state_module

    state_module.RUNNING.limit = options.max_commands
    try:
        key, given_by = _api_key(options)
    except ValueError as exc:
        print(f"isolate-run serve: {exc}", file=sys.stderr)
        return 125
    if key is not None and len(key) < 16:
        print(f"isolate-run serve: {given_by}: the API key must have at least 16 characters", file=sys.stderr)
        return 125
    if key is None:
        key = secrets.token_urlsafe(24)
        print(f"isolate-run serve: API key (OPEN-SANDBOX-API-KEY): {key}", flush=True)
    host, port = options.listen
    try:
        if not ipaddress.ip_address(host).is_loopback:
            print(f"isolate-run serve: warning: listening on {host}, not loopback; the API is plain HTTP",
                  file=sys.stderr)
    except ValueError:
        pass
    names = ", ".join(sorted(profiles)) + (", any other name (--profile)" if any_image is not None else "")
    print(f"isolate-run serve: http://{host}:{port} (images: {names})", flush=True)
    if options.max_sandboxes < 1:
        print("isolate-run serve: --max-sandboxes: at least 1", file=sys.stderr)
        return 125
    if options.warm < 0:
        print("isolate-run serve: --warm: 0 or more", file=sys.stderr)
        return 125
    if options.ray is not None and (options.warm or volume_roots or volume_store):
        print("isolate-run serve: --warm, --volume-root and --volume-store keep sandboxes and host paths of this "
              "machine; with "
              "--ray the sandboxes are on the cluster's nodes: drop them, or serve without --ray", file=sys.stderr)
        return 125
    if options.ray is not None and not _join_cluster(options.ray):
        return 125
    keeper = None
    try:
        from .keep import Keeper, check_out_of_reach

        keeper = Keeper(options.state_dir)
        check_out_of_reach(keeper.path, [*profiles.values(), *([any_image] if any_image else [])],
                           [*volume_roots, *([volume_store] if volume_store else [])])
        state = ServerState(key, profiles, any_image, max_sandboxes=options.max_sandboxes,
                            volume_roots=volume_roots, warm=options.warm, volume_store=volume_store,
                            keeper=keeper, end_on_exit=options.end_on_exit)
        state.cluster = options.ray is not None
        for line in restore(state):
            print(f"isolate-run serve: {line}", flush=True)
        state.start_pool()
    except (IsolationError, OSError) as exc:
        if keeper is not None:
            keeper.close()
        print(f"isolate-run serve: {exc}", file=sys.stderr)
        return 125
    app = _create(state)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
