"""The direct route's byte stream (isolate/ray/direct.py): the TCP socket as it is, or TLS over it when the
cluster's Ray uses TLS, with Ray's own certificates.

Ray's TLS (``RAY_USE_TLS``) names three files on every node and client:
``RAY_TLS_SERVER_CERT`` and ``RAY_TLS_SERVER_KEY`` (this process's
certificate, which Ray presents both as a server and as a client) and
``RAY_TLS_CA_CERT`` (the cluster's CA). The route trusts what Ray trusts: the
host asks every client for a certificate signed by that CA and closes a peer
without one; the client checks the host's certificate against the CA and the
node's address as Ray knows it (as Ray's own gRPC does); TLS 1.3 only.

The route reads a connection in one thread while others write to it, and
CPython does not promise that an ``ssl.SSLSocket`` read and written from two
threads at once is safe. So the socket stays a plain one and the TLS state
machine is an ``ssl.SSLObject`` over two memory BIOs (``Tls``): it is touched
only under a lock and never while blocked (it only encrypts and decrypts
bytes in memory); the blocking ``recv`` and ``sendall`` are on the plain
socket, outside that lock, as on the plain route. Records leave in the order
they were made (the writers' lock is held from the encryption to the send).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading

from ..model.errors import UnsupportedError

#: The files of Ray's TLS, as Ray reads them (ray/_private/tls_utils.py).
CERT, KEY, CA = "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"


def ray_uses_tls() -> bool:
    """Whether the cluster's Ray encrypts its connections (as Ray reads it): then so does the route."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def tls_context(server_side: bool) -> ssl.SSLContext:
    """A TLS context of Ray's certificates (see the module's docstring); UnsupportedError when they do not
    load (the route is not offered: calls go through the actor, over Ray's own TLS)."""
    files = {name: os.environ.get(name, "") for name in (CERT, KEY, CA)}
    missing = [name for name, path in files.items() if not path]
    if missing:
        raise UnsupportedError(f"Ray uses TLS but {', '.join(missing)} is not set")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED  # the client's certificate too: a peer without one is closed
    if server_side:
        ctx.options |= ssl.OP_NO_TICKET  # no session tickets: nothing for the host to send but answers
    try:
        ctx.load_cert_chain(files[CERT], files[KEY])
        ctx.load_verify_locations(files[CA])
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise UnsupportedError(f"Ray's TLS files did not load ({CERT}, {KEY}, {CA}): {exc}") from None
    return ctx


class Plain:
    """The TCP socket as it is: one thread reads, writers take turns (the route's own locks)."""

    tls = False

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv(self, size: int) -> bytes:
        return self.sock.recv(size)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)


class Tls:
    """TLS over the TCP socket through memory BIOs (see the module's docstring). The handshake runs in the
    constructor, under the socket's timeout; a failed one raises ssl.SSLError (an OSError)."""

    tls = True

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = ctx.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._state = threading.Lock()  # the SSL object: held only around calls that do not block
        self._writing = threading.Lock()  # from a record's encryption to its send: records leave in order
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = sock.recv(1 << 16)
                if not data:
                    raise ConnectionResetError("the peer closed the connection during the TLS handshake") from None
                self._in.write(data)
        self._flush()

    def _flush(self) -> None:
        with self._writing:
            with self._state:
                data = self._out.read()
            if data:
                self.sock.sendall(data)

    def recv(self, size: int) -> bytes:
        """Up to ``size`` bytes of plaintext; b"" at the end of the stream (a close, a TLS close or a cut)."""
        while True:
            with self._state:
                try:
                    data: bytes | None = self._ssl.read(size)
                except ssl.SSLWantReadError:
                    data = None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    return b""
                reply = self._out.pending > 0  # a post-handshake message's answer (none expected)
            if reply:
                self._flush()
            if data is not None:
                return data
            raw = self.sock.recv(1 << 16)  # a timeout leaves a partial record in the BIO: the next recv goes on
            with self._state:
                if raw:
                    self._in.write(raw)
                else:
                    self._in.write_eof()

    def sendall(self, data: bytes) -> None:
        with self._writing:
            with self._state:
                view, sealed = memoryview(data), []
                while view:
                    written = self._ssl.write(view)
                    view = view[written:]
                    sealed.append(self._out.read())
            self.sock.sendall(b"".join(sealed))

    def shutdown(self, how: int) -> None:
        """The TCP connection's side(s) shut, with no TLS close (a forwarded connection's end, direct.py)."""
        self.sock.shutdown(how)
