"""``isolate-run serve`` moves files with bounded memory: a download or upload of 1 GiB raises the server's
resident memory by a chunk or two, not by the file (before: a 700 MiB file took it from 39 MB to 2.18 GB),
and the files moving at once over the whole server are bounded (503 past that). The server runs as in
tests/test_server.py; its memory is measured on its own process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import test_server as base

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

server = base.server  # the suite's server, started once for this module

GIB = 1 << 30
#: What moving a file may add to the server's resident memory, over its idle.
HEADROOM = 64 << 20


class PeakRss:
    """The peak resident memory of a process, sampled in a thread while the block runs."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def _run(srv: base.Server, prefix: str, headers: dict[str, str], command: str) -> None:
    r = httpx.post(f"http://{srv.domain}{prefix}/command", json={"command": command}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def _upload_body(path: str, size: int, boundary: str = "isolate-test-boundary") -> tuple[Iterator[bytes], str]:
    """A multipart upload of size zero bytes at path, made a chunk at a time (never whole in this process)."""
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"\r\n"
            f"Content-Type: application/json\r\n\r\n{json.dumps({'path': path, 'mode': 644})}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()

    def chunks() -> Iterator[bytes]:
        yield head
        zeros = bytes(1 << 20)
        left = size
        while left:
            yield zeros[:min(left, len(zeros))]
            left -= min(left, len(zeros))
        yield f"\r\n--{boundary}--\r\n".encode()

    return chunks(), f"multipart/form-data; boundary={boundary}"


def test_moving_a_gib_keeps_the_server_small(server: base.Server) -> None:
    box = base._create(server)
    try:
        prefix, headers = base._endpoint(server, box["id"])
        url = f"http://{server.domain}{prefix}"
        _run(server, prefix, headers, f"truncate -s {GIB} /tmp/big && printf small > /tmp/small")
        # Warm the routes' code paths, then the idle figure.
        assert httpx.get(f"{url}/files/download", params={"path": "/tmp/small"}, headers=headers).content == b"small"
        time.sleep(0.2)
        idle = psutil.Process(server.proc.pid).memory_info().rss
        with PeakRss(server.proc.pid) as down:
            got = 0
            with httpx.stream("GET", f"{url}/files/download", params={"path": "/tmp/big"}, headers=headers,
                              timeout=120) as r:
                assert r.status_code == 200, r.read()
                assert int(r.headers["content-length"]) == GIB
                for chunk in r.iter_raw(1 << 20):
                    got += len(chunk)
        assert got == GIB
        assert down.peak - idle < HEADROOM, f"a 1 GiB download raised the server by {(down.peak - idle) >> 20} MiB"

        # A client that goes away mid-download gives its slot back (a sandbox holds 4 at most: a leak shows).
        for _ in range(6):
            with httpx.stream("GET", f"{url}/files/download", params={"path": "/tmp/big"}, headers=headers,
                              timeout=60) as r:
                assert r.status_code == 200, r.read()
                next(r.iter_raw(1 << 20))
        deadline = time.monotonic() + 10
        while True:
            r = httpx.get(f"{url}/files/download", params={"path": "/tmp/small"}, headers=headers)
            if r.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text

        body, kind = _upload_body("/workspace/big", GIB)
        with PeakRss(server.proc.pid) as up:
            r = httpx.post(f"{url}/files/upload", content=body, headers={**headers, "Content-Type": kind},
                           timeout=120)
        assert r.status_code == 200, r.text
        info = httpx.get(f"{url}/files/info", params={"path": "/workspace/big"}, headers=headers).json()
        assert info["/workspace/big"]["size"] == GIB
        assert up.peak - idle < HEADROOM, f"a 1 GiB upload raised the server by {(up.peak - idle) >> 20} MiB"
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_download_lines_and_ranges(server: base.Server) -> None:
    """offset/limit select lines (1-based) and a Range applies to what they select; read a chunk at a time."""
    box = base._create(server)
    try:
        prefix, headers = base._endpoint(server, box["id"])
        url = f"http://{server.domain}{prefix}/files/download"
        _run(server, prefix, headers, "printf 'a\\nbb\\nccc\\ndddd' > /tmp/lines")

        def get(extra: dict[str, str] | None = None, **params: Any) -> Any:
            return httpx.get(url, params={"path": "/tmp/lines", **params}, headers={**headers, **(extra or {})})

        assert get().content == b"a\nbb\nccc\ndddd"
        assert get(offset=2).content == b"bb\nccc\ndddd"
        assert get(offset=2, limit=2).content == b"bb\nccc\n"
        assert get(limit=1).content == b"a\n"
        assert get(offset=4, limit=5).content == b"dddd"
        assert get(offset=9).content == b""
        assert get(offset=2, limit=0).content == b""
        r = get({"Range": "bytes=1-3"}, offset=2)
        assert r.status_code == 206 and r.content == b"b\nc" and r.headers["content-range"] == "bytes 1-3/11"
        r = get({"Range": "bytes=-4"})
        assert r.status_code == 206 and r.content == b"dddd"
        assert get({"Range": "bytes=20-"}).status_code == 416
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_files_moving_at_once_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the server's transfers at once, a download, an upload or a replace is answered 503 at once."""
    from starlette.testclient import TestClient

    import isolate
    from isolate.server import create_app
    from isolate.server.execd import access
    from isolate.server.state import _Slots

    key = base.KEY
    with TestClient(create_app(key, {"ubuntu": isolate.Policy()})) as client:  # type: ignore[arg-type]
        created = client.post("/v1/sandboxes", json={"image": {"uri": "ubuntu"}}, headers={"OPEN-SANDBOX-API-KEY": key})
        assert created.status_code == 202, created.text
        sid = created.json()["id"]
        endpoint = client.get(f"/v1/sandboxes/{sid}/endpoints/44772", headers={"OPEN-SANDBOX-API-KEY": key}).json()
        prefix, headers = "/" + endpoint["endpoint"].split("/", 1)[1], endpoint["headers"]
        files = [("metadata", ("metadata", json.dumps({"path": "/tmp/f", "mode": 644}), "application/json")),
                 ("file", ("f", b"x", "application/octet-stream"))]
        assert client.post(prefix + "/files/upload", files=files, headers=headers).status_code == 200
        monkeypatch.setattr(access, "TRANSFERS", _Slots(0))
        answers = [client.get(prefix + "/files/download", params={"path": "/tmp/f"}, headers=headers),
                   client.post(prefix + "/files/upload", files=files, headers=headers),
                   client.post(prefix + "/files/replace", json={"/tmp/f": {"old": "x", "new": "y"}}, headers=headers)]
        for r in answers:
            assert r.status_code == 503 and r.json()["code"] == "SERVER_BUSY", r.text
        monkeypatch.setattr(access, "TRANSFERS", _Slots(8))
        r = client.get(prefix + "/files/download", params={"path": "/tmp/f"}, headers=headers)
        assert r.status_code == 200 and r.content == b"x"
        # One sandbox holds at most a quarter of the slots: its clients cannot take them all.
        managed = client.app.state.isolate.get(sid)  # type: ignore[attr-defined]
        held = [access.transfer_slot(managed) for _ in range(2)]
        r = client.get(prefix + "/files/download", params={"path": "/tmp/f"}, headers=headers)
        assert r.status_code == 429 and r.json()["code"] == "TOO_MANY_TRANSFERS", r.text
        for release in held:
            release()
        assert access.TRANSFERS._used == 0 and managed.transfers == 0  # every download gave its slot back
        assert client.delete(f"/v1/sandboxes/{sid}", headers={"OPEN-SANDBOX-API-KEY": key}).status_code == 204


def test_kept_command_output_is_bounded_over_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command kept its last 16 MiB and a sandbox its last 256 finished commands: 4 GiB a sandbox. The
    output kept over all commands is bounded; the oldest bytes go, finished commands' first."""
    from isolate.server import state

    monkeypatch.setattr(state, "OUTPUT_TOTAL", 4 << 20)
    monkeypatch.setattr(state, "OUTPUT_BUDGET", state._OutputBudget())
    records = [state.CommandRecord(f"c{i}", "true", False, None, started_at=float(i))  # type: ignore[arg-type]
               for i in range(4)]
    for record in records[:3]:
        record.finished_at = 1.0
    chunk = bytes(512 << 10)
    for record in records:
        for _ in range(4):
            record.add_output("stdout", chunk)
    assert sum(len(r.output) for r in records) <= 4 << 20
    assert len(records[3].output) == 2 << 20  # the running command kept all it wrote
    assert records[0].output == b"" and records[0].output_base == 2 << 20  # the oldest finished one went first
    data, end = records[2].read_from(0)  # a cursor behind what is kept gets what is left
    assert end == 2 << 20 and len(data) == len(records[2].output)


def test_snapshot_archive_moves_in_chunks(server: base.Server) -> None:
    """A snapshot's archive of /tmp went through the server's memory whole, twice (up to 1 GiB): now it goes
    from the sandbox's tar to its file, and back into a new sandbox's tar, a chunk at a time."""
    size = 200 << 20
    box = base._create(server)
    snapshot, child = None, None
    try:
        prefix, headers = base._endpoint(server, box["id"])
        # Data tar keeps as it is (not zeros, which --sparse would leave out).
        _run(server, prefix, headers, f"yes 0123456789abcdef | head -c {size} > /tmp/big")
        idle = psutil.Process(server.proc.pid).memory_info().rss
        with PeakRss(server.proc.pid) as taking:
            status, body = server.call("POST", f"/v1/sandboxes/{box['id']}/snapshots", {})
        assert status == 202, body
        snapshot = body["id"]
        with PeakRss(server.proc.pid) as starting:
            status, body = server.call("POST", "/v1/sandboxes", {"snapshotId": snapshot})
        assert status == 202, body
        child = body["id"]
        prefix, headers = base._endpoint(server, child)
        info = httpx.get(f"http://{server.domain}{prefix}/files/info", params={"path": "/tmp/big"},
                         headers=headers).json()
        assert info["/tmp/big"]["size"] == size
        for what, peak in (("taking", taking.peak), ("starting from", starting.peak)):
            assert peak - idle < HEADROOM, f"{what} a snapshot raised the server by {(peak - idle) >> 20} MiB"
    finally:
        for sid in (box["id"], child):
            if sid is not None:
                server.call("DELETE", f"/v1/sandboxes/{sid}")
        if snapshot is not None:
            server.call("DELETE", f"/v1/snapshots/{snapshot}")


def test_output_waiting_for_slow_clients_is_bounded_over_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each streamed command's output waiting for its client was bounded (8 MiB), not their sum (1024 commands:
    8 GiB). Past the server's total, a bridge with bytes of its own waiting holds its command back."""
    import asyncio

    from isolate.server.execd import commands

    monkeypatch.setattr(commands, "BRIDGE_LIMIT", 1 << 20)
    monkeypatch.setattr(commands, "BRIDGES_TOTAL", 2 << 20, raising=False)
    loop = asyncio.new_event_loop()
    try:
        a, b, c = (commands.Bridge(loop) for _ in range(3))
        big = bytes(3 << 19)
        a.put("stdout", big)
        b.put("stdout", bytes(1 << 20))
        c.put("stdout", bytes(1 << 20))  # one with nothing waiting always passes
        second = threading.Thread(target=c.put, args=("stdout", b"more"))
        second.start()
        second.join(0.3)
        assert second.is_alive(), "a bridge passed the server's total with bytes of its own waiting"
        a.taken(big)  # a client read: room again
        second.join(5)
        assert not second.is_alive()
        for bridge in (a, b, c):
            bridge.close()
        assert commands._waiting == 0
    finally:
        loop.close()
