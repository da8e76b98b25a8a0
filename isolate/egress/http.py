"""The HTTP proxy's parsing: a request head, its target, its body's framing.

Strict on purpose: what a proxy and a server read differently (two
Content-Lengths, Content-Length with chunked, bare LF, folded headers) is how
requests are smuggled past a proxy, so such a head is refused (400).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..model.egress_rules import parse_port

#: A request head larger than this is refused (431).
MAX_HEAD = 64 * 1024
#: A chunk-size or trailer line larger than this ends the request.
MAX_LINE = 8 * 1024
#: A chunk-size line: hex digits (no sign, no 0x, no underscore), an optional extension, CRLF.
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(;[^\r\n]*)?\r\n")
#: Headers a proxy never forwards (hop-by-hop, RFC 9110 7.6.1), plus those we set ourselves.
HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authorization",
                        "proxy-authenticate", "te", "upgrade", "host"})


class HTTPError(Exception):
    """A request the proxy refuses: ``status`` and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


REASONS = {200: "Connection established", 400: "Bad Request", 403: "Forbidden", 405: "Method Not Allowed",
           408: "Request Timeout", 411: "Length Required", 431: "Request Header Fields Too Large",
           501: "Not Implemented", 502: "Bad Gateway", 504: "Gateway Timeout"}


def response(status: int, body: str = "") -> bytes:
    data = (body + "\n").encode() if body else b""
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data


def read_head(sock: socket.socket, timeout: float) -> tuple[bytes, bytes]:
    """The request head (without its final blank line) and whatever came after it.

    HTTPError 408 when the head is not complete within ``timeout`` seconds,
    431 when it grows past MAX_HEAD; ConnectionError when the client leaves.
    """
    deadline = time.monotonic() + timeout
    data = bytearray()
    searched = 0
    while True:
        end = data.find(b"\r\n\r\n", max(0, searched - 3))
        searched = len(data)
        if end > MAX_HEAD:
            raise HTTPError(431, f"the request head is larger than {MAX_HEAD} bytes")
        if end >= 0:
            return bytes(data[:end]), bytes(data[end + 4:])
        if len(data) > MAX_HEAD:
            raise HTTPError(431, f"the request head is larger than {MAX_HEAD} bytes")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HTTPError(408, "the request head did not come in time")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise HTTPError(408, "the request head did not come in time") from None
        if not chunk:
            raise ConnectionError("the client closed the connection")
        data += chunk


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]     # (name as sent, value), in order

    def values(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name]


def parse_head(head: bytes) -> Request:
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise HTTPError(400, "undecodable request head") from None
    lines = text.split("\r\n")
    if any("\n" in line or "\r" in line or "\0" in line for line in lines):
        raise HTTPError(400, "a bare CR or LF in the request head")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HTTPError(400, f"not an HTTP/1 request line: {lines[0][:100]!r}")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise HTTPError(400, f"bad header line: {line[:100]!r}")
        headers.append((name, value.strip(" \t")))
    return Request(parts[0], parts[1], parts[2], tuple(headers))


