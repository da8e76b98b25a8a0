"""The egress mediator (isolate/egress/), on the host's own loopback.

Every 127/8 address is local, so the plan's addresses (127.77.0.53 for DNS,
127.77.0.1 for the proxy, 127.77.1.N for names) are bound here directly; the
DNS server and the proxy get free high ports instead of 53 and 3128. Servers
of the tests' own play the outside world on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import recv_exact

from isolate.egress import Mediator, dns, rules_from_json, rules_to_json
from isolate.model.egress_rules import DNS_ADDRESS, PROXY_ADDRESS, EgressRules, HostRule

NAME_ADDRESSES = ("127.77.1.0", "127.77.1.1", "127.77.1.2", "127.77.1.3")


def _free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class EchoServer:
    """A TCP server on 127.0.0.1 that echoes, one thread per connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


class WebServer:
    """http.server on 127.0.0.1 recording each request's Host, path and Connection headers (TLS with ``tls``)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.requests.append({"host": self.headers.get("Host"), "path": self.path,
                                       "connection": self.headers.get_all("Connection"),
                                       "proxy": self.headers.get("Proxy-Connection")})
                body = f"hello {self.path}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if self.headers.get("Transfer-Encoding") == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        data += self.rfile.read(size)
                        self.rfile.readline()
                else:
                    data = self.rfile.read(length)
                outer.requests.append({"host": self.headers.get("Host"), "path": self.path, "body": data})
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeResolver:
    """An upstream DNS server (UDP and TCP) with fixed answers, for ``rules.resolver``."""

    def __init__(self, answers: dict[str, list[str]], truncate: frozenset[str] = frozenset()) -> None:
        self.answers = answers
        self.truncate = truncate
        # One port for both: a free UDP port's TCP twin may be another process's (the suite runs beside
        # others), so a pair that cannot be had is given up and another tried.
        for _ in range(50):
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(("127.0.0.1", 0))
            self.port = int(self.udp.getsockname()[1])
            try:
                self.tcp = socket.create_server(("127.0.0.1", self.port))
                break
            except OSError:
                self.udp.close()
        else:
            raise RuntimeError("no loopback port free for both UDP and TCP")
        self.tcp_queries = 0
        threading.Thread(target=self._udp_loop, daemon=True).start()
        threading.Thread(target=self._tcp_loop, daemon=True).start()

    def _answer(self, data: bytes, tcp: bool) -> bytes:
        query = dns.parse_query(data)
        if query.name not in self.answers:
            return dns.build_response(query, dns.NXDOMAIN)
        family = socket.AF_INET if query.qtype == dns.TYPE_A else socket.AF_INET6
        records = [a for a in self.answers[query.name] if (":" in a) == (family == socket.AF_INET6)]
        if query.name in self.truncate and not tcp:
            reply = bytearray(dns.build_response(query, dns.NOERROR))
            reply[2] |= 0x02  # TC
            return bytes(reply)
        out = bytearray(struct.pack("!HHHHHH", query.id, 0x8180, 1, len(records), 0, 0)) + query.question
        rtype = dns.TYPE_A if family == socket.AF_INET else dns.TYPE_AAAA
        for address in records:
            raw = socket.inet_pton(family, address)
            out += struct.pack("!HHHIH", 0xC00C, rtype, 1, 300, len(raw)) + raw
        return bytes(out)

    def _udp_loop(self) -> None:
        while True:
            try:
                data, peer = self.udp.recvfrom(4096)
            except OSError:
                return
            self.udp.sendto(self._answer(data, False), peer)

    def _tcp_loop(self) -> None:
        while True:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                self.tcp_queries += 1
                length = struct.unpack("!H", conn.recv(2))[0]
                reply = self._answer(conn.recv(length), True)
                conn.sendall(struct.pack("!H", len(reply)) + reply)

    def close(self) -> None:
        self.udp.close()
        self.tcp.close()


class Plan:
    """A mediator on the host's loopback: its DNS and proxy addresses, and listeners for ``ports``."""

    def __init__(self, rules: EgressRules, ports: tuple[int, ...], extra: tuple[tuple[str, int], ...] = (),
                 **options: Any) -> None:
        self.dns_port = _free_port(DNS_ADDRESS)
        self.proxy_port = _free_port(PROXY_ADDRESS)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((DNS_ADDRESS, self.dns_port))
        addresses = [(DNS_ADDRESS, self.dns_port), (PROXY_ADDRESS, self.proxy_port), *extra]
        addresses += [(address, port) for address in NAME_ADDRESSES for port in ports]
        listeners = [socket.create_server(address, backlog=128) for address in addresses]
        self.mediator = Mediator(rules, self.udp, listeners, dns_port=self.dns_port, proxy_port=self.proxy_port,
                                 **options).start()

    @property
    def proxy(self) -> tuple[str, int]:
        return (PROXY_ADDRESS, self.proxy_port)

    @property
    def proxy_url(self) -> str:
        return f"http://{PROXY_ADDRESS}:{self.proxy_port}"

    def query(self, name: str, qtype: int = dns.TYPE_A, tcp: bool = False) -> dns.Answer:
        ident = int.from_bytes(os.urandom(2), "big")
        message = dns.build_query(ident, name, qtype)
        if tcp:
            with socket.create_connection((DNS_ADDRESS, self.dns_port), timeout=10) as s:
                s.sendall(struct.pack("!H", len(message)) + message)
                length = struct.unpack("!H", recv_exact(s, 2))[0]
                return dns.parse_response(recv_exact(s, length), ident, name, qtype)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(10)
            s.sendto(message, (DNS_ADDRESS, self.dns_port))
            return dns.parse_response(s.recv(4096), ident, name, qtype)

    def resolve(self, name: str) -> str:
        answer = self.query(name)
        assert answer.rcode == dns.NOERROR and len(answer.records) == 1, answer
        return answer.records[0][0]



