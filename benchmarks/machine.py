"""What machine the figures come from."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Any


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def meminfo_kib(field: str) -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def distro() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return "unknown"


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def describe() -> dict[str, Any]:
    """Kernel, CPU, cores, memory, Python and isolate version, and the load when asked."""
    try:
        import isolate

        isolate_version = isolate.__version__
    except ImportError:  # pragma: no cover - the harness needs isolate anyway
        isolate_version = "not importable"
    landlock_abi: int | None
    try:
        from isolate.kernel import landlock

        landlock_abi = int(landlock.abi())
    except Exception:  # the C core may be missing; the description must not fail for it
        landlock_abi = None
    total = meminfo_kib("MemTotal")
    return {
        "kernel": platform.release(),
        "distro": distro(),
        "arch": platform.machine(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(total / 1024 / 1024, 1) if total else None,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "python_executable": sys.executable,
        "isolate": isolate_version,
        "landlock_abi": landlock_abi,
        "euid": os.geteuid(),
        "load_average_start": load_average(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
