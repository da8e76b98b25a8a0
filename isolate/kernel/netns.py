"""Network namespaces made ahead of the runs that need an empty one.

A new network namespace costs its maker about 0.3 ms of the kernel's time
(each protocol's per-namespace state), most of what six new namespaces cost
a sandbox's ``clone()``. For a root caller a thread of this process makes
them ahead (``iso_make_netns``: ``unshare`` in that thread alone, a
descriptor, back to its own namespace), and a run whose network is "none"
is born in one of them (``iso_plan.netns_fd``: the caller's thread joins it
around the ``clone``). Each namespace serves one sandbox and no other: it is
taken from the pool once, and its descriptor closed once the sandbox runs.
It is as empty as one the ``clone`` would have made (only ``lo``, down),
and owned by the caller's user namespace rather than the sandbox's, so the
sandbox holds no capability over it at all. The namespace is made again
when the pool runs dry; a run never waits for one.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import deque

from .._core import lib
from ..model.forks import fork_safe, in_child

#: Namespaces kept ready: one for the next run, one being made meanwhile.
POOL_SIZE = 2
#: Seconds the maker thread waits with a full pool before it ends (the next run starts another): a burst of
#: runs keeps one thread, and a process that stopped running sandboxes holds none (Python 3.12+ warns at an
#: ``os.fork()`` of a process with threads, and a thread of ours would be the only one of many callers).
IDLE_SECONDS = 1.0


class _Pool:
    def __init__(self) -> None:
        # Free again in a forked child (model/forks.py), which has none of the parent's threads: one may have held it.
        self._lock = fork_safe(threading.Lock())
        self._wake = fork_safe(threading.Condition(self._lock))
        self._ready: deque[int] = deque()
        self._thread: threading.Thread | None = None
        self._broken = False
        self._pid = os.getpid()

    def take(self) -> int:
        """A namespace made ahead (a descriptor the caller closes), or -1: none ready, make your own."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's namespaces are the parent's
                self._reset_locked()
            if self._broken:
                return -1
            fd = self._ready.popleft() if self._ready else -1
            if self._thread is None:
                self._thread = threading.Thread(target=self._maker, name="isolate-netns", daemon=True)
                self._thread.start()
            else:
                self._wake.notify()
        return fd

    def _maker(self) -> None:
        # One thread while runs come (IDLE_SECONDS), at the caller's priority (a lower one would hold the kernel's
        # network locks while preempted, in the way of every other namespace made meanwhile; measured, it
        # paid no more: docs/benchmarks.md). iso_make_netns moves the calling thread (cffi lets go of the GIL
        # meanwhile); a thread that could not come back (-2) ends here, in the namespace it made, which no one
        # is given.
        pid = os.getpid()
        while True:
            with self._lock:
                while len(self._ready) >= POOL_SIZE and self._pid == pid:
                    if not self._wake.wait(IDLE_SECONDS) and len(self._ready) >= POOL_SIZE:
                        if self._thread is threading.current_thread():
                            self._thread = None  # the next take() starts another
                        return
                if self._pid != pid:
                    return
            fd = int(lib.iso_make_netns())
            if 0 <= fd <= 2:  # netns_fd 0 means none: keep it off the standard streams
                fd = _above_stdio(fd)
            with self._lock:
                if fd < 0 or self._pid != pid:
                    if fd >= 0:
                        os.close(fd)
                    self._broken = self._broken or fd < 0
                    return
                self._ready.append(fd)

    def _reset_locked(self) -> None:
        for fd in self._ready:
            try:
                os.close(fd)
            except OSError:
                pass
        self._ready.clear()
        self._thread = None
        self._pid = os.getpid()


def _above_stdio(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


_POOL = _Pool()
in_child(_POOL._reset_locked)  # a forked child: the parent's namespaces are the parent's, its maker thread gone


def take() -> int:
    """A fresh, empty network namespace made ahead by this process (a descriptor), or -1.

    Only a root caller can make one (``CAP_SYS_ADMIN`` over its network
    namespace); for others, and when none is ready, -1: the sandbox's own
    ``clone`` makes it, as before.
    """
    if os.geteuid() != 0:
        return -1
    return _POOL.take()
