"""Pulling images: Debian's docker-registry on loopback (pushed to with skopeo), and a small stand-in registry
written here for what the real one is not easily made to do (bearer tokens, a redirect to another host, a
blob that lies about its digest)."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import http.server
import io
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import termios
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest

from isolate.image import BadImageError, Image, Store
from isolate.image.archive import host_platform
from isolate.image.registry import Client, RegistryError, credentials

REGISTRY = shutil.which("docker-registry")
SKOPEO = shutil.which("skopeo")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docker-registry on 127.0.0.1, with a busybox scratch image and a two-platform index pushed to it."""
    if REGISTRY is None or SKOPEO is None:
        pytest.skip("docker-registry and skopeo are not installed (apt-get install docker-registry skopeo)")
    tmp = tmp_path_factory.mktemp("registry")
    with kit.loopback_registry(str(tmp), REGISTRY) as address:
        kit.oci_layout(str(tmp / "busybox"), [kit.busybox_layer()], ref="1", Env=["PATH=/bin"])
        _multi_platform(tmp / "multi")
        kit.push(SKOPEO, f"{tmp / 'busybox'}:1", f"{address}/tests/busybox:1", str(tmp))
        kit.push(SKOPEO, f"{tmp / 'multi'}:1", f"{address}/tests/multi:1", str(tmp), ["--all"])
        yield address


def _multi_platform(path: Path) -> None:
    """An OCI layout whose index names a manifest for this host and one for another architecture."""
    kit.oci_layout(str(path), [kit.layer([{"name": "platform", "data": b"host\n"}])], ref=None)
    index = json.loads((path / "index.json").read_text())
    host_entry = index["manifests"][0]
    os_, arch = host_platform()
    host_entry["platform"] = {"os": os_, "architecture": arch}
    other_layer = kit.layer([{"name": "platform", "data": b"other\n"}])
    other_config = json.dumps({"architecture": "s390x", "os": "linux", "config": {},
                               "rootfs": {"type": "layers", "diff_ids": [kit.digest(other_layer)]}}).encode()
    gz = kit.gz(other_layer)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": kit.digest(other_config), "size": len(other_config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                       "digest": kit.digest(gz), "size": len(gz)}]}).encode()
    for blob in (other_config, gz, manifest):
        (path / "blobs/sha256" / kit.digest(blob)[7:]).write_bytes(blob)
    nested = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                         "manifests": [{**host_entry}, {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                        "digest": kit.digest(manifest), "size": len(manifest),
                                                        "platform": {"os": "linux", "architecture": "s390x"}}]}
                        ).encode()
    (path / "blobs/sha256" / kit.digest(nested)[7:]).write_bytes(nested)
    index["manifests"] = [{"mediaType": "application/vnd.oci.image.index.v1+json", "digest": kit.digest(nested),
                           "size": len(nested), "annotations": {"org.opencontainers.image.ref.name": "1"}}]
    (path / "index.json").write_text(json.dumps(index))