def _recv_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _rules(*rules: tuple[str, tuple[int, ...]], static: tuple[tuple[str, str], ...] = (),
           resolver: tuple[str, int] | None = None, allow_private: bool = False) -> EgressRules:
    return EgressRules(tuple(HostRule(p, ports) for p, ports in rules), static, resolver, allow_private)


@contextlib.contextmanager
def plan(rules: EgressRules, ports: tuple[int, ...] = (), **options: Any) -> Iterator[Plan]:
    p = Plan(rules, ports, **options)
    try:
        yield p
    finally:
        p.mediator.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def web() -> Iterator[WebServer]:
    server = WebServer()
    yield server
    server.close()


def _connect_request(p: Plan, target: str) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(p.proxy, timeout=10)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            break
        head += chunk
    return s, head


def _assert_reset(address: tuple[str, int]) -> None:
    """Connect and read: the mediator resets the connection (a hang would end in TimeoutError)."""
    with pytest.raises(ConnectionResetError):   # the reset may come before connect() returns
        with socket.create_connection(address, timeout=10) as s:
            s.sendall(b"hello")
            s.recv(10)


# --- DNS -----------------------------------------------------------------------------------------------


def test_dns_gives_allowed_names_consecutive_stable_addresses() -> None:
    rules = _rules(("one.test", (443,)), ("*.two.test", (80, 443)),
                   static=(("one.test", "127.0.0.1"), ("a.two.test", "127.0.0.1")))
    with plan(rules) as p:
        first = p.resolve("one.test")
        second = p.resolve("a.two.test")
        assert (first, second) == ("127.77.1.0", "127.77.1.1")
        assert p.resolve("ONE.test.") == first            # case and the final dot do not matter
        assert p.query("one.test", tcp=True).records[0][0] == first   # DNS over TCP, same answer
        assert p.query("one.test").records[0][1] == dns.ANSWER_TTL
        aaaa = p.query("one.test", dns.TYPE_AAAA)
        assert (aaaa.rcode, aaaa.records) == (dns.NOERROR, ())        # no IPv6: NODATA
        assert p.mediator.address_name(first) == "one.test"
        assert p.mediator.address_name("127.77.1.9") is None


def test_dns_refuses_names_not_on_the_list_and_reports_them() -> None:
    with plan(_rules(("one.test", (443,)), static=(("one.test", "127.0.0.1"),))) as p:
        assert p.query("other.test").rcode == dns.NXDOMAIN
        assert p.query("other.test", tcp=True).rcode == dns.NXDOMAIN
        assert p.query("one.test.evil").rcode == dns.NXDOMAIN
        assert p.query("x.one.test").rcode == dns.NXDOMAIN        # no wildcard: only the name itself
        denied = p.mediator.summary()["denied"]
        assert {"host": "other.test", "port": None, "count": 2, "reason": "not allowed"} in denied
        assert p.mediator.summary()["allowed"] == []


