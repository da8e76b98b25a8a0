"""``Sandbox.restore(snapshot, ahead=True)``: the next restore to that snapshot, started now in the background.

A restore ends the sandbox's processes and starts it again over the snapshot's files: a new init, exec
server, namespaces and workspace layer, a few milliseconds of CPU each time. A loop that resets a sandbox to
one snapshot after every episode (reinforcement learning's) pays that on its critical path, while its
sandbox mostly waits for the episode's commands. With ``ahead``, the restore also starts a second sandbox of
the same policy from the snapshot, in the background; the next restore to that snapshot swaps it in (the
old one ended as a restore ends it) instead of starting one. The spare is a sandbox like any, started from
the snapshot's files as a restore would start it (a snapshot's layers never change); it holds its own
processes and a few hundred KiB meanwhile, and it goes at a restore to another snapshot or the sandbox's
close.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..backends.kept import KeptBackend
from ..model.forks import in_child


def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="isolate-restore")


#: The spares' starts and the old sandboxes' ends run here, off the restores' path: a thread started per
#: restore cost the restore its start (a switch to it and back, about a millisecond on a busy host).
_BACKGROUND = _executor()


def _after_fork() -> None:
    """A forked child has none of its parent's threads, while the executor still counts them: a new one."""
    global _BACKGROUND
    _BACKGROUND = _executor()


in_child(_after_fork)


def in_background(work: Any) -> None:
    """Run ``work()`` on the restores' background threads (what it raises is its own: it is dropped)."""
    _BACKGROUND.submit(_quietly, work)


def _quietly(work: Any) -> None:
    try:
        work()
    except Exception:
        pass


class Ahead:
    """A sandbox being started (or started) from a snapshot, for the next restore to it."""

    def __init__(self, snapshot: Any, impl: KeptBackend) -> None:
        self.snapshot_id, self.identity = snapshot.id, snapshot.identity
        self.impl = impl
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._discarded = False
        self._closed = False
        #: The process it was started for: a child forked since has neither its starting thread nor a right to
        #: its processes (they are the parent's), and leaves it alone.
        self._pid = os.getpid()
        in_background(self._start)

    def _start(self) -> None:
        try:
            self.impl.start()
        except BaseException as exc:  # the restore that would take it starts one the usual way
            self.error = exc
        with self._lock:
            self._done.set()
            discarded = self._discarded
        if discarded:
            self._close()

    def of(self, snapshot: Any) -> bool:
        """Whether it was started from ``snapshot``."""
        return (snapshot.id, snapshot.identity) == (self.snapshot_id, self.identity)

    def take(self, snapshot: Any) -> KeptBackend | None:
        """The started sandbox when it is of ``snapshot`` and still runs (waited for if still starting); None
        otherwise (it is then ended)."""
        if os.getpid() != self._pid:
            return None  # a forked child's copy: the parent's spare (its start may never be seen here)
        if not self.of(snapshot):
            self.discard()
            return None
        self._done.wait()
        process = getattr(self.impl, "process", None)
        # Its init still runs (an idle end or a process of its own may have ended it meanwhile).
        if self.error is None and process is not None and process.poll() is None:
            return self.impl
        self.discard()
        return None

    def discard(self) -> None:
        """End it, once it has started (off the caller's path: a start still under way ends it when done)."""
        if os.getpid() != self._pid:
            return  # a forked child's copy: the parent's to end
        with self._lock:
            self._discarded = True
            started = self._done.is_set()
        if started:
            in_background(self._close)

    def end(self) -> None:
        """End it now: wait for a start still under way, then close it (the sandbox's close: nothing of it is
        left running once that returns)."""
        if os.getpid() != self._pid:
            return  # a forked child's copy: the parent's to end
        with self._lock:
            self._discarded = True
        self._done.wait()
        self._close()

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return  # ended by the other of discard's and end's paths
            self._closed = True
        try:
            self.impl.close()
        except Exception:
            pass
