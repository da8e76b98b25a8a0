"""The connector: how the server reaches a port on a sandbox's own loopback without its network.

The server holds no route into the sandbox's network namespace (and an
unprivileged server could not enter it). A connector, a small python3
program the server starts inside the sandbox (as its program, under its
policy) with a private socket pair as its descriptor 3, connects to
``127.0.0.1:PORT`` (then ``[::1]:PORT``) for each forwarded connection and
passes the connected socket back over that pair (SCM_RIGHTS). So the
sandbox's network policy is unchanged: the connector can reach what the
sandbox's own programs can (its loopback under ``loopback`` and egress
policies, the host's loopback under ``host``; nothing under ``none``, which
has no loopback). What comes back is checked before use (a TCP socket whose
peer is a loopback address on that port); a sandbox that sends anything
else, or stalls its connector, only breaks its own forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import stat
import struct
from typing import Any

from starlette.concurrency import run_in_threadpool

from ..model.errors import IsolationError
from .models import ApiError
from .state import ManagedSandbox

#: How long the connector may take to answer (a loopback connect is immediate, or refused).
CONNECT_TIMEOUT = 10.0

#: The connector (python3 -I -c): a port number in, a connected socket (or an errno) out.
CONNECTOR = r'''
import errno, os, socket, struct, sys
channel = socket.socket(fileno=3)
while True:
    message = channel.recv(16)
    if len(message) != 2:
        break
    port = struct.unpack("!H", message)[0]
    conn, error = None, errno.ECONNREFUSED
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            error = exc.errno or error
            continue
        s.settimeout(5)
        try:
            s.connect((host, port))
            conn = s
            break
        except OSError as exc:
            error = exc.errno or error
            s.close()
    if conn is None:
        channel.send(b"E%d" % error)
        continue
    conn.setblocking(True)
    socket.send_fds(channel, [b"K"], [conn.fileno()])
    conn.close()
'''

def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class Forwarder:
    """One sandbox's connector: a connected socket to one of its loopback ports at a time.

    The conversation with it waits on the event loop, not in a thread: a
    connector stalled from inside (SIGSTOP) holds none of the server's
    threads, only its own sandbox's forwards, each for CONNECT_TIMEOUT.
    """

    def __init__(self, managed: ManagedSandbox) -> None:
        self.managed = managed
        self.lock = asyncio.Lock()
        self.proc: Any = None
        self.channel: socket.socket | None = None
        self.closed = False

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = self.managed.box.spawn(["python3", "-I", "-c", CONNECTOR], fd3=theirs.fileno())
        except FileNotFoundError:
            ours.close()
            raise ApiError(502, "FORWARD_UNAVAILABLE", "a sandbox's ports are forwarded by a connector run by "
                           "the sandbox's python3, which its policy does not provide") from None
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the connector holds its own copy now
        ours.setblocking(False)
        self.channel = ours
        return ours

    def _stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.kill()
            with contextlib.suppress(Exception):
                self.proc.close()
            self.proc = None

    @staticmethod
    async def _receive(channel: socket.socket) -> tuple[bytes, list[int]]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(channel, 64, 1)
                return message, fds
            except (BlockingIOError, InterruptedError):
                pass
            ready = loop.create_future()
            loop.add_reader(channel.fileno(), _wake, ready)
            try:
                await ready
            finally:
                loop.remove_reader(channel.fileno())

    async def connect(self, port: int) -> socket.socket:
        async with self.lock:
            for attempt in (1, 2):  # a connector that ended (killed from inside) is started again, once
                if self.closed:
                    raise ApiError(404, "SANDBOX_NOT_FOUND", f"sandbox {self.managed.id} is gone")
                channel = self.channel
                if channel is None:
                    try:
                        channel = await run_in_threadpool(self._start)
                    except IsolationError as exc:  # its spawn failed (the sandbox's exec server busy, ending)
                        self._stop()
                        if attempt == 2:
                            raise ApiError(502, "FORWARD_FAILED", f"the sandbox's connector could not start ({exc})") \
                                from None
                        continue
                try:
                    channel.send(struct.pack("!H", port))  # 2 bytes into an empty socket: never blocks
                    message, fds = await asyncio.wait_for(self._receive(channel), CONNECT_TIMEOUT)
                except (OSError, asyncio.TimeoutError) as exc:
                    self._stop()
                    if attempt == 2 or isinstance(exc, asyncio.TimeoutError):
                        raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector did not answer "
                                       f"({exc or 'timed out'})") from None
                    continue
                if not message and not fds:
                    self._stop()
                    continue
                break
            else:
                raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector keeps ending")
        if message.startswith(b"E") and not fds:
            # An errno: a few digits, never a number large enough to overflow os.strerror.
            code = int(message[1:]) if message[1:].isdigit() and len(message) <= 5 else 0
            raise ApiError(502, "PORT_NOT_LISTENING", f"port {port}: nothing accepts connections on the sandbox's "
                           f"loopback ({os.strerror(code) if code else 'refused'})")
        return _checked(fds, message, port)

    def close(self) -> None:
        self.closed = True
        self._stop()


def _checked(fds: list[int], message: bytes, port: int) -> socket.socket:
    """The connector's socket, if it is what was asked for: TCP, connected to a loopback address on port."""
    for extra in fds[1:]:
        os.close(extra)
    if message != b"K" or len(fds) != 1:
        for fd in fds[:1]:
            os.close(fd)
        raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector answered something else than a connection")
    fd = fds[0]
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError("not a socket")
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector sent something else than a socket") from None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            raise OSError("not a TCP socket")
        peer = sock.getpeername()
        address = ipaddress.ip_address(peer[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_loopback or peer[1] != port:
            raise OSError(f"connected to {peer[0]} port {peer[1]}")
    except OSError as exc:
        sock.close()
        raise ApiError(502, "FORWARD_FAILED", f"the sandbox's connector sent a wrong connection ({exc})") from None
    return sock


def forwarder_of(managed: ManagedSandbox) -> Forwarder:
    with managed.lock:
        if managed.forwarder is None:
            managed.forwarder = Forwarder(managed)
        forwarder: Forwarder = managed.forwarder
        return forwarder