def test_dns_asks_the_policy_resolver_and_guards_against_rebinding() -> None:
    upstream = FakeResolver({"public.test": ["93.184.216.34", "2606:2800:220:1::1"],
                             "lan.test": ["10.0.0.5"],
                             "mixed.test": ["10.1.1.1", "93.184.216.35"],
                             "big.test": ["93.184.216.36"]}, truncate=frozenset({"big.test"}))
    names = ("public.test", "lan.test", "mixed.test", "big.test", "gone.test")
    try:
        with plan(_rules(*((n, (443,)) for n in names), resolver=("127.0.0.1", upstream.port))) as p:
            assert p.resolve("public.test") == "127.77.1.0"
            assert p.mediator.resolver.resolve("public.test").addresses == ("93.184.216.34", "2606:2800:220:1::1")
            assert p.query("lan.test").rcode == dns.NXDOMAIN
            reason = "lan.test resolves to 10.0.0.5, a private address; allow_private=True / --allow-private " \
                     "lets it through"
            assert {"host": "lan.test", "port": None, "count": 1, "reason": reason} in p.mediator.summary()["denied"]
            p.resolve("mixed.test")
            assert p.mediator.resolver.resolve("mixed.test").addresses == ("93.184.216.35",)
            p.resolve("big.test")                                     # truncated over UDP: asked again over TCP
            assert upstream.tcp_queries >= 1
            assert p.query("gone.test").rcode == dns.NXDOMAIN
            assert p.mediator.summary()["failed"] == [{"host": "gone.test", "port": None, "count": 1,
                                                       "reason": "gone.test does not resolve"}]
        with plan(_rules(("lan.test", (443,)), resolver=("127.0.0.1", upstream.port), allow_private=True)) as p:
            p.resolve("lan.test")
            assert p.mediator.resolver.resolve("lan.test").addresses == ("10.0.0.5",)
            assert p.mediator.summary()["denied"] == []
    finally:
        upstream.close()


def test_dns_through_the_hosts_resolver_refuses_loopback() -> None:
    with plan(_rules(("localhost", (443,)))) as p:
        assert p.query("localhost").rcode == dns.NXDOMAIN
        (entry,) = p.mediator.summary()["denied"]
        assert entry["host"] == "localhost" and "a loopback address" in entry["reason"]
        assert "--allow-private" in entry["reason"]


def test_dns_answers_garbage_without_harm() -> None:
    with plan(_rules(("one.test", (443,)), static=(("one.test", "127.0.0.1"),))) as p:
        m = p.mediator
        assert m.answer_dns(b"") is None
        assert m.answer_dns(b"\x12\x34" + b"\x81\x80" + b"\0" * 8) is None       # a response: never answered
        loop = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c"     # a name pointing at itself
        reply = m.answer_dns(loop)
        assert reply is not None and reply[:2] == b"\x00\x07" and reply[3] & 0xF == dns.FORMERR
        two = struct.pack("!HHHHHH", 8, 0x0100, 2, 0, 0, 0) + dns.encode_name("one.test") + b"\0\1\0\1" * 2
        reply = m.answer_dns(two)
        assert reply is not None and reply[3] & 0xF == dns.FORMERR
        # The server keeps answering.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"\xff" * 3000, (DNS_ADDRESS, p.dns_port))
        assert p.resolve("one.test") == "127.77.1.0"


# --- the proxy -----------------------------------------------------------------------------------------


def test_connect_relays_an_allowed_name_and_refuses_the_rest(echo: EchoServer) -> None:
    rules = _rules(("one.test", (echo.port,)), ("nowhere.test", (echo.port,)),
                   static=(("one.test", "127.0.0.1"),), resolver=("127.0.0.1", _free_port()))
    with plan(rules, connect_timeout=2) as p:
        s, head = _connect_request(p, f"one.test:{echo.port}")
        with s:
            assert head.startswith(b"HTTP/1.1 200 ")
            s.sendall(b"ping")
            assert recv_exact(s, 4) == b"ping"
        for target, status, words in ((f"other.test:{echo.port}", b"403", f"--allow-host other.test:{echo.port}"),
                                      ("one.test:1", b"403", "--allow-host one.test:1"),
                                      (f"127.0.0.1:{echo.port}", b"403", "an address, not a name"),
                                      (f"nowhere.test:{echo.port}", b"502", "nowhere.test")):
            s, head = _connect_request(p, target)
            with s:
                assert head.split(b" ")[1] == status, (target, head)
                body = _recv_all(s).decode()
                assert words in body and body.count("\n") == 1
        summary = p.mediator.summary()
        assert summary["allowed"] == [{"host": "one.test", "port": echo.port, "count": 1}]
        denied = {(d.get("host") or d.get("address"), d["port"]): d for d in summary["denied"]}
        assert denied[("other.test", echo.port)]["reason"] == "not allowed"
        assert denied[("one.test", 1)]["reason"] == "port not allowed"
        assert denied[("127.0.0.1", echo.port)]["reason"] == "an address, not an allowed name"


