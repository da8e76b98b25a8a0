"""The cost of denial tracing: ``python -m benchmarks.why [--runs N] [--out PATH]``.

With ``trace_denials`` the sandbox's init looks at every path system call of
the program (csrc/why.c: a seccomp user notification, a few lookups, then the
call continues). This measures whole runs with it off and on, interleaved so
that machine drift hits both alike:

- ``python3 -c pass`` (the interpreter's start: a few dozen opens);
- ``gcc -O2`` of a small two-file C project (the driver, cc1, as, collect2
  and ld: exec, hundreds of opens and the objects' creation).

and, as the worst case that prices one call, 5000 opens of one file in a
loop (the added time divided by the calls looked at).

Reported: medians, the ratio on/off and the path calls the init looked at in
one traced run. Goal (issue 29): at most 1.3x for the first two. Results:
``benchmarks/results/why.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ._stats import median, ratio, summary_ms
from .machine import describe

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "why.json")
GOAL = 1.3

_MAIN_C = '#include "util.h"\n#include <stdio.h>\nint main(void) { printf("%d\\n", twice(21)); return 0; }\n'
_UTIL_C = '#include "util.h"\nint twice(int x) { return 2 * x; }\n'
_UTIL_H = "int twice(int x);\n"


def _workloads(workdir: str) -> dict[str, list[str]]:
    # The interpreter by its real path: a venv's bin/python is a link from a directory the sandbox does not show.
    real = os.path.realpath(sys.executable)
    out: dict[str, list[str]] = {"python3 -c pass": [real if real.startswith("/usr/") else "/usr/bin/python3", "-c",
                                                     "pass"]}
    gcc = shutil.which("gcc")
    if gcc and gcc.startswith(("/usr/", "/bin/")):
        for name, text in (("main.c", _MAIN_C), ("util.c", _UTIL_C), ("util.h", _UTIL_H)):
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        out["gcc -O2 (two files)"] = [gcc, "-O2", "-o", "prog", "main.c", "util.c"]
    out[OPENS] = [out["python3 -c pass"][0], "-c", "for _ in range(5000): open('/etc/hostname').close()"]
    return out


OPENS = "5000 opens (worst case, no goal)"


def measure(runs: int, workdir: str, log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    import isolate

    workloads = _workloads(workdir)
    policies = {False: isolate.Policy(backend="native"), True: isolate.Policy(backend="native", trace_denials=True)}
    results: dict[str, Any] = {"method": (__doc__ or "").strip(), "runs": runs, "goal": f"<= {GOAL}x",
                               "workloads": {}}
    if "gcc -O2 (two files)" not in workloads:
        results["skipped"] = {"gcc -O2 (two files)": "no gcc under /usr on this host"}
    for label, argv in workloads.items():
        log(f"why: {label}, {runs} runs each, tracing off and on")
        times: dict[bool, list[float]] = {False: [], True: []}
        seen = None
        for i in range(runs + 1):  # the first round warms the caches (plans, filters, page cache)
            for traced in ((False, True) if i % 2 == 0 else (True, False)):
                started = time.perf_counter()
                done = isolate.run(argv, policy=policies[traced], cwd=workdir, capture_output=True)
                elapsed = time.perf_counter() - started
                if done.returncode != 0:
                    raise RuntimeError(f"{label} failed (traced={traced}): {done.stderr[-500:]!r}")
                if traced:
                    seen = done.report.denials_observed.get("landlock", {}).get("calls_looked_at", seen)
                    if done.report.denied:
                        raise RuntimeError(f"{label}: a clean run reported denials: {done.report.denied}")
                if i:
                    times[traced].append(elapsed)
        off, on = median(times[False]), median(times[True])
        factor = ratio(on, off)
        results["workloads"][label] = {
            "argv": argv, "off": summary_ms(times[False]), "on": summary_ms(times[True]),
            "ratio": factor, "path_calls_looked_at": seen,
        }
        if label == OPENS:
            results["workloads"][label]["us_per_call"] = (
                round((on - off) * 1e6 / seen, 2) if seen else None)
        else:
            results["workloads"][label]["goal_met"] = factor is not None and factor <= GOAL
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.why", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="isolate-bench-why-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.chmod(workdir, 0o777)  # a root caller's program runs as 65534 and writes its objects here
    try:
        results = {"machine": describe(), **measure(args.runs, workdir, lambda m: print(m, file=sys.stderr))}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
    for label, figures in results["workloads"].items():
        goal = ("" if "goal_met" not in figures else
                f" ({'met' if figures['goal_met'] else 'NOT met'}; goal <= {GOAL}x)")
        per_call = f", {figures['us_per_call']} us per call" if "us_per_call" in figures else ""
        print(f"{label}: off {figures['off']['median_ms']:.2f} ms, on {figures['on']['median_ms']:.2f} ms, "
              f"ratio {figures['ratio']}{goal}, {figures['path_calls_looked_at']} path calls looked at{per_call}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
