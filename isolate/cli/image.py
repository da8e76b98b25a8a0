"""``isolate-run image ...``: the caller's image store from the shell.

    isolate-run image load PATH [--ref REF]     a docker save archive, an OCI layout (directory or tar)
    isolate-run image pull REF [--cert-dir DIR] from a registry (OCI distribution API)
    isolate-run image push REF [--to DEST] [--cert-dir DIR]  to a registry (its own name, or DEST)
    isolate-run image build [-f FILE] [-t REF] [--build-arg K=V] [--target STAGE] CONTEXT
    isolate-run image ls [--json]
    isolate-run image inspect REF
    isolate-run image rm REF...
    isolate-run image prune [--build-cache]     the layers no image names (and the build cache)

``--image-store DIR`` (before or after the action) names another store than
``$ISOLATE_IMAGE_STORE`` or ``<state dir>/images``. Errors are one line and
status 125.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

from ..model.errors import IsolationError
from ..model.units import parse_size
from .flags import EXIT_SETUP, UsageError, UsageParser, printable


def _parser() -> UsageParser:
    parser = UsageParser(prog="isolate-run image", description="The caller's image store: load, pull, list, "
                         "inspect, remove images; prune unused layers.")
    parser.add_argument("--image-store", metavar="DIR", help="the store (default: $ISOLATE_IMAGE_STORE, else "
                        "<state dir>/images)")
    commands = parser.add_subparsers(dest="action", parser_class=UsageParser, required=True)
    load = commands.add_parser("load", help="load a docker save archive or an OCI image layout")
    load.add_argument("path")
    load.add_argument("--ref", help="the name to keep it under (default: the name the file gives)")
    load.add_argument("--max-size", help="refuse an image larger than this unpacked (default 16g)")
    pull = commands.add_parser("pull", help="pull an image from a registry")
    pull.add_argument("ref")
    pull.add_argument("--max-size", help="refuse an image larger than this unpacked (default 16g)")
    pull.add_argument("--insecure", action="store_true", help="plain HTTP to this registry (never needed for "
                      "loopback)")
    pull.add_argument("--cert-dir", metavar="DIR", help="the registry's CAs (*.crt) and client certificate "
                      "(NAME.cert, NAME.key), instead of ~/.config/containers/certs.d/HOST:PORT, "
                      "/etc/containers/certs.d/HOST:PORT, /etc/docker/certs.d/HOST:PORT")
    push = commands.add_parser("push", help="push an image to a registry")
    push.add_argument("ref")
    push.add_argument("--to", metavar="DEST", help="the reference to push to (default: the image's own)")
    push.add_argument("--insecure", action="store_true", help="plain HTTP to this registry (never needed for "
                      "loopback)")
    push.add_argument("--cert-dir", metavar="DIR", help="the registry's CAs and client certificate (as for pull)")
    build = commands.add_parser("build", help="build a Dockerfile (each RUN in a sandbox, each step cached)")
    build.add_argument("context")
    build.add_argument("-f", "--file", help="the Dockerfile (default: CONTEXT/Dockerfile)")
    build.add_argument("-t", "--tag", help="the reference to keep the image as")
    build.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE")
    build.add_argument("--target", help="the stage to build (default: the last)")
    build.add_argument("-q", "--quiet", action="store_true", help="no step lines and no output of RUN steps")
    build.add_argument("--net", choices=("none", "loopback", "host"), help="every RUN step's network (default: none)")
    build.add_argument("--allow-host", action="append", default=[], metavar="NAME[:PORT]",
                       help="let RUN steps reach this name (repeatable): a filtered network, as isolate-run's")
    ls = commands.add_parser("ls", help="list the images")
    ls.add_argument("--json", action="store_true")
    inspect = commands.add_parser("inspect", help="an image's record as JSON")
    inspect.add_argument("ref")
    rm = commands.add_parser("rm", help="remove images (their layers stay until prune)")
    rm.add_argument("refs", nargs="+")
    prune = commands.add_parser("prune", help="remove the layers no image names")
    prune.add_argument("--build-cache", action="store_true", help="the build cache too (as docker builder prune "
                       "-a): the images kept between build steps, the cache mounts' directories; not what a running "
                       "build uses")
    for sub in (load, pull, push, build, ls, inspect, rm, prune):
        sub.add_argument("--image-store", metavar="DIR", default=argparse.SUPPRESS)
    return parser


def image_main(argv: Sequence[str]) -> int:
    from ..image import Image, Store

    try:
        options = _parser().parse_args(list(argv))
        # An empty value is refused, never taken for no option: push --to "" pushed to the image's own name,
        # build -t "" kept it under a made-up one, --image-store "" used the default store.
        empty = sorted(name for name, value in vars(options).items() if value == "" or (
            isinstance(value, list) and "" in value))
        if empty:
            label = empty[0] if empty[0] in ("path", "ref", "refs", "context") else f"--{empty[0].replace('_', '-')}"
            raise UsageError(f"{label}: an empty value; give one, or leave the option out")
        max_size = parse_size(options.max_size, "max-size") if getattr(options, "max_size", None) else None
        store = Store(options.image_store) if options.image_store else Store()
        if max_size is not None:
            store.max_image_size = max_size
        if options.action == "load":
            started = time.monotonic()
            image = Image.load(options.path, reference=options.ref, store=store)
            print(f"loaded {image.reference} ({image.short_id}, {len(image.layers)} layers, "
                  f"{_megabytes(image.size)}) in {time.monotonic() - started:.2f} s")
        elif options.action == "pull":
            image = Image.pull(options.ref, store=store, insecure=options.insecure, progress=sys.stderr,
                               cert_dir=options.cert_dir)
            print(f"pulled {image.reference} ({image.short_id}, {len(image.layers)} layers, "
                  f"{_megabytes(image.size)})")
        elif options.action == "push":
            image = Image.get(options.ref, store)
            digest = image.push(options.to, insecure=options.insecure, cert_dir=options.cert_dir, progress=sys.stderr)
            print(f"pushed {options.to or image.reference}@{digest}")
        elif options.action == "build":
            build_args = {}
            for item in options.build_arg:
                key, sep, value = item.partition("=")
                if not sep:
                    value = os.environ.get(key, "")
                build_args[key] = value
            path = options.file or os.path.join(options.context, "Dockerfile")
            network: object = options.net
            if options.allow_host:
                from ..model.policy import Egress

                if options.net:
                    raise UsageError(f"--allow-host filters the network; it cannot go with --net {options.net}")
                network = Egress(tuple(options.allow_host))
            image = Image.from_dockerfile(path, options.context, reference=options.tag, build_args=build_args,
                                          target=options.target, store=store, network=network,
                                          progress=None if options.quiet else sys.stderr)
            print(f"built {image.reference} ({image.short_id})")
        elif options.action == "ls":
            images = Image.list(store)
            if options.json:
                print(json.dumps([_record(i) for i in images], indent=2))
            else:
                print(f"{'REFERENCE':50} {'ID':12} {'LAYERS':>6} {'SIZE':>9}")
                for image in images:
                    print(f"{image.reference:50} {image.short_id:12} {len(image.layers):>6} "
                          f"{_megabytes(image.size):>9}")
        elif options.action == "inspect":
            print(json.dumps(_record(Image.get(options.ref, store)), indent=2))
        elif options.action == "rm":
            for ref in options.refs:
                image = Image.get(ref, store)
                image.remove()
                print(f"removed {image.reference}")
        elif options.action == "prune":
            from ..image import PruneStats

            stats = PruneStats()
            removed = Image.prune(store, build_cache=options.build_cache, stats=stats)
            line = f"removed {len(removed)} unused layer{'s' if len(removed) != 1 else ''}"
            if options.build_cache:
                line += (f", {stats.images} build image{'s' if stats.images != 1 else ''}, {stats.cache_mounts} "
                         f"cache mount{'s' if stats.cache_mounts != 1 else ''}")
            print(line + (f", {stats.steps} step cache entries" if stats.steps else ""))
        return 0
    except UsageError as exc:
        print(f"isolate-run image: {printable(str(exc))}", file=sys.stderr)
        return EXIT_SETUP
    except IsolationError as exc:
        print(f"isolate-run image: {printable(str(exc))}", file=sys.stderr)
        return EXIT_SETUP
    except OSError as exc:
        print(f"isolate-run image: {printable(str(exc.strerror or exc))}: {printable(str(exc.filename or ''))}"
              .rstrip(": "), file=sys.stderr)
        return EXIT_SETUP


def _record(image: object) -> dict[str, object]:
    from ..image import Image

    assert isinstance(image, Image)
    return {"reference": image.reference, "id": image.id, "digest": image.digest, "layers": list(image.layers),
            "size": image.size, "created": image.created, "config": dataclasses.asdict(image.config),
            "store": os.path.abspath(image.store.path),
            # A regular user's store keeps no owner but its user, unless through its subordinate ids (docs/images.md):
            # what the image gives others.
            "owners": {"kept": image.store.owners_kept or image.owners_mapped(),
                       "other_than_root": image.foreign_owners()}}


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