def test_plain_http_proxy_sends_one_request_per_connection(web: WebServer) -> None:
    rules = _rules(("one.test", (web.port,)), ("two.test", (web.port,)),
                   static=(("one.test", "127.0.0.1"), ("two.test", "127.0.0.1")))
    with plan(rules) as p, socket.create_connection(p.proxy, timeout=10) as s:
        s.sendall(f"GET http://one.test:{web.port}/first?x=1 HTTP/1.1\r\nHost: evil.test\r\n"
                  f"Proxy-Connection: keep-alive\r\nConnection: keep-alive\r\n\r\n"
                  f"GET http://two.test:{web.port}/second HTTP/1.1\r\nHost: two.test\r\n\r\n".encode())
        reply = _recv_all(s)
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello /first?x=1")
        assert b"/second" not in reply
        assert reply.count(b"\r\nConnection: close\r\n") == 1      # the client is told, too
        time.sleep(0.2)
        # The server saw one request, in origin form, for the URI's host (not the Host the client sent),
        # with Connection: close; the second request reached no one.
        assert web.requests == [{"host": f"one.test:{web.port}", "path": "/first?x=1",
                                 "connection": ["close"], "proxy": None}]


def test_plain_http_proxy_forwards_bodies_exactly(web: WebServer) -> None:
    rules = _rules(("one.test", (web.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules) as p:
        for body, framing in ((b"a" * 100000, "length"), (b"chunky" * 1000, "chunked")):
            with socket.create_connection(p.proxy, timeout=10) as s:
                url = f"http://one.test:{web.port}/post"
                if framing == "length":
                    s.sendall(f"POST {url} HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body +
                              f"GET {url}/smuggled HTTP/1.1\r\n\r\n".encode())
                else:
                    s.sendall(f"POST {url} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".encode() +
                              b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 999]), body[i:i + 999])
                                       for i in range(0, len(body), 999)) + b"0\r\n\r\n" +
                              f"GET {url}/smuggled HTTP/1.1\r\n\r\n".encode())
                reply = _recv_all(s)
                assert reply.endswith(body)
        time.sleep(0.2)
        assert [r["path"] for r in web.requests] == ["/post", "/post"]
        with socket.create_connection(p.proxy, timeout=10) as s:   # ambiguous framing: refused
            s.sendall(f"POST http://one.test:{web.port}/ HTTP/1.1\r\nContent-Length: 3\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n".encode())
            assert _recv_all(s).startswith(b"HTTP/1.1 400")


