"""Threads that make a layer's files side by side, for unpack.py.

Most of an unpack's time is the kernel making inodes (an ext4 ``openat(O_CREAT)``
or ``symlinkat`` costs hundreds of microseconds on a busy file system), one
after another on one thread. These threads make them side by side: each task
goes to the thread its key (a directory of the layer) hashes to, and each
thread runs its tasks in the order given, so what one directory holds is made
in the archive's order (and in different directories, which the kernel locks
apart, at once).

The reading thread decides everything (unpack.py's checks run there, in the
archive's order, before a task is given); a task only makes what was decided,
through the directory descriptors it was given (its own: closed once the task ran, or was dropped).
The contents read and not yet written are bounded (``limit`` bytes), and so are
the tasks given and not yet run (``tasks``: each holds a descriptor or two, and
a symbolic link or an empty file has no bytes to bound it). The first
error of a task is raised in the reading thread at its next ``submit``, or at
``drain``; the tasks after it are dropped.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

Task = Callable[[], None]


class Writers:
    """``count`` threads running tasks by key (started on the first task); ``done(size)`` called once each task
    given is run or dropped (its contents' bytes no longer held)."""

    def __init__(self, count: int, limit: int, tasks: int, done: Callable[[int], None] | None = None) -> None:
        self.count, self.limit, self.tasks, self.done = count, limit, tasks, done
        self._queues: list[queue.SimpleQueue[tuple[Task, int, tuple[int, ...]] | None]] = []
        self._threads: list[threading.Thread] = []
        self._done = threading.Condition()
        self._pending = 0  # tasks given and not yet run
        self._bytes = 0  # their contents' bytes
        self.error: BaseException | None = None
        self._dropping = False  # closing: the tasks left are dropped

    def submit(self, key: str, task: Task, size: int, fds: tuple[int, ...]) -> None:
        """Run ``task`` on ``key``'s thread, after the tasks given it before, then close ``fds`` (given to the
        task: closed here even when it is not run). Waits while more than ``limit`` bytes of contents, or
        ``tasks`` tasks, are pending. Raises the first error of a task run before (``fds`` then closed at once)."""
        try:
            if not self._threads:
                self._start()
            with self._done:
                while (self._bytes > self.limit or self._pending >= self.tasks) and self.error is None:
                    self._done.wait()
                if self.error is not None:
                    raise self.error
                self._pending += 1
                self._bytes += size
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._queues[hash(key) % self.count].put((task, size, fds))

    def drain(self) -> None:
        """Wait until every task given has run; raise the first error of one."""
        with self._done:
            while self._pending:
                self._done.wait()
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        """Stop the threads, the tasks not yet run dropped (after drain(), none is left). Raises nothing."""
        self._dropping = True
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        self._queues.clear()

    def _start(self) -> None:
        for number in range(self.count):
            q: queue.SimpleQueue[tuple[Task, int, tuple[int, ...]] | None] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(q,), name=f"isolate-unpack-{number}", daemon=True)
            self._queues.append(q)
            self._threads.append(thread)
            thread.start()

    def _run(self, tasks: queue.SimpleQueue[tuple[Task, int, tuple[int, ...]] | None]) -> None:
        while (item := tasks.get()) is not None:
            task, size, fds = item
            failed: BaseException | None = None
            try:
                if self.error is None and not self._dropping:
                    task()
            except BaseException as exc:  # handed to the reading thread, which raises it
                failed = exc
            finally:
                for fd in fds:
                    os.close(fd)
            if self.done is not None and size:
                self.done(size)  # run or dropped: its bytes no longer held
            with self._done:
                if failed is not None and self.error is None:
                    self.error = failed
                self._pending -= 1
                self._bytes -= size
                self._done.notify_all()
