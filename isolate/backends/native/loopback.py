"""A connection to a port on a sandbox's own loopback, made from inside it (its connector).

Nothing outside a sandbox holds a route into its network namespace. The
connector, a small python3 program run inside the sandbox (as its program,
under its policy) with a private socket pair as its descriptor 3, connects to
``127.0.0.1:PORT`` (then ``[::1]:PORT``) for each port number it is sent and
passes the connected socket back (SCM_RIGHTS), or an errno. What comes back is
checked before use (``checked``: a TCP socket whose peer is a loopback address
on that port). The server drives one connector per sandbox
(isolate.server.connector); a Ray node's host starts one per forwarded
connection of a sandbox on that node (``connect_once``, isolate.ray.direct).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat
import struct
from typing import Any

from ...model.errors import IsolationError

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


class ConnectorError(IsolationError):
    """The connector could not give a connection to the port; ``code`` says why in the server's words
    (PORT_NOT_LISTENING, FORWARD_UNAVAILABLE or FORWARD_FAILED)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:  # from a Ray node's host to its client, as itself
        return (type(self), (self.code, str(self)))


def unavailable() -> ConnectorError:
    return ConnectorError("FORWARD_UNAVAILABLE", "a sandbox's ports are forwarded by a connector run by the "
                          "sandbox's python3, which its policy does not provide")


def checked(fds: list[int], message: bytes, port: int) -> socket.socket:
    """The connector's answer to ``port`` as a socket, if it is what was asked for: TCP, connected to a
    loopback address on that port. Raises ConnectorError (every descriptor received closed)."""
    for extra in fds[1:]:
        os.close(extra)
    if message.startswith(b"E") and not fds:
        # An errno: a few digits, never a number large enough to overflow os.strerror.
        code = int(message[1:]) if message[1:].isdigit() and len(message) <= 5 else 0
        raise ConnectorError("PORT_NOT_LISTENING", f"port {port}: nothing accepts connections on the sandbox's "
                             f"loopback ({os.strerror(code) if code else 'refused'})")
    if message != b"K" or len(fds) != 1:
        for fd in fds[:1]:
            os.close(fd)
        raise ConnectorError("FORWARD_FAILED", "the sandbox's connector answered something else than a connection")
    fd = fds[0]
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError("not a socket")
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        raise ConnectorError("FORWARD_FAILED", "the sandbox's connector sent something else than a socket") from None
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
        raise ConnectorError("FORWARD_FAILED", f"the sandbox's connector sent a wrong connection ({exc})") from None
    return sock


def connect_once(box: Any, port: int, timeout: float) -> socket.socket:
    """A connection to ``port`` on the loopback of ``box`` (a started isolate.Sandbox), by a connector started
    for it alone and ended before this returns; ConnectorError when there is none within ``timeout``."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc: Any = None
    try:
        try:
            proc = box.spawn(["python3", "-I", "-c", CONNECTOR], fd3=theirs.fileno())
        except FileNotFoundError:
            raise unavailable() from None
        finally:
            theirs.close()  # the connector holds its own copy now
        ours.settimeout(timeout)
        try:
            ours.send(struct.pack("!H", port))
            message, fds, _, _ = socket.recv_fds(ours, 64, 1)
        except OSError as exc:  # a timeout too (a connector stalled from inside)
            raise ConnectorError("FORWARD_FAILED", f"the sandbox's connector did not answer ({exc or 'timed out'})") \
                from None
        if not message and not fds:
            raise ConnectorError("FORWARD_FAILED", "the sandbox's connector ended without an answer")
        return checked(fds, message, port)
    finally:
        ours.close()  # the connector reads its end and exits
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.close()
