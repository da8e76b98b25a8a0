"""Branches: a kept sandbox's snapshot, fork and restore, against copying its workspace and against Docker.

The workspace: ``files`` files of ``size_mb`` MB in all (full run: 10,000
files / 500 MB; --quick: 500 / 5 MB) in 100 directories, shown as an overlay
workspace (isolate's layers). An *episode* rewrites 100 of its files (one
command), as an RL step or an agent's edit does. Each round, untimed: an
episode; then timed, one of:

- ``snapshot``: ``sb.snapshot()`` (the layer of what changed since the source);
- ``fork``: ``sb.fork(1)``, until the fork is started and answers;
- ``restore``: ``sb.restore(start)`` of a sandbox started from the snapshot
  ``start``, after the episode (the RL reset): its files back, a fresh sandbox;

The same rounds then run on a copy workspace (``Workspace(mode="copy")``: the
source copied once, at the sandbox's start, then kept as the lower layer of an
overlay: its snapshots, forks and restores cost what changed since the copy);
``copy_workspace`` holds its figures and what its report says its snapshots are
(``whole copies: ...`` where the overlay is refused, or before issue 37).

All against a whole copy of the workspace (a new copy sandbox's start: what
a fork or a restore costs when the workspace is copied, until the sandbox
answers; a snapshot by copy: the workspace's tree copied), and against Docker
in the same run where an engine answers: ``docker commit`` of a container
holding the same workspace after the episode (a snapshot) and ``docker run -d``
of the committed image (a fork or a restore; the container started, not waited
for). The /tmp and the home hold nothing here (a snapshot keeps them by an
archive made inside, which adds a tar run when they hold files).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ._stats import median, summary_ms

EPISODE_FILES = 100
GOALS_MS = {"snapshot": 50.0, "fork": 50.0, "restore": 20.0}
#: A copy workspace's snapshot, fork and restore after its first copy (issue 37).
COPY_GOAL_MS = 50.0


def make_workspace(root: str, files: int, size_mb: int) -> None:
    size = max(1, size_mb * (1 << 20) // files)
    block = os.urandom(min(size, 1 << 16))
    data = (block * (size // len(block) + 1))[:size]
    for i in range(files):
        directory = os.path.join(root, f"d{i % 100:02d}")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"f{i:05d}.dat"), "wb") as handle:
            handle.write(data)
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def episode(files: int, round_: int) -> str:
    """A command rewriting EPISODE_FILES files of the workspace (different ones each round)."""
    picks = [(round_ * 37 + k * max(1, files // EPISODE_FILES)) % files for k in range(EPISODE_FILES)]
    paths = " ".join(f"d{i % 100:02d}/f{i:05d}.dat" for i in picks)
    return f"for f in {paths}; do echo episode {round_} > $f; done"


def measure(workdir: str, files: int, size_mb: int, rounds: int, copy_rounds: int, image: str | None,
            log: Callable[[str], None]) -> dict[str, Any]:
    import isolate

    root = tempfile.mkdtemp(prefix="branches-", dir=workdir)
    os.chmod(root, 0o755)
    source = os.path.join(root, "workspace")
    os.mkdir(source)
    started = time.monotonic()
    make_workspace(source, files, size_mb)
    log(f"branches: workspace of {files} files / {size_mb} MB made in {time.monotonic() - started:.1f} s")
    policy = isolate.Policy(write=())
    overlay = isolate.Workspace(source, mode="overlay")
    out: dict[str, Any] = {"files": files, "size_mb": size_mb, "episode_files": EPISODE_FILES, "rounds": rounds,
                           "mechanism": "overlay layers: a snapshot is the sandbox's upper layer laid over a hard-link "
                                        "clone of its base layer; a fork mounts a hard-link clone of the snapshot's "
                                        "layer (the last fork takes it by a rename); a restore to the snapshot the "
                                        "sandbox started from takes over the old sandbox's base layer (a rename)"}
    try:
        isolate_figures, out["restore_checked"] = _rounds(policy, overlay, files, rounds)
        out["isolate"] = {k: summary_ms(v) for k, v in isolate_figures.items()}
        log("branches: isolate " + ", ".join(f"{k} {median(v) * 1e3:.1f} ms" for k, v in isolate_figures.items()))
        # A copy workspace: its private copy made once (the first copy, a sandbox's start: "copy" below),
        # then kept as the lower layer of an overlay, its snapshots, forks and restores as an overlay's.
        copy_ws = isolate.Workspace(source, mode="copy")
        copy_figures, out["copy_workspace_restore_checked"] = _rounds(policy, copy_ws, files, rounds)
        out["copy_workspace"] = {k: summary_ms(v) for k, v in copy_figures.items()}
        with isolate.Sandbox(policy, workspace=copy_ws) as probe:
            out["copy_workspace"]["snapshots"] = (probe.enforced.get("workspace") or {}).get(
                "snapshots", "whole copies (no report: before copies were kept as layers)")
        log("branches: copy workspace " + ", ".join(f"{k} {median(v) * 1e3:.1f} ms" for k, v in copy_figures.items()))
        out["copy"] = _copy(source, policy, files, copy_rounds, log)
        out["docker"] = _docker(source, files, copy_rounds, image, log) if image else {
            "skipped": "Docker left out (--no-docker)"}
        out["goals"] = {
            f"{what} <= {limit:g} ms (median)": {
                "value": out["isolate"][what]["median_ms"], "met": out["isolate"][what]["median_ms"] <= limit}
            for what, limit in GOALS_MS.items()}
        out["goals"].update({
            f"copy workspace {what} <= {COPY_GOAL_MS:g} ms (median)": {
                "value": out["copy_workspace"][what]["median_ms"],
                "met": out["copy_workspace"][what]["median_ms"] <= COPY_GOAL_MS}
            for what in ("snapshot", "fork", "restore")})
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rounds(policy: Any, workspace: Any, files: int, rounds: int) -> tuple[dict[str, list[float]], bool]:
    """Each round an episode, then a snapshot and a fork of one sandbox timed; then restores of a sandbox
    started from the RL start state (the source and one episode). The figures, and whether the last restore
    gave the start state's files."""
    import isolate

    figures: dict[str, list[float]] = {"snapshot": [], "fork": [], "restore": []}
    with isolate.Sandbox(policy, workspace=workspace) as sb:
        clean = sb.snapshot()  # the source as it is: each round changes EPISODE_FILES files since it
        try:
            for i in range(rounds):
                sb.restore(clean)
                sb.exec(episode(files, i))
                t = time.perf_counter()
                snap = sb.snapshot()
                figures["snapshot"].append(time.perf_counter() - t)
                t = time.perf_counter()
                fork, = sb.fork(1)
                figures["fork"].append(time.perf_counter() - t)
                fork.close()
                snap.remove()
            # The RL start state: the source and one episode's changes (its setup).
            sb.restore(clean)
            sb.exec(episode(files, rounds))
            start = sb.snapshot()
        finally:
            clean.remove()
    try:
        with isolate.Sandbox(policy, snapshot=start) as rl:
            for i in range(rounds):
                rl.exec(episode(files, i + rounds + 1))
                t = time.perf_counter()
                rl.restore(start)
                figures["restore"].append(time.perf_counter() - t)
            first = (rounds * 37) % files  # a file the start state's episode wrote
            checked = rl.exec(f"cat d{first % 100:02d}/f{first:05d}.dat").stdout == f"episode {rounds}\n"
    finally:
        start.remove()
    return figures, checked


