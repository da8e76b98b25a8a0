"""Denial tracing: the init's table of refused file accesses (csrc/why.c), as report entries."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..._core import ffi, lib

#: The bytes the init writes after struct iso_status when the plan traces denials.
REPORT_SIZE = ffi.sizeof("struct iso_why_report")

ACCESS = {
    lib.ISO_WHY_READ: "read", lib.ISO_WHY_WRITE: "write", lib.ISO_WHY_EXECUTE: "execute",
    lib.ISO_WHY_CREATE: "create", lib.ISO_WHY_REMOVE: "remove", lib.ISO_WHY_RENAME: "rename",
    lib.ISO_WHY_TRUNCATE: "truncate", lib.ISO_WHY_LOOKUP: "lookup",
}
MECHANISM = {
    lib.ISO_WHY_LANDLOCK: "landlock", lib.ISO_WHY_ABSENT: "absent", lib.ISO_WHY_READONLY: "read-only",
    lib.ISO_WHY_DAC: "dac",
}


def _text(raw: Any) -> str:
    return os.fsdecode(ffi.string(raw, len(raw)))


def _entry(d: Any, count: int) -> dict[str, Any]:
    """A report entry for one struct iso_file_denial; "cut": its path is the start of a longer one."""
    from ...kernel import seccomp

    entry: dict[str, Any] = {"mechanism": MECHANISM.get(int(d.mechanism), "unknown"),
                             "access": ACCESS.get(int(d.access), "unknown"), "path": _text(d.path),
                             "resolved": _text(d.resolved), "syscall": seccomp.syscall_name(int(d.nr)),
                             "count": count}
    if int(d.flags) & lib.ISO_WHY_CUT:
        entry["cut"] = True
    return entry


def on_host(entry: dict[str, Any]) -> bool:
    """Whether an "absent" entry names what the host has (for a new entry: its directory); a cut one
    cannot be looked up, and is kept."""
    if entry["mechanism"] != "absent" or entry.get("cut"):
        return True
    resolved = str(entry["resolved"])
    if entry["access"] in ("create", "rename"):
        resolved = os.path.dirname(resolved.rstrip("/")) or "/"
    return os.path.lexists(resolved)


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
    out: list[dict[str, Any]] = []
    for i in range(min(int(table.n), len(table.denied))):
        found = _entry(table.denied[i], int(table.denied[i].count))
        if on_host(found):
            out.append(found)
    if int(table.dropped):
        out.append({"mechanism": "files", "more": int(table.dropped)})
    return out


#: One refusal as the init streams it (a kept sandbox): its caller's session, then the entry.
EVENT_SIZE = ffi.sizeof("struct iso_why_event")
#: Distinct entries kept per session, and sessions kept, until a command's report takes them.
_MAX_PER_SESSION = 256
_MAX_SESSIONS = 1024


class WhyStream:
    """The host's end of a kept sandbox's refusal stream: each command's entries, by its session.

    A command leads a session of its own (its monitor starts it with setsid), so the entries of the
    processes of that session are the command's. The init never waits on this pipe: what overflows
    it while nobody reads is lost (a command's report is read as it ends, which drains it).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._pending = b""
        self._sessions: dict[int, dict[tuple[str, ...], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def take(self, session: int) -> list[dict[str, Any]]:
        """The entries of ``session`` so far (merged, counted), forgotten here once taken."""
        with self._lock:
            self._drain()
            found = self._sessions.pop(session, {})
        return [entry for entry in found.values() if on_host(entry)]

    def _drain(self) -> None:
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, EVENT_SIZE * 64)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        while len(self._pending) >= EVENT_SIZE:
            raw, self._pending = self._pending[:EVENT_SIZE], self._pending[EVENT_SIZE:]
            self._add(raw)

    def _add(self, raw: bytes) -> None:
        event = ffi.new("struct iso_why_event *")
        ffi.memmove(event, raw, EVENT_SIZE)
        entry = _entry(event.denial, 1)
        key = tuple(str(entry.get(k)) for k in ("mechanism", "access", "path", "resolved", "syscall", "cut"))
        session = self._sessions.get(int(event.session))
        if session is None:
            if len(self._sessions) >= _MAX_SESSIONS:
                del self._sessions[next(iter(self._sessions))]  # the oldest: a command no one asked about
            session = self._sessions[int(event.session)] = {}
        if key in session:
            session[key]["count"] += 1
        elif len(session) < _MAX_PER_SESSION:
            session[key] = entry

    def close(self) -> None:
        with self._lock:
            self._drain()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
