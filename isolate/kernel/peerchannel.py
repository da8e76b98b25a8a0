"""The host's end of a socket pair that takes bytes from one process only.

A kept interpreter's results and a code context's answers come on a socket
pair whose far end one process inside the sandbox holds (its driver). A
child that process forks without exec inherits that end, and the code a
driver runs may fork: such a child could write a result of its own for a
later run. With SO_PASSCRED, every read carries the pid of the process that
wrote those bytes (the kernel's word, translated into the reader's PID
namespace, not the writer's claim), and a stream socket never joins two
writers' bytes in one read. The first bytes come from the driver before any
code runs (its hello): their writer is the peer, and bytes written by any
other process are dropped (and counted).
"""

from __future__ import annotations

import socket
import struct

_UCRED = struct.Struct("iII")


class PeerChannel:
    """A non-blocking stream socket's reads, kept to one writer (see the module's docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        """``sock``: the host's end, given SO_PASSCRED before the far end is handed out."""
        self.sock = sock
        #: The writer's pid in this PID namespace, set by the first read (the driver's hello).
        self.peer: int | None = None
        #: Bytes written by other processes, dropped.
        self.dropped = 0

    @staticmethod
    def pair() -> tuple[socket.socket, socket.socket]:
        """A socket pair: the host's end (credentials asked for) and the far end to hand out."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        return ours, theirs

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def read(self, limit: int = 1 << 16) -> bytes | None:
        """The next bytes of the peer's; b"" at the end, None when there is nothing of the peer's now."""
        try:
            data, ancdata, _, _ = self.sock.recvmsg(limit, socket.CMSG_SPACE(_UCRED.size))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""
        if not data:
            return b""
        writer = -1
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(blob) >= _UCRED.size:
                writer = _UCRED.unpack_from(blob)[0]
        if self.peer is None and writer > 0:
            self.peer = writer
        if writer != self.peer:
            self.dropped += len(data)
            return None
        return data
