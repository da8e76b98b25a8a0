"""What the sandbox costs the program inside it: system calls under each filter, and short real workloads.

System calls: a small C program (compiled here with gcc into a temporary
directory; without gcc this part is skipped) times three loops, each repeated
and its best repetition kept: ``syscall(SYS_getpid)`` (a call every filter
allows unconditionally, which the kernel's seccomp action cache can serve),
``open``/``close`` of a file under /usr (Landlock checks the open too), and
``ioctl(FIONREAD)`` on a pipe (``ioctl`` is a call whose arguments the
default and strict filters inspect, so the filter really runs). The program
runs unsandboxed and under ``isolate.run`` with ``seccomp="none"``,
``"default"`` and ``"strict"`` (everything else as the default policy, but
with no writable path: a root caller's writable paths bring a seccomp guard
against set-ID files, so that ``"none"`` would not be filter-free), the runs
interleaved; the figure per variant is the median over the runs.

Workloads: compiling that C file with ``gcc -O2``, and a short Python script
(the system's python3), each run plainly, under ``isolate.run`` with the
default policy and with ``seccomp="none"``, and under bwrap (same binds as the
spawn benchmark, the working directory writable), interleaved; the ratio of
the medians of the whole run times (start-up included) to the plain run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ._stats import median, ratio

C_SOURCE = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 200000;
    const char *path = argc > 2 ? argv[2] : "/usr/bin/env";
    int reps = argc > 3 ? atoi(argv[3]) : 5;
    int p[2];
    if (pipe(p) < 0) { perror("pipe"); return 2; }
    double best_getpid = 1e30, best_open = 1e30, best_ioctl = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now_ns();
        for (long i = 0; i < n; i++)
            syscall(SYS_getpid);
        double t1 = now_ns();
        for (long i = 0; i < n / 10; i++) {
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) { perror(path); return 2; }
            close(fd);
        }
        double t2 = now_ns();
        int avail = 0;
        for (long i = 0; i < n; i++)
            if (ioctl(p[0], FIONREAD, &avail) < 0) { perror("ioctl"); return 2; }
        double t3 = now_ns();
        if ((t1 - t0) / n < best_getpid) best_getpid = (t1 - t0) / n;
        if ((t2 - t1) / (n / 10) < best_open) best_open = (t2 - t1) / (n / 10);
        if ((t3 - t2) / n < best_ioctl) best_ioctl = (t3 - t2) / n;
    }
    printf("{\"getpid_ns\": %.2f, \"open_close_ns\": %.2f, \"ioctl_fionread_ns\": %.2f}\n",
           best_getpid, best_open, best_ioctl);
    return 0;
}
"""

PY_WORKLOAD = r"""
import hashlib, json, re
data = [{"id": i, "name": f"item-{i}", "tags": ["a", "b", str(i % 7)]} for i in range(20000)]
text = json.dumps(data)
back = json.loads(text)
words = re.findall(r"item-(\d+)", text)
digest = hashlib.sha256(text.encode()).hexdigest()
assert len(back) == len(words) == 20000, digest
"""

CALLS = ("getpid_ns", "open_close_ns", "ioctl_fionread_ns")
FILTERS = ("none", "default", "strict")


