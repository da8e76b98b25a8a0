"""Waiting for descriptors with poll(2), never select(2).

select() takes no descriptor numbered FD_SETSIZE (1024) or more: a host
process that holds many sandboxes, commands or connections (an agent's
server) gets past that, and every select() then fails with ValueError.
"""

from __future__ import annotations

import fcntl
import select
import sys
import termios
from collections.abc import Iterable


def ready(readers: Iterable[int] = (), writers: Iterable[int] = (), timeout: float | None = None) -> set[int]:
    """The descriptors among readers (readable or hung up) and writers (writable) that are ready.

    ``timeout`` in seconds (None: wait for one).
    """
    poller = select.poll()
    for fd in readers:
        poller.register(fd, select.POLLIN)
    for fd in writers:
        poller.register(fd, select.POLLOUT)
    millis = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return {fd for fd, _ in poller.poll(millis)}


def pending_bytes(fd: int) -> int:
    """How many bytes a pipe (or socket) holds now: what can be read without waiting for a writer."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
