"""Moving bytes between two connected sockets, fast.

Each direction is a thread that splices from one socket into a pipe and from
the pipe into the other socket: the data never enters Python, and a blocking
splice releases the GIL. A direction that reads EOF half-closes the other
side (shutdown SHUT_WR) so that request/response protocols that rely on it
work; an error in either direction ends both.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Callable

Spawn = Callable[[Callable[[], None]], bool]

#: The pipe's size between the two sockets once a direction carries bulk data (GROW_AFTER bytes).
#: A pipe starts at the kernel's default (64 KiB): the user's pipe quota
#: (fs.pipe-user-pages-soft, 64 MiB) counts a pipe's nominal size, so idle
#: connections must not hold 1 MiB each. Beyond the quota the kernel refuses
#: the change, and the pipe keeps its size.
PIPE_SIZE = 1 << 20
GROW_AFTER = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1)
_DEFAULT_PIPE = 65536


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until EOF (then shut dst's writing side); raise on errors."""
    if hasattr(os, "splice"):
        r, w = os.pipe2(os.O_CLOEXEC)
        size = _DEFAULT_PIPE
        moved = 0
        grown = False
        try:
            src_fd, dst_fd = src.fileno(), dst.fileno()
            while True:
                n = os.splice(src_fd, w, size, flags=_SPLICE_FLAGS)
                if n == 0:
                    break
                moved += n
                while n:
                    n -= os.splice(r, dst_fd, n, flags=_SPLICE_FLAGS)
                if moved >= GROW_AFTER and not grown:
                    grown = True   # asked once; refused (the quota): the pipe keeps its size
                    try:
                        size = fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)   # the pipe is empty here
                    except OSError:
                        pass
        finally:
            os.close(r)
            os.close(w)
    else:  # pragma: no cover - Python before 3.10 or a platform without splice
        buffer = bytearray(PIPE_SIZE)
        view = memoryview(buffer)
        while True:
            n = src.recv_into(buffer)
            if n == 0:
                break
            dst.sendall(view[:n])
    dst.shutdown(socket.SHUT_WR)


def _quiet_shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


class Relay:
    """Both directions between ``a`` and ``b``; ``run()`` returns when both are done.

    ``spawn(fn)`` runs ``fn()`` in another thread (a pool's), False if it cannot.
    """

    def __init__(self, a: socket.socket, b: socket.socket, spawn: Spawn | None = None) -> None:
        self.a = a
        self.b = b
        self.spawn = spawn
        self.failed = False

    def _direction(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            _copy(src, dst)
        except OSError:
            self.failed = True
            # One side is gone: wake the other direction, which may be waiting on a read.
            _quiet_shutdown(self.a)
            _quiet_shutdown(self.b)

    def run(self) -> None:
        for sock in (self.a, self.b):
            sock.settimeout(None)    # splice needs blocking sockets (a timeout makes them non-blocking)
        done = threading.Event()

        def back() -> None:
            try:
                self._direction(self.b, self.a)
            finally:
                done.set()

        if self.spawn is None or not self.spawn(back):
            threading.Thread(target=back, daemon=True, name="isolate-egress-relay").start()
        self._direction(self.a, self.b)
        done.wait()


def relay(a: socket.socket, b: socket.socket, spawn: Spawn | None = None) -> bool:
    """Relay both directions until both end; True when neither failed."""
    r = Relay(a, b, spawn)
    r.run()
    return not r.failed