def test_a_silent_client_times_out_and_blocks_no_one(echo: EchoServer) -> None:
    rules = _rules(("one.test", (echo.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules, head_timeout=3) as p:
        silent = socket.create_connection(p.proxy, timeout=10)
        s, head = _connect_request(p, f"one.test:{echo.port}")
        with s:
            assert head.startswith(b"HTTP/1.1 200")
        with silent:
            silent.setblocking(False)
            with pytest.raises(BlockingIOError):      # served while the silent one still waits
                silent.recv(10)
            silent.setblocking(True)
            silent.settimeout(10)
            assert _recv_all(silent).startswith(b"HTTP/1.1 408")


def test_urllib_and_curl_through_the_proxy(web: WebServer) -> None:
    rules = _rules(("one.test", (web.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules) as p:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": p.proxy_url}))
        with opener.open(f"http://one.test:{web.port}/urllib", timeout=10) as response:
            assert response.read() == b"hello /urllib"
        with pytest.raises(urllib.error.HTTPError) as denied:
            opener.open(f"http://two.test:{web.port}/", timeout=10)
        assert denied.value.code == 403
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "http_proxy": p.proxy_url}
        url = f"http://one.test:{web.port}/curl"
        plain = subprocess.run(["curl", "-sS", "--max-time", "10", url], env=env, capture_output=True, text=True)
        assert plain.stdout == "hello /curl", plain.stderr
        tunnel = subprocess.run(["curl", "-sS", "--max-time", "10", "--proxytunnel", url], env=env,
                                capture_output=True, text=True)   # CONNECT, as for https
        assert tunnel.stdout == "hello /curl", tunnel.stderr
        refused = subprocess.run(["curl", "-sS", "--max-time", "10", "--proxytunnel", f"http://two.test:{web.port}/"],
                                 env=env, capture_output=True, text=True)
        assert refused.returncode != 0 and "403" in refused.stderr


def test_tls_passes_through_untouched(tmp_path: Any) -> None:
    """https through CONNECT: the client checks the server's own certificate for the name it asked for."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=one.test",
                    "-addext", "subjectAltName=DNS:one.test", "-days", "1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    web = WebServer(tls)
    rules = _rules(("one.test", (web.port,)), static=(("one.test", "127.0.0.1"),))
    try:
        with plan(rules) as p:
            client = ssl.create_default_context(cafile=cert)
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({"https": p.proxy_url}),
                                                 urllib.request.HTTPSHandler(context=client))
            with opener.open(f"https://one.test:{web.port}/tls", timeout=10) as response:
                assert response.read() == b"hello /tls"
            if shutil.which("curl") is not None:
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "https_proxy": p.proxy_url}
                done = subprocess.run(["curl", "-sS", "--max-time", "10", "--cacert", cert,
                                       f"https://one.test:{web.port}/curl"], env=env, capture_output=True, text=True)
                assert done.stdout == "hello /curl", done.stderr
            assert p.mediator.summary()["allowed"][0]["host"] == "one.test"
    finally:
        web.close()


# --- the transparent path --------------------------------------------------------------------------------


def test_transparent_path_relays_allowed_names_and_resets_the_rest(echo: EchoServer) -> None:
    other = _free_port()
    rules = _rules(("one.test", (echo.port,)), ("two.test", (echo.port,)),
                   static=(("one.test", "127.0.0.1"), ("two.test", "127.0.0.1")))
    with plan(rules, ports=(echo.port, other), extra=(("127.0.0.3", echo.port),)) as p:
        address = p.resolve("one.test")
        with socket.create_connection((address, echo.port), timeout=10) as s:
            s.sendall(b"through")
            assert recv_exact(s, 7) == b"through"
            s.shutdown(socket.SHUT_WR)               # half-close reaches the server, whose close comes back
            assert _recv_all(s) == b""
        _assert_reset((address, other))                    # a port the name is not allowed on
        _assert_reset(("127.77.1.1", echo.port))          # an address no name has (yet)
        _assert_reset(("127.0.0.3", echo.port))           # a direct address
        summary = p.mediator.summary()
        assert summary["allowed"] == [{"host": "one.test", "port": echo.port, "count": 1}]
        denied = {(d.get("host") or d.get("address"), d["port"]): d["reason"] for d in summary["denied"]}
        assert denied == {("one.test", other): "port not allowed",
                          ("127.77.1.1", echo.port): "an address, not an allowed name",
                          ("127.0.0.3", echo.port): "an address, not an allowed name"}


def test_transparent_path_resets_when_the_name_cannot_be_reached() -> None:
    closed = _free_port()
    rules = _rules(("one.test", (closed,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules, ports=(closed,)) as p:
        _assert_reset((p.resolve("one.test"), closed))
        (failed,) = p.mediator.summary()["failed"]
        assert failed["host"] == "one.test" and failed["port"] == closed
        assert failed["reason"].startswith(f"cannot connect: 127.0.0.1:{closed}: ")
        assert p.mediator.summary()["denied"] == []


def test_fifty_connections_at_once(echo: EchoServer) -> None:
    rules = _rules(("one.test", (echo.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules, ports=(echo.port,)) as p:
        address = p.resolve("one.test")
        sockets = [socket.create_connection((address, echo.port), timeout=10) for _ in range(25)]
        for _ in range(25):
            s, head = _connect_request(p, f"one.test:{echo.port}")
            assert head.startswith(b"HTTP/1.1 200")
            sockets.append(s)
        for i, s in enumerate(sockets):        # all open at once, then each used
            s.sendall(b"%05d" % i)
        for i, s in enumerate(sockets):
            assert recv_exact(s, 5) == b"%05d" % i
            s.close()
        assert p.mediator.summary()["allowed"] == [{"host": "one.test", "port": echo.port, "count": 50}]


def test_close_ends_relays_and_is_idempotent(echo: EchoServer) -> None:
    rules = _rules(("one.test", (echo.port,)), static=(("one.test", "127.0.0.1"),))
    p = Plan(rules, (echo.port,))
    s = socket.create_connection((p.resolve("one.test"), echo.port), timeout=10)
    s.sendall(b"x")
    assert recv_exact(s, 1) == b"x"
    p.mediator.close()
    try:                     # ended by close(): not left to the 10 s timeout
        assert s.recv(10) == b""
    except ConnectionResetError:
        pass
    s.close()
    p.mediator.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("isolate-egress")]
    with pytest.raises(OSError):
        socket.create_connection(p.proxy, timeout=2)


def test_summary_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.egress import mediator

    monkeypatch.setattr(mediator, "MAX_SUMMARY_ENTRIES", 3)
    with plan(_rules(("one.test", (443,)))) as p:
        for i in range(5):
            p.query(f"n{i}.test")
        p.query("n0.test")
        summary = p.mediator.summary()
        assert [d["host"] for d in summary["denied"]] == ["n0.test", "n1.test", "n2.test"]
        assert summary["denied"][0]["count"] == 2 and summary["dropped"] == 2


# --- the process form --------------------------------------------------------------------------------------


def test_rules_travel_as_json() -> None:
    rules = _rules(("one.test", (443,)), ("*.two.test", (80, 443)), static=(("one.test", "127.0.0.1"),),
                   resolver=("127.0.0.1", 5353), allow_private=True)
    assert rules_from_json(rules_to_json(rules)) == rules
    with pytest.raises(ValueError):
        rules_from_json(json.dumps({"rules": [["1.2.3.4", [443]]], "static_hosts": [], "resolver": None,
                                    "allow_private": False}))


def test_mediator_process_serves_and_reports(echo: EchoServer) -> None:
    rules = _rules(("one.test", (echo.port,)), static=(("one.test", "127.0.0.1"),))
    dns_port, proxy_port = _free_port(DNS_ADDRESS), _free_port(PROXY_ADDRESS)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((DNS_ADDRESS, dns_port))
    listeners = [socket.create_server(a) for a in ((DNS_ADDRESS, dns_port), (PROXY_ADDRESS, proxy_port),
                                                    (NAME_ADDRESSES[0], echo.port))]
    rules_r, rules_w = os.pipe()
    os.write(rules_w, rules_to_json(rules).encode())
    os.close(rules_w)
    control, theirs = socket.socketpair()
    fds = [rules_r, udp.fileno(), theirs.fileno(), *(s.fileno() for s in listeners)]
    argv = [sys.executable, "-m", "isolate.egress", "--rules-fd", str(rules_r), "--dns-fd", str(udp.fileno()),
            "--control-fd", str(theirs.fileno()), "--dns-port", str(dns_port), "--proxy-port", str(proxy_port)]
    for s in listeners:
        argv += ["--listen-fd", str(s.fileno())]
    process = subprocess.Popen(argv, pass_fds=fds)
    for fd in (rules_r,):
        os.close(fd)
    for s in (udp, theirs, *listeners):
        s.close()
    try:
        p = Plan.__new__(Plan)
        p.dns_port, p.proxy_port = dns_port, proxy_port
        address = p.resolve("one.test")
        with socket.create_connection((address, echo.port), timeout=10) as s:
            s.sendall(b"hi")
            assert recv_exact(s, 2) == b"hi"
        assert p.query("no.test").rcode == dns.NXDOMAIN
        control.sendall(b"summary\n")
        reader = control.makefile("r")
        summary = json.loads(reader.readline())
        assert summary["allowed"] == [{"host": "one.test", "port": echo.port, "count": 1}]
        assert summary["denied"][0]["host"] == "no.test"
        control.sendall(b"stop\n")
        assert json.loads(reader.readline())["allowed"][0]["count"] == 1
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        control.close()


def test_mediator_process_stops_when_the_sandbox_exits() -> None:
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open")
    rules = _rules(("one.test", (443,)))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((DNS_ADDRESS, 0))
    rules_r, rules_w = os.pipe()
    os.write(rules_w, rules_to_json(rules).encode())
    os.close(rules_w)
    sandbox = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(sandbox.pid)
    process = subprocess.Popen([sys.executable, "-m", "isolate.egress", "--rules-fd", str(rules_r), "--dns-fd",
                                str(udp.fileno()), "--pidfd", str(pidfd)], pass_fds=[rules_r, udp.fileno(), pidfd])
    os.close(rules_r)
    os.close(pidfd)
    udp.close()
    try:
        time.sleep(0.5)
        assert process.poll() is None
        sandbox.kill()
        sandbox.wait()
        assert process.wait(timeout=10) == 0
        # SIGTERM stops it too.
        rules_r, rules_w = os.pipe()
        os.write(rules_w, rules_to_json(rules).encode())
        os.close(rules_w)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((DNS_ADDRESS, 0))
        process = subprocess.Popen([sys.executable, "-m", "isolate.egress", "--rules-fd", str(rules_r),
                                    "--dns-fd", str(udp.fileno())], pass_fds=[rules_r, udp.fileno()])
        os.close(rules_r)
        dns_port = int(udp.getsockname()[1])
        udp.close()
        p = Plan.__new__(Plan)
        p.dns_port = dns_port
        assert p.query("no.test").rcode == dns.NXDOMAIN     # serving: its signal handlers are in place
        process.terminate()
        assert process.wait(timeout=10) == 0
    finally:
        for child in (process, sandbox):
            if child.poll() is None:
                child.kill()
                child.wait()


def test_a_dot_inside_a_label_is_not_a_name() -> None:
    with plan(_rules(("*.one.test", (443,)), static=(("a.one.test", "127.0.0.1"),))) as p:
        query = struct.pack("!HHHHHH", 9, 0x0100, 1, 0, 0, 0) + b"\x0aa.one.test\x00\x00\x01\x00\x01"
        reply = p.mediator.answer_dns(query)
        assert reply is not None and reply[3] & 0xF == dns.FORMERR


def test_hostile_proxy_clients_get_short_answers(echo: EchoServer) -> None:
    rules = _rules(("one.test", (echo.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules) as p:
        for request, status in ((b"GET http://one.test/ HTTP/1.1\r\nX: " + b"a" * 70000, b"431"),
                                (b"GET / HTTP/1.1\r\n\r\n", b"400"),                      # not a proxy request
                                (b"GET http://u:p@one.test/ HTTP/1.1\r\n\r\n", b"400"),
                                (b"GET https://one.test/ HTTP/1.1\r\n\r\n", b"501"),
                                (b"GET http://one.test/ HTTP/1.1\r\nX: a\nY: b\r\n\r\n", b"400"),   # bare LF
                                (b"GET http://one.test/ HTTP/1.1\r\n folded\r\n\r\n", b"400"),
                                (b"CONNECT one.test HTTP/1.1\r\n\r\n", b"400")):             # no port
            with socket.create_connection(p.proxy, timeout=10) as s:
                try:
                    s.sendall(request)
                except ConnectionResetError:
                    pass
                assert _recv_all(s).split(b" ")[1] == status, request[:60]
        # A CONNECT to a name's own address (a client that resolved first) is that name.
        address = p.resolve("one.test")
        s, head = _connect_request(p, f"{address}:{echo.port}")
        with s:
            assert head.startswith(b"HTTP/1.1 200")


def test_an_error_in_one_connection_leaves_the_others_served(echo: EchoServer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rules = _rules(("one.test", (echo.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules, ports=(echo.port,)) as p:
        address = p.resolve("one.test")
        real = p.mediator._serve_transparent
        calls = []

        def broken_once(*args: Any) -> bool:
            calls.append(args)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            return real(*args)

        monkeypatch.setattr(p.mediator, "_serve_transparent", broken_once)
        _assert_reset((address, echo.port))                 # the broken one: reset, not left hanging
        with socket.create_connection((address, echo.port), timeout=10) as s:
            s.sendall(b"ok")
            assert recv_exact(s, 2) == b"ok"
        # The broken connection's worker counts its error after the reset it caused: on a busy host, later.
        deadline = time.monotonic() + 10
        while "errors" not in p.mediator.summary() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.mediator.summary()["errors"] == 1


def test_fifty_dns_queries_at_once() -> None:
    names = tuple(f"n{i}.test" for i in range(50))
    rules = _rules(*((n, (443,)) for n in names), static=tuple((n, "127.0.0.1") for n in names))
    with plan(rules) as p:
        results: dict[str, str] = {}

        def ask(name: str) -> None:
            results[name] = p.resolve(name)

        threads = [threading.Thread(target=ask, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(set(results.values())) == 50
        assert all(p.mediator.address_name(address) == name for name, address in results.items())


def test_a_keep_alive_server_sees_only_the_first_request() -> None:
    """A server that ignores Connection: close and reads on still gets one request from the proxy."""
    server = socket.create_server(("127.0.0.1", 0))
    port = int(server.getsockname()[1])
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(1.0)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                while chunk := conn.recv(65536):   # a keep-alive server waits for the next request
                    data += chunk
            except OSError:
                pass
            received.append(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    rules = _rules(("one.test", (port,)), ("two.test", (port,)),
                   static=(("one.test", "127.0.0.1"), ("two.test", "127.0.0.1")))
    try:
        with plan(rules) as p, socket.create_connection(p.proxy, timeout=10) as s:
            s.sendall(f"GET http://one.test:{port}/first HTTP/1.1\r\n\r\n"
                      f"GET http://two.test:{port}/second HTTP/1.1\r\n\r\n".encode())
            s.settimeout(10)
            data = b""
            while not data.endswith(b"ok"):
                chunk = s.recv(65536)
                assert chunk
                data += chunk
            thread.join(10)
        assert len(received) == 1 and b"/first" in received[0] and b"second" not in received[0]
    finally:
        server.close()


def test_git_clones_over_http_through_the_proxy(tmp_path: Any) -> None:
    """git (libcurl) through http_proxy: many requests, each on its own proxied connection."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    work, served = tmp_path / "work", tmp_path / "served"
    for argv in (["git", "init", "-q", str(work)], ["git", "-C", str(work), "commit", "-q", "--allow-empty", "-m", "x"],
                 ["git", "clone", "-q", "--bare", str(work), str(served / "repo.git")],
                 ["git", "-C", str(served / "repo.git"), "update-server-info"]):
        subprocess.run(argv, env=env, check=True, capture_output=True)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = int(server.server_address[1])
    rules = _rules(("git.test", (port,)), static=(("git.test", "127.0.0.1"),))
    try:
        with plan(rules) as p:
            done = subprocess.run(["git", "clone", "-q", f"http://git.test:{port}/repo.git", str(tmp_path / "clone")],
                                  env={**env, "http_proxy": p.proxy_url}, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            (allowed,) = p.mediator.summary()["allowed"]
            assert allowed["host"] == "git.test" and allowed["count"] >= 3
    finally:
        server.shutdown()
        server.server_close()


def test_pip_downloads_from_an_index_through_the_proxy(tmp_path: Any) -> None:
    """pip (requests) through http_proxy, against a local simple index holding one wheel."""
    from conftest import write_tiny_wheel

    index = tmp_path / "index"
    (index / "simple" / "tinypkg").mkdir(parents=True)
    write_tiny_wheel(index / "simple" / "tinypkg" / "tinypkg-1.0-py3-none-any.whl")
    (index / "simple" / "tinypkg" / "index.html").write_text(
        '<html><body><a href="tinypkg-1.0-py3-none-any.whl">tinypkg-1.0-py3-none-any.whl</a></body></html>')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(index)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = int(server.server_address[1])
    rules = _rules(("pypi.test", (port,)), static=(("pypi.test", "127.0.0.1"),))
    try:
        with plan(rules) as p:
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "http_proxy": p.proxy_url,
                   "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
            done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                                   str(tmp_path / "got"), "--index-url", f"http://pypi.test:{port}/simple/",
                                   "--trusted-host", f"pypi.test:{port}", "tinypkg"],
                                  env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            assert os.listdir(tmp_path / "got") == ["tinypkg-1.0-py3-none-any.whl"]
            assert p.mediator.summary()["allowed"][0]["host"] == "pypi.test"
    finally:
        server.shutdown()
        server.server_close()


def test_a_name_that_is_none_is_refused_and_reported(echo: EchoServer) -> None:
    # Refused before as now (400, NXDOMAIN), but missing from report.egress.denied, which lists every refusal.
    rules = _rules(("one.test", (echo.port,)), static=(("one.test", "127.0.0.1"),))
    with plan(rules) as p:
        s, head = _connect_request(p, f"bad!name.test:{echo.port}")
        with s:
            assert head.startswith(b"HTTP/1.1 400"), head
        assert p.query("no_t-even~a.name").rcode == dns.NXDOMAIN
        denied = {(entry["host"], entry["port"], entry["reason"]) for entry in p.mediator.summary()["denied"]}
        assert ("bad!name.test", echo.port, "not a host name") in denied, denied
        assert ("no_t-even~a.name", None, "not a host name") in denied, denied
