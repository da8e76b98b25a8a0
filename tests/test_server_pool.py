"""``isolate-run serve`` under the SDK's client-side pool (``opensandbox.pool``, SDK 1.1.1).

The pool drives the lifecycle API only (create with metadata, list, get, delete, renew): it warms idle
sandboxes, hands them out, and its state lives in a store, in memory or in Redis (shared by several
pools: another process takes a sandbox this one warmed). The Redis test starts its own
``redis-server`` (Debian's) on a free port of 127.0.0.1, and is skipped, saying so, without it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import test_server as base

pytest.importorskip("opensandbox.pool", reason="the SDK has no pool before 1.1.1: pip install 'isolate[server-test]'")

from opensandbox import SandboxManagerSync, SandboxSync
from opensandbox.config import ConnectionConfigSync
from opensandbox.exceptions import PoolEmptyException
from opensandbox.models.sandboxes import SandboxFilter
from opensandbox.pool import AcquirePolicy, InMemoryPoolStateStore, PoolCreationSpec, PoolState, SandboxPoolSync

KEY = base.KEY


server = base.server  # the suite's server, started once for this module


def config(server: base.Server) -> ConnectionConfigSync:
    return ConnectionConfigSync(domain=server.domain, api_key=KEY)


def eventually(what: str, check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def pool(server: base.Server, name: str, store: object, max_idle: int = 1) -> SandboxPoolSync:
    return SandboxPoolSync(pool_name=name, owner_id=f"owner-{uuid.uuid4().hex[:8]}", max_idle=max_idle,
                           state_store=store, connection_config=config(server), warmup_concurrency=1,
                           primary_lock_ttl=timedelta(seconds=4), drain_timeout=timedelta(milliseconds=300),
                           creation_spec=PoolCreationSpec(image="ubuntu", entrypoint=["tail", "-f", "/dev/null"],
                                                          metadata={"pool": name}))


def tagged(server: base.Server, name: str) -> list[str]:
    manager = SandboxManagerSync.create(config(server))
    try:
        return [info.id for info in manager.list_sandbox_infos(SandboxFilter(metadata={"pool": name})).sandbox_infos]
    finally:
        manager.close()


def test_sdk_pool_with_the_in_memory_store(server: base.Server) -> None:
    name = f"mem-{uuid.uuid4().hex[:8]}"
    p = pool(server, name, InMemoryPoolStateStore(), max_idle=2)
    p.start()
    try:
        eventually("the pool warms two", lambda: p.snapshot().state == PoolState.HEALTHY
                   and p.snapshot().idle_count >= 2)
        warm = {e.sandbox_id for e in p.snapshot_idle_entries()}
        box = p.acquire(timedelta(minutes=5), AcquirePolicy.FAIL_FAST)
        try:
            assert box.id in warm
            run = box.commands.run("echo pooled")
            assert run.error is None and run.logs.stdout[0].text == "pooled"
        finally:
            box.kill()
        p.resize(0)
        p.release_all_idle()
        eventually("idle drains after resize(0)", lambda: p.snapshot().idle_count == 0)
        with pytest.raises(PoolEmptyException):
            p.acquire(timedelta(minutes=5), AcquirePolicy.FAIL_FAST)
        direct = p.acquire(timedelta(minutes=5), AcquirePolicy.DIRECT_CREATE)
        try:
            assert direct.commands.run("echo direct").logs.stdout[0].text == "direct"
        finally:
            direct.kill()
    finally:
        p.shutdown(graceful=False)
    eventually("no sandbox of the pool is left", lambda: tagged(server, name) == [])


@pytest.fixture
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="isolate-redis-") as home:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", home, "--save", "",
                                 "--appendonly", "no", "--protected-mode", "yes"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


def test_sdk_pool_with_the_redis_store_across_two_pools(server: base.Server, redis_url: str) -> None:
    redis = pytest.importorskip("redis", reason="the redis client is not installed: pip install 'isolate[server-test]'")
    from opensandbox.pool_redis import RedisPoolStateStore

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    name = f"redis-{uuid.uuid4().hex[:8]}"
    a = pool(server, name, RedisPoolStateStore(client, "isolate-test"))
    b = pool(server, name, RedisPoolStateStore(client, "isolate-test"))
    a.start()
    b.start()
    try:
        eventually("the shared pool warms", lambda: a.snapshot().idle_count >= 1)
        # Whichever pool warmed it, the other takes it: the idle list is Redis's.
        box = b.acquire(timedelta(minutes=5), AcquirePolicy.FAIL_FAST)
        try:
            assert box.commands.run("echo shared").logs.stdout[0].text == "shared"
        finally:
            box.kill()
        a.resize(0)
        eventually("b sees the shared size", lambda: b.snapshot().max_idle == 0)
        a.release_all_idle()
        eventually("idle drains", lambda: a.snapshot().idle_count == 0 and b.snapshot().idle_count == 0)
    finally:
        a.shutdown(graceful=False)
        b.shutdown(graceful=False)
        client.close()
    eventually("no sandbox of the pool is left", lambda: tagged(server, name) == [])


def test_server_warm_pool_serves_the_sdks_default_create() -> None:
    """--warm 2: a create of the SDK's default shape takes a fresh warm sandbox; any other shape starts its own."""
    srv = base.Server("--warm", "2", *(() if base.limits_enforceable() else ("--best-effort",)))
    try:
        boxes = [SandboxSync.create("ubuntu", connection_config=config(srv)) for _ in range(3)]
        other = SandboxSync.create("ubuntu", connection_config=config(srv), env={"SHAPE": "other"})
        try:
            events = [json.dumps(srv.call("GET", f"/v1/sandboxes/{b.id}/diagnostics/events?scope=lifecycle")[1])
                      for b in [*boxes, other]]
            warm = ["warm pool" in text for text in events]
            # Two were warm at start; the third is warm too if the refill was quicker than the SDK, else direct.
            assert warm[:2] == [True, True] and warm[3] is False, events
            boxes[0].files.write_file("/tmp/mine.txt", "first\n")
            assert boxes[1].commands.run("cat /tmp/mine.txt").error is not None  # never the same sandbox
            assert other.commands.run("echo $SHAPE").logs.stdout[0].text == "other"
        finally:
            for box in [*boxes, other]:
                box.kill()
    finally:
        srv.stop()