def _python_for_workload() -> str | None:
    """An interpreter under the default read-only paths (/usr): the system's python3."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(path, os.X_OK):
            return path
    return None


def _interleave(variants: dict[str, Callable[[], float]], runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in variants}
    keys = list(variants)
    for r in range(runs):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            out[key].append(variants[key]())
    return out


def measure(*, workdir: str, loops: int, runs: int, workload_runs: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The syscall and workload figures; sections that cannot run here say why in ``skipped``."""
    import isolate

    result: dict[str, Any] = {"method": __doc__.strip() if __doc__ else ""}
    gcc = shutil.which("gcc")
    if gcc is None:
        result["skipped"] = "gcc is not installed (apt-get install gcc): no syscall program and no compile workload"
        return result
    source = os.path.join(workdir, "sysbench.c")
    binary = os.path.join(workdir, "sysbench")
    with open(source, "w", encoding="ascii") as f:
        f.write(C_SOURCE)
    subprocess.run([gcc, "-O2", "-o", binary, source], check=True, cwd=workdir)
    os.chmod(binary, 0o755)
    os.chmod(source, 0o644)

    # No writable path: for a root caller, a writable path adds a seccomp guard against set-ID files,
    # and seccomp="none" would not mean "no filter" any more.
    from isolate.model.policy import DEFAULT_READ

    policies = {name: isolate.Policy(seccomp=name, read=(*DEFAULT_READ, workdir), write=()) for name in FILTERS}
    argv = [binary, str(loops), "/usr/bin/env", "5"]
    enforced: dict[str, Any] = {}

    def parse(stdout: bytes, what: str) -> dict[str, float]:
        try:
            figures: dict[str, float] = json.loads(stdout)
        except ValueError:
            raise RuntimeError(f"{what}: the syscall program printed {stdout[:200]!r}") from None
        return figures

    figures: dict[str, list[dict[str, float]]] = {"unsandboxed": [], **{f"seccomp={n}": [] for n in FILTERS}}

    def plain() -> float:
        done = subprocess.run(argv, capture_output=True, cwd=workdir, check=True)
        figures["unsandboxed"].append(parse(done.stdout, "unsandboxed"))
        return 0.0

    def sandboxed(name: str) -> Callable[[], float]:
        def go() -> float:
            done = isolate.run(argv, policy=policies[name], capture_output=True, cwd=workdir)
            if done.returncode != 0:
                raise RuntimeError(f"seccomp={name}: exit {done.returncode}: {done.stderr[-300:]!r}")
            enforced[name] = _filters(done.report.enforced)
            figures[f"seccomp={name}"].append(parse(done.stdout, f"seccomp={name}"))
            return 0.0

        return go

    log(f"overhead: syscall loops ({runs} interleaved runs of 4 variants)")
    variants: dict[str, Callable[[], float]] = {"unsandboxed": plain}
    variants.update({f"seccomp={n}": sandboxed(n) for n in FILTERS})
    _interleave(variants, runs)
    calls: dict[str, Any] = {}
    for variant, rows in figures.items():
        calls[variant] = {call: round(median([row[call] for row in rows]), 2) for call in CALLS}
    calls_ratios: dict[str, Any] = {}
    for name in ("default", "strict"):
        for call in CALLS:
            calls_ratios[f"{name}/none {call.removesuffix('_ns')}"] = ratio(
                calls[f"seccomp={name}"][call], calls["seccomp=none"][call]
            )
    for name in FILTERS:
        for call in CALLS:
            calls_ratios[f"{name}/unsandboxed {call.removesuffix('_ns')}"] = ratio(
                calls[f"seccomp={name}"][call], calls["unsandboxed"][call]
            )
    result["syscalls"] = {
        "loops": loops,
        "runs": runs,
        "ns_per_call": calls,
        "ratios": calls_ratios,
        "seccomp_enforced": enforced,
        "goals": {
            "getpid default/none <= 1.15": _goal(calls_ratios["default/none getpid"], 1.15),
            "argument-checked (ioctl) default/none <= 1.35": _goal(calls_ratios["default/none ioctl_fionread"], 1.35),
        },
    }

    # Real workloads: the whole run, plain vs isolate.run with the default policy.
    log(f"overhead: workloads ({workload_runs} interleaved runs)")
    default = isolate.Policy()
    workloads: dict[str, list[str]] = {"gcc -O2 (small C file)": [gcc, "-O2", "-o", "out.bin", "sysbench.c"]}
    python = _python_for_workload()
    if python:
        script = os.path.join(workdir, "workload.py")
        with open(script, "w", encoding="ascii") as f:
            f.write(PY_WORKLOAD)
        os.chmod(script, 0o644)
        workloads[f"python3 script ({python})"] = [python, "workload.py"]
    result_workloads: dict[str, Any] = {}
    no_filter = isolate.Policy(seccomp="none")  # as root, with "." writable: the set-ID guard filter stays
    filters_seen: dict[str, Any] = {}
    bwrap = shutil.which("bwrap")
    for label, command in workloads.items():

        def timed_plain(command: list[str] = command) -> float:
            start = time.perf_counter()
            subprocess.run(command, cwd=workdir, check=True, stdout=subprocess.DEVNULL)
            return time.perf_counter() - start

        def timed_sandboxed(policy: isolate.Policy, command: list[str] = command, label: str = label) -> float:
            start = time.perf_counter()
            done = isolate.run(command, policy=policy, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            elapsed = time.perf_counter() - start
            if done.returncode != 0:
                raise RuntimeError(f"{label} in the sandbox: exit {done.returncode}: {done.stderr[-300:]!r}")
            if policy is no_filter:
                filters_seen[label] = _filters(done.report.enforced)
            return elapsed

        def timed_bwrap(command: list[str] = command) -> float:
            assert bwrap is not None
            start = time.perf_counter()
            subprocess.run([*bwrap_prefix(bwrap, workdir), *command], check=True, stdout=subprocess.DEVNULL)
            return time.perf_counter() - start

        variants = {
            "plain": timed_plain,
            "isolate.run": lambda: timed_sandboxed(default),
            "isolate.run seccomp=none": lambda: timed_sandboxed(no_filter),
        }
        if bwrap:
            variants["bwrap"] = timed_bwrap
        try:
            times = _interleave(variants, workload_runs)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            result_workloads[label] = {"skipped": str(exc)[:300]}
            continue
        medians = {k: median(v) * 1000 for k, v in times.items()}
        result_workloads[label] = {
            "runs": workload_runs,
            "median_ms": {k: round(v, 2) for k, v in medians.items()},
            "ratio_to_plain": {k: ratio(v, medians["plain"]) for k, v in medians.items() if k != "plain"},
            "seccomp=none enforced": filters_seen.get(label),
        }
    if not python:
        result_workloads["python3 script"] = {"skipped": "no python3 under /usr (the default policy's read paths)"}
    result["workloads"] = result_workloads
    return result


def bwrap_prefix(bwrap: str, workdir: str) -> list[str]:
    """bwrap with the binds of the spawn benchmark, plus the working directory writable."""
    return [
        bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", workdir, workdir, "--chdir", workdir,
    ]  # fmt: skip


def _filters(enforced: dict[str, Any]) -> dict[str, Any]:
    """The report's entries about system call filters."""
    return {k: v for k, v in enforced.items() if k.startswith(("seccomp", "setid"))}


def _goal(value: float | None, limit: float) -> dict[str, Any]:
    return {"value": value, "limit": limit, "met": None if value is None else value <= limit}


if __name__ == "__main__":  # pragma: no cover - a manual entry for this part alone
    import tempfile

    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        os.chmod(tmp, 0o755)
        print(json.dumps(measure(workdir=tmp, loops=200000, runs=5, workload_runs=5,
                                 log=lambda m: print(m, file=sys.stderr)), indent=2))
