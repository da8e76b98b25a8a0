"""Denial tracing: the init's table of refused file accesses (csrc/why.c), as report entries."""

from __future__ import annotations

import os
from typing import Any

from ..._core import ffi, lib

#: The bytes the init writes after struct iso_status when the plan traces denials.
REPORT_SIZE = ffi.sizeof("struct iso_why_report")

ACCESS = {
    lib.ISO_WHY_READ: "read", lib.ISO_WHY_WRITE: "write", lib.ISO_WHY_EXECUTE: "execute",
    lib.ISO_WHY_CREATE: "create", lib.ISO_WHY_REMOVE: "remove", lib.ISO_WHY_RENAME: "rename",
    lib.ISO_WHY_TRUNCATE: "truncate",
}
MECHANISM = {
    lib.ISO_WHY_LANDLOCK: "landlock", lib.ISO_WHY_ABSENT: "absent", lib.ISO_WHY_READONLY: "read-only",
    lib.ISO_WHY_DAC: "dac",
}


def _text(raw: Any) -> str:
    return os.fsdecode(ffi.string(raw, len(raw)))


def calls_seen(data: bytes) -> int | None:
    """How many path system calls the init looked at (None: no table)."""
    if len(data) < REPORT_SIZE:
        return None
    table = ffi.new("struct iso_why_report *")
    ffi.memmove(table, data, REPORT_SIZE)
    return int(table.seen) if table.magic == lib.ISO_WHY_MAGIC else None


def file_denials(data: bytes) -> list[dict[str, Any]]:
    """The report's entries for the init's table: path as named and as resolved, access, mechanism, count.

    An "absent" entry (the built root lacks the path) is kept only when the host has that path: a
    name that exists nowhere (a search along PATH, a probe for an optional file) is no denial.
    """
    if len(data) < REPORT_SIZE:
        return []
    table = ffi.new("struct iso_why_report *")
    ffi.memmove(table, data, REPORT_SIZE)
    if table.magic != lib.ISO_WHY_MAGIC:
        return []
    from ...kernel import seccomp

    out: list[dict[str, Any]] = []
    for i in range(min(int(table.n), len(table.denied))):
        entry = table.denied[i]
        mechanism = MECHANISM.get(int(entry.mechanism), "unknown")
        resolved = _text(entry.resolved)
        if mechanism == "absent" and not os.path.lexists(resolved):
            continue
        out.append({"mechanism": mechanism, "access": ACCESS.get(int(entry.access), "unknown"),
                    "path": _text(entry.path), "resolved": resolved,
                    "syscall": seccomp.syscall_name(int(entry.nr)), "count": int(entry.count)})
    if int(table.dropped):
        out.append({"mechanism": "files", "more": int(table.dropped)})
    return out
