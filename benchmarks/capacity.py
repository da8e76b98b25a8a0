"""How many sandboxes per second, and what each live sandbox costs the host in memory.

Throughput: 1 and 2 threads call ``isolate.run(["/bin/true"])`` back to back
for a fixed time (plain ``subprocess.run`` alongside, as the reference); the
configurations alternate in two passes so drift hits them alike.

Memory: N sandboxes are started, each running ``sleep 600``, and held alive.
Three measures are taken before and after, N apart:

* the growth of this process's memory cgroup (``memory.usage_in_bytes`` in
  cgroup v1, ``memory.current`` in v2), less the change of this process's
  own RSS. Children stay in the caller's cgroup (the policy sets no limit),
  and the kernel charges the cgroup for their user pages *and* for kernel
  memory they cause (page tables, namespaces, mounts, the task structures),
  so this is the whole cost, and other processes on the machine do not
  disturb it;
* the fall of the system's ``MemAvailable`` (everything, but noisy on a shared
  machine; the only measure for Docker, whose containers live in the
  engine's cgroups);
* the PSS of the sandbox's own processes (isolate's init, bwrap's monitor)
  and of the program, from /proc/PID/smaps_rollup (psutil): user memory only.

The same N plain ``sleep 600`` processes give the cost of the program itself;
the cost of a sandbox beyond its program is the difference per sandbox. Each
measurement starts once the cgroup's usage has stopped moving (the kernel
frees a network namespace late), is repeated, and the median kept.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from ._stats import median
from .machine import meminfo_kib

TRUE = "/bin/true"
SLEEP = ["sleep", "600"]


# --------------------------------------------------------------------------
# Throughput


def _rate(call: Callable[[], None], workers: int, seconds: float) -> tuple[int, float, int]:
    """(completed, elapsed seconds, failures) for ``workers`` threads calling ``call`` for ``seconds``."""
    stop = time.monotonic() + seconds
    counts = [0] * workers
    failures = [0] * workers

    def loop(i: int) -> None:
        while time.monotonic() < stop:
            try:
                call()
            except Exception:
                failures[i] += 1
                continue
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(workers)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.monotonic() - start, sum(failures)


def throughput(*, seconds: float, log: Callable[[str], None]) -> dict[str, Any]:
    import isolate

    default = isolate.Policy()
    landlock_only = isolate.Policy(namespaces=False, tmpfs=(), write=())
    quiet: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL}

    def plain() -> None:
        if subprocess.run([TRUE], **quiet).returncode != 0:
            raise RuntimeError("exit status")

    def sandboxed(policy: isolate.Policy) -> Callable[[], None]:
        def go() -> None:
            if isolate.run([TRUE], policy=policy, **quiet).returncode != 0:
                raise RuntimeError("exit status")

        return go

    calls = {
        "subprocess.run": plain,
        "isolate.run": sandboxed(default),
        "isolate.run/ll": sandboxed(landlock_only),
    }
    totals: dict[tuple[str, int], list[float]] = {}
    for pass_ in range(2):
        for name, call in calls.items():
            for workers in (1, 2):
                done, elapsed, failed = _rate(call, workers, seconds / 2)
                acc = totals.setdefault((name, workers), [0, 0.0, 0])
                acc[0] += done
                acc[1] += elapsed
                acc[2] += failed
        log(f"throughput: pass {pass_ + 1}/2 done")
    out: dict[str, Any] = {"seconds_per_configuration": seconds, "per_second": {}}
    for (name, workers), (completed, elapsed, failures) in totals.items():
        entry = out["per_second"].setdefault(name, {})
        entry[f"{workers} worker" + ("s" if workers > 1 else "")] = round(completed / elapsed, 1)
        if failures:
            entry[f"failures with {workers}"] = int(failures)
    return out


# --------------------------------------------------------------------------
# Memory of live sandboxes


def _cgroup_usage_file() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidate = f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"
            if os.access(candidate, os.R_OK):
                return candidate
    for line in lines:
        if line.startswith("0::"):
            candidate = f"/sys/fs/cgroup{line[3:]}/memory.current"
            if os.access(candidate, os.R_OK):
                return candidate
    return None


def _read_int(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _snapshot(cgroup_file: str | None) -> dict[str, int | None]:
    import psutil

    gc.collect()
    time.sleep(0.3)
    available = meminfo_kib("MemAvailable")
    return {
        "available": available * 1024 if available is not None else None,
        "cgroup": _read_int(cgroup_file),
        "own_rss": int(psutil.Process().memory_info().rss),
    }


def _descendants() -> list[Any]:
    import psutil

    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def _pss(procs: list[Any]) -> int:
    import psutil

    total = 0
    for proc in procs:
        try:
            total += int(proc.memory_full_info().pss)
        except (psutil.Error, AttributeError):
            continue
    return total


def _wait_for_programs(n: int, before: set[int], timeout: float = 30.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        sleeping = []
        for proc in _descendants():
            if proc.pid in before:
                continue
            try:
                if proc.name() == "sleep":
                    sleeping.append(proc)
            except Exception:
                continue
        if len(sleeping) >= n or time.monotonic() > deadline:
            return sleeping
        time.sleep(0.05)


class _Kind:
    def __init__(self, name: str, start: Callable[[], Any], stop: Callable[[Any], None], local: bool = True) -> None:
        self.name = name
        self.start = start
        self.stop = stop
        self.local = local  # its processes are our descendants, in our cgroup


def _kill(handle: Any) -> None:
    import psutil

    try:
        family = [*psutil.Process(handle.pid).children(recursive=True), psutil.Process(handle.pid)]
    except psutil.Error:
        family = []
    for proc in family:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    handle.wait()


def _settle(cgroup_file: str | None, timeout: float = 8.0) -> None:
    """Wait until the cgroup's usage stops moving: the kernel frees some of a sandbox's memory late
    (a network namespace is torn down by a work queue), which would count against the next kind."""
    if cgroup_file is None:
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    last = _read_int(cgroup_file)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _read_int(cgroup_file)
        if last is not None and now is not None and abs(now - last) < 128 * 1024:
            return
        last = now


def _measure_kind(kind: _Kind, n: int, cgroup_file: str | None) -> dict[str, Any]:
    before_pids = {p.pid for p in _descendants()}
    _settle(cgroup_file)
    base = _snapshot(cgroup_file)
    handles = []
    try:
        for _ in range(n):
            handles.append(kind.start())
        programs: list[Any] = []
        helpers: list[Any] = []
        if kind.local:
            programs = _wait_for_programs(n, before_pids)
            helpers = [p for p in _descendants() if p.pid not in before_pids and p not in programs]
            if len(programs) < n:
                raise RuntimeError(f"only {len(programs)} of {n} programs started")
        else:
            time.sleep(1.0)
        after = _snapshot(cgroup_file)
        row: dict[str, Any] = {}
        if base["available"] is not None and after["available"] is not None:
            row["mem_available_drop_kib"] = (base["available"] - after["available"]) / n / 1024
        if kind.local and base["cgroup"] is not None and after["cgroup"] is not None:
            # This process is in the cgroup too: its own heap's ups and downs are taken out.
            own = (after["own_rss"] or 0) - (base["own_rss"] or 0)
            row["cgroup_growth_kib"] = (after["cgroup"] - base["cgroup"] - own) / n / 1024
        if kind.local:
            row["pss_program_kib"] = _pss(programs) / n / 1024
            row["pss_sandbox_processes_kib"] = _pss(helpers) / n / 1024
            row["sandbox_processes_per_sandbox"] = round(len(helpers) / n, 2)
        return row
    finally:
        for handle in handles:
            try:
                kind.stop(handle)
            except Exception:
                pass


def memory(*, n: int, reps: int, docker_image: str | None, docker_n: int, log: Callable[[str], None]) -> dict[str, Any]:
    import isolate

    cgroup_file = _cgroup_usage_file()
    devnull: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    default = isolate.Policy()
    landlock_only = isolate.Policy(namespaces=False, tmpfs=(), write=())
    kinds = [
        _Kind("plain process", lambda: subprocess.Popen(SLEEP, **devnull), _kill),
        _Kind("isolate (default policy)", lambda: isolate.Popen(SLEEP, policy=default, **devnull), _kill),
        _Kind("isolate (Landlock+seccomp only)", lambda: isolate.Popen(SLEEP, policy=landlock_only, **devnull), _kill),
    ]
    bwrap = shutil.which("bwrap")
    if bwrap:
        from .peers import _bwrap

        argv = [*_bwrap(bwrap)[:-1], "/usr/bin/sleep", "600"]
        kinds.append(_Kind("bwrap --unshare-all", lambda: subprocess.Popen(argv, **devnull), _kill))
    results: dict[str, list[dict[str, Any]]] = {k.name: [] for k in kinds}
    errors: dict[str, str] = {}
    for rep in range(reps):
        for kind in kinds if rep % 2 == 0 else list(reversed(kinds)):
            if kind.name in errors:
                continue
            try:
                results[kind.name].append(_measure_kind(kind, n, cgroup_file))
            except Exception as exc:
                errors[kind.name] = f"{type(exc).__name__}: {exc}"[:300]
        log(f"memory: pass {rep + 1}/{reps} done")
    out: dict[str, Any] = {"n": n, "reps": reps, "cgroup_file": cgroup_file, "kib_per_sandbox": {}}
    for name, rows in results.items():
        if name in errors:
            out["kib_per_sandbox"][name] = {"skipped": errors[name]}
            continue
        keys = rows[0].keys() if rows else []
        out["kib_per_sandbox"][name] = {key: round(median([r[key] for r in rows]), 1) for key in keys}
    if docker_image is not None:
        out["kib_per_sandbox"]["docker run -d (container)"] = _docker_memory(docker_image, docker_n, log)
    plain = out["kib_per_sandbox"].get("plain process", {})
    beyond: dict[str, Any] = {}
    for name, row in out["kib_per_sandbox"].items():
        if name == "plain process" or "skipped" in row:
            continue
        for measure in ("cgroup_growth_kib", "mem_available_drop_kib"):
            if measure in row and measure in plain:
                beyond.setdefault(name, {})[measure] = round(row[measure] - plain[measure], 1)
    out["beyond_program_kib"] = beyond
    return out


def _docker_memory(image: str, n: int, log: Callable[[str], None]) -> dict[str, Any]:
    docker = shutil.which("docker")
    if docker is None:
        return {"skipped": "no docker CLI"}
    log(f"memory: {n} Docker containers")
    rows = []
    ids: list[str] = []
    try:
        base = _snapshot(None)
        for _ in range(n):
            done = subprocess.run([docker, "run", "-d", "--rm", "--network", "none", image, *SLEEP],
                                  capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                return {"skipped": f"docker run -d failed: {done.stderr.strip()[-200:]}"}
            ids.append(done.stdout.strip())
        time.sleep(1.0)
        after = _snapshot(None)
        if base["available"] is not None and after["available"] is not None:
            rows.append((base["available"] - after["available"]) / n / 1024)
    finally:
        if ids:
            subprocess.run([docker, "rm", "-f", *ids], capture_output=True, timeout=120)
    return {"mem_available_drop_kib": round(rows[0], 1)} if rows else {"skipped": "MemAvailable unreadable"}
