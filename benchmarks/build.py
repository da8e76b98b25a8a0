"""Image builds: the ``build`` section of ``python -m benchmarks`` (alone: ``python -m benchmarks.build``).

One Dockerfile of three steps (``RUN`` a command, ``COPY`` a small context,
``RUN`` another) over a busybox-static ``scratch`` image built here
(tests/imagekit.py's; nothing is pulled), built in the same run by:

- isolate, through its API (``Image.from_dockerfile``, in this process) and
  its CLI (``isolate-run image build``, a whole process, as the others are);
- ``docker build`` (the base loaded with ``docker load`` from an archive made
  here), with the legacy builder (``DOCKER_BUILDKIT=0``: Debian's docker.io
  has no buildx, BuildKit's client);
- ``buildah bud`` (Debian's buildah; its storage a directory of its own
  here, the base pulled from the OCI layout isolate loads).

Cold: every cache misses (the first RUN's command carries a new nonce each
round, so no step's parent is one built before); cached: the same Dockerfile
built again with nothing changed. Rounds are interleaved (each round every
builder once, in a shuffled order). Goals: a cached build <= 50 ms (isolate's
API) and a cold one <= 0.7x ``docker build``'s (median). ``bash
benchmarks/setup-peers.sh`` installs docker.io and buildah.

Writes ``results/build.json`` when run alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ._stats import ratio, summary_ms
from .images import image_store

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "benchbuild:1"
CONTEXT_FILES = 20
DOCKERFILE = """\
FROM {base}
RUN echo {nonce} > /etc/first.txt
COPY src/ /app/src/
RUN cat /etc/first.txt /app/src/*.txt > /app/all.txt
"""
GOAL_CACHED_MS = 50.0
GOAL_COLD_RATIO = 0.7


def _kit() -> Any:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import imagekit

    return imagekit


def _answers(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def peers(with_docker: bool) -> tuple[list[str], dict[str, str]]:
    """The builders beside isolate that answer (docker, buildah), and why each other one is left out."""
    found, skipped = [], {}
    if not with_docker:
        skipped["docker"] = "Docker left out (--no-docker)"
    elif not shutil.which("docker"):
        skipped["docker"] = "no docker command (bash benchmarks/setup-peers.sh)"
    elif not _answers(["docker", "info"]):
        skipped["docker"] = "docker does not answer (tests/docker_env.sh starts dockerd)"
    else:
        found.append("docker")
    if not shutil.which("buildah"):
        skipped["buildah"] = "no buildah command (bash benchmarks/setup-peers.sh)"
    elif os.geteuid() != 0:
        skipped["buildah"] = "buildah left out: not root (rootless buildah needs subordinate ids set up)"
    else:
        found.append("buildah")
    return found, skipped


class Builders:
    """The argv of each builder, and how each one's images are removed between rounds."""

    def __init__(self, tmp: str, tools: list[str]) -> None:
        self.tmp, self.tools = tmp, tools
        self.binary = os.path.join(os.path.dirname(sys.executable), "isolate-run")
        self.buildah = ["buildah", "--root", os.path.join(tmp, "buildah-root"),
                        "--runroot", os.path.join(tmp, "buildah-run")]
        self.made: list[str] = []  # every tag a round made (removed at the end, a round that failed too)
        self.env = dict(os.environ, DOCKER_BUILDKIT="0")
        # Bytecode written (the warm-up round writes it), as an installed package has it: without it the CLI
        # compiles its modules again in every process (~65 ms here).
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)

    def argv(self, name: str, context: str, tag: str) -> list[str]:
        dockerfile = os.path.join(context, "Dockerfile")
        if name == "isolate-run":
            return [self.binary, "image", "build", "-f", dockerfile, "-t", tag, context]
        if name == "docker":
            return ["docker", "build", "-q", "-f", dockerfile, "-t", tag, context]
        # buildah: --layers caches each step as docker build does (its default builds one layer, no cache);
        # --isolation=chroot: no user namespace or runc, the cheapest way it runs a RUN as root.
        return [*self.buildah, "bud", "-q", "--layers", "--pull=never", "--isolation=chroot", "-f", dockerfile,
                "-t", tag, context]

    def load_base(self, archive: str, layout: str) -> None:
        if "docker" in self.tools:
            subprocess.run(["docker", "load", "-q", "-i", archive], check=True, capture_output=True, timeout=300)
        if "buildah" in self.tools:
            # buildah names an image pulled from a layout after the layout's path, which must then be a valid
            # reference: a temporary directory's random name may not be (a "_" at its end): a link of a safe name.
            safe = os.path.join(os.path.dirname(self.tmp), f"isolatebenchoci{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(safe)
            os.symlink(layout, safe)
            try:
                pulled = subprocess.run([*self.buildah, "pull", "-q", f"oci:{safe}:{BASE}"], check=True,
                                        capture_output=True, text=True, timeout=300).stdout.split()[-1]
            finally:
                os.unlink(safe)
            # buildah names it after the layout's path: tagged as localhost/NAME, which FROM NAME finds.
            subprocess.run([*self.buildah, "tag", pulled, f"localhost/{BASE}"], check=True, capture_output=True,
                           timeout=60)

    def forget(self, tags: list[str]) -> None:
        """The images (and so the cached steps) the rounds made, removed: the next cold round finds none."""
        if "docker" in self.tools and tags:
            # Their untagged parents (the legacy builder's steps) go with them; nothing else of the daemon's.
            subprocess.run(["docker", "rmi", "-f", *tags], capture_output=True, timeout=300)
        if "buildah" in self.tools and tags:
            subprocess.run([*self.buildah, "rmi", "-f", *tags], capture_output=True, timeout=300)
            subprocess.run([*self.buildah, "rmi", "--prune"], capture_output=True, timeout=300)

    def cleanup(self) -> None:
        self.forget([t for t in self.made if "isolate" not in t])
        if "docker" in self.tools:
            subprocess.run(["docker", "rmi", "-f", BASE], capture_output=True, timeout=300)
        if "buildah" in self.tools:
            subprocess.run([*self.buildah, "rm", "--all"], capture_output=True, timeout=300)
            subprocess.run([*self.buildah, "rmi", "--all", "-f"], capture_output=True, timeout=300)
            # Its overlay mounts, if any are left, before the directory goes.
            subprocess.run(["umount", "-R", os.path.join(self.tmp, "buildah-root", "overlay")],
                           capture_output=True, timeout=60)


def _context(tmp: str, nonce: str) -> str:
    context = os.path.join(tmp, f"ctx-{nonce}")
    os.makedirs(os.path.join(context, "src"))
    for i in range(CONTEXT_FILES):
        with open(os.path.join(context, "src", f"f{i:02d}.txt"), "w", encoding="utf-8") as handle:
            handle.write(f"file {i}\n" * 20)
    with open(os.path.join(context, "Dockerfile"), "w", encoding="utf-8") as handle:
        handle.write(DOCKERFILE.format(base=BASE, nonce=nonce))
    return context


def measure(rounds: int, tmp: str, with_docker: bool = True,
            log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    with image_store(os.path.join(tmp, "store")) as store:
        return _measure(rounds, tmp, store, with_docker, log)


def _measure(rounds: int, tmp: str, store_path: str, with_docker: bool, log: Callable[[str], None]) -> dict[str, Any]:
    from isolate.image import Image, Store
    from isolate.image.build import Stats

    tools, skipped = peers(with_docker)
    log(f"build: builders isolate, {', '.join(tools) or 'no other'}" + "".join(f"; {k}: {v}"
                                                                               for k, v in skipped.items()))
    os.chmod(tmp, 0o755)
    kit = _kit()
    store = Store(store_path)
    base_layer = kit.busybox_layer()
    # A history entry for its layer: buildah's --layers counts the base's layers by its history.
    config = json.loads(kit.config_for([base_layer], Env=["PATH=/bin"]))
    config["history"] = [{"created_by": "benchmarks/build.py: busybox-static"}]
    kit.oci_layout(os.path.join(tmp, "oci-base"), [base_layer], ref=BASE, config=json.dumps(config).encode())
    Image.load(os.path.join(tmp, "oci-base"), store=store)
    archive = os.path.join(tmp, "base.tar")
    kit.docker_archive(archive, [base_layer], tag=BASE, Env=["PATH=/bin"])
    builders = Builders(tmp, tools)
    builders.load_base(archive, os.path.join(tmp, "oci-base"))

    names = ["isolate (API)", "isolate-run", *tools]

    def build(name: str, context: str, tag: str) -> tuple[float, Stats | None]:
        stats = Stats() if name == "isolate (API)" else None
        started = time.perf_counter()
        if stats is not None:
            Image.from_dockerfile(os.path.join(context, "Dockerfile"), context, reference=tag, store=store,
                                  stats=stats)
        else:
            done = subprocess.run(builders.argv(name, context, tag), capture_output=True, text=True,
                                  env=builders.env, timeout=600)
            if done.returncode != 0:
                tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
                raise RuntimeError(f"{name} build failed ({done.returncode}): {' | '.join(tail)}")
        return time.perf_counter() - started, stats

    cold: dict[str, list[float]] = {n: [] for n in list(names)}
    cached: dict[str, list[float]] = {n: [] for n in list(names)}
    counted: dict[str, Any] = {}
    try:
        for number in range(rounds + 1):  # round 0 warms (caches of the binaries, the daemon's first build)
            log(f"build: round {number}/{rounds}")
            order = list(names)
            random.shuffle(order)
            tags = []
            for name in order:
                if name not in names:
                    continue
                nonce = f"r{number}-{name.split()[0].replace('-', '')}-{os.urandom(4).hex()}"
                context = _context(tmp, nonce)
                tag = f"localhost/benchbuild-out:{nonce}"
                tags.append(tag)
                builders.made.append(tag)
                try:
                    seconds, stats = build(name, context, tag)
                except RuntimeError as exc:
                    if number or name not in tools:
                        raise
                    # A peer that cannot build here is left out, with its reason (isolate's failures are raised).
                    names.remove(name)
                    tools.remove(name)
                    skipped[name] = str(exc)[:300]
                    log(f"build: {name} left out: {exc}")
                    shutil.rmtree(context)
                    continue
                again, again_stats = build(name, context, tag)
                if number:
                    cold[name].append(seconds)
                    cached[name].append(again)
                if stats is not None and again_stats is not None:
                    counted = {"cold": vars(stats), "cached": vars(again_stats)}
                shutil.rmtree(context)
            builders.forget([t for t in tags if "isolate" not in t])
    finally:
        builders.cleanup()
    results: dict[str, Any] = {
        "rounds": rounds, "builders": names, "skipped": skipped,
        "docker_builder": "legacy (DOCKER_BUILDKIT=0; no buildx installed)" if "docker" in tools else None,
        "buildah_options": "bud --layers --isolation=chroot, storage in its own --root" if "buildah" in tools
        else None,
        "dockerfile": DOCKERFILE.format(base=BASE, nonce="NONCE"), "context_files": CONTEXT_FILES,
        "isolate_steps": counted,
        "cold": {n: summary_ms(cold[n]) for n in names},
        "cached": {n: summary_ms(cached[n]) for n in names},
    }
    ratios: dict[str, Any] = {}
    for which in ("cold", "cached"):
        for mine in ("isolate (API)", "isolate-run"):
            for tool in tools:
                ratios[f"{which}: {mine} / {tool}"] = ratio(results[which][mine]["median_ms"],
                                                            results[which][tool]["median_ms"])
    results["ratios"] = ratios
    api_cached = results["cached"]["isolate (API)"]["median_ms"]
    goals: dict[str, Any] = {
        f"cached build (isolate API) <= {GOAL_CACHED_MS:g} ms": {"value": api_cached,
                                                                  "met": api_cached <= GOAL_CACHED_MS}}
    if "docker" in tools:
        for mine in ("isolate (API)", "isolate-run"):
            value = ratios[f"cold: {mine} / docker"]
            goals[f"cold build ({mine}) <= {GOAL_COLD_RATIO}x docker build"] = {
                "value": value, "met": value is not None and value <= GOAL_COLD_RATIO}
    results["goals"] = goals
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.build")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-docker", action="store_true")
    args = parser.parse_args(argv)
    from . import machine

    started = machine.load_average()
    with tempfile.TemporaryDirectory(prefix="isolate-bench-build-", dir="/var/tmp") as tmp:
        results = measure(args.rounds, tmp, not args.no_docker, log=lambda m: print(m, file=sys.stderr))
    results["machine"] = {**machine.describe(), "load_average_start": started, "load_average_end":
                          machine.load_average()}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "build.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
