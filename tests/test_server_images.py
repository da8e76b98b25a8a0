"""``isolate-run serve``: a create request's image.uri is an image of a registry, run natively.

The registry is Debian's docker-registry on loopback with basic auth (an
htpasswd file made here), a busybox scratch image pushed to it with skopeo;
the client is the OpenSandbox SDK, as in tests/test_server.py.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY
from test_server import KEY, Server, run_example

REGISTRY = shutil.which("docker-registry")
SKOPEO = shutil.which("skopeo")
USER, PASSWORD = "tester", "s3cret-pass"

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")


def _bcrypt(password: str) -> str:
    """An htpasswd line's hash (docker-registry takes bcrypt only), by the C library's crypt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # the standard library's, up to Python 3.12

        return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """docker-registry on 127.0.0.1 with basic auth, holding tests/busybox:1."""
    if REGISTRY is None or SKOPEO is None:
        pytest.skip("docker-registry and skopeo are not installed (apt-get install docker-registry skopeo)")
    tmp = tmp_path_factory.mktemp("registry")
    (tmp / "htpasswd").write_text(f"{USER}:{_bcrypt(PASSWORD)}\n")
    with kit.loopback_registry(str(tmp), REGISTRY, htpasswd=str(tmp / "htpasswd")) as address:
        kit.oci_layout(str(tmp / "busybox"), [kit.busybox_layer()], ref="1", Env=["PATH=/bin"])
        kit.push(SKOPEO, f"{tmp / 'busybox'}:1", f"{address}/tests/busybox:1", str(tmp),
                 ["--dest-creds", f"{USER}:{PASSWORD}"])
        yield address


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose --profile runs any image reference (isolate's default policy), with a store of its own."""
    store = tmp_path_factory.mktemp("server-images") / "store"
    saved = os.environ.get("ISOLATE_IMAGE_STORE")
    os.environ["ISOLATE_IMAGE_STORE"] = str(store)
    try:
        srv = Server("--profile", "default", "--best-effort")
    finally:
        if saved is None:
            os.environ.pop("ISOLATE_IMAGE_STORE", None)
        else:
            os.environ["ISOLATE_IMAGE_STORE"] = saved
    try:
        yield srv
    finally:
        srv.stop()


SDK_IMAGE = '''
import asyncio
from opensandbox.sandbox import Sandbox
from opensandbox.config import ConnectionConfig
from opensandbox.models.sandboxes import SandboxImageAuth, SandboxImageSpec

async def main():
    config = ConnectionConfig(domain=DOMAIN, api_key=KEY)
    image = SandboxImageSpec(IMAGE, auth=SandboxImageAuth(username=USER, password=PASSWORD))
    sandbox = await Sandbox.create(image, connection_config=config)
    try:
        execution = await sandbox.commands.run(
            "cat /etc/os-release; ls /usr 2>/dev/null || echo no-host-usr; test -e /bin/busybox && echo busybox")
        print("".join(line.text + "\\n" for line in execution.logs.stdout), end="")
    finally:
        await sandbox.destroy()

asyncio.run(main())
'''


def _sdk(server: Server, image: str, user: str = USER, password: str = PASSWORD) -> str:
    code = (f"DOMAIN, KEY, IMAGE, USER, PASSWORD = {server.domain!r}, {KEY!r}, {image!r}, {user!r}, {password!r}\n"
            + SDK_IMAGE)
    return run_example(server, code)


def test_the_sdk_creates_a_sandbox_from_an_image_of_the_registry(registry: str, server: Server) -> None:
    out = _sdk(server, f"{registry}/tests/busybox:1")
    assert out.splitlines() == ["NAME=busybox-scratch", "no-host-usr", "busybox"]
    # Again: the image is in the server's store now, no pull (a wrong password does not matter then).
    assert _sdk(server, f"{registry}/tests/busybox:1", password="wrong").splitlines()[0] == "NAME=busybox-scratch"


def test_a_pull_that_fails_is_refused_in_one_clear_error(registry: str, server: Server) -> None:
    status, body = server.call("POST", "/v1/sandboxes", {
        "image": {"uri": f"{registry}/tests/absent:1", "auth": {"username": USER, "password": PASSWORD}},
        "entrypoint": ["tail", "-f", "/dev/null"], "resourceLimits": {}})
    assert status == 400 and body["code"] == "IMAGE_PULL_FAILED", body
    assert "absent" in body["message"] and PASSWORD not in body["message"]
    status, body = server.call("POST", "/v1/sandboxes", {
        "image": {"uri": f"{registry}/tests/other:1", "auth": {"username": USER, "password": "wrong"}},
        "entrypoint": ["tail", "-f", "/dev/null"], "resourceLimits": {}})
    assert status == 400 and body["code"] == "IMAGE_PULL_FAILED" and "wrong" not in body["message"], body
    status, body = server.call("POST", "/v1/sandboxes", {
        "image": {"uri": f"{registry}/tests/busybox:1", "auth": {"username": USER}},
        "entrypoint": ["tail", "-f", "/dev/null"], "resourceLimits": {}})
    assert status == 400 and "image.auth" in body["message"], body


def test_without_profile_an_image_reference_is_still_refused(registry: str, tmp_path: Path) -> None:
    srv = Server()
    try:
        status, body = srv.call("POST", "/v1/sandboxes", {"image": {"uri": f"{registry}/tests/busybox:1"},
                                                          "entrypoint": ["tail", "-f", "/dev/null"]})
        assert status == 400 and body["code"] == "IMAGE_NOT_SUPPORTED" and "--profile" in body["message"], body
    finally:
        srv.stop()


SDK_SNAPSHOT = '''
from opensandbox.sync.sandbox import SandboxSync
from opensandbox.config.connection_sync import ConnectionConfigSync
from opensandbox.models.sandboxes import SandboxImageAuth, SandboxImageSpec

config = ConnectionConfigSync(domain=DOMAIN, api_key=KEY)
box = SandboxSync.create(SandboxImageSpec(IMAGE, auth=SandboxImageAuth(username=USER, password=PASSWORD)),
                         connection_config=config)
try:
    box.commands.run("echo in-the-root > /data/marker")
    info = box.create_snapshot(name="image root")
finally:
    box.kill()
child = SandboxSync.create(snapshot_id=info.id, connection_config=config)
try:
    run = child.commands.run("cat /data/marker; cat /etc/os-release | head -n 1")
    print("".join(m.text + "\\n" for m in run.logs.stdout), end="")
finally:
    child.kill()
'''


def test_a_snapshot_of_an_image_sandbox_holds_its_roots_changes(registry: str, server: Server,
                                                                tmp_path: Path) -> None:
    # The server's image sandboxes keep their upper layer on disk (where the state directory keeps user.*
    # attributes): a snapshot then holds what the program wrote to the image's root, and a sandbox from it
    # has the image and those writes. With the tmpfs upper layer the snapshot was refused.
    assert SKOPEO is not None
    kit.oci_layout(str(tmp_path / "data"), [kit.busybox_layer(), kit.layer([{"name": "data", "type": "dir",
                                                                              "mode": 0o777}])],
                   ref="1", Env=["PATH=/bin"])
    kit.push(SKOPEO, f"{tmp_path / 'data'}:1", f"{registry}/tests/data:1", str(tmp_path),
             ["--dest-creds", f"{USER}:{PASSWORD}"])
    code = (f"DOMAIN, KEY, IMAGE, USER, PASSWORD = {server.domain!r}, {KEY!r}, {registry + '/tests/data:1'!r}, "
            f"{USER!r}, {PASSWORD!r}\n" + SDK_SNAPSHOT)
    assert run_example(server, code).splitlines() == ["in-the-root", "NAME=busybox-scratch"]