def _copy(source: str, policy: Any, files: int, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Today's way: a fork or restore copies the workspace; a snapshot copies its tree."""
    import isolate
    from isolate.kernel.tree import copy_tree

    starts: list[float] = []
    copies: list[float] = []
    with isolate.Sandbox(policy, workspace=isolate.Workspace(source, mode="copy")) as sb:
        for i in range(rounds):
            sb.exec(episode(files, i))
            t = time.perf_counter()
            box = isolate.Sandbox(policy, workspace=isolate.Workspace(source, mode="copy")).start()
            starts.append(time.perf_counter() - t)
            box.close()
            target = tempfile.mkdtemp(prefix="copy-", dir=os.path.dirname(source))
            # The workspace's whole tree, copied: the source's (the same files but the episode's 100; the
            # sandbox's own directory is now an overlay's upper layer, which holds only what changed).
            t = time.perf_counter()
            copy_tree(source, target, isolate.Workspace())
            copies.append(time.perf_counter() - t)
            shutil.rmtree(target, ignore_errors=True)
    log(f"branches: copy: fork/restore {median(starts) * 1e3:.0f} ms, snapshot {median(copies) * 1e3:.0f} ms")
    return {"fork_or_restore": summary_ms(starts), "snapshot": summary_ms(copies)}


def _docker(source: str, files: int, rounds: int, image: str, log: Callable[[str], None]) -> dict[str, Any]:
    """docker commit (a snapshot) and docker run -d of the committed image (a fork or a restore)."""
    from .peers import docker_engine

    why = docker_engine(image)
    if why:
        return {"skipped": why}
    docker = shutil.which("docker") or "docker"

    def run(*args: str, timeout: float = 600) -> str:
        done = subprocess.run([docker, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"docker {args[0]}: {done.stderr.strip()[-300:]}")
        return done.stdout.strip()

    name = f"isolate-bench-branches-{os.getpid()}"
    commits: list[float] = []
    runs: list[float] = []
    images: list[str] = []
    containers: list[str] = []
    try:
        run("create", "--name", name, "--network", "none", image, "sleep", "100000")
        run("cp", source + "/.", f"{name}:/workspace")  # the workspace in the container's own layer
        run("start", name)
        for i in range(rounds):
            run("exec", name, "sh", "-c", f"cd /workspace && {episode(files, i)}")
            tag = f"isolate-bench-branches:{os.getpid()}-{i}"
            t = time.perf_counter()
            images.append(run("commit", name, tag))
            commits.append(time.perf_counter() - t)
            t = time.perf_counter()
            containers.append(run("run", "-d", "--network", "none", tag, "sleep", "100000"))
            runs.append(time.perf_counter() - t)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        return {"skipped": f"docker failed: {exc}"}
    finally:
        for container in [*containers, name]:
            subprocess.run([docker, "rm", "-f", container], capture_output=True, timeout=120)
        for img in images:
            subprocess.run([docker, "rmi", "-f", img], capture_output=True, timeout=120)
    log(f"branches: docker commit {median(commits) * 1e3:.0f} ms, docker run -d {median(runs) * 1e3:.0f} ms")
    return {"commit": summary_ms(commits), "run": summary_ms(runs)}


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.branches [--quick] [--no-docker] [--out DIR]``: this section alone, written to
    ``results/branches.json`` and ``branches.md`` (the full harness keeps it in ``latest.*``)."""
    import argparse
    import json
    import sys

    from . import machine
    from .output import _branches_markdown

    parser = argparse.ArgumentParser(prog="python -m benchmarks.branches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="500 files / 5 MB, 3 rounds")
    parser.add_argument("--no-docker", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    from .peers import docker_image

    workdir = tempfile.mkdtemp(prefix="isolate-bench-branches-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(workdir, 0o777)
    load_start = machine.load_average()
    try:
        figures = measure(workdir, 500 if args.quick else 10_000, 5 if args.quick else 500, 3 if args.quick else 20,
                          1 if args.quick else 3, None if args.no_docker else docker_image(), log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine.describe(),
               "load_average_start": load_start, "load_average_end": machine.load_average(), "branches": figures}
    os.makedirs(args.out, exist_ok=True)
    stem = "branches-quick" if args.quick else "branches"
    with open(os.path.join(args.out, f"{stem}.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
    text = "\n".join([f"# Branches ({results['date']}; load average {load_start} at the start, "
                      f"{results['load_average_end']} at the end)", "", *_branches_markdown(figures)])
    with open(os.path.join(args.out, f"{stem}.md"), "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
