"""A pool of threads that grows on demand and shrinks when idle.

Starting a Python thread costs a few hundred microseconds on a busy machine,
more than the whole budget the mediator has per connection: connections
and relay directions are handed to threads that wait for work instead.
Nothing bounds the pool but its callers (the mediator bounds connections).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

#: A thread with no work for this long exits.
IDLE_SECONDS = 30.0

_Task = tuple[Callable[..., None], tuple[Any, ...]]


class Workers:
    def __init__(self, name: str, idle_seconds: float = IDLE_SECONDS) -> None:
        self.name = name
        self.idle_seconds = idle_seconds
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0         # threads waiting for a task
        self._pending = 0      # tasks queued, not yet taken
        self._busy = 0         # tasks running
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn(*args)`` in a thread of the pool; False once the pool is closed (or no thread starts)."""
        with self._lock:
            if self._closed:
                return False
            self._pending += 1
            spawn = self._pending > self._idle
            if spawn:
                thread = threading.Thread(target=self._work, daemon=True, name=self.name)
                self._threads.add(thread)
        if spawn:
            try:
                thread.start()
            except RuntimeError:
                with self._lock:
                    self._threads.discard(thread)
                    self._pending -= 1
                return False
        self._queue.put((fn, args))
        return True

    def busy(self) -> int:
        with self._lock:
            return self._busy + self._pending

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    self._idle += 1
                try:
                    task = self._queue.get(timeout=self.idle_seconds)
                except queue.Empty:
                    with self._lock:
                        if self._pending >= self._idle or self._closed:
                            self._idle -= 1
                            if not self._closed:
                                continue   # a task is on its way and may be ours
                            return
                        self._idle -= 1
                        return
                with self._lock:
                    self._idle -= 1
                    if task is None:
                        return
                    self._pending -= 1
                    self._busy += 1
                try:
                    task[0](*task[1])
                except Exception:   # the caller's task guards itself; a stray error ends only the task
                    pass
                finally:
                    with self._lock:
                        self._busy -= 1
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def close(self, timeout: float) -> None:
        """Stop taking tasks; let idle threads go; wait at most ``timeout`` s for all to end."""
        with self._lock:
            self._closed = True
            count = len(self._threads)
        for _ in range(count):
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not threading.current_thread()]
            if not threads or time.monotonic() >= deadline:
                return
            threads[0].join(max(0.0, deadline - time.monotonic()))
