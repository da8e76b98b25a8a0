"""A sandbox's port forwarded over the direct route (isolate/ray/direct.py, ``serve --ray``), against a hostile
app and a client that goes away, with a host's Listener and its client's ``open_port`` and no Ray cluster (the
connector is a plain loopback connect here: what is tested is the route's relay, not the connector).

What a forwarded connection holds on the node's host (a connection, two threads) it gives back: when the client
closed and the app never does (nor answers), after ``LINGER`` idle seconds; when the sandbox is retired; when
the host closes, at once; under TLS the client's own relay threads too. Forwarded connections held open do not
take the route's connections (its calls still open), and one sandbox's forwards do not refuse another's.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from imagekit import node_tls_files

pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")
from isolate.ray import channel, direct  # after the skip: isolate.ray imports ray

SID, OTHER = "0123456789abcdef", "fedcba9876543210"


def serve(sid: str, operation: str, args: tuple[Any, ...]) -> Any:
    return (sid, operation, args)


class App:
    """A hostile app on the sandbox's loopback: it accepts and holds every connection, never answers, never
    closes (not even at the client's end)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def relays() -> list[threading.Thread]:
    """The threads that carry forwarded connections (the host's and, under TLS, the client's)."""
    return [t for t in threading.enumerate() if t.name in ("isolate-direct-port", "isolate-direct-conn")]


def settled(within: float) -> list[threading.Thread]:
    deadline = time.monotonic() + within
    while relays() and time.monotonic() < deadline:
        time.sleep(0.05)
    return relays()


@pytest.fixture
def app() -> Iterator[App]:
    a = App()
    yield a
    a.close()


@pytest.fixture(params=["plain", "tls"])
def route_tls(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(the host's TLS context, the client's): none on the plain route; Ray's TLS with openssl's files."""
    if request.param == "plain":
        return None, None
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test's certificates")
    files = node_tls_files(os.path.join(str(tmp_path_factory.mktemp("tls")), "cluster"), ["127.0.0.1"])
    for name, value in ((channel.CERT, files["cert"]), (channel.KEY, files["key"]), (channel.CA, files["ca"])):
        monkeypatch.setenv(name, value)
    return channel.tls_context(server_side=True), channel.tls_context(server_side=False)


def connector(sid: str, port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


@pytest.fixture
def host(route_tls: tuple[Any, Any]) -> Iterator[tuple[direct.Listener, Callable[..., socket.socket]]]:
    assert settled(5.0) == [], "an earlier test left relays running"
    listener = direct.Listener("127.0.0.1", serve, route_tls[0], connector)
    secrets = {sid: listener.admit(sid) for sid in (SID, OTHER)}

    def forward(port: int, sid: str = SID) -> socket.socket:
        return direct.open_port(listener.address, sid, secrets[sid], port, route_tls[1])

    try:
        yield listener, forward
    finally:
        listener.close()


def test_a_client_gone_from_an_app_that_never_closes_holds_nothing(host: Any, app: App,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "LINGER", 0.5, raising=False)
    _, forward = host
    sock = forward(app.port)
    sock.sendall(b"GET / HTTP/1.1\r\nconnection: close\r\n\r\n")
    sock.close()  # the server's port route closes for good: the app sees the end, and ignores it
    assert settled(5.0) == [], "a forwarded connection held past its client"


def test_a_retired_sandbox_and_a_closed_host_end_their_forwards(host: Any, app: App) -> None:
    listener, forward = host
    held = [forward(app.port) for _ in range(3)]
    other = forward(app.port, OTHER)
    listener.retire(SID)  # the sandbox closed: its forwards end (the other sandbox's stays)
    for sock in held:
        sock.settimeout(5)
        assert sock.recv(1) == b""
    other.sendall(b"still here")
    listener.close()  # the host ends: every forward with it, the app's idle ones too
    other.settimeout(5)
    assert other.recv(1) == b""
    for sock in (*held, other):
        sock.close()
    assert settled(5.0) == []


def test_forwards_held_open_take_neither_the_routes_connections_nor_another_sandboxs(
        host: Any, app: App, route_tls: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(direct, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(direct, "MAX_FORWARDS_PER_SANDBOX", 6, raising=False)
    listener, forward = host
    held = [forward(app.port) for _ in range(6)]  # more than the route's connections, held open by the app
    route = direct.Route(listener.address, lambda: False, route_tls[1])
    try:
        assert route.call(SID, listener._secrets[SID], "call", ("exec",)) == (SID, "call", ("exec",))
    finally:
        route.close()
    with pytest.raises(Exception, match="forwarded connections"):
        forward(app.port)  # this sandbox's share is taken: refused with the host's words
    held.append(forward(app.port, OTHER))  # another sandbox's still opens
    for sock in held:
        sock.close()


def test_a_remote_sandboxs_stalled_connector_holds_none_of_the_servers_threads() -> None:
    """``serve --ray``'s port route for a sandbox on a node: a connector that never answers (stopped from inside
    the sandbox) holds that sandbox's forwards only, as a local sandbox's does, never the server's shared threads
    (40 requests to its port stalled every endpoint that runs in a thread)."""
    pytest.importorskip("starlette", reason="the server's extra: pip install '.[server]'")
    import asyncio
    import types

    from starlette.concurrency import run_in_threadpool

    from isolate.server.connector import NodeForwarder

    stalled, entered = threading.Event(), threading.Semaphore(0)
    pairs: list[socket.socket] = []

    class Box:  # an isolate.ray.Sandbox whose node's connector never answers (until the test lets it)
        def open_port(self, port: int) -> socket.socket:
            entered.release()
            stalled.wait(30)
            ours, theirs = socket.socketpair()
            pairs.append(theirs)
            return ours

    forwarder = NodeForwarder(types.SimpleNamespace(id="remote", box=Box()))  # type: ignore[arg-type]

    async def scene() -> float:
        requests = [asyncio.ensure_future(forwarder.connect(8080)) for _ in range(48)]
        try:
            await asyncio.sleep(0.5)
            start = time.monotonic()
            assert await asyncio.wait_for(run_in_threadpool(lambda: 1), 10) == 1  # another endpoint's thread
            return time.monotonic() - start
        finally:
            stalled.set()
            for sock in await asyncio.gather(*requests):
                sock.close()

    try:
        waited = asyncio.run(scene())
    finally:
        stalled.set()
        for sock in pairs:
            sock.close()
    assert waited < 2.0, f"another endpoint waited {waited:.1f} s for a thread"



def test_a_peer_that_trickles_its_first_frame_is_closed_in_time(route_tls: tuple[Any, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """FIRST_FRAME_TIMEOUT bounds the whole of a connection's unproved start (the TLS handshake, the first
    frame), not each read: a peer without a secret that sends a byte now and then held one of the host's
    connections (what forwards and routes open: MAX_CONNECTIONS) for as long as it liked."""
    monkeypatch.setattr(direct, "FIRST_FRAME_TIMEOUT", 1.0)
    listener = direct.Listener("127.0.0.1", serve, route_tls[0], connector)
    start = time.monotonic()
    try:
        with socket.create_connection(listener.address, timeout=5) as peer:
            try:
                if route_tls[0] is not None:
                    peer.sendall(b"\x16\x03\x01\x02\x00")  # a handshake record of 512 bytes, then its bytes
                while time.monotonic() - start < 6:
                    peer.sendall(b"\x01")  # never a whole record, nor a whole header, here
                    time.sleep(0.2)
            except OSError:
                pass  # reset: the host closed it
    finally:
        listener.close()
    assert time.monotonic() - start < 4, "a trickling peer kept its connection"


def test_a_retired_sandbox_forwards_nothing(host: Any, app: App) -> None:
    """A retired sandbox's secret still proves a late call (answered "closed"), but opens no forward: none opens
    between the retire and the sandbox's end, when nothing would end it (an app outside the sandbox's network
    namespace: a sandbox of the host's network)."""
    listener, forward = host
    listener.retire(SID)
    with pytest.raises(Exception, match="closed"):
        forward(app.port)
    assert app.held == []


def test_a_forwarded_connection_is_probed_when_idle(host: Any, app: App, route_tls: tuple[Any, Any]) -> None:
    """A node that dies without a word (its machine off the network) ends a forward that waits on it (a WebSocket's)
    after TCP keepalive's probes, not when its browser leaves: the client's connection to the node is probed."""
    if route_tls[1] is not None:
        pytest.skip("under TLS the socket returned is a local pair's end; the TCP connection is the relay's")
    _, forward = host
    with forward(app.port) as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == direct.KEEPALIVE_IDLE
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == direct.KEEPALIVE_PROBES
