"""``isolate-run serve``: snapshots (kept past the sandbox and the server) and host volumes.

Through the real SDK (``opensandbox``: ``create_snapshot``, ``SandboxManagerSync`` snapshot calls,
``SandboxSync.create(snapshot_id=...)``, ``Volume``); the server runs as in tests/test_server.py, with its
own state directory so that its snapshots are this test's.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import test_server as base
from conftest import in_threads
from opensandbox import SandboxManagerSync, SandboxSync
from opensandbox.config import ConnectionConfigSync
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import PVC, Host, Volume

KEY = base.KEY


def start(state_dir: str, *extra: str) -> base.Server:
    """A server whose isolate state directory (and so its snapshots) is state_dir."""
    before = os.environ.get("ISOLATE_STATE_DIR")
    os.environ["ISOLATE_STATE_DIR"] = state_dir
    try:
        return base.Server(*(() if base.limits_enforceable() else ("--best-effort",)), *extra)
    finally:
        if before is None:
            del os.environ["ISOLATE_STATE_DIR"]
        else:
            os.environ["ISOLATE_STATE_DIR"] = before


@pytest.fixture(scope="module")
def places() -> Iterator[dict[str, str]]:
    # Reachable by the sandbox's user (uid 65534 under a root server): a+rx on the way.
    with tempfile.TemporaryDirectory(prefix="isolate-serve-snap-") as top:
        os.chmod(top, 0o755)
        out = {"state": os.path.join(top, "state"), "root": os.path.join(top, "volumes"),
               "outside": os.path.join(top, "outside")}
        for path in out.values():
            os.mkdir(path, 0o755)
        yield out
        # The descriptions' directories of that state directory in the runtime directory (empty by now).
        from isolate.kernel.places import runtime_dir, state_key

        os.environ["ISOLATE_STATE_DIR"], before = out["state"], os.environ.get("ISOLATE_STATE_DIR")
        try:
            for name in (f"opensandbox-snapshots-{state_key()}", f"snapshots-{state_key()}"):
                try:
                    os.rmdir(os.path.join(runtime_dir(), name))
                except FileNotFoundError:
                    pass
        finally:
            if before is None:
                del os.environ["ISOLATE_STATE_DIR"]
            else:
                os.environ["ISOLATE_STATE_DIR"] = before


def config(server: base.Server) -> ConnectionConfigSync:
    return ConnectionConfigSync(domain=server.domain, api_key=KEY, request_timeout=timedelta(seconds=60))


def test_snapshot_survives_its_sandbox_and_a_server_restart(places: dict[str, str]) -> None:
    server = start(places["state"])
    try:
        box = SandboxSync.create("ubuntu", connection_config=config(server))
        try:
            box.files.write_file("/workspace/kept.txt", "in the workspace\n")
            box.files.write_file("/tmp/scratch.txt", "in /tmp\n")
            info = box.create_snapshot(name="before import")
            assert info.id.startswith("osb-snap-") and info.sandbox_id == box.id and info.name == "before import"
            assert info.status.state == "Ready"
            box.files.write_file("/workspace/kept.txt", "changed after\n")
            box.pause()
            status, body = server.call("POST", f"/v1/sandboxes/{box.id}/snapshots", {})
            assert status == 409 and body["code"] == "INVALID_STATE", body
            assert server.call("GET", "/v1/snapshots", key=None)[0] == 401
            assert server.call("DELETE", f"/v1/snapshots/{info.id}", key="wrong-key-0123456789")[0] == 401
        finally:
            box.kill()
        manager = SandboxManagerSync.create(config(server))
        try:
            assert manager.get_snapshot(info.id).id == info.id
        finally:
            manager.close()
    finally:
        server.stop()
    # A new server process (same state directory) finds it, and starts sandboxes from it.
    server = start(places["state"])
    try:
        status, listing = server.call("GET", f"/v1/snapshots?sandboxId={info.sandbox_id}")
        assert status == 200 and [s["id"] for s in listing["items"]] == [info.id], listing
        assert listing["pagination"]["totalItems"] == 1
        child = SandboxSync.create(snapshot_id=info.id, connection_config=config(server))
        try:
            assert child.files.read_file("/workspace/kept.txt") == "in the workspace\n"
            assert child.files.read_file("/tmp/scratch.txt") == "in /tmp\n"
            run = child.commands.run("echo made >> /workspace/kept.txt && cat /workspace/kept.txt")
            assert [m.text for m in run.logs.stdout] == ["in the workspace", "made"]
        finally:
            child.kill()
        assert server.call("DELETE", f"/v1/snapshots/{info.id}")[0] == 204
        status, body = server.call("GET", f"/v1/snapshots/{info.id}")
        assert status == 404 and body["code"] == "SNAPSHOT_NOT_FOUND"
        assert server.call("DELETE", f"/v1/snapshots/{info.id}")[0] == 404
        status, body = server.call("POST", "/v1/sandboxes", {"snapshotId": info.id})
        assert status == 400 or status == 404, body
        # Not an id of this server's: never a path.
        assert server.call("GET", "/v1/snapshots/..%2F..%2Fetc")[0] == 404
        status, body = server.call("POST", "/v1/sandboxes", {"snapshotId": "x", "image": {"uri": "ubuntu"}})
        assert status == 400 and "exactly one" in body["message"]
    finally:
        server.stop()
    assert not os.listdir(os.path.join(places["state"], "snapshots"))


def _volume_create(server: base.Server, host: str, read_only: bool, mount: str = "/data") -> Any:
    return SandboxSync.create("ubuntu", connection_config=config(server),
                              volumes=[Volume(name="data", host=Host(path=host), mount_path=mount,
                                              read_only=read_only)])


def test_host_volumes_below_the_root_only(places: dict[str, str]) -> None:
    root, outside = places["root"], places["outside"]
    shared = os.path.join(root, "shared")
    os.mkdir(shared, 0o777)
    os.chmod(shared, 0o777)
    with open(os.path.join(shared, "in.txt"), "w") as f:
        f.write("from the host\n")
    with open(os.path.join(outside, "secret.txt"), "w") as f:
        f.write("not for the sandbox\n")
    os.symlink(outside, os.path.join(root, "escape"))
    os.mkdir(os.path.join(root, "dir"), 0o755)
    os.symlink(outside, os.path.join(root, "dir", "deeper"))
    server = start(places["state"], "--volume-root", root)
    try:
        ro = _volume_create(server, shared, read_only=True)
        try:
            assert ro.files.read_file("/data/in.txt") == "from the host\n"
            run = ro.commands.run("echo x > /data/new.txt")
            assert run.error is not None
            assert not os.path.exists(os.path.join(shared, "new.txt"))
        finally:
            ro.kill()
        rw = _volume_create(server, shared, read_only=False, mount="/tmp/rw")
        try:
            rw.files.write_file("/tmp/rw/out.txt", "from the sandbox\n")
            rw.files.write_file("/tmp/own.txt", "its own\n")
            with open(os.path.join(shared, "out.txt")) as f:
                assert f.read() == "from the sandbox\n"
            # A snapshot keeps the sandbox's /tmp, not the host's volume shown in it.
            snap = rw.create_snapshot()
        finally:
            rw.kill()
        child = SandboxSync.create(snapshot_id=snap.id, connection_config=config(server))
        try:
            assert child.files.read_file("/tmp/own.txt") == "its own\n"
            assert child.commands.run("test -e /tmp/rw").error is not None
        finally:
            child.kill()
            server.call("DELETE", f"/v1/snapshots/{snap.id}")
        # Leaving the root: by '..', by a link in it (at the end or on the way), or not under it at all.
        for path in (f"{root}/../outside", f"{root}/escape", f"{root}/escape/secret.txt", f"{root}/dir/deeper",
                     outside, "/etc"):
            body = {"image": {"uri": "ubuntu"}, "volumes": [{"name": "v", "host": {"path": path},
                                                             "mountPath": "/data", "readOnly": True}]}
            status, answer = server.call("POST", "/v1/sandboxes", body)
            assert status == 400 and answer["code"] == "VOLUME_NOT_ALLOWED", (path, answer)
        body = {"image": {"uri": "ubuntu"}, "volumes": [{"name": "v", "host": {"path": root}, "subPath": "../outside",
                                                         "mountPath": "/data"}]}
        assert server.call("POST", "/v1/sandboxes", body)[0] == 400
        body = {"image": {"uri": "ubuntu"}, "volumes": [{"name": "v", "ossfs": {"bucket": "b"}, "mountPath": "/d"}]}
        status, answer = server.call("POST", "/v1/sandboxes", body)
        assert status == 400 and answer["code"] == "VOLUME_NOT_SUPPORTED" and "--volume-root" in answer["message"]
        assert server.call("GET", "/v1/sandboxes")[1]["items"] == []
    finally:
        server.stop()
    # Without --volume-root, no host path at all.
    server = start(places["state"])
    try:
        with pytest.raises(SandboxException, match="--volume-root"):
            _volume_create(server, shared, read_only=True)
    finally:
        server.stop()


def _named(server: base.Server, claim: str, mount: str = "/mnt/pvc", read_only: bool = False, sub: str | None = None,
           **pvc: Any) -> SandboxSync:
    return SandboxSync.create("ubuntu", connection_config=config(server), volumes=[Volume(
        name="named", pvc=PVC(claimName=claim, **pvc), mount_path=mount, read_only=read_only, sub_path=sub)])


def test_named_volumes_live_in_the_volume_store(places: dict[str, str]) -> None:
    """pvc volumes (Docker named volumes, here a directory each in the server's store): made on first use,
    kept across sandboxes, read-only when asked, a subPath alone, removed with their last sandbox when asked,
    and walked like host volumes (a link planted inside is not followed)."""
    state = tempfile.mkdtemp(prefix="state-", dir=os.path.dirname(places["state"]))
    os.chmod(state, 0o755)
    store = os.path.join(state, "opensandbox-volumes")
    server = start(state)
    try:
        first = _named(server, "data")
        try:
            first.commands.run("mkdir -p /mnt/pvc/sub && echo kept > /mnt/pvc/kept.txt && echo sub > /mnt/pvc/sub/s"
                               " && ln -s / /mnt/pvc/escape")
        finally:
            first.kill()
        assert os.path.isfile(os.path.join(store, "data", "kept.txt"))
        ro = _named(server, "data", read_only=True)
        try:
            assert ro.files.read_file("/mnt/pvc/kept.txt") == "kept\n"
            assert ro.commands.run("echo x > /mnt/pvc/new.txt").error is not None
        finally:
            ro.kill()
        sub = _named(server, "data", sub="sub", mount="/mnt/sub")
        try:
            assert sub.commands.run("ls /mnt/sub").logs.stdout[0].text == "s"
        finally:
            sub.kill()
        for pvc, sub_path, code in (({"claimName": "data"}, "escape", "VOLUME_NOT_ALLOWED"),
                                    ({"claimName": "data"}, "../..", "INVALID_REQUEST"),
                                    ({"claimName": "../x"}, None, "INVALID_REQUEST"),
                                    ({"claimName": "missing", "createIfNotExists": False}, None, "VOLUME_NOT_ALLOWED")):
            volume: dict[str, Any] = {"name": "v", "pvc": pvc, "mountPath": "/d"}
            if sub_path is not None:
                volume["subPath"] = sub_path
            status, answer = server.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "volumes": [volume]})
            assert status == 400 and answer["code"] == code, (pvc, sub_path, answer)
        assert not os.path.exists(os.path.join(store, "missing"))
        # deleteOnSandboxTermination: a volume this create made goes with its last sandbox; one that was there
        # stays.
        temp = _named(server, "temp", delete_on_sandbox_termination=True)
        again = _named(server, "temp")
        temp.kill()
        assert os.path.isdir(os.path.join(store, "temp"))  # still used
        again.kill()
        assert not os.path.exists(os.path.join(store, "temp"))
        _named(server, "data", delete_on_sandbox_termination=True).kill()
        assert os.path.isfile(os.path.join(store, "data", "kept.txt"))
    finally:
        server.stop()


def test_named_volume_goes_only_with_its_last_user(places: dict[str, str]) -> None:
    """deleteOnSandboxTermination against a create of the same volume that runs at the same time: whichever start
    ends first, the volume stays while a sandbox uses it; a failed create takes neither the volume it made nor
    the one another create made."""
    state = tempfile.mkdtemp(prefix="state-", dir=os.path.dirname(places["state"]))
    os.chmod(state, 0o755)
    store = os.path.join(state, "opensandbox-volumes")
    server = start(state)

    def create(volumes: list[dict[str, Any]]) -> tuple[int, Any]:
        return server.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "entrypoint": ["sleep", "300"],
                                                     "volumes": volumes})

    try:
        for i in range(8):
            claim = f"race{i}"
            # The first create makes the volume and asks it to go with it, then opens many more (its start ends
            # later); the second takes the same volume meanwhile.
            first_volumes = [{"name": "v", "pvc": {"claimName": claim, "deleteOnSandboxTermination": True},
                              "mountPath": "/d"}]
            first_volumes += [{"name": f"p{j}", "pvc": {"claimName": f"pad{i}-{j}"}, "mountPath": f"/p{j}"}
                              for j in range(40)]
            answers: dict[str, tuple[int, Any]] = {}
            thread = threading.Thread(target=lambda volumes=first_volumes, out=answers:
                                      out.update(first=create(volumes)))
            thread.start()
            time.sleep(0.002 * i)
            answers["second"] = create([{"name": "v", "pvc": {"claimName": claim}, "mountPath": "/d"}])
            thread.join()
            assert answers["first"][0] == 202 and answers["second"][0] == 202, answers
            server.call("DELETE", f"/v1/sandboxes/{answers['first'][1]['id']}")
            assert os.path.isdir(os.path.join(store, claim)), i  # the second sandbox still uses it
            server.call("DELETE", f"/v1/sandboxes/{answers['second'][1]['id']}")
        # A create that fails after it took a volume another sandbox made and uses: the volume stays.
        keeper = _named(server, "kept", delete_on_sandbox_termination=True)
        try:
            status, answer = create([{"name": "v", "pvc": {"claimName": "kept"}, "mountPath": "/d"},
                                     {"name": "w", "pvc": {"claimName": "absent", "createIfNotExists": False},
                                      "mountPath": "/e"}])
            assert status == 400, answer
            assert os.path.isdir(os.path.join(store, "kept"))
            # One that made a volume and then failed on another leaves neither behind.
            status, answer = create([{"name": "v", "pvc": {"claimName": "fresh"}, "mountPath": "/d"},
                                     {"name": "w", "pvc": {"claimName": "absent", "createIfNotExists": False},
                                      "mountPath": "/e"}])
            assert status == 400, answer
            assert not os.path.exists(os.path.join(store, "fresh"))
        finally:
            keeper.kill()
        assert not os.path.exists(os.path.join(store, "kept"))
    finally:
        server.stop()


def test_snapshot_copies_taken_and_removed_at_once_by_many_threads(tmp_path: Any, monkeypatch: Any) -> None:
    """The server takes and removes snapshots in its worker threads at once, and removing the last copy takes
    the copies' directory (and its descriptor) with it: every copy is written whole and every removal goes
    through, whatever the interleaving (before the copies had a lock, a copy could be written through a
    descriptor another thread had just closed, or into the directory it had just removed: an OSError, 500)."""
    import json as json_

    from isolate.kept.snapshots import _meta_dir
    from isolate.server.snapkeep import SNAPSHOTS, SnapshotCopies

    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "isolate"))
    server_state = tmp_path / "server"
    server_state.mkdir()
    state_fd = os.open(server_state, os.O_RDONLY | os.O_DIRECTORY)
    copies = SnapshotCopies(state_fd)

    def churn(worker: int) -> None:
        for round_ in range(150):
            snapshot_id = f"osb-snap-{worker:08x}{round_:08x}"
            with open(os.path.join(_meta_dir(), f"{snapshot_id}.json"), "w") as handle:
                json_.dump({"kind": "test"}, handle)
            copies.keep({"id": snapshot_id, "sandboxId": "s", "name": None, "image": "i", "created": 1.0})
            copies.forget(snapshot_id)
            os.unlink(os.path.join(_meta_dir(), f"{snapshot_id}.json"))

    try:
        failures = in_threads(churn, 6)
        assert not failures, failures[:3]
        assert not (server_state / SNAPSHOTS).exists()  # the last removal took the directory
    finally:
        copies.close()
        os.close(state_fd)
        import shutil

        shutil.rmtree(_meta_dir(), ignore_errors=True)
