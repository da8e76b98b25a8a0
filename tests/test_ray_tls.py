"""isolate.ray's direct route under Ray's TLS (isolate/ray/channel.py): with RAY_USE_TLS and a CA and a node
certificate made by openssl here, a host's Listener and a client's Route speak TLS with Ray's own files.

Calls go over it, many at once from many threads (the one TLS state shared by the reader and the writers), an
answer of many records too; a peer that does not speak TLS, one without a certificate and one whose certificate
another CA signed are closed before the host says anything; one with the cluster's certificate still has to
prove the sandbox's secret; a client does not talk to a host whose certificate another CA signed, nor to a host
that answers in the clear. (The host and the client here are the ones a node's actor and a client run, without a
Ray cluster: what is tested is the route, not Ray's own TLS.)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import shutil
import socket
import ssl
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conftest import recv_exact
from imagekit import node_tls_files

pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")
from isolate.ray import channel, direct

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificates")

SID = "0123456789abcdef"
HELLO = len(direct.MAGIC) + direct.NONCE


def serve(sid: str, operation: str, args: tuple[Any, ...]) -> Any:
    """A host's answer: what was asked, or (``big``) an answer of many TLS records."""
    if operation == "big":
        return os.urandom(1 << 20)
    return (sid, operation, args)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    where = str(tmp_path_factory.mktemp("tls"))
    return {"cluster": node_tls_files(os.path.join(where, "cluster"), ["127.0.0.1"]),
            "stranger": node_tls_files(os.path.join(where, "stranger"), ["127.0.0.1"])}


