"""The native ``isolate-run`` against bubblewrap: whole process, ``isolate-run -- /bin/true``.

Four variants, interleaved (a fresh random order each round), each a whole
process started with posix_spawn and reaped with wait4, in the same working
directory (granted writable by isolate-run's default policy; bound writable
for bwrap, whose binds are the other benchmarks' plus that directory):

- ``binary warm``: the installed binary, its plan cached (the usual case);
- ``binary cold``: the same with the caller's plan cache emptied first: the
  binary hands over to Python, which compiles the plan, caches it and execs
  the binary back to run it;
- ``python CLI``: ``python -m isolate.cli`` (the Python CLI as it was);
- ``bwrap``: ``bwrap --unshare-all`` with the equivalent binds.

Peak RSS: GNU time's %M (ru_maxrss of the process it forks and execs) over
20 more runs of each variant (fewer with fewer rounds), the largest seen; the binary's figure is its
own process (it reads the init's report and waits for no sandbox process).
(wait4 from this Python parent would not do: posix_spawn's child shares the
parent's pages until exec, and ru_maxrss counts them.) ``python -m benchmarks.cli [--rounds N]`` writes
``results/cli.json`` and ``results/cli.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import machine
from ._stats import summary_ms
from .overhead import bwrap_prefix

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def binary_path() -> str:
    """The isolate-run pip installed beside this interpreter."""
    return os.path.join(os.path.dirname(sys.executable), "isolate-run")


def _run(argv: list[str], cwd: str) -> tuple[float, int]:
    """(seconds, peak RSS in KiB) of one whole process; raises when it fails."""
    env = dict(os.environ)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        previous = os.getcwd()
        os.chdir(cwd)
        try:
            started = time.perf_counter()
            pid = os.posix_spawn(argv[0], argv, env, file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 1)])
            _, status, usage = os.wait4(pid, 0)
            elapsed = time.perf_counter() - started
        finally:
            os.chdir(previous)
    finally:
        os.close(devnull)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} failed: status {status}")
    return elapsed, int(usage.ru_maxrss)


def _clear_plans(workdir: str) -> None:
    """Remove the cached plan of ``isolate-run -- /bin/true`` in workdir (with this environment)."""
    from isolate.cli import plan as cliplan

    key = cliplan.key_material([], workdir)
    try:
        os.unlink(os.path.join(cliplan.cache_dir(create=False), cliplan.plan_name(key)))
    except FileNotFoundError:
        pass


def _peak_rss(variants_argv: dict[str, list[str]], workdir: str, runs: int = 20) -> dict[str, int | str]:
    """The largest %M GNU time reports for each variant (KiB)."""
    import subprocess

    gnu_time = "/usr/bin/time"
    if not os.access(gnu_time, os.X_OK):
        return {key: "skipped: no /usr/bin/time (apt-get install time)" for key in variants_argv}
    out: dict[str, int | str] = {}
    for key, argv in variants_argv.items():
        peaks = []
        for _ in range(runs):
            if key == "binary cold":
                _clear_plans(workdir)
            done = subprocess.run([gnu_time, "-f", "%M", *argv], cwd=workdir, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, check=True)
            peaks.append(int(done.stderr.strip().splitlines()[-1]))
        out[key] = max(peaks)
    return out


def measure(*, rounds: int, workdir: str, log: Callable[[str], None]) -> dict[str, Any]:
    binary = binary_path()
    if not os.access(binary, os.X_OK):
        return {"skipped": f"no isolate-run binary at {binary} (pip install the package)"}
    bwrap = shutil.which("bwrap")
    variants_argv: dict[str, list[str]] = {
        "binary warm": [binary, "--", "/bin/true"],
        "binary cold": [binary, "--", "/bin/true"],
        "python CLI": [sys.executable, "-m", "isolate.cli", "--", "/bin/true"],
    }
    if bwrap:
        variants_argv["bwrap"] = [*bwrap_prefix(bwrap, workdir), "/bin/true"]

    def variant(key: str) -> Callable[[], tuple[float, int]]:
        def go() -> tuple[float, int]:
            if key == "binary cold":
                _clear_plans(workdir)
            return _run(variants_argv[key], workdir)
        return go

    variants = {key: variant(key) for key in variants_argv}
    _run([binary, "--", "/bin/true"], workdir)  # the plan, and warm page caches
    samples: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    shuffle = random.Random(17)
    for round_no in range(rounds):
        shuffle.shuffle(order)
        for key in order:  # (a cold run leaves its plan cached: a warm one is warm wherever it comes)
            seconds, _ = variants[key]()
            samples[key].append(seconds)
        if (round_no + 1) % max(1, rounds // 5) == 0:
            log(f"  cli: {round_no + 1}/{rounds} rounds")
    peak = _peak_rss(variants_argv, workdir, runs=min(20, max(3, rounds)))
    figures = {k: {**summary_ms(v), "peak_rss_kib_max": peak.get(k)} for k, v in samples.items()}
    result: dict[str, Any] = {"rounds": rounds, "variants": figures,
                              "method": (__doc__ or "").strip().split("\n\n")[1]}
    warm, cold, python = (figures[k]["median_ms"] for k in ("binary warm", "binary cold", "python CLI"))
    goals = []
    if bwrap:
        ratio = warm / figures["bwrap"]["median_ms"]
        goals.append({"goal": "binary warm median <= 2.5 x bwrap median", "value": round(ratio, 3),
                      "met": ratio <= 2.5})
    else:
        result["bwrap"] = "skipped: bwrap not installed (apt-get install bubblewrap)"
    goals.append({"goal": "binary cold median <= python CLI median", "value": round(cold / python, 3),
                  "met": cold <= python})
    result["goals"] = goals
    return result


def markdown(results: dict[str, Any]) -> str:
    cli = results["cli"]
    lines = ["# isolate-run: the native binary", "",
             f"`python -m benchmarks.cli` on {results['date']}; {results['machine_line']}", "",
             cli.get("method", ""), "",
             f"{cli['rounds']} interleaved rounds; times in ms, whole process as seen by the caller.", "",
             "| variant | median | p99 | min | peak RSS (KiB, largest of 20) |", "|---|---:|---:|---:|---:|"]
    for key, entry in cli["variants"].items():
        lines.append(f"| {key} | {entry['median_ms']:.2f} | {entry['p99_ms']:.2f} | {entry['min_ms']:.2f} | "
                     f"{entry['peak_rss_kib_max']} |")
    lines.append("")
    for goal in cli["goals"]:
        lines.append(f"- {goal['goal']}: {goal['value']} ({'met' if goal['met'] else 'NOT met'})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cli", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="isolate-bench-cli-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(workdir, 0o777)
    try:
        def log(message: str) -> None:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

        described = machine.describe()
        results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": described,
                   "cli": measure(rounds=args.rounds, workdir=workdir, log=log)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine_line"] = (f"{described.get('cpu_model', '?')}, {described.get('cores', '?')} cores, "
                               f"load average {machine.load_average()}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cli.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
    if "skipped" not in results["cli"]:
        with open(os.path.join(args.out, "cli.md"), "w", encoding="utf-8") as handle:
            handle.write(markdown(results))
        print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
