"""Pulling from registries that want trust: Debian's docker-registry on loopback over TLS (a CA the test makes),
and with bearer tokens from a token service written here (the registry is the real one: it verifies the
tokens' signatures, issuer, audience, expiry and scopes)."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest

from isolate.image import Image, Store
from isolate.image import registry as registry_mod
from isolate.image.registry import RegistryError

REGISTRY = shutil.which("docker-registry")
SKOPEO = shutil.which("skopeo")


def _tools() -> None:
    if REGISTRY is None or SKOPEO is None or shutil.which("openssl") is None:
        pytest.skip("docker-registry, skopeo and openssl are not installed (apt-get install docker-registry skopeo "
                    "openssl)")


@pytest.fixture(autouse=True)
def _nothing_of_the_callers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No CA, certs.d or auth file of this machine's user takes part."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "DOCKER_CONFIG"):
        monkeypatch.delenv(name, raising=False)


# -- TLS ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """docker-registry on 127.0.0.1 over HTTPS (a certificate of a CA made here), with the busybox image."""
    _tools()
    assert REGISTRY is not None and SKOPEO is not None
    tmp = tmp_path_factory.mktemp("tls")
    files = kit.tls_files(str(tmp))
    with kit.loopback_registry(str(tmp), REGISTRY, tls=files) as address:
        kit.oci_layout(str(tmp / "busybox"), [kit.busybox_layer()], ref="1")
        kit.push(SKOPEO, f"{tmp / 'busybox'}:1", f"{address}/tests/busybox:1", str(tmp))
        yield address, files


def _ca_in(directory: Path, ca: str) -> Path:
    directory.mkdir(parents=True)
    shutil.copy(ca, directory / "ca.crt")
    return directory


def test_a_registry_whose_ca_is_not_trusted_is_refused_in_one_line(tls_registry: tuple[str, dict[str, str]],
                                                                   tmp_path: Path) -> None:
    address, _ = tls_registry
    store = Store(tmp_path / "store")
    # A loopback registry may be plain HTTP: one that speaks TLS is never tried over it instead.
    with pytest.raises(RegistryError) as caught:
        Image.pull(f"{address}/tests/busybox:1", store=store)
    message = str(caught.value)
    assert f"the TLS certificate of {address} is not trusted (unable to get local issuer certificate)" in message
    assert f"containers/certs.d/{address}/ca.crt" in message and "\n" not in message
    assert Image.list(store) == [] and os.listdir(os.path.join(store.path, "layers")) == []


def test_the_cli_says_what_is_wrong_and_takes_a_cert_dir(tls_registry: tuple[str, dict[str, str]],
                                                         tmp_path: Path) -> None:
    from conftest import ISOLATE_RUN

    address, files = tls_registry
    command = [ISOLATE_RUN, "image", "--image-store", str(tmp_path / "store"), "pull", f"{address}/tests/busybox:1"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 125 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "is not trusted (unable to get local issuer certificate)" in refused.stderr
    certs = _ca_in(tmp_path / "certs", files["ca"])
    pulled = subprocess.run([*command, "--cert-dir", str(certs)], capture_output=True, text=True, timeout=60)
    assert pulled.returncode == 0 and pulled.stdout.startswith(f"pulled {address}/tests/busybox:1"), pulled.stderr


def test_the_users_certs_d_gives_the_ca_as_podman_reads_it(tls_registry: tuple[str, dict[str, str]],
                                                           tmp_path: Path) -> None:
    address, files = tls_registry
    _ca_in(tmp_path / "home/.config/containers/certs.d" / address, files["ca"])
    image = Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
    assert os.path.exists(os.path.join(image.lower_dirs()[0], "bin/busybox"))


def test_the_system_certs_d_directories_give_it_as_docker_and_podman_read_them(
        tls_registry: tuple[str, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # /etc/containers/certs.d and /etc/docker/certs.d are the host's: the test names two of its own in their place.
    address, files = tls_registry
    containers, docker = tmp_path / "etc-containers", tmp_path / "etc-docker"
    monkeypatch.setattr(registry_mod, "SYSTEM_CERT_DIRS", (str(containers), str(docker)))
    assert registry_mod.cert_dirs(address) == [str(tmp_path / "home/.config/containers/certs.d" / address),
                                               str(containers / address), str(docker / address)]
    _ca_in(docker / address, files["ca"])
    Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
    # The first directory that exists is the one read (as containers/image does): an empty one there wins, and
    # the refusal names it.
    (containers / address).mkdir(parents=True)
    with pytest.raises(RegistryError, match=f"neither the CAs of {containers / address} nor the system's"):
        Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store2"))


def test_a_certificate_for_another_name_is_refused_even_with_its_ca(tls_registry: tuple[str, dict[str, str]],
                                                                    tmp_path: Path) -> None:
    address, files = tls_registry
    other = address.replace("127.0.0.1", "localhost")  # the certificate names 127.0.0.1 only
    certs = _ca_in(tmp_path / "certs", files["ca"])
    with pytest.raises(RegistryError, match=f"the TLS certificate of {other} is not trusted \\(Hostname mismatch"):
        Image.pull(f"{other}/tests/busybox:1", store=Store(tmp_path / "store"), cert_dir=str(certs))


@pytest.fixture(scope="module")
def mtls_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str], Path]]:
    """docker-registry over HTTPS that asks for a client certificate of its CA; and a certs.d directory with
    one (and the CA)."""
    _tools()
    assert REGISTRY is not None and SKOPEO is not None
    tmp = tmp_path_factory.mktemp("mtls")
    files = kit.tls_files(str(tmp))
    kit.client_certificate(files, str(tmp / "certs"))
    with kit.loopback_registry(str(tmp), REGISTRY, tls={**files, "clients": "yes"}) as address:
        kit.oci_layout(str(tmp / "busybox"), [kit.busybox_layer()], ref="1")
        kit.push(SKOPEO, f"{tmp / 'busybox'}:1", f"{address}/tests/busybox:1", str(tmp),
                 ["--dest-cert-dir", str(tmp / "certs")])
        yield address, files, tmp / "certs"


def test_a_client_certificate_of_the_certs_d_directory_is_presented(
        mtls_registry: tuple[str, dict[str, str], Path], tmp_path: Path) -> None:
    address, files, certs = mtls_registry
    only_ca = _ca_in(tmp_path / "home/.config/containers/certs.d" / address, files["ca"])
    with pytest.raises(RegistryError, match=f"registry {re.escape(address)}: https://{re.escape(address)}: TLS: "
                                            ".*CERTIFICATE.*: it refused this client's certificate, or wants one"):
        Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
    shutil.copy(certs / "client.cert", only_ca / "client.cert")
    with pytest.raises(RegistryError, match=f"the client certificate {re.escape(str(only_ca))}/client.cert has no "
                                            "key"):
        Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
    shutil.copy(certs / "client.key", only_ca / "client.key")
    Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))


# -- bearer tokens -------------------------------------------------------------------------------------------------


class _TokenService(http.server.BaseHTTPRequestHandler):
    """A token service as the distribution registry's ``auth: token:`` expects one: Basic credentials checked,
    a JWT of the asked scopes cut down to what the user may do (an anonymous caller gets a token of nothing)."""

    signer: kit.TokenSigner
    users: dict[str, tuple[str, dict[str, set[str]]]]  # user: (password, {repository: actions})
    seen: list[tuple[dict[str, list[str]], str | None]]  # (query, Authorization)

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parts.query)
        auth = self.headers.get("Authorization")
        self.seen.append((query, auth))
        granted: dict[str, set[str]] = {}
        user = ""
        if auth is not None:
            try:
                user, _, password = base64.b64decode(auth.removeprefix("Basic ")).decode().partition(":")
            except ValueError:
                user, password = "", ""
            if not auth.startswith("Basic ") or self.users.get(user, ("",))[0] != password or not password:
                return self._send(401, b'{"details": "bad credentials"}')
            granted = self.users[user][1]
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            allowed = [a for a in actions.split(",") if a in granted.get(name, set())]
            if kind == "repository" and allowed:
                access.append({"type": kind, "name": name, "actions": allowed})
        now = int(time.time())
        token = self.signer.token({"iss": "isolate-test-issuer", "sub": user, "aud": query.get("service", [""])[0],
                                   "exp": now + 300, "nbf": now - 10, "iat": now, "jti": os.urandom(8).hex(),
                                   "access": access})
        self._send(200, json.dumps({"token": token, "expires_in": 300}).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, type[_TokenService]]]:
    """docker-registry on 127.0.0.1 trusting the tokens of a service beside it: alice may pull tests/busybox;
    admin pushed it and tests/secret."""
    _tools()
    assert REGISTRY is not None and SKOPEO is not None
    tmp = tmp_path_factory.mktemp("token")
    handler = type("Handler", (_TokenService,), {
        "signer": kit.TokenSigner(str(tmp)), "seen": [],
        "users": {"alice": ("s3cret", {"tests/busybox": {"pull"}}),
                  "admin": ("adm1n", {"tests/busybox": {"pull", "push"}, "tests/secret": {"pull", "push"}})}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = {"realm": f"http://127.0.0.1:{server.server_address[1]}/token", "service": "isolate-tests",
             "issuer": "isolate-test-issuer", "rootcertbundle": handler.signer.cert}
    try:
        with kit.loopback_registry(str(tmp), REGISTRY, token=token) as address:
            kit.oci_layout(str(tmp / "busybox"), [kit.busybox_layer()], ref="1")
            for repository in ("busybox", "secret"):
                kit.push(SKOPEO, f"{tmp / 'busybox'}:1", f"{address}/tests/{repository}:1", str(tmp),
                         ["--dest-creds", "admin:adm1n"])
            yield address, handler
    finally:
        server.shutdown()
        server.server_close()


def _docker_login(home: Path, address: str, user: str, password: str) -> None:
    (home / ".docker").mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (home / ".docker/config.json").write_text(json.dumps({"auths": {address: {"auth": auth}}}))


def test_a_token_from_the_docker_config_credentials_pulls(token_registry: tuple[str, Any], tmp_path: Path) -> None:
    address, service = token_registry
    _docker_login(tmp_path / "home", address, "alice", "s3cret")
    del service.seen[:]
    image = Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
    assert os.path.exists(os.path.join(image.lower_dirs()[0], "bin/busybox"))
    alice = "Basic " + base64.b64encode(b"alice:s3cret").decode()
    assert service.seen and all(auth == alice for _, auth in service.seen), service.seen
    assert all(query["service"] == ["isolate-tests"] and query["scope"] == ["repository:tests/busybox:pull"]
               for query, _ in service.seen), service.seen


def test_without_credentials_the_pull_is_refused_clearly(token_registry: tuple[str, Any], tmp_path: Path) -> None:
    address, _ = token_registry
    store = Store(tmp_path / "store")
    with pytest.raises(RegistryError, match=f"registry {address}: unauthorized for /v2/tests/busybox/manifests/1 "
                                            r"\(credentials from docker/podman login"):
        Image.pull(f"{address}/tests/busybox:1", store=store)
    assert Image.list(store) == []


def test_the_cli_pulls_with_a_docker_login_and_says_why_not_without(token_registry: tuple[str, Any],
                                                                     tmp_path: Path) -> None:
    from conftest import ISOLATE_RUN

    address, _ = token_registry
    command = [ISOLATE_RUN, "image", "--image-store", str(tmp_path / "store"), "pull", f"{address}/tests/busybox:1"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 125 and refused.stderr.splitlines() == [
        f"isolate-run image: registry {address}: unauthorized for /v2/tests/busybox/manifests/1 (credentials from "
        "docker/podman login, e.g. ~/.docker/config.json)"], refused.stderr
    _docker_login(tmp_path / "home", address, "alice", "s3cret")
    pulled = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert pulled.returncode == 0 and pulled.stdout.startswith(f"pulled {address}/tests/busybox:1"), pulled.stderr


def test_wrong_credentials_are_refused_by_the_token_service(token_registry: tuple[str, Any], tmp_path: Path) -> None:
    address, _ = token_registry
    _docker_login(tmp_path / "home", address, "alice", "wrong")
    with pytest.raises(RegistryError, match=f"the token service refused the credentials for {re.escape(address)}"):
        Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))


def test_a_token_gives_only_its_scope(token_registry: tuple[str, Any], tmp_path: Path) -> None:
    # alice's token for tests/secret grants nothing: the registry itself refuses it.
    address, _ = token_registry
    _docker_login(tmp_path / "home", address, "alice", "s3cret")
    with pytest.raises(RegistryError, match="unauthorized for /v2/tests/secret/manifests/1"):
        Image.pull(f"{address}/tests/secret:1", store=Store(tmp_path / "store"))
    _docker_login(tmp_path / "home", address, "admin", "adm1n")
    Image.pull(f"{address}/tests/secret:1", store=Store(tmp_path / "store"))


def test_a_fifo_in_a_certs_d_directory_or_for_an_auth_file_never_hangs_a_pull(
        tls_registry: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    # The home may be one a sandbox could write: a FIFO planted there is refused by name (a CA), or not read
    # (an auth file), where opening it would have waited for a writer for ever.
    address, files = tls_registry
    certs = _ca_in(tmp_path / "home/.config/containers/certs.d" / address, files["ca"])
    (tmp_path / "home/.docker").mkdir()
    os.mkfifo(tmp_path / "home/.docker/config.json")
    assert registry_mod.credentials(address) is None
    os.mkfifo(certs / "planted.crt")
    with pytest.raises(RegistryError, match=f"{re.escape(str(certs))}/planted.crt: not a certificate or key it can "
                                            r"use \(not a regular file\)"):
        Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
    os.unlink(certs / "planted.crt")
    shutil.copy(files["cert"], certs / "client.cert")
    os.mkfifo(certs / "client.key")
    with pytest.raises(RegistryError, match=r"client\.key: not a certificate or key it can use \(not a regular file\)"):
        Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
    for name in ("client.cert", "client.key"):
        os.unlink(certs / name)
    Image.pull(f"{address}/tests/busybox:1", store=Store(tmp_path / "store"))
