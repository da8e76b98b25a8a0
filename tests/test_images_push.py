"""Pushing images: to Debian's docker-registry on loopback, pulled back into a second store."""

from __future__ import annotations

import base64
import http.server
import io
import os
import shutil
import stat
import subprocess
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest

from isolate.image import Image, Store

REGISTRY = shutil.which("docker-registry")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REGISTRY is None:
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    tmp = tmp_path_factory.mktemp("registry")
    with kit.loopback_registry(str(tmp), REGISTRY) as address:
        yield address


def tree(root: str) -> dict[str, tuple[str, int, bytes]]:
    """What a layer holds: kind, permission bits and content (a link's target) of each path."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                out[rel] = ("link", 0, os.readlink(path).encode())
            elif stat.S_ISDIR(info.st_mode):
                opaque = os.getxattr(path, "user.overlay.opaque", follow_symlinks=False) \
                    if "user.overlay.opaque" in os.listxattr(path, follow_symlinks=False) else b""
                out[rel] = ("dir", stat.S_IMODE(info.st_mode), opaque)
            elif stat.S_ISCHR(info.st_mode):
                out[rel] = ("whiteout", 0, b"")
            elif stat.S_ISFIFO(info.st_mode):
                out[rel] = ("fifo", stat.S_IMODE(info.st_mode), b"")
            else:
                out[rel] = ("file", stat.S_IMODE(info.st_mode), Path(path).read_bytes())
    return out


def _image(tmp: Path) -> Image:
    top = kit.layer([{"name": "etc", "type": "dir"}, {"name": "etc/.wh..wh..opq"},
                     {"name": "etc/only", "data": b"top\n"}, {"name": "bin/.wh.ls"},
                     {"name": "data", "type": "dir", "mode": 0o777},
                     {"name": "data/pipe", "type": "fifo", "mode": 0o640},
                     {"name": "data/a", "data": b"same\n", "mode": 0o600},
                     {"name": "data/b", "type": "hard", "target": "data/a"},
                     {"name": "data/to-a", "type": "link", "target": "a"}])
    kit.oci_layout(str(tmp / "layout"), [kit.busybox_layer(), top], ref="pushme:1", Env=["PATH=/bin"],
                   Cmd=["sh"])
    return Image.load(tmp / "layout", store=Store(tmp / "one"))


def test_a_pushed_image_pulled_back_into_another_store_is_the_same(registry: str, tmp_path: Path) -> None:
    image = _image(tmp_path)
    out = io.StringIO()
    digest = image.push(f"{registry}/tests/pushed:1", progress=out)
    assert "3 blobs sent, 0 already there" in out.getvalue(), out.getvalue()
    back = Image.pull(f"{registry}/tests/pushed:1", store=Store(tmp_path / "two"))
    assert back.digest == digest and len(back.layers) == 2
    assert back.config == image.config
    for mine, theirs in zip(image.lower_dirs(), back.lower_dirs(), strict=True):
        assert tree(mine) == tree(theirs)
    ino = {os.stat(os.path.join(back.lower_dirs()[0], "data", n)).st_ino for n in ("a", "b")}
    assert len(ino) == 1  # the hard link stays one
    # A second push sends the manifest only; so does a push of the image pulled back (same blobs).
    again = io.StringIO()
    assert image.push(f"{registry}/tests/pushed:2", progress=again) == digest
    assert "0 blobs sent, 3 already there" in again.getvalue(), again.getvalue()
    assert back.push(f"{registry}/tests/pushed:3") == digest


def test_the_cli_pushes(registry: str, tmp_path: Path) -> None:
    from conftest import ISOLATE_RUN

    image = _image(tmp_path)
    ref = f"{registry}/tests/cli:1"
    pushed = subprocess.run([ISOLATE_RUN, "image", "push", "--image-store", str(tmp_path / "one"), image.reference,
                             "--to", ref], capture_output=True, text=True, timeout=60)
    assert pushed.returncode == 0 and "blobs sent" in pushed.stderr, pushed.stderr
    assert pushed.stdout.strip().startswith(f"pushed {ref}@sha256:")
    missing = subprocess.run([ISOLATE_RUN, "image", "push", "--image-store", str(tmp_path / "one"), "no/such:1"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 125 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    back = Image.pull(ref, store=Store(tmp_path / "two"))
    assert tree(back.lower_dirs()[1]) == tree(image.lower_dirs()[1])



class _PushStandIn(http.server.BaseHTTPRequestHandler):
    """A registry that takes pushes with Basic auth, and sends uploads to another host (its storage)."""

    blobs: dict[str, bytes]
    manifests: dict[str, bytes]
    seen: list[tuple[str, str, str, str | None]]  # (method, host header, path, Authorization)
    port: int
    want = "Basic " + base64.b64encode(b"alice:s3cret").decode()

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _allowed(self, method: str) -> bool:
        auth = self.headers.get("Authorization")
        self.seen.append((method, self.headers.get("Host", ""), self.path, auth))
        if self.path.startswith("/storage/"):
            return True  # the storage host takes what the registry sent there, with no credentials
        if auth != self.want:
            self._send(401, {"WWW-Authenticate": 'Basic realm="standin"'})
            return False
        return True

    def do_HEAD(self) -> None:
        if self._allowed("HEAD"):
            self._send(200 if self.path.rsplit("/", 1)[1] in self.blobs else 404)

    def do_POST(self) -> None:
        if self._allowed("POST"):
            self._send(202, {"Location": f"http://localhost:{self.port}/storage/{uuid.uuid4().hex}"})

    def do_PUT(self) -> None:
        if not self._allowed("PUT"):
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        url = urllib.parse.urlsplit(self.path)
        if url.path.startswith("/storage/"):
            digest = urllib.parse.parse_qs(url.query)["digest"][0]
            assert kit.digest(body) == digest
            self.blobs[digest] = body
        else:
            self.manifests[url.path.rsplit("/", 1)[1]] = body
        self._send(201)


def test_a_push_authenticates_and_never_sends_credentials_to_another_host(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    handler = type("Handler", (_PushStandIn,), {"blobs": {}, "manifests": {}, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        kit.docker_login(tmp_path, f"127.0.0.1:{handler.port}", "alice", "s3cret", monkeypatch)
        image = _image(tmp_path)
        digest = image.push(f"127.0.0.1:{handler.port}/team/app:1")
    finally:
        server.shutdown()
        server.server_close()
    assert kit.digest(handler.manifests["1"]) == digest and len(handler.blobs) == 3
    storage = [s for s in handler.seen if s[2].startswith("/storage/")]
    assert storage and all(auth is None and host.startswith("localhost:") for _, host, _, auth in storage)
    assert any(auth == handler.want for method, _, _, auth in handler.seen if method == "PUT")


class _SlowReader(_PushStandIn):
    """A registry that takes an upload's body at 64 KiB/s (a slow link, or one that holds pushes on purpose)."""

    def _allowed(self, method: str) -> bool:
        return True

    def do_PUT(self) -> None:
        left = int(self.headers.get("Content-Length", "0"))
        try:
            while left > 0:
                got = self.rfile.read(min(left, 8 << 10))
                if not got:
                    return
                left -= len(got)
                threading.Event().wait(0.125)
        except OSError:
            return
        self._send(201)


