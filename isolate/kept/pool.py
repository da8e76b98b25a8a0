"""Many kept sandboxes: ``Sandbox.create_many`` and the warm ``SandboxPool``.

    pool = isolate.SandboxPool(policy, size=8, workspace=isolate.Workspace("./repo"))
    with pool.acquire() as sb:          # started already: the acquire costs a lock and a pop
        sb.exec(["pytest", "-q"])
    pool.close()

A sandbox is started once and handed out once: its release (``close()``, or
the end of its ``with`` block) ends it, and the pool starts a fresh one in
the background to keep ``size`` warm. Nothing of one user's (a process, a
file in the workspace, ``/tmp`` or the home, a shell) can reach the next,
because the next never gets the same sandbox.

Starting is mostly waiting (for the init to make its namespaces, for the
exec server's first answer) and runs no Python in the child, so n sandboxes
start side by side from threads of this process; nothing forks the
interpreter.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from typing import Any

from ..model.errors import IsolationError, PolicyError
from ..model.policy import Policy
from .sandbox import Sandbox, create_many, whole_number

__all__ = ["PoolClosedError", "PoolExhaustedError", "SandboxPool", "create_many"]


class PoolExhaustedError(IsolationError, TimeoutError):
    """``acquire(timeout=...)`` found no sandbox to hand out in time (the pool is at ``max_size``)."""


class PoolClosedError(IsolationError):
    """The pool was closed."""


class SandboxPool:
    """Keeps ``size`` sandboxes started so that ``acquire()`` hands one out at once.

    ``max_size``: at most that many sandboxes live at a time, warm and handed
    out together (None: no bound); an ``acquire`` past it waits for a release.
    The other keyword arguments are ``isolate.Sandbox``'s (workspace, mounts,
    backend, ttl, idle_timeout); ``name`` is refused (a pool's sandboxes are
    its own). With a ``ttl``, a sandbox handed out has at least half of it
    left: a warm one older than that is ended and a new one started in its
    place (handed out with a moment to live, it ended under its first
    command). The first ``size`` start before the constructor returns, so a
    policy the host cannot enforce fails here, with the reason.
    """

    def __init__(self, policy: Policy | None = None, *, size: int, max_size: int | None = None,
                 **sandbox_kwargs: Any) -> None:
        self.size = whole_number(size, "size", 0)
        if max_size is not None:
            max_size = whole_number(max_size, "max_size", 1)
            if max_size < self.size:
                raise PolicyError(f"max_size: {max_size} is below size {self.size}", "max_size")
        self.max_size = max_size
        if sandbox_kwargs.get("name") is not None:
            raise PolicyError("name: a pool's sandboxes are unnamed (they are the pool's own)", "name")
        self.policy = policy if policy is not None else Policy()
        self._kwargs = sandbox_kwargs
        Sandbox(self.policy, **sandbox_kwargs)  # refuse bad arguments before anything starts
        self._lock = threading.Condition()
        self._warm: deque[Sandbox] = deque()
        self._in_use: set[int] = set()
        self._starting = 0
        self._closed = False
        self._error: BaseException | None = None
        self._filler: threading.Thread | None = None
        #: When each warm sandbox's ttl ends it (by id; none without a ttl): an ended one is never handed out.
        self._ends: dict[int, float] = {}
        self._ttl = sandbox_kwargs.get("ttl")
        #: The process the pool's sandboxes are of: a child forked since shares none of them (see _forked).
        self._pid = os.getpid()
        #: A forked child's hold on its parent's warm sandboxes: never handed out, never ended here.
        self._parents: list[Sandbox] = []
        self._warm.extend(self._note(time.monotonic(), create_many(self.size, self.policy, **sandbox_kwargs)))

    def __repr__(self) -> str:
        return f"SandboxPool(size={self.size}, max_size={self.max_size}, warm={len(self._warm)})"

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, int]:
        """How many sandboxes are warm, handed out and starting now."""
        self._forked()
        with self._lock:
            return {"warm": len(self._warm), "in_use": len(self._in_use), "starting": self._starting}

    def _forked(self) -> None:
        """In a child forked since the pool started, forget what is the parent's: its warm sandboxes (the parent
        hands them out too: one sandbox would serve two users, the parent's and the child's), those it handed
        out or is starting, its filler thread (absent here) and its lock (held for good if another thread held it
        at the fork). They stay referenced, unused: collected here, their finalizers would remove the parent's
        files. The child's pool starts its own sandboxes."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._parents.extend(self._warm)
        self._lock = threading.Condition()
        self._warm = deque()
        self._in_use = set()
        self._starting = 0
        self._filler = None
        self._error = None
        self._ends = {}

    # -- handing out -----------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> Sandbox:
        """A started sandbox no one used before; ``with pool.acquire() as sb:`` ends it on exit.

        Waits (up to ``timeout`` seconds; None: as long as it takes) when none is
        warm; raises ``PoolExhaustedError`` when the time is up.
        """
        return self.acquire_many(1, timeout)[0]

    def acquire_many(self, n: int, timeout: float | None = None) -> list[Sandbox]:
        """n sandboxes at once: the warm ones, and the rest started side by side."""
        self._forked()
        n = whole_number(n, "n", 1)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or math.isnan(timeout) or timeout < 0):
            raise PolicyError(f"timeout: expected seconds (0 or more), got {timeout!r}", "timeout")
        if self.max_size is not None and n > self.max_size:
            raise PolicyError(f"n: {n} is more than the pool's max_size {self.max_size}", "n")
        deadline = None if timeout is None or math.isinf(timeout) else time.monotonic() + timeout
        taken: list[Sandbox] = []
        expired: list[Sandbox] = []
        to_start = 0
        with self._lock:
            while True:
                self._check_open()
                room = self._room()
                if len(self._warm) + room >= n:
                    # A warm sandbox past half its ttl is ended, its place started again below.
                    stale = time.monotonic() + (float(self._ttl) / 2 if self._ttl is not None else 0.0)
                    while self._warm and len(taken) < n:
                        box = self._warm.popleft()
                        (expired if self._ends.get(id(box), math.inf) <= stale else taken).append(box)
                    to_start = n - len(taken)
                    self._starting += to_start
                    break
                if self._error is not None and not self._starting:
                    error, self._error = self._error, None
                    raise error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PoolExhaustedError(
                        f"acquire: no sandbox within {timeout:g} s ({len(self._in_use)} handed out, max_size "
                        f"{self.max_size}); release one, or raise max_size")
                self._lock.wait(left)
        for box in expired:
            self._ends.pop(id(box), None)
            box.close()
        if to_start:
            try:
                started = create_many(to_start, self.policy, **self._kwargs)
            except BaseException:
                with self._lock:
                    self._starting -= to_start
                    self._warm.extendleft(taken)  # unused: still fresh
                    self._lock.notify_all()
                raise
            with self._lock:
                self._starting -= to_start
            taken.extend(started)
        with self._lock:
            for box in taken:
                self._ends.pop(id(box), None)
                self._in_use.add(id(box))
                box._on_close = self._released
        self._refill()
        return taken

    def _note(self, started: float, boxes: list[Sandbox]) -> list[Sandbox]:
        """boxes, whose ttl began after started: when each ends."""
        if self._ttl is not None:
            for box in boxes:
                self._ends[id(box)] = started + float(self._ttl)
        return boxes

    def _room(self) -> int:
        """How many more sandboxes may start now without passing max_size."""
        if self.max_size is None:
            return 1 << 30
        return max(0, self.max_size - len(self._warm) - len(self._in_use) - self._starting)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the pool is closed")

    def _released(self, box: Sandbox) -> None:
        """A handed-out sandbox was closed (ended by Sandbox.close): make room, start its replacement."""
        self._forked()
        with self._lock:
            self._in_use.discard(id(box))
            self._lock.notify_all()
        self._refill()

    # -- keeping size warm -------------------------------------------------------------

    def _refill(self) -> None:
        self._forked()
        with self._lock:
            if self._closed or self._filler is not None:
                return
            if len(self._warm) + self._starting >= self.size or not self._room():
                return
            self._filler = threading.Thread(target=self._fill, name="isolate-pool-fill", daemon=True)
            self._filler.start()

    def _fill(self) -> None:
        while True:
            with self._lock:
                want = min(self.size - len(self._warm) - self._starting, self._room())
                if self._closed or want <= 0:
                    self._filler = None  # under the lock: a later _refill starts a new filler
                    return
                self._starting += want
            try:
                boxes = self._note(time.monotonic(), create_many(want, self.policy, **self._kwargs))
            except BaseException as exc:
                with self._lock:
                    self._starting -= want
                    self._error = exc  # the next acquire that finds nothing warm raises it
                    self._filler = None
                    self._lock.notify_all()
                return
            with self._lock:
                self._starting -= want
                if self._closed:
                    stale: list[Sandbox] = boxes
                else:
                    self._warm.extend(boxes)
                    stale = []
                self._lock.notify_all()
            for box in stale:
                box.close()

    def resize(self, size: int) -> None:
        """Keep ``size`` warm from now on: more start in the background, the warm ones past it end."""
        self._forked()
        size = whole_number(size, "size", 0)
        if self.max_size is not None and size > self.max_size:
            raise PolicyError(f"size: {size} is above max_size {self.max_size}", "size")
        with self._lock:
            self.size = size
            extra = [self._warm.pop() for _ in range(max(0, len(self._warm) - size))]
        for box in extra:
            box.close()
        self._refill()

    def close(self) -> None:
        """End the warm sandboxes; those handed out end at their release. Idempotent."""
        self._forked()
        with self._lock:
            self._closed = True
            warm, self._warm = list(self._warm), deque()
            filler = self._filler
            self._lock.notify_all()
        for box in warm:
            box.close()
        if filler is not None and filler is not threading.current_thread():
            filler.join()
