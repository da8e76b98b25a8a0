"""The egress mediator's parsers are strict: malformed HTTP and DNS, sent to a running mediator for real.

What a proxy and a server read differently is how a request is smuggled past the proxy: such a request
gets 400 and reaches the server incomplete or not at all. A malformed DNS query gets FORMERR.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from test_egress_mediator import _recv_all, _rules, plan

from isolate.egress import dns
from isolate.model.egress_rules import DNS_ADDRESS


class RawServer:
    """Records the raw bytes each connection sends it, and answers 200 once the peer stops or goes quiet."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.received: list[bytes] = []
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(0.5)
                data = b""
                try:
                    while chunk := conn.recv(65536):
                        data += chunk
                except OSError:
                    pass
                self.received.append(data)
                try:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw() -> Iterator[RawServer]:
    server = RawServer()
    yield server
    server.close()


def _send(proxy: tuple[str, int], request: bytes) -> bytes:
    with socket.create_connection(proxy, timeout=10) as s:
        try:
            s.sendall(request)
        except ConnectionResetError:
            pass
        return _recv_all(s)


HEADS = [
    (b"X: a\nY: b\r\n", "bare LF between header lines"),
    (b"X: a\r\n folded\r\n", "obs-fold"),
    (b"X: a\r\n\tfolded\r\n", "obs-fold with a tab"),
    (b"X: a\rb\r\n", "bare CR in a value"),
    (b"Content-Length: 3\r\nContent-Length: 3\r\n", "Content-Length twice, the same"),
    (b"Content-Length: 3\r\nContent-Length: 4\r\n", "Content-Length twice, different"),
    (b"Content-Length: 3, 3\r\n", "Content-Length as a list"),
    (b"Content-Length: 1_0\r\n", "Content-Length with an underscore"),
    (b"Content-Length: +3\r\n", "Content-Length with a sign"),
    (b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", "Content-Length and chunked"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n", "chunked and Content-Length"),
    (b"X : a\r\n", "a space before the colon"),
]


@pytest.mark.parametrize(("extra", "why"), HEADS, ids=[why for _, why in HEADS])
def test_an_ambiguous_request_head_is_refused_and_reaches_no_one(raw: RawServer, extra: bytes, why: str) -> None:
    rules = _rules(("one.test", (raw.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules) as p:
        reply = _send(p.proxy, b"POST http://one.test:%d/ HTTP/1.1\r\nHost: one.test\r\n%s\r\nabc"
                      % (raw.port, extra))
        assert reply.split(b" ")[1] == b"400", (why, reply[:80])
        time.sleep(0.1)
        assert raw.received == [], why


CHUNKS = [
    (b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", "a chunk size with an underscore"),
    (b"+3\r\nabc\r\n0\r\n\r\n", "a chunk size with a sign"),
    (b"0x3\r\nabc\r\n0\r\n\r\n", "a chunk size with 0x"),
    (b" 3\r\nabc\r\n0\r\n\r\n", "a chunk size after a space"),
    (b"3\nabc\r\n0\r\n\r\n", "a chunk size line with a bare LF"),
    (b"1" * 16 + b"\r\nabc\r\n0\r\n\r\n", "a chunk size of 16 hex digits"),
    (b"3\r\nabcXY0\r\n\r\n", "chunk data not ending with CRLF"),
    (b"3\r\nabc\nX0\r\n\r\n", "chunk data ending with a bare LF"),
    (b"3\r\nabc\r\n0\r\nX: t\n\r\n", "a trailer line with a bare LF"),
]


@pytest.mark.parametrize(("body", "why"), CHUNKS, ids=[why for _, why in CHUNKS])
def test_a_malformed_chunked_body_is_not_forwarded_past_the_error(raw: RawServer, body: bytes, why: str) -> None:
    rules = _rules(("one.test", (raw.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules) as p:
        _send(p.proxy, b"POST http://one.test:%d/ HTTP/1.1\r\nHost: one.test\r\nTransfer-Encoding: chunked\r\n\r\n"
              % raw.port + body + b"GET /smuggled HTTP/1.1\r\nHost: one.test\r\n\r\n")
        deadline = time.monotonic() + 5
        while not raw.received and time.monotonic() < deadline:
            time.sleep(0.05)
        got = b"".join(raw.received)
        # The head went first; the body stops before what is malformed, and what follows it never goes.
        assert got.startswith(b"POST / HTTP/1.1\r\n"), (why, got[:80])
        assert b"smuggled" not in got, why
        body = got.partition(b"\r\n\r\n")[2]
        assert not body.endswith(b"0\r\n\r\n") and not body.endswith(b"\n\r\n"), (why, body[-40:])


def _query(name_wire: bytes, ident: int = 7, qdcount: int = 1) -> bytes:
    return struct.pack("!HHHHHH", ident, 0x0100, qdcount, 0, 0, 0) + name_wire + b"\0\1\0\1"


MESSAGES = [
    (_query(b"\xc0\x0c"), "a pointer to itself"),
    (_query(b"\x03one\xc0\x0c"), "a pointer back to its own start"),
    (_query(b"\x03one\xc0\x10"), "a pointer forward into the name"),
    (_query(b"\x03one\x04test\x00")[:-3], "truncated in the question's type"),
    (_query(b"\x03one\x04te"), "truncated in a label"),
    (_query(b"\x03one\xc0"), "truncated in a pointer"),
    (_query(b"\x40" + b"a" * 64 + b"\x00"), "a label of 64 bytes"),
    (_query(b"\x7f" + b"a" * 127 + b"\x00"), "a label of 127 bytes"),
    (_query(b"\x3fa" * 4 + b"\x00"), "a truncated label of 63"),
    (_query(b"".join(b"\x3f" + b"a" * 63 for _ in range(4)) + b"\x00"), "a name over 255 bytes"),
    (_query(b"\x03one\x00", qdcount=0), "no question"),
]


@pytest.mark.parametrize(("message", "why"), MESSAGES, ids=[why for _, why in MESSAGES])
def test_a_malformed_dns_query_gets_formerr_over_udp_and_tcp(message: bytes, why: str) -> None:
    with plan(_rules(("one.test", (443,)), static=(("one.test", "127.0.0.1"),))) as p:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(10)
            s.sendto(message, (DNS_ADDRESS, p.dns_port))
            reply = s.recv(4096)
        assert reply[:2] == b"\x00\x07" and reply[2] & 0x80 and reply[3] & 0xF == dns.FORMERR, (why, reply)
        assert struct.unpack_from("!HH", reply, 6) == (0, 0), why     # no answer records
        with socket.create_connection((DNS_ADDRESS, p.dns_port), timeout=10) as s:
            s.sendall(struct.pack("!H", len(message)) + message)
            length = struct.unpack("!H", s.recv(2))[0]
            reply = s.recv(length)
        assert reply[3] & 0xF == dns.FORMERR, why
        assert p.resolve("one.test") == "127.77.1.0"    # the server keeps answering