def test_a_push_to_a_registry_that_reads_slowly_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pull is paced (at least MIN_PACE bytes in each TIMEOUT seconds) but a push was not: each sendall of
    # the upload was bounded by the socket's timeout, the body as a whole by nothing, and a registry reading a
    # few KiB a second held a push of a large layer for hours. Now the upload has the pull's pace.
    import time

    from isolate.image import registry
    from isolate.image.registry import RegistryError

    monkeypatch.setattr(registry, "TIMEOUT", 4.0)
    monkeypatch.setattr(registry, "MIN_PACE", 2 << 20)  # 2 MiB in 4 s, well above the stand-in's 64 KiB/s
    handler = type("Handler", (_SlowReader,), {"blobs": {}, "manifests": {}, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    handler.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # 24 MiB that gzip cannot shrink: far more than the socket buffers on both sides take in at once.
    big = kit.layer([{"name": "big", "data": os.urandom(24 << 20)}])
    kit.oci_layout(str(tmp_path / "layout"), [big], ref="slow:1")
    image = Image.load(tmp_path / "layout", store=Store(tmp_path / "store"))
    outcome: list[BaseException | None] = []

    def push() -> None:
        try:
            image.push(f"127.0.0.1:{handler.port}/team/slow:1")
            outcome.append(None)
        except BaseException as exc:  # what the push ended with, checked below
            outcome.append(exc)

    try:
        started = time.monotonic()
        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        pusher.join(120)
        assert not pusher.is_alive(), f"the push still runs after {time.monotonic() - started:.0f} s"
    finally:
        server.shutdown()
        server.server_close()
    assert len(outcome) == 1 and isinstance(outcome[0], RegistryError), repr(outcome)
    # The pace, or (a stand-in starved on a loaded machine) one block's send bounded by TIMEOUT: one line either way.
    said = str(outcome[0])
    assert ("less than" in said or "timed out" in said) and len(said.splitlines()) == 1, said