def split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) into its host (lower case, unbracketed) and port."""
    host, port_text = authority, ""
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise HTTPError(400, f"bad authority {authority!r}")
            port_text = rest[1:]
    elif ":" in authority:
        host, _, port_text = authority.rpartition(":")
    if port_text:
        parsed = parse_port(port_text)
        if parsed is None:
            raise HTTPError(400, f"bad port in {authority!r}")
        port = parsed
    elif default_port is None:
        raise HTTPError(400, f"{authority!r} names no port")
    else:
        port = default_port
    if not host or "@" in host:
        raise HTTPError(400, f"bad authority {authority!r}")
    return host.lower().rstrip("."), port


def absolute_target(request: Request) -> tuple[str, int, str]:
    """Host, port and origin-form path of a plain-HTTP proxy request."""
    if not request.target.lower().startswith("http://"):
        if request.target.lower().startswith("https://"):
            raise HTTPError(501, "https:// through a plain request; use CONNECT (https_proxy)")
        raise HTTPError(400, "a proxy request needs an absolute http:// URI")
    try:
        parts = urlsplit(request.target)
    except ValueError:   # "http://[" and "http://[not-an-address]/"
        raise HTTPError(400, "a malformed URI") from None
    if parts.username is not None or parts.password is not None:
        raise HTTPError(400, "credentials in the proxy URI")
    host, port = split_authority(parts.netloc, 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return host, port, path


def origin_target(request: Request) -> str:
    """The path of a request sent straight to a server (origin form: ``/path?query``)."""
    if not request.target.startswith("/"):
        raise HTTPError(400, "a request to a server needs an origin-form target (/path)")
    return request.target


def body_framing(request: Request) -> tuple[str, int]:
    """``("none", 0)``, ``("length", N)`` or ``("chunked", 0)``; HTTPError on ambiguous framing."""
    encodings = request.values("transfer-encoding")
    lengths = request.values("content-length")
    if encodings:
        if lengths:
            raise HTTPError(400, "both Transfer-Encoding and Content-Length")
        codings = [c.strip().lower() for value in encodings for c in value.split(",") if c.strip()]
        if codings != ["chunked"]:
            raise HTTPError(501, f"Transfer-Encoding {', '.join(codings)!r} is not supported")
        return "chunked", 0
    if lengths:
        # One field, digits only. Not even a repeat of the same value passes: it would be forwarded twice,
        # and a server that reads the fields as a list ("3, 3") takes it for no length at all.
        value = lengths[0].strip()
        if len(lengths) != 1 or not value.isascii() or not value.isdigit():
            raise HTTPError(400, "a bad or repeated Content-Length")
        return "length", int(value)
    return "none", 0


def forward_head(request: Request, host_header: str, path: str,
                 inject: Sequence[tuple[str, str]] = ()) -> bytes:
    """The request as the origin server gets it: origin form, our Host, one request per connection.

    ``inject``: headers added (the credential vault's); the request's own headers of those names go.
    """
    named = {token.strip().lower() for value in request.values("connection") for token in value.split(",")}
    # An injected name also drops the request's headers spelled with "_" for "-": CGI and WSGI servers read
    # both as one (HTTP_X_API_KEY), and the program's value would compete with the vault's.
    replaced = {name.lower().replace("_", "-") for name, _ in inject}
    lines = [f"{request.method} {path} {request.version}", f"Host: {host_header}"]
    for name, value in request.headers:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named or lower.replace("_", "-") in replaced:
            continue
        lines.append(f"{name}: {value}")
    lines.extend(f"{name}: {value}" for name, value in inject)
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class BodyReader:
    """Reads a request body from the client, starting with bytes already received."""

    def __init__(self, sock: socket.socket, pending: bytes, idle_timeout: float) -> None:
        self.sock = sock
        self.buffer = bytearray(pending)
        self.idle_timeout = idle_timeout

    def _fill(self) -> None:
        self.sock.settimeout(self.idle_timeout)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed the connection inside the request body")
        self.buffer += chunk

    def take(self, n: int) -> bytes:
        """Up to n bytes (at least one)."""
        if not self.buffer:
            self._fill()
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    def line(self) -> bytes:
        while True:
            end = self.buffer.find(b"\n")
            if end >= 0:
                data = bytes(self.buffer[:end + 1])
                del self.buffer[:end + 1]
                return data
            if len(self.buffer) > MAX_LINE:
                raise HTTPError(400, "a chunk line is too long")
            self._fill()


def copy_body(reader: BodyReader, framing: tuple[str, int], upstream: socket.socket, trailers: bool = True) -> None:
    """Forward exactly the request's body to ``upstream``; nothing after it.

    ``trailers=False``: a chunked body's trailer fields are read and dropped (RFC 9110 lets an intermediary
    discard them). A request the vault put a credential into takes no header fields from the program after
    its head: a server that merges trailers into the headers would otherwise read the program's
    ``Authorization`` beside, or instead of, the vault's.
    """
    kind, length = framing
    if kind == "length":
        while length:
            data = reader.take(min(length, 1 << 20))
            upstream.sendall(data)
            length -= len(data)
    elif kind == "chunked":
        # Each line is checked before it is forwarded, and the chunk's data must end with its CRLF: what the
        # server reads as the end of the body is where this proxy stopped forwarding (nothing after it).
        while True:
            line = reader.line()
            found = _CHUNK_SIZE.fullmatch(line)
            if found is None:
                raise HTTPError(400, "a bad chunk size line")
            upstream.sendall(line)
            size = int(found[1], 16)
            if size == 0:
                while True:  # trailers, up to the blank line
                    trailer = reader.line()
                    if not trailer.endswith(b"\r\n") or b"\r" in trailer[:-2]:
                        raise HTTPError(400, "a trailer line without its CRLF")
                    if trailers or trailer == b"\r\n":
                        upstream.sendall(trailer)
                    if trailer == b"\r\n":
                        return
            remaining = size
            while remaining:
                data = reader.take(min(remaining, 1 << 20))
                upstream.sendall(data)
                remaining -= len(data)
            end = reader.take(2)
            if len(end) < 2:
                end += reader.take(1)
            if end != b"\r\n":
                raise HTTPError(400, "a chunk's data does not end with CRLF")
            upstream.sendall(end)


def close_response_head(upstream: socket.socket) -> bytes:
    """The response's first bytes, its head saying ``Connection: close`` (the connection ends after it).

    The client learns that it cannot send a second request on this
    connection, whatever the server answers. Interim (1xx) heads pass
    unchanged; a head that is not HTTP/1 or is too large passes as it came.
    """
    out = bytearray()
    data = bytearray()
    for _ in range(8):
        while b"\r\n\r\n" not in data:
            if len(data) > MAX_HEAD:
                return bytes(out + data)
            chunk = upstream.recv(65536)
            if not chunk:
                return bytes(out + data)
            data += chunk
        end = data.index(b"\r\n\r\n")
        lines = bytes(data[:end]).split(b"\r\n")
        status = lines[0].split(b" ")
        if not lines[0].startswith(b"HTTP/1.") or len(status) < 2 or not status[1].isdigit():
            return bytes(out + data)
        if status[1].startswith(b"1") and status[1] != b"101":
            out += data[:end + 4]
            del data[:end + 4]
            continue
        kept = [line for line in lines[1:]
                if line.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive",
                                                                   b"proxy-connection")]
        return bytes(out + b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n" + data[end + 4:])
    return bytes(out + data)