def test_a_pulled_image_runs_natively(registry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import NAMESPACES_WHY

    import isolate

    monkeypatch.setenv("ISOLATE_IMAGE_STORE", str(tmp_path / "store"))
    image = Image.pull(f"{registry}/tests/busybox:1")
    assert image.reference == f"{registry}/tests/busybox:1" and len(image.layers) == 1
    if NAMESPACES_WHY:
        pytest.skip(NAMESPACES_WHY)
    result = isolate.run(["cat", "/etc/os-release"], policy=isolate.Policy(image=image.reference, backend="native"),
                         capture_output=True, text=True)
    assert result.stdout == "NAME=busybox-scratch\n", result.stderr


def test_an_index_gives_the_hosts_platform(registry: str, tmp_path: Path) -> None:
    image = Image.pull(f"{registry}/tests/multi:1", store=Store(tmp_path / "store"))
    assert open(os.path.join(image.lower_dirs()[0], "platform")).read() == "host\n"


def test_concurrent_pulls_of_one_image_fetch_each_layer_once(registry: str, tmp_path: Path) -> None:
    lines: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        out = io.StringIO()
        try:
            Image.pull(f"{registry}/tests/busybox:1", store=Store(tmp_path / "store"), progress=out)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        lines.append(out.getvalue())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    fetched = sorted(float(line.split(" MB fetched")[0].rsplit(" ", 1)[1]) for line in lines)
    assert fetched[:3] == [0.0, 0.0, 0.0] and fetched[3] > 0.5, lines
    assert len(os.listdir(tmp_path / "store" / "layers")) == 1


def test_the_cli_pulls_lists_and_runs(registry: str, tmp_path: Path) -> None:
    from conftest import ISOLATE_RUN, NAMESPACES_WHY

    store = str(tmp_path / "store")
    ref = f"{registry}/tests/busybox:1"
    pulled = subprocess.run([ISOLATE_RUN, "image", "--image-store", store, "pull", ref], capture_output=True,
                            text=True, timeout=60)
    assert pulled.returncode == 0 and "MB fetched" in pulled.stderr, pulled.stderr
    listed = subprocess.run([ISOLATE_RUN, "image", "ls", "--image-store", store], capture_output=True, text=True)
    assert ref in listed.stdout
    if not NAMESPACES_WHY:
        ran = subprocess.run([ISOLATE_RUN, "--image-store", store, "--image", ref, "--", "cat", "/etc/os-release"],
                             capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        assert ran.stdout == "NAME=busybox-scratch\n", ran.stderr
    removed = subprocess.run([ISOLATE_RUN, "image", "--image-store", store, "rm", ref], capture_output=True,
                             text=True)
    assert removed.returncode == 0
    pruned = subprocess.run([ISOLATE_RUN, "image", "--image-store", store, "prune"], capture_output=True, text=True)
    assert pruned.stdout.startswith("removed 1 unused layer")


# -- the stand-in registry: tokens, redirects, lies ----------------------------------------------------


class _StandIn(http.server.BaseHTTPRequestHandler):
    layout: Path
    token_auth: str  # the Basic header the token service wants
    blob_host: str  # where blobs redirect to ("" : served here)
    seen: list[tuple[str, str, str | None]]  # (host header, path, Authorization)
    lie: bool = False
    basic: bool = False  # Basic auth on every request, instead of tokens
    storage_challenge: bool = False  # the redirected-to storage asks for a token, at a realm of its own

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        auth = self.headers.get("Authorization")
        self.seen.append((self.headers.get("Host", ""), self.path, auth))
        if self.path.startswith("/token"):
            if auth != self.token_auth:
                return self._send(401, b"{}")
            return self._send(200, json.dumps({"token": "T0KEN"}).encode())
        if self.path.startswith("/storage/"):
            if self.storage_challenge and auth is None:
                return self._send(401, b"{}", {"WWW-Authenticate": f'Bearer realm="http://{self.blob_host}/grab"'})
            return self._send(200, self._blob(self.path.rsplit("/", 1)[1]))
        if self.path.startswith("/grab"):
            return self._send(200, json.dumps({"token": "T0KEN"}).encode())
        if self.basic and auth != self.token_auth:
            return self._send(401, b"{}", {"WWW-Authenticate": 'Basic realm="standin"'})
        if not self.basic and auth != "Bearer T0KEN":
            port = self.server.server_address[1]
            return self._send(401, b"{}", {"WWW-Authenticate": f'Bearer realm="http://127.0.0.1:{port}/token",'
                                                                 'service="standin"'})
        if self.path == "/v2/":
            return self._send(200, b"{}")
        _, kind, ref = self.path.rsplit("/", 2)
        if kind == "manifests":
            index = json.loads((self.layout / "index.json").read_text())
            digest = index["manifests"][0]["digest"] if not ref.startswith("sha256:") else ref
            return self._send(200, self._blob(digest[7:]),
                              {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        if self.blob_host:
            return self._send(307, b"", {"Location": f"http://{self.blob_host}/storage/{ref[7:]}"})
        return self._send(200, self._blob(ref[7:]))

    def _blob(self, hex_: str) -> bytes:
        data = (self.layout / "blobs/sha256" / hex_).read_bytes()
        if self.lie and not data.startswith(b"{"):
            data = kit.gz(kit.layer([{"name": "evil", "data": b"x"}]))
        return data

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_StandIn]]:
    layout = tmp_path / "layout"
    kit.oci_layout(str(layout), [kit.layer([{"name": "hello", "data": b"hi\n"}])], ref="1")
    handler = type("Handler", (_StandIn,), {"layout": layout, "seen": [], "blob_host": "",
                                            "token_auth": "Basic " + base64.b64encode(b"alice:s3cret").decode()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.port = server.server_address[1]  # type: ignore[attr-defined]
    kit.docker_login(tmp_path, f"127.0.0.1:{handler.port}", "alice", "s3cret", monkeypatch)
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def test_bearer_tokens_are_asked_with_the_docker_config_credentials(standin: Any, tmp_path: Path) -> None:
    assert credentials(f"127.0.0.1:{standin.port}") == ("alice", "s3cret")
    image = Image.pull(f"127.0.0.1:{standin.port}/team/app:1", store=Store(tmp_path / "store"))
    assert open(os.path.join(image.lower_dirs()[0], "hello")).read() == "hi\n"
    token_requests = [s for s in standin.seen if s[1].startswith("/token")]
    assert token_requests and "scope=repository%3Ateam%2Fapp%3Apull" in token_requests[-1][1]


def test_basic_auth_sends_the_docker_config_credentials(standin: Any, tmp_path: Path) -> None:
    standin.basic = True
    image = Image.pull(f"127.0.0.1:{standin.port}/team/app:1", store=Store(tmp_path / "store"))
    assert open(os.path.join(image.lower_dirs()[0], "hello")).read() == "hi\n"
    assert not any(path.startswith("/token") for _, path, _ in standin.seen)


def test_a_redirect_to_another_host_never_carries_the_credentials(standin: Any, tmp_path: Path) -> None:
    # "localhost" is another host than "127.0.0.1" to HTTP: the blob's redirect goes there.
    standin.blob_host = f"localhost:{standin.port}"
    Image.pull(f"127.0.0.1:{standin.port}/team/app:1", store=Store(tmp_path / "store"))
    storage = [s for s in standin.seen if s[1].startswith("/storage/")]
    assert storage and all(auth is None for _, _, auth in storage)
    assert any(auth == "Bearer T0KEN" for _, path, auth in standin.seen if path.startswith("/v2/team"))


def test_a_host_the_registry_redirects_to_never_gets_the_credentials_by_a_challenge(standin: Any,
                                                                                     tmp_path: Path) -> None:
    # The host a blob redirects to answered 401 with a Bearer realm of its own: the registry's user and
    # password were sent there (Basic), to ask it for a token.
    standin.blob_host = f"localhost:{standin.port}"
    standin.storage_challenge = True
    with pytest.raises(RegistryError, match="never sent to another host"):
        Image.pull(f"127.0.0.1:{standin.port}/team/app:1", store=Store(tmp_path / "store"))
    assert not [s for s in standin.seen if s[1].startswith("/grab")], standin.seen


def test_a_blob_that_lies_about_its_digest_keeps_nothing(standin: Any, tmp_path: Path) -> None:
    standin.lie = True
    store = Store(tmp_path / "store")
    with pytest.raises(BadImageError, match="does not match its digest"):
        Image.pull(f"127.0.0.1:{standin.port}/team/app:1", store=store)
    assert os.listdir(os.path.join(store.path, "layers")) == [] and Image.list(store) == []


def test_plain_http_is_refused_beyond_loopback_unless_named_insecure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ISOLATE_INSECURE_REGISTRIES", raising=False)
    client = Client("registry.example")
    with pytest.raises(RegistryError, match=r"plain HTTP to registry\.example refused"):
        client._send("http://registry.example/v2/", {})  # refused before any connection is made
    assert Client("registry.example", insecure=True).plain_allowed
    monkeypatch.setenv("ISOLATE_INSECURE_REGISTRIES", "registry.example")
    assert Client("registry.example").plain_allowed
    assert Client("127.0.0.1:5000").plain_allowed and Client("localhost:5000").plain_allowed


def test_a_manifest_past_the_bound_is_refused(standin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.image import registry as registry_mod

    monkeypatch.setattr(registry_mod, "MAX_METADATA_SIZE", 64)
    with pytest.raises(BadImageError, match="past 64"):
        Image.pull(f"127.0.0.1:{standin.port}/team/app:1", store=Store(tmp_path / "store"))


# -- progress ----------------------------------------------------------------------------------------------------


def test_off_a_terminal_a_pull_writes_one_line_of_figures(registry: str, tmp_path: Path) -> None:
    from conftest import ISOLATE_RUN

    ref = f"{registry}/tests/busybox:1"
    pulled = subprocess.run([ISOLATE_RUN, "image", "--image-store", str(tmp_path / "store"), "pull", ref],
                            capture_output=True, text=True, timeout=60, env=dict(os.environ, TERM="xterm"))
    assert pulled.returncode == 0, pulled.stderr
    assert re.fullmatch(rf"pull {re.escape(ref)}: 1 layer, (\d+\.\d) MB fetched in \d+\.\d\d s \(\d+\.\d MB/s\)\n",
                        pulled.stderr), pulled.stderr


def test_on_a_terminal_a_pull_draws_a_bar_in_place(registry: str, tmp_path: Path) -> None:
    from conftest import ISOLATE_RUN

    ref = f"{registry}/tests/busybox:1"
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(main, "rb", buffering=0) as terminal:
        with subprocess.Popen([ISOLATE_RUN, "image", "--image-store", str(tmp_path / "store"), "pull", ref],
                              stdout=subprocess.PIPE, stderr=secondary, env=dict(os.environ, TERM="xterm")) as child:
            os.close(secondary)
            shown = b""
            while True:
                try:
                    chunk = terminal.read(65536)
                except OSError:  # EIO: the child's end of the terminal is closed
                    break
                if not chunk:
                    break
                shown += chunk
            assert child.wait(60) == 0, shown
    frames = shown.decode().split("\r\x1b[K")
    assert frames[0] == "" and len(frames) >= 4, frames  # the first bar, the last, the figures in its place
    bars, figures = frames[1:-1], frames[-1]
    assert bars[0].startswith(f"{ref} [") and "  0%" in bars[0] and "0/1 layers" in bars[0], bars
    assert "100%" in bars[-1] and "1/1 layers" in bars[-1] and "[" + "#" * 10 in bars[-1], bars
    assert all(len(bar) <= 99 and "\n" not in bar and "\r" not in bar for bar in bars), bars
    assert re.fullmatch(rf"pull {re.escape(ref)}: 1 layer, \d+\.\d MB fetched in .* MB/s\)\r\n", figures), figures


def test_the_bar_fits_any_terminal_width() -> None:
    from isolate.image.progress import PullProgress

    shown = PullProgress(io.StringIO(), "127.0.0.1:5000/a/long/name/of/an/image:1", total=3_000_000, layers=3,
                         fetched=lambda: 1_000_000, done=lambda: 1)
    for width in (1, 20, 50, 79, 200):
        assert len(shown.bar(width)) <= width
    assert " 33%  1.0/3.0 MB  1/3 layers" in shown.bar(200) and shown.bar(200).startswith("127.0.0.1:5000/a/long")
    assert "[" + "#" * 13 + "." * 27 + "]" in shown.bar(200)
    assert not shown.terminal  # a StringIO: the figures line only


@contextlib.contextmanager
def _slow_registry(way: str) -> Iterator[str]:
    """A loopback registry that answers /v2/ and then, for anything else, ``way``: "body" (a 200 whose body comes
    a byte a second), "head" (a header line a second, for ever), "stall" (a 200 and one byte, then nothing)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def one(conn: socket.socket) -> None:
        with conn:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = conn.recv(4096)
                    if not data:
                        return
                    request += data
                if request.startswith(b"GET /v2/ "):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + (b"" if way == "head" else b"\r\n" + b"{" * (way == "stall")))
                while not stop.wait(1.0):
                    if way != "stall":
                        conn.sendall(b"X-Slow: y\r\n" if way == "head" else b" ")
            except OSError:
                return

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()


@pytest.mark.parametrize("way", ["body", "head", "stall"])
def test_a_registry_that_answers_a_byte_now_and_then_is_given_up(way: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Each read waits TIMEOUT at most, but a registry that sent a byte now and then held a pull for ever (a manifest,
    # a token, a layer; a header line at a time), and one that stopped raised a raw TimeoutError. Now: a pace, a
    # deadline for the answer's head, and a RegistryError.
    import time

    from isolate.image import registry

    monkeypatch.setattr(registry, "TIMEOUT", 2.0)
    monkeypatch.setattr(registry, "HEADERS_DEADLINE", 4.0, raising=False)
    outcome: list[BaseException | None] = []
    with _slow_registry(way) as address:
        def pull() -> None:
            try:
                Image.pull(f"{address}/slow:1", store=Store(tmp_path / "store"))
                outcome.append(None)
            except BaseException as exc:  # what the pull ended with, checked below
                outcome.append(exc)

        started = time.monotonic()
        puller = threading.Thread(target=pull, daemon=True)
        puller.start()
        puller.join(60)
        assert not puller.is_alive(), f"the pull still runs after {time.monotonic() - started:.0f} s"
    assert len(outcome) == 1 and isinstance(outcome[0], RegistryError), repr(outcome)
