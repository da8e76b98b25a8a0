"""Leases: which layers of the store a running sandbox stands on, so that prune never removes them.

A sandbox from an image holds a lease while it runs: ``leases/PID-START~NS``
in the store, PID the host pid of its init (or of the one-shot's first
process) and START that process's start time (``/proc/PID/stat``, clock
ticks since boot: a pid used again is another process, whose start time
differs), NS the inode of the writer's PID namespace, one line per layer
directory the overlay is made of. A pid is a number of one PID namespace: a
lease written in another one (a container sharing the store) names a process
that may run although this namespace has no such pid, so only a pruner of the
lease's own namespace may take it for ended; the others keep it (and its
layers) until one does. The lease is
written under the store's lock held shared, between the check that the
layers are still there and the spawn's end; prune takes that lock
exclusively and keeps every layer a live lease names. A lease whose process
has ended is no lease: prune removes it, as its sandbox's end does.

The native ``isolate-run`` binary writes the same file when it replays a
cached plan (csrc/cli.c: the plan carries the directory and the lines).

A build holds one too while it runs (``Holding``: ``leases/PID-START.bN``):
its first line ``started WALLTIME``, then the paths it stands on as it goes
(its images' records and layers, its cache mounts' directories), so that
``prune(build_cache=True)`` takes neither an image a running build made or
starts from, nor a cache directory a running step has bound.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

LEASES = "leases"


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()  # the name, in parentheses, may hold anything
    try:
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    except (IndexError, ValueError):
        return None


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _name(pid: int, started: int) -> str:
    return f"{pid}-{started}~{pid_namespace()}"


def body(layer_dirs: Sequence[str]) -> bytes:
    return "".join(f"{path}\n" for path in layer_dirs).encode()


def write(store_path: str, pid: int, layer_dirs: Sequence[str]) -> str | None:
    """Record that ``pid``'s sandbox stands on ``layer_dirs``; the lease's path (None: the process has
    already ended, it needs none)."""
    started = start_time(pid)
    if started is None:
        return None
    directory = os.path.join(store_path, LEASES)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    path = os.path.join(directory, _name(pid, started))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, body(layer_dirs))
    finally:
        os.close(fd)
    return path


def release(path: str | None) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@dataclass(frozen=True)
class Lease:
    name: str
    lines: tuple[str, ...]


def _live_leases(store_path: str) -> Iterator[Lease]:
    """The leases of running processes (``PID-START~NS``, ``.TAG`` after it for a build's), and those of other
    PID namespaces; those of ended ones removed."""
    directory = os.path.join(store_path, LEASES)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    own = str(pid_namespace())
    for name in names:
        pid_text, _, rest = name.partition("-")
        start_text, _, namespace = rest.partition(".")[0].partition("~")
        path = os.path.join(directory, name)
        if not (pid_text.isdigit() and start_text.isdigit() and (namespace.isdigit() or not namespace)):
            release(path)  # not a lease (a writer's leftover)
            continue
        # One without NS is of an earlier isolate, which wrote leases of its own PID namespace only.
        if namespace in ("", own) and start_time(int(pid_text)) != int(start_text):
            release(path)
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                lines = handle.read(1 << 20).decode(errors="replace").splitlines()
        except OSError:
            continue
        yield Lease(name, tuple(lines))


def live(store_path: str) -> Iterator[str]:
    """The names (the last component of each path: a layer's hex digest, an image record's file, a cache
    directory's key) that live leases hold; the leases of ended processes are removed."""
    for lease in _live_leases(store_path):
        for line in lease.lines:
            if line.startswith("/"):
                yield os.path.basename(line.rstrip("/"))


def builds_started(store_path: str) -> list[float]:
    """When each running build began (wall clock): an image made since may be one it has not leased yet."""
    out = []
    for lease in _live_leases(store_path):
        first = lease.lines[0] if lease.lines else ""
        if first.startswith("started "):
            with contextlib.suppress(ValueError):
                out.append(float(first.split()[1]))
    return out


_counter = itertools.count()


class Holding:
    """A build's lease, held while it runs: ``add`` names more paths (call it under the store's shared lock,
    which prune takes exclusively, so that what prune decided and what is added never cross)."""

    def __init__(self, store_path: str) -> None:
        self.store_path = store_path
        self.lines = [f"started {time.time()!r}"]
        self.path: str | None = None
        self.tag = f"b{next(_counter)}"

    def add(self, paths: Sequence[str]) -> None:
        new = [p for p in paths if p not in self.lines]
        if not new and self.path is not None:
            return
        self.lines.extend(new)
        started = start_time(os.getpid())
        if started is None:  # no /proc: nothing can lease
            return
        directory = os.path.join(self.store_path, LEASES)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        self.path = os.path.join(directory, f"{_name(os.getpid(), started)}.{self.tag}")
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, "".join(f"{line}\n" for line in self.lines).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def release(self) -> None:
        release(self.path)
        self.path = None
