"""``isolate-run sandbox ...``: kept sandboxes from the shell.

    isolate-run sandbox create NAME [POLICY OPTIONS] [--workspace SRC] [--mode copy|overlay|bind] [--exclude PAT]
    isolate-run sandbox exec NAME [--cwd DIR] [--timeout S] [--env N=V] -- CMD [ARG...]
    isolate-run sandbox shell NAME            an interactive shell, on a terminal of its own
    isolate-run sandbox cp NAME:PATH HOSTPATH | HOSTPATH NAME:PATH
    isolate-run sandbox diff|commit [--to DIR]|pause|resume NAME
    isolate-run sandbox list | rm NAME... | prune [--idle S] [--age S]

A created sandbox is native and named: it lives until ``rm``, ``prune``,
its ``--ttl`` or ``--idle`` timeout (an hour by default). ``list``, ``rm``
and ``prune`` cover kept Docker sandboxes too. Errors are one line and
status 125; ``exec`` exits with the command's status.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Sequence
from typing import Any

from ..backends.native.named import _native_state, native_names, prune_native, remove_native
from ..backends.registry import Registry
from ..kernel import fdwait
from ..model.errors import CommandNotExecutableError, CommandNotFoundError, IsolationError, PolicyError
from .flags import EXIT_SETUP, UsageError, UsageParser


def _seconds(text: str) -> float:
    try:
        value = float(text.strip().removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be zero or more seconds")
    return value


def _parser() -> UsageParser:
    from ..backends.docker.sandbox import DEFAULT_AGE_SECONDS, DEFAULT_IDLE_SECONDS

    parser = UsageParser(prog="isolate-run sandbox", description="Kept sandboxes: create one, run commands in "
                         "it, copy files, diff and commit its workspace, remove it.")
    commands = parser.add_subparsers(dest="action", parser_class=UsageParser,
                                     metavar="create|exec|shell|cp|diff|commit|pause|resume|list|rm|prune")
    commands.required = True
    create = commands.add_parser("create", help="make a named native sandbox (policy options as isolate-run's)")
    create.add_argument("name", metavar="NAME")
    create.add_argument("--workspace", metavar="SRC", help="the directory the workspace starts from (default: empty)")
    create.add_argument("--mode", choices=("copy", "overlay", "bind"), default="copy",
                        help="copy SRC (default), overlay SRC (read-only lower layer; changes kept apart until "
                        "commit), or bind SRC itself writable")
    create.add_argument("--target", default="/workspace", metavar="PATH",
                        help="where the workspace is inside (default /workspace)")
    create.add_argument("--exclude", action="append", default=[], metavar="NAME",
                        help="a name (or glob) not copied, at any depth, e.g. --exclude .git")
    create.add_argument("--ttl", type=_seconds, metavar="SECONDS", help="end the sandbox after this long")
    create.add_argument("--idle", type=_seconds, metavar="SECONDS",
                        help="end it after this long without a command (default 3600; 0: never)")
    run = commands.add_parser("exec", help="run a command in a sandbox; exits with its status")
    run.add_argument("name", metavar="NAME")
    run.add_argument("--cwd", metavar="DIR", help="inside the sandbox (default: the workspace)")
    run.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="end the command's whole tree after this")
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    run.add_argument("command", nargs=argparse.REMAINDER)
    shell = commands.add_parser("shell", help="an interactive shell in a sandbox")
    shell.add_argument("name", metavar="NAME")
    shell.add_argument("--shell", default="/bin/sh", metavar="PATH", help="the shell inside (default /bin/sh)")
    cp = commands.add_parser("cp", help="copy a file: NAME:PATH HOSTPATH, or HOSTPATH NAME:PATH")
    cp.add_argument("source")
    cp.add_argument("destination")
    for name, text in (("diff", "what the workspace changed against its source"),
                       ("pause", "stop every process of a sandbox"), ("resume", "resume a paused sandbox")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("name", metavar="NAME")
    commit = commands.add_parser("commit", help="write the workspace back to its source (or --to DIR)")
    commit.add_argument("name", metavar="NAME")
    commit.add_argument("--to", metavar="DIR", help="another directory to make equal to the workspace")
    commands.add_parser("list", help="list kept sandboxes (native and Docker)")
    rm = commands.add_parser("rm", help="end and remove sandboxes by name")
    rm.add_argument("names", nargs="+", metavar="NAME")
    prune = commands.add_parser("prune", help="remove ended native sandboxes, and idle or old Docker ones")
    prune.add_argument("--idle", type=_seconds, default=DEFAULT_IDLE_SECONDS, metavar="SECONDS",
                       help=f"Docker: remove sandboxes unused for this long (default {DEFAULT_IDLE_SECONDS:.0f})")
    prune.add_argument("--age", type=_seconds, default=DEFAULT_AGE_SECONDS, metavar="SECONDS",
                       help=f"Docker: remove sandboxes created this long ago (default {DEFAULT_AGE_SECONDS:.0f})")
    return parser


def _refuse_empty(options: argparse.Namespace) -> None:
    """An option given an empty value is refused, never taken for one not given: ``commit --to ""`` wrote the
    workspace back over its source instead of the directory meant, ``create --workspace ""`` started empty."""
    for name, value in sorted(vars(options).items()):
        if name != "command" and (value == "" or (isinstance(value, list) and "" in value)):  # a command's own
            label = name if name in ("name", "names", "source", "destination") else f"--{name.replace('_', '-')}"
            raise UsageError(f"{label}: an empty value; give one, or leave the option out")


def sandbox_main(argv: Sequence[str]) -> int:
    """``isolate-run sandbox ...`` (argv: the words after "sandbox"); the exit status."""
    words = list(argv)
    if words[:1] == ["sandbox"]:
        words = words[1:]
    try:
        if words[:1] == ["create"]:
            return _create(words[1:])
        try:
            options = _parser().parse_args(words)
        except SystemExit as stop:  # --help
            return int(stop.code or 0)
        _refuse_empty(options)
        return int(_COMMANDS[options.action](options))
    except UsageError as exc:
        print(f"isolate-run sandbox: {exc} (see isolate-run sandbox --help)", file=sys.stderr)
    except (CommandNotFoundError, CommandNotExecutableError) as exc:
        print(f"isolate-run sandbox: {exc}", file=sys.stderr)
        return 127 if isinstance(exc, CommandNotFoundError) else 126
    except (IsolationError, PolicyError) as exc:
        print(f"isolate-run sandbox: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"isolate-run sandbox: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
    except Exception as exc:  # never a traceback for a CLI user (unless ISOLATE_DEBUG asks for one)
        if os.environ.get("ISOLATE_DEBUG"):
            import traceback

            traceback.print_exc()
        print(f"isolate-run sandbox: unexpected {type(exc).__name__}: {exc}", file=sys.stderr)
    return EXIT_SETUP


def _create(words: list[str]) -> int:
    from ..kept.sandbox import Sandbox
    from ..model.workspace import Workspace
    from .flags import CliError, build_parser, policy_from_args, refuse_empty

    own = _parser()._subparsers._group_actions[0].choices["create"]  # type: ignore[union-attr,index]
    try:
        options, rest = own.parse_known_args(words)
    except SystemExit as stop:
        return int(stop.code or 0)
    _refuse_empty(options)
    try:
        # The run's options, read as isolate-run's (their parser's CliError said "unexpected" here before).
        policy_options = build_parser().parse_args(rest)
        refuse_empty(policy_options)
    except CliError as exc:
        raise UsageError(str(exc).removesuffix(" (see isolate-run --help)")) from None
    if policy_options.command:
        raise UsageError(f"create takes no command ({' '.join(policy_options.command)}); use sandbox exec")
    try:
        policy = policy_from_args(policy_options)
    except CliError as exc:
        raise UsageError(str(exc)) from None
    workspace = Workspace(options.workspace, options.target, options.mode, tuple(options.exclude))
    idle = None if options.idle is None else (float("inf") if options.idle == 0 else options.idle)
    box = Sandbox(policy, workspace=workspace, name=options.name, backend="native", ttl=options.ttl or None,
                  idle_timeout=idle)
    box.start()
    box.detach()
    print(options.name)
    return 0


def _attach(name: str, ping: bool = True) -> Any:
    from ..kept.sandbox import Sandbox

    return Sandbox.attach(name, ping)


def _exec(options: argparse.Namespace) -> int:
    from ..backends.native.commands import Command
    from ..backends.native.kept import environment_for

    command = list(options.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("exec: no command given: isolate-run sandbox exec NAME -- CMD [ARG...]")
    env = {}
    for item in options.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env: {item!r} is not NAME=VALUE")
        env[key] = value
    box = _attach(options.name)
    impl = box._impl
    # One ignored when isolate-run started is left alone (nohup's SIGHUP, a background job's SIGINT): not
    # forwarded, as for a one-shot run. The others are caught before the command starts: one sent as soon as the
    # command printed something killed this process, and the command ran on without it.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) != signal.SIG_IGN}
    started: list[Command] = []
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if started:
            started[0].signal(signum)
        else:
            pending.append(signum)

    for sig in previous:
        signal.signal(sig, forward)
    try:
        # The command gets this process's own stdin, stdout and stderr: nothing is copied in between.
        running = Command(impl.connect(), command, options.cwd or "", environment_for(impl.environment, env),
                          options.timeout, (0, 1, 2), False, impl.report_enforced, impl.backend, impl)
        started.append(running)
        for signum in pending:
            running.signal(signum)
        running.wait_exit()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        box.detach()
    report = running.report()
    if report.status == "timeout":
        print(f"isolate-run sandbox: killed: timeout {options.timeout:g} s reached", file=sys.stderr)
    return int(running.returncode or 0)


def _shell(options: argparse.Namespace) -> int:
    box = _attach(options.name)
    process = box.spawn([options.shell, "-i"], env={"TERM": os.environ.get("TERM", "xterm")}, pty=True)
    master = process.master_fd
    interactive = os.isatty(0)
    saved = termios.tcgetattr(0) if interactive else None

    def resize(*_: Any) -> None:
        if interactive:
            import fcntl

            size = fcntl.ioctl(0, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(master, termios.TIOCSWINSZ, size)

    try:
        if interactive:
            tty.setraw(0)
            resize()
            signal.signal(signal.SIGWINCH, resize)
        stdin_open = True
        while process.poll() is None:
            watched = [master] + ([0] if stdin_open else [])
            ready = fdwait.ready(watched, timeout=0.2)
            if master in ready:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    data = b""
                if data:
                    os.write(1, data)
            if 0 in ready:
                data = os.read(0, 65536)
                if data:
                    os.write(master, data)
                else:
                    stdin_open = False
                    os.write(master, b"\x04")
    finally:
        if saved is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
        rc = process.returncode
        process.close()
        box.detach()
    return int(rc or 0)


def _split_remote(text: str) -> tuple[str, str] | None:
    name, sep, path = text.partition(":")
    if sep and name and not name.startswith((".", "/")) and "/" not in name:
        return name, path or "."
    return None


def _cp(options: argparse.Namespace) -> int:
    source, destination = _split_remote(options.source), _split_remote(options.destination)
    if (source is None) == (destination is None):
        raise UsageError("cp: exactly one side must be NAME:PATH")
    if source is not None:
        box = _attach(source[0])
        try:
            box.download(source[1], options.destination)
        finally:
            box.detach()
    else:
        assert destination is not None
        box = _attach(destination[0])
        try:
            box.upload(options.source, destination[1])
        finally:
            box.detach()
    return 0


def _shown(rel: str) -> str:
    """A path the program named, printable on one line: a newline or escape in a name could
    otherwise forge lines of this output (``x\\nD README``) or drive the terminal."""
    if rel.isprintable():
        return rel
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode() for c in rel)


def _diff(options: argparse.Namespace) -> int:
    box = _attach(options.name)
    try:
        changes = box.diff()
    finally:
        box.detach()
    for mark, names in (("A", changes.added), ("M", changes.modified), ("D", changes.deleted)):
        for rel in names:
            print(f"{mark} {_shown(rel)}")
    for rel, why in changes.refused.items():
        print(f"! {_shown(rel)}: {_shown(why)}")
    return 0


def _commit(options: argparse.Namespace) -> int:
    box = _attach(options.name)
    try:
        changes = box.commit(options.to)
    finally:
        box.detach()
    print(f"{len(changes.added)} added, {len(changes.modified)} modified, {len(changes.deleted)} deleted")
    for rel, why in changes.refused.items():
        print(f"isolate-run sandbox: not committed: {_shown(rel)}: {_shown(why)}", file=sys.stderr)
    return 0


def _pause(options: argparse.Namespace) -> int:
    box = _attach(options.name, ping=False)  # a paused sandbox does not answer
    try:
        print(box.pause() if options.action == "pause" else box.resume())
    finally:
        box.detach()
    return 0


def _list(options: argparse.Namespace) -> int:
    rows = [("NAME", "BACKEND", "STATE", "CREATED")]
    for name in native_names():
        state, created = _native_state(name)
        rows.append((name, "native", state, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))))
    docker_note = None
    try:
        from ..backends.docker import sandbox as docker_sandbox

        for entry in docker_sandbox.list_sandboxes():
            rec = entry.record
            state = entry.state if entry.registered else f"{entry.state} (unregistered)"
            rows.append((rec.name, "docker", state, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.created))))
    except (ImportError, IsolationError) as exc:
        docker_note = f"(Docker sandboxes not listed: {exc})"
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if docker_note and _docker_wanted():
        print(docker_note, file=sys.stderr)
    return 0


def _docker_wanted() -> bool:
    return any(rec.engine != "native" for rec in Registry().all())


def _rm(options: argparse.Namespace) -> int:
    missing = []
    for name in options.names:
        if remove_native(name):
            continue
        try:
            from ..backends.docker import sandbox as docker_sandbox

            if docker_sandbox.remove_sandbox(name):
                continue
        except (ImportError, IsolationError):
            pass
        missing.append(name)
    if missing:
        raise IsolationError(f"no such sandbox: {', '.join(missing)} (see isolate-run sandbox list)")
    return 0


def _prune(options: argparse.Namespace) -> int:
    for name, why in prune_native():
        print(f"removed {name} ({why})")
    from ..kept.snapshots import sweep_temporary_snapshots

    for name in sweep_temporary_snapshots():
        print(f"removed snapshot {name} (isolate took it for a fork or a merge, which was killed)")
    if _docker_wanted():
        from ..backends.docker import sandbox as docker_sandbox

        for name, why in docker_sandbox.prune(options.idle, options.age):
            print(f"removed {name} ({why})")
    return 0


_COMMANDS = {"exec": _exec, "shell": _shell, "cp": _cp, "diff": _diff, "commit": _commit, "pause": _pause,
             "resume": _pause, "list": _list, "rm": _rm, "prune": _prune}
