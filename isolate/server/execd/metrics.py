"""Metrics (``/metrics``, ``/metrics/watch``): the sandbox's CPU and memory, not the host's.

A sandbox with limits has a cgroup of its own: its CPU time and memory in
use are the cgroup's counters (every process it ever ran, exited ones
included). Without one, they are summed over its processes from /proc (CPU
time of the living processes and of the children they waited for; resident
memory). The CPU percentage is the CPU time used between two readings over
the wall time between them, relative to the CPUs the sandbox may use (its
``cpus`` limit, else the host's), so 0..100 as the spec has it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...kept.sandbox import Sandbox
from ..common import SSE_HEADERS, api
from ..reach import run_cgroup
from ..state import ManagedSandbox
from .access import sandbox_for

#: How often /metrics/watch sends a reading (the spec: every second).
WATCH_INTERVAL = 1.0
#: A first reading is compared with one taken this long after it.
FIRST_INTERVAL = 0.1


def _cgroup_memory(cgroup: Any) -> int | None:
    for directory in cgroup.directories:
        for name in ("memory.current", "memory.usage_in_bytes"):  # v2, v1
            try:
                with open(os.path.join(directory, name), encoding="ascii") as f:
                    return int(f.read().strip())
            except (FileNotFoundError, ValueError):
                continue
    return None


def _proc_usage(box: Sandbox) -> tuple[float, int]:
    cpu = 0.0
    rss = 0
    for proc in box.processes():
        try:
            times = proc.cpu_times()
            cpu += times.user + times.system + times.children_user + times.children_system
            rss += proc.memory_info().rss
        except Exception:  # it ended meanwhile
            continue
    return cpu, rss


def usage(box: Sandbox) -> tuple[float, int]:
    """(CPU seconds used so far, memory in use in bytes)."""
    remote = getattr(box, "usage", None)
    if remote is not None:
        return remote()  # type: ignore[no-any-return]  # a sandbox on a Ray node reads its own
    cgroup = run_cgroup(box)
    if cgroup is not None and not cgroup.removed:
        try:
            cpu = cgroup.cpu_seconds()
            memory = _cgroup_memory(cgroup)
        except OSError:
            cpu = memory = None
        if cpu is not None and memory is not None:
            return cpu, memory
        proc_cpu, rss = _proc_usage(box)
        return (cpu if cpu is not None else proc_cpu), (memory if memory is not None else rss)
    return _proc_usage(box)


def reading(managed: ManagedSandbox, previous: tuple[float, float] | None) -> tuple[dict[str, Any],
                                                                                 tuple[float, float]]:
    """One Metrics object, and the CPU sample it was computed from (for the next reading)."""
    box = managed.box
    now = time.monotonic()
    cpu, memory = usage(box)
    if previous is None or not 0.05 <= now - previous[0] <= 30:
        first = (now, cpu)
        time.sleep(FIRST_INTERVAL)
        now = time.monotonic()
        cpu, memory = usage(box)
        previous = first
    limits = box.policy.limits
    cpus = float(limits.value("cpus") or os.cpu_count() or 1)
    limit = limits.value("memory")
    if limit is None:
        import psutil

        limit = psutil.virtual_memory().total
    used_pct = max(0.0, min(100.0, (cpu - previous[1]) / max(now - previous[0], 1e-6) / cpus * 100))
    metrics = {"cpu_count": cpus, "cpu_used_pct": round(used_pct, 2), "mem_total_mib": limit / (1 << 20),
               "mem_used_mib": min(memory, limit) / (1 << 20), "timestamp": int(time.time() * 1000)}
    return metrics, (now, cpu)


@api
async def metrics(request: Request) -> Response:
    managed = sandbox_for(request)

    def work() -> dict[str, Any]:
        out, managed.cpu_sample = reading(managed, managed.cpu_sample)
        return out

    return JSONResponse(await run_in_threadpool(work))


@api
async def watch_metrics(request: Request) -> Response:
    managed = sandbox_for(request)
    state = request.app.state.isolate
    import json

    async def stream() -> AsyncIterator[bytes]:
        previous: tuple[float, float] | None = None
        while state.sandboxes.get(managed.id) is managed:  # until the sandbox is deleted or expires
            try:
                out, previous = await run_in_threadpool(reading, managed, previous)
            except Exception:  # the sandbox ended: so does the stream
                return
            yield b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n"
            await asyncio.sleep(WATCH_INTERVAL)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
