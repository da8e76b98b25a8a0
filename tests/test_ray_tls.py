"""isolate.ray's direct route under Ray's TLS (isolate/ray/channel.py): on a real local cluster started with
RAY_USE_TLS and a CA and node certificate made by openssl here, the route is TLS with Ray's own files.

Calls take it (``stats`` says so), many at once from many threads (the one TLS state shared by the reader and
the writers); a peer that does not speak TLS, one without a certificate and one whose certificate another CA
signed are closed before the host says anything; one with the cluster's certificate still has to prove the
sandbox's secret; and a client does not talk to a host whose certificate the cluster's CA did not sign.
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
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conftest import NAMESPACES_WHY, python_read
from imagekit import node_tls_files

import isolate

ray = pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils")
import isolate.ray as iray  # noqa: E402  (after the skip: it imports ray)
from isolate.ray import channel, direct  # noqa: E402
from isolate.ray.placement import Hosts  # noqa: E402

pytestmark = [pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or ""),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificates")]

ENV = ("RAY_USE_TLS", channel.CERT, channel.KEY, channel.CA)


def box_policy() -> isolate.Policy:
    return isolate.Policy(read=python_read(), write=())


@pytest.fixture(scope="module")
def tls() -> Iterator[tuple[Any, dict[str, str], dict[str, str]]]:
    """A one-node cluster under Ray's TLS, the cluster's files and another CA's (a stranger's)."""
    where = tempfile.mkdtemp(prefix="iray-tls-")
    ips = ["127.0.0.1", ray.util.get_node_ip_address()]  # the node's address as Ray will know it
    files = node_tls_files(os.path.join(where, "cluster"), ips)
    stranger = node_tls_files(os.path.join(where, "stranger"), ips)
    saved = {name: os.environ.get(name) for name in ENV}
    os.environ.update({"RAY_USE_TLS": "1", channel.CERT: files["cert"], channel.KEY: files["key"],
                       channel.CA: files["ca"]})
    c = None
    try:
        c = cluster_utils.Cluster(initialize_head=True,
                                  head_node_args={"num_cpus": 1, "temp_dir": os.path.join(where, "ray")})
        ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
        yield c, files, stranger
    finally:
        iray.shutdown()
        ray.shutdown()
        if c is not None:
            c.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(where, ignore_errors=True)


def test_calls_take_the_route_over_tls(tls: Any) -> None:
    c, _, _ = tls
    with iray.Sandbox(box_policy(), node_id=c.head_node.node_id) as sb:
        result = sb.exec(["sh", "-c", "echo out; cat"], input="in\n")
        assert (result.returncode, result.stdout) == (0, "out\nin\n")
        stats = sb.stats
        assert stats["route"] == "direct" and stats["tls"] is True and stats["direct_calls"] == 1, stats
        assert Hosts.get().route(c.head_node.node_id).tls  # type: ignore[union-attr]
        # Many calls at once: the reader and the writers share the connection's one TLS state.
        with ThreadPoolExecutor(16) as callers:
            said = list(callers.map(lambda i: sb.exec(["echo", str(i)]).stdout, range(64)))
        assert said == [f"{i}\n" for i in range(64)]
        # An answer of many TLS records.
        blob = os.urandom(1 << 20)
        sb.write_file("blob", blob)
        assert sb.read_file("blob", text=False) == blob
        assert sb.stats["direct_calls"] == 1 + 64 + 2 and sb.stats["actor_calls"] == 0


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


def _said_exactly(peer: socket.socket, size: int) -> bytes:
    got = b""
    while len(got) < size:
        chunk = peer.recv(size - len(got))
        assert chunk, "the host closed the connection"
        got += chunk
    return got


def test_peers_without_the_clusters_certificate_are_closed(tls: Any) -> None:
    c, files, stranger = tls
    with iray.Sandbox(box_policy(), node_id=c.head_node.node_id) as sb:
        sb.exec(["true"])
        address = Hosts.get()._addresses[c.head_node.node_id]
        hello = len(direct.MAGIC) + direct.NONCE
        plain = socket.create_connection(address, timeout=5)
        plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _said(plain, hello) == b"", "a peer not speaking TLS"
        assert _said(_tls_peer(address, files["ca"], None), hello) == b"", "a peer without a certificate"
        assert _said(_tls_peer(address, files["ca"], stranger), hello) == b"", "another CA's certificate"
        # The cluster's certificate opens the connection; the sandbox's secret is still asked for.
        body = pickle.dumps(("call", ("exec", (["echo", "hi"],), {})))
        for secret, answered in ((b"w" * 32, False), (sb._secret, True)):
            assert secret is not None
            peer = _tls_peer(address, files["ca"], files)
            greeting = _said_exactly(peer, hello)
            assert greeting.startswith(direct.MAGIC)
            nonce = greeting[len(direct.MAGIC):]
            header = struct.pack(">IQ16s", len(body), 1, sb.id.encode())
            peer.sendall(header + hmac.new(secret, nonce + header + body, hashlib.sha256).digest() + body)
            if not answered:
                assert _said(peer, 1) == b""
                continue
            head = _said_exactly(peer, direct.ANSWER.size)
            length, rid, _ = direct.ANSWER.unpack(head)
            assert rid == 1 and pickle.loads(_said_exactly(peer, length)).stdout == "hi\n"
            peer.close()
        assert sb.exec(["echo", "still"]).stdout == "still\n" and sb.stats["tls"] is True


def test_a_host_whose_certificate_another_ca_signed_is_not_called(tls: Any) -> None:
    _, _, stranger = tls
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(stranger["cert"], stranger["key"])
    ctx.load_verify_locations(stranger["ca"])
    ctx.verify_mode = ssl.CERT_REQUIRED
    listener = direct.Listener("127.0.0.1", lambda sid, operation, args: "answered", ctx)
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            direct.Route(listener.address, lambda: False, channel.tls_context(server_side=False))
    finally:
        listener.close()