@pytest.fixture
def ray_tls(files: dict[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's Ray uses TLS with the cluster's files (as a node's and a client's do)."""
    cluster = files["cluster"]
    for name, value in (("RAY_USE_TLS", "1"), (channel.CERT, cluster["cert"]), (channel.KEY, cluster["key"]),
                        (channel.CA, cluster["ca"])):
        monkeypatch.setenv(name, value)
    return cluster


@pytest.fixture
def host(ray_tls: dict[str, str]) -> Iterator[direct.Listener]:
    listener = direct.Listener("127.0.0.1", serve, channel.tls_context(server_side=True))
    try:
        yield listener
    finally:
        listener.close()


def test_calls_go_over_tls(host: direct.Listener) -> None:
    secret = host.admit(SID)
    route = direct.Route(host.address, lambda: False, channel.tls_context(server_side=False))
    try:
        assert route.tls
        assert route.call(SID, secret, "call", ("exec", ["true"])) == (SID, "call", ("exec", ["true"]))
        with ThreadPoolExecutor(16) as callers:
            said = list(callers.map(lambda i: route.call(SID, secret, "call", (i,)), range(200)))
        assert said == [(SID, "call", (i,)) for i in range(200)]
        assert len(route.call(SID, secret, "big", ())) == 1 << 20
    finally:
        route.close()


def _tls_peer(address: tuple[str, int], ca: str, cert: dict[str, str] | None) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    if cert is not None:
        ctx.load_cert_chain(cert["cert"], cert["key"])
    return ctx.wrap_socket(socket.create_connection(address, timeout=5), server_hostname=address[0])


def _said(peer: socket.socket, size: int) -> bytes:
    """What the host sends before it closes (up to size bytes); b"" when it closed without a word."""
    got = b""
    try:
        while len(got) < size:
            chunk = peer.recv(size - len(got))
            if not chunk:
                break
            got += chunk
    except (ssl.SSLError, ConnectionResetError):  # an alert (certificate required, unknown CA), or a reset
        pass
    finally:
        peer.close()
    return got



def test_peers_without_the_clusters_certificate_are_closed(host: direct.Listener, files: dict[str, Any]) -> None:
    secret = host.admit(SID)
    cluster, stranger = files["cluster"], files["stranger"]
    plain = socket.create_connection(host.address, timeout=5)
    plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _said(plain, HELLO) == b"", "a peer not speaking TLS"
    try:
        peer = _tls_peer(host.address, cluster["ca"], None)
    except (ssl.SSLError, ConnectionResetError):
        pass  # refused during the handshake
    else:
        assert _said(peer, HELLO) == b"", "a peer without a certificate"
    try:
        peer = _tls_peer(host.address, cluster["ca"], stranger)
    except (ssl.SSLError, ConnectionResetError):
        pass
    else:
        assert _said(peer, HELLO) == b"", "another CA's certificate"
    # The cluster's certificate opens the connection; the sandbox's secret is still asked for.
    body = pickle.dumps(("call", ("echo",)))
    for key, answered in ((b"w" * 32, False), (secret, True)):
        peer = _tls_peer(host.address, cluster["ca"], cluster)
        greeting = recv_exact(peer, HELLO)
        assert greeting.startswith(direct.MAGIC)
        nonce = greeting[len(direct.MAGIC):]
        header = struct.pack(">IQ16s", len(body), 1, SID.encode())
        peer.sendall(header + hmac.new(key, nonce + header + body, hashlib.sha256).digest() + body)
        if not answered:
            assert _said(peer, 1) == b""
            continue
        head = recv_exact(peer, direct.ANSWER.size)
        length, rid, _ = direct.ANSWER.unpack(head)
        assert rid == 1 and pickle.loads(recv_exact(peer, length)) == (SID, "call", ("echo",))
        peer.close()


def test_a_forwarded_port_goes_over_tls(ray_tls: dict[str, str]) -> None:
    """A sandbox's port forwarded over the route (``serve --ray``'s port route) is TLS under Ray's TLS: the
    app's bytes both ways, an app that answers before it reads included, and its end; the sandbox's secret is
    still asked for."""
    app = socket.create_server(("127.0.0.1", 0))
    port = app.getsockname()[1]

    def app_serves() -> None:
        conn, _ = app.accept()
        with conn:
            conn.sendall(b"hello\n")  # before it reads
            while data := conn.recv(1 << 16):
                conn.sendall(data.upper())

    opened: list[int] = []

    def open_port(sid: str, asked: int) -> socket.socket:
        opened.append(asked)
        return socket.create_connection(("127.0.0.1", asked), timeout=5)

    listener = direct.Listener("127.0.0.1", serve, channel.tls_context(server_side=True), open_port)
    try:
        secret = listener.admit(SID)
        with pytest.raises(direct.Broken):  # a wrong secret: the host closes without an answer
            direct.open_port(listener.address, SID, b"w" * 32, port, channel.tls_context(server_side=False))
        with ThreadPoolExecutor(1) as background:
            served = background.submit(app_serves)
            sock = direct.open_port(listener.address, SID, secret, port, channel.tls_context(server_side=False))
            with sock:
                assert recv_exact(sock, 6) == b"hello\n"
                payload = os.urandom(300_000).hex().encode()  # many TLS records each way
                sock.sendall(payload)
                assert recv_exact(sock, len(payload)) == payload.upper()
                sock.shutdown(socket.SHUT_WR)
                assert sock.recv(1) == b""  # the app saw the end and closed
            served.result(timeout=10)
        assert opened == [port]
        with pytest.raises(OSError):  # a client in the clear: the TLS host never greets it
            direct.open_port(listener.address, SID, secret, port)
    finally:
        listener.close()
        app.close()


def test_a_client_under_tls_calls_no_host_the_cluster_did_not_certify(ray_tls: dict[str, str],
                                                                     files: dict[str, Any]) -> None:
    stranger = files["stranger"]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(stranger["cert"], stranger["key"])
    ctx.load_verify_locations(stranger["ca"])
    ctx.verify_mode = ssl.CERT_REQUIRED
    foreign = direct.Listener("127.0.0.1", serve, ctx)
    plain = direct.Listener("127.0.0.1", serve)  # a host that speaks in the clear
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            direct.Route(foreign.address, lambda: False, channel.tls_context(server_side=False))
        with pytest.raises(OSError):
            direct.Route(plain.address, lambda: False, channel.tls_context(server_side=False))
    finally:
        foreign.close()
        plain.close()


def test_tls_files_that_do_not_load_offer_no_route(ray_tls: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Any) -> None:
    monkeypatch.setenv(channel.CERT, str(tmp_path / "missing.crt"))
    with pytest.raises(direct_unsupported()):
        channel.tls_context(server_side=True)
    monkeypatch.delenv(channel.CA)
    with pytest.raises(direct_unsupported(), match=channel.CA):
        channel.tls_context(server_side=False)


def direct_unsupported() -> type[Exception]:
    import isolate

    return isolate.UnsupportedError
