"""isolate.ray's direct route (isolate/ray/direct.py): a sandbox's calls go from the client to its node's host over
a connection of their own, not through Ray, on a real local cluster (``ray.cluster_utils.Cluster``: a head and
a worker).

The same results as through the actor (a large result too, taken through the actor); a peer without the
sandbox's secret (a raw one, a wrong proof, a replayed request, a length of 4 GiB) has its connection closed;
a route that does not open leaves the calls to the actor, and ``stats`` says so; a node that dies during a
call on the route is named as Ray names it (``SandboxLostError``).
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conftest import NAMESPACES_WHY, python_read, ray_cluster

import isolate

ray = pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils")
import isolate.ray as iray  # noqa: E402  (after the skip: it imports ray)
from isolate.ray import direct  # noqa: E402
from isolate.ray.placement import Hosts, outcome  # noqa: E402

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def box_policy() -> isolate.Policy:
    return isolate.Policy(read=python_read(), write=())


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    temp = tempfile.mkdtemp(prefix="iray-direct-")
    c, (c.worker,) = ray_cluster({"num_cpus": 1, "temp_dir": temp}, [{"num_cpus": 1, "resources": {"worker": 1}}])
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        iray.shutdown()
        ray.shutdown()
        c.shutdown()


def through_actor(box: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    return outcome(box._actor.call.remote(box.id, method, args, kwargs), box.node_id, "test")


def test_calls_on_the_direct_route_answer_as_through_the_actor(cluster: Any) -> None:
    with iray.Sandbox(box_policy(), node_id=cluster.head_node.node_id) as sb:
        assert sb.stats["route"] == "direct"
        script = "echo out; echo err >&2; cat; exit 3"
        direct_result = sb.exec(["sh", "-c", script], input="in\n")
        actor_result = through_actor(sb, "exec", ["sh", "-c", script], input="in\n")
        for field in ("returncode", "stdout", "stderr"):
            assert getattr(direct_result, field) == getattr(actor_result, field), field
        assert (direct_result.returncode, direct_result.stdout) == (3, "out\nin\n")
        stats = sb.stats
        assert stats["route"] == "direct" and stats["why"] is None and stats["direct_calls"] == 1, stats
        assert stats["tls"] is False  # Ray without TLS: neither is the route (test_ray_tls.py)
        # A node's refusal comes back as itself.
        with pytest.raises(FileNotFoundError) as direct_error:
            sb.read_file("/nonexistent/x")
        with pytest.raises(FileNotFoundError) as actor_error:
            through_actor(sb, "read_file", "/nonexistent/x")
        assert str(direct_error.value) == str(actor_error.value)
        # A result past a frame stays on the node and comes through the actor's object store.
        big = b"x" * (direct.MAX_FRAME + 1000)
        sb.write_file("big", big)  # past LARGE: the object store, through the actor
        before = sb.stats
        assert sb.read_file("big", text=False) == big
        assert sb.stats["direct_calls"] == before["direct_calls"] + 1
        # Many calls at once on the one connection: each gets its own answer (and is counted).
        calls = sb.stats["direct_calls"]
        with ThreadPoolExecutor(16) as callers:
            said = list(callers.map(lambda i: sb.exec(["echo", str(i)]).stdout, range(64)))
        assert said == [f"{i}\n" for i in range(64)]
        assert sb.stats["direct_calls"] == calls + 64
        shell = sb.shell()
        calls = sb.stats["direct_calls"]
        assert "42" in str(shell.run("echo $((6*7))"))  # sessions take the route too
        assert sb.stats["direct_calls"] == calls + 1


def _hello(address: tuple[str, int]) -> tuple[socket.socket, bytes]:
    peer = socket.create_connection(address, timeout=5)
    hello = b""
    while len(hello) < len(direct.MAGIC) + direct.NONCE:
        chunk = peer.recv(64)
        assert chunk
        hello += chunk
    assert hello.startswith(direct.MAGIC)
    return peer, hello[len(direct.MAGIC):]


def _closed(peer: socket.socket) -> bool:
    """Whether the host closed the connection (it sends nothing to a peer it refused)."""
    try:
        return peer.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        peer.close()


def _request(sid: str, secret: bytes, nonce: bytes, rid: int, body: bytes) -> bytes:
    header = struct.pack(">IQ16s", len(body), rid, sid.encode())
    return header + hmac.new(secret, nonce + header + body, hashlib.sha256).digest() + body


def test_a_peer_without_the_sandboxs_secret_is_closed(cluster: Any) -> None:
    with iray.Sandbox(box_policy(), node_id=cluster.head_node.node_id) as sb:
        sb.exec(["true"])
        address = Hosts.get()._addresses[cluster.head_node.node_id]
        assert address[0] == cluster.head_node.node_ip_address  # the node's address as Ray knows it
        secret = sb._secret
        assert secret is not None and len(secret) == 32
        body = pickle.dumps(("call", ("exec", (["echo", "hi"],), {})))
        # A client of the protocol with the secret is answered (the proof, as the client checks it, holds).
        peer, nonce = _hello(address)
        frame = _request(sb.id, secret, nonce, 1, body)
        peer.sendall(frame)
        head = peer.recv(direct.ANSWER.size, socket.MSG_WAITALL)
        length, rid, proof = direct.ANSWER.unpack(head)
        answer = peer.recv(length, socket.MSG_WAITALL)
        assert rid == 1 and hmac.compare_digest(
            proof, hmac.new(secret, nonce + b"R" + head[:12] + answer, hashlib.sha256).digest())
        assert pickle.loads(answer).stdout == "hi\n"
        # ... and the same request sent again (a replay) closes the connection.
        peer.sendall(frame)
        assert _closed(peer)
        refused = {
            "a wrong secret": lambda nonce: _request(sb.id, b"w" * 32, nonce, 1, body),
            "another connection's proof": lambda nonce: frame,
            "an unknown sandbox": lambda nonce: _request("0" * 16, secret, nonce, 1, body),
            "a length of 4 GiB": lambda nonce: struct.pack(">IQ16s32s", 0xFFFFFFFF, 1, sb.id.encode(), b"\0" * 32),
            "a raw peer": lambda nonce: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64,
        }
        for what, make in refused.items():
            peer, nonce = _hello(address)
            peer.sendall(make(nonce))
            assert _closed(peer), what
        # The sandbox's own calls go on over the route.
        assert sb.exec(["echo", "still"]).stdout == "still\n" and sb.stats["route"] == "direct"


def test_a_node_lost_during_a_call_on_the_route(cluster: Any) -> None:
    doomed = cluster.worker
    sb = iray.Sandbox(box_policy(), resources={"worker": 1}).start()
    assert sb.node_id == doomed.node_id
    try:
        assert sb.exec(["true"]).returncode == 0 and sb.stats["route"] == "direct"
        raised: list[BaseException] = []
        started = threading.Event()

        def long_exec() -> None:
            started.set()
            try:
                sb.exec(["sleep", "60"])
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=long_exec)
        thread.start()
        started.wait()
        time.sleep(0.5)
        t0 = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)
        thread.join(30)
        assert raised and isinstance(raised[0], isolate.SandboxLostError), raised
        assert time.monotonic() - t0 <= 5.0, "the loss was named too late"
        assert raised[0].node_id == doomed.node_id
        with pytest.raises(isolate.SandboxLostError):
            sb.read_file("x")
    finally:
        sb.close()


def test_a_route_that_does_not_open_leaves_the_calls_to_the_actor(cluster: Any) -> None:
    home = cluster.head_node.node_id
    with iray.Sandbox(box_policy(), node_id=home) as sb:
        assert sb.exec(["true"]).returncode == 0 and sb.stats["route"] == "direct"
        # The host closes its port (and the connection): the next call finds it closed, cannot open it again,
        # and goes through the actor.
        ray.get(Hosts.get().actor(home).unlisten.remote())
        before = sb.stats
        assert sb.exec(["echo", "via actor"]).stdout == "via actor\n"
        stats = sb.stats
        assert stats["route"] == "actor" and "did not open" in stats["why"], stats
        assert stats["actor_calls"] == before["actor_calls"] + 1 and stats["direct_calls"] == before["direct_calls"]
        # A sandbox started there now is told there is no route, and says why.
        with iray.Sandbox(box_policy(), node_id=home) as later:
            assert later.exec(["true"]).returncode == 0
            assert later.stats["route"] == "actor" and later.stats["why"] == "the host stopped listening"
