"""Waiting for descriptors with poll(2), never select(2).

select() takes no descriptor numbered FD_SETSIZE (1024) or more: a host
process that holds many sandboxes, commands or connections (an agent's
server) gets past that, and every select() then fails with ValueError.
"""

from __future__ import annotations

import fcntl
import math
import select
import sys
import termios
from collections.abc import Iterable

#: poll()'s longest wait (its int milliseconds); a longer one is waited for in rounds.
MAX_POLL_MS = 2**31 - 1


def poll_millis(seconds: float | None) -> int | None:
    """A wait of ``seconds`` as poll(2)'s timeout: whole milliseconds rounded up, 0 for none left (or NaN),
    at most MAX_POLL_MS (a caller's larger wait, say a month, would make poll raise OverflowError: the
    caller waits again); None waits for ever."""
    if seconds is None:
        return None
    if not seconds > 0:
        return 0
    return MAX_POLL_MS if seconds * 1000 >= MAX_POLL_MS else math.ceil(seconds * 1000)


def ready(readers: Iterable[int] = (), writers: Iterable[int] = (), timeout: float | None = None) -> set[int]:
    """The descriptors among readers (readable or hung up) and writers (writable) that are ready.

    ``timeout`` in seconds (None: wait for one).
    """
    poller = select.poll()
    for fd in readers:
        poller.register(fd, select.POLLIN)
    for fd in writers:
        poller.register(fd, select.POLLOUT)
    return {fd for fd, _ in poller.poll(poll_millis(timeout))}


def pending_bytes(fd: int) -> int:
    """How many bytes a pipe (or socket) holds now: what can be read without waiting for a writer."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
