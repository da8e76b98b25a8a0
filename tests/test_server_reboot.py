"""``isolate-run serve --state-dir DIR`` (on disk) past a host reboot: a sandbox's processes end, its files and
identity do not. A reboot cannot be made by a test: it is simulated by what it does. The server is killed
(SIGKILL), every process of its sandboxes too, and the runtime directory's files about them (their
descriptions, sockets, registry rows: a tmpfs a reboot empties) are removed; isolate's state directory and the
server's (on disk here) stay. The next server lists the sandbox stopped (Paused, reason host_reboot) with
its metadata and expiry, refuses a command (409, saying to resume it), and its resume starts it again over
its files; a delete then leaves nothing. One whose expiry passes while stopped is ended with its files; one
whose data directory was replaced is let go.
The server runs as in tests/test_server.py (a subprocess on a loopback port, plain HTTP).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import pytest
import test_server as base
from conftest import in_threads
from test_server_restart import _kill, _pvc, _run

FLAGS = () if base.limits_enforceable() else ("--best-effort",)


def _name(state_dir: str, box_id: str) -> str:
    import hashlib

    key = hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:8]
    return f"osb-{key}-{box_id}"


def _reboot(server: base.Server, names: list[str], state_dir: str, same_boot: tuple[str, ...] = ()) -> None:
    """What a reboot does to the server and its sandboxes: every process ends, the runtime files go, and the
    kernel's boot id changes (the copies were written in another boot). ``same_boot``: names whose copy keeps
    this boot's id (their description went without a reboot)."""
    from isolate.backends.registry import Registry
    from isolate.kernel.places import runtime_dir

    pids = server.sandbox_pids()
    _kill(server)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    base._wait_gone(list(pids))
    for name in names:
        for suffix in (".json", ".sock", ".egress"):
            try:
                os.unlink(os.path.join(runtime_dir(), name + suffix))
            except FileNotFoundError:
                pass
        Registry().forget("native", name)
        if name in same_boot:
            continue
        path = os.path.join(state_dir, "stopped", name.split("-", 2)[2] + ".json")
        with open(path) as handle:
            copy = json.load(handle)
        copy["boot"] = "00000000-0000-4000-8000-000000000000"  # the boot before this one
        with open(path, "w") as handle:
            json.dump(copy, handle)


def _data(name: str) -> str:
    from isolate.kernel.places import state_dir as isolate_state

    return os.path.join(isolate_state(), "sandboxes", name)


def test_a_sandbox_outlives_a_simulated_reboot_stopped_and_resumes_over_its_files(state_dir: str,
                                                                                 volume_store: str) -> None:
    flags = (*FLAGS, "--volume-store", volume_store)
    first = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
    second = None
    made: list[str] = []
    replaced = ""
    try:
        box = base._create(first, timeout=900, metadata={"team": "blue"}, volumes=_pvc("reboot-vol"),
                           resourceLimits={"cpu": "1", "memory": "1Gi"})
        short = base._create(first, timeout=900)["id"]
        replaced = base._create(first, timeout=900)["id"]
        no_reboot = base._create(first, timeout=900)["id"]
        made = [box["id"], short, replaced, no_reboot]
        prefix, headers = base._endpoint(first, box["id"])
        _run(first, prefix, headers, "echo before-reboot > /workspace/f.txt; mkdir -p /workspace/d; "
             "ln -s /etc/shadow /workspace/d/link; echo vol > /mnt/v/g.txt; echo tmp > /tmp/t.txt")
        names = [_name(state_dir, i) for i in made]
        # The fourth one's description goes, and its copy was written in this boot: no reboot took it (a delete
        # or a create the last server did not finish): let go, never kept stopped.
        _reboot(first, names, state_dir, same_boot=(names[3],))
        assert os.path.isdir(_data(names[0]))
        # The copy names its data directory's identity: a directory put in the place of the third one's while
        # no server ran is not started from; that sandbox is let go, as before copies were kept.
        os.rename(_data(names[2]), _data(names[2]) + ".old")  # held while the other is made: not its inode
        os.mkdir(_data(names[2]), 0o700)

        second = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
        status, got = second.call("GET", f"/v1/sandboxes/{box['id']}")
        assert status == 200, got
        assert got["status"]["state"] == "Paused" and got["status"]["reason"] == "host_reboot", got
        assert "reboot" in got["status"]["message"] and "resume" in got["status"]["message"], got
        assert got["metadata"] == {"team": "blue"} and got["expiresAt"] == box["expiresAt"]
        listed = {item["id"]: item["status"]["state"] for item in second.call("GET", "/v1/sandboxes")[1]["items"]}
        assert listed == {box["id"]: "Paused", short: "Paused"}
        for gone in (replaced, no_reboot):
            made.remove(gone)
            assert not os.path.exists(os.path.join(state_dir, f"{gone}.json"))
            assert not os.path.exists(os.path.join(state_dir, "stopped", f"{gone}.json"))
        assert not os.path.exists(_data(names[3]))
        # A command is refused, saying what to do; the old token is still its own.
        status, body = second.call("POST", prefix + "/command", {"command": "true"}, key=None, headers=headers)
        assert status == 409 and "resume" in json.dumps(body) and "reboot" in json.dumps(body), body

        # The other one's expiry, moved close while it is stopped, ends it with its files.
        soon = datetime.datetime.fromtimestamp(time.time() + 2, datetime.timezone.utc).isoformat()
        assert second.call("POST", f"/v1/sandboxes/{short}/renew-expiration", {"expiresAt": soon})[0] == 200
        deadline = time.monotonic() + 15
        while second.call("GET", f"/v1/sandboxes/{short}")[0] != 404 or os.path.exists(_data(names[1])) \
                or os.path.exists(os.path.join(state_dir, f"{short}.json")):
            assert time.monotonic() < deadline, "a stopped sandbox outlived its expiry, or left its files"
            time.sleep(0.3)
        made.remove(short)

        assert second.call("POST", f"/v1/sandboxes/{box['id']}/resume")[0] == 202
        status, got = second.call("GET", f"/v1/sandboxes/{box['id']}")
        assert got["status"]["state"] == "Running", got
        prefix, headers = base._endpoint(second, box["id"])
        assert _run(second, prefix, headers, "cat /workspace/f.txt") == "before-reboot"
        assert _run(second, prefix, headers, "readlink /workspace/d/link") == "/etc/shadow"  # kept as a link
        assert _run(second, prefix, headers, "cat /mnt/v/g.txt") == "vol"  # its named volume again
        assert _run(second, prefix, headers, "cat /tmp/t.txt 2>&1 || echo gone") .endswith("gone")  # a tmpfs
        assert _run(second, prefix, headers, "echo after > /workspace/h.txt; cat /workspace/h.txt") == "after"
        assert not os.path.exists(_data(names[0]) + ".resuming")

        assert second.call("DELETE", f"/v1/sandboxes/{box['id']}")[0] == 204
        made = []
        assert not os.path.exists(_data(names[0]))
        assert sorted(os.listdir(state_dir)) == [".lock"]  # no record, no copy left
        assert os.listdir(volume_store) == []  # the volume its create made goes with it
        second.stop()
        import subprocess

        from conftest import ISOLATE_RUN

        pruned = subprocess.run([ISOLATE_RUN, "sandbox", "prune"], capture_output=True, text=True, timeout=60)
        assert pruned.returncode == 0, pruned.stderr
        assert not [line for line in pruned.stdout.splitlines() if any(n in line for n in names)], pruned.stdout
    finally:
        if second is not None:
            for box_id in made:
                second.call("DELETE", f"/v1/sandboxes/{box_id}")
            second.stop()
        first.stop()
        if replaced:
            import shutil

            shutil.rmtree(_data(_name(state_dir, replaced)) + ".old", ignore_errors=True)


@pytest.mark.parametrize("change", [
    {"version": 2}, {"request": "x"}, {"data": [1]}, {"data": [1, True]}, {"upper": ["1", 2]}, {"data": [-1, 2]},
    {"image": "sha256:" + "0" * 64}, {"image": "../x", "imageUpper": [1, 2]}, {"imageUpper": [1, 2]},
    {"extra": 1}, {"boot": "../x"}, {"boot": 1}])
def test_a_hostile_copy_is_refused_field_by_field(change: dict[str, object]) -> None:
    from isolate.server.stopped import parse_copy

    good = {"version": 1, "request": {"image": {"uri": "ubuntu"}}, "data": [1, 2], "upper": [3, 4], "image": None,
            "imageUpper": None, "boot": "00000000-0000-4000-8000-000000000000"}
    assert parse_copy(good).data == (1, 2)
    with pytest.raises(ValueError):
        parse_copy({**good, **change})


def test_the_kept_request_holds_no_registry_credentials() -> None:
    from isolate.server.stopped import request_of

    kept = request_of({"image": {"uri": "reg.test/a:1", "auth": {"username": "u", "password": "p"}},
                       "snapshotId": "osb-snap-" + "0" * 16, "timeout": 60}, "reg.test/a:1")
    assert kept == {"image": {"uri": "reg.test/a:1"}, "timeout": 60}


@pytest.mark.skipif(not os.path.exists("/bin/busybox"), reason="busybox-static is not installed")
def test_an_image_sandbox_keeps_its_root_changes_past_a_reboot(state_dir: str, tmp_path: Path) -> None:
    """A sandbox of an image whose root's upper layer is on disk: what it wrote to the image's root comes back
    with the resume, over the same image."""
    import imagekit as kit

    from isolate.image import Image, Store
    from isolate.server.state import disk_upper_possible

    if not disk_upper_possible():
        pytest.skip("isolate's state directory keeps no user.* attributes: an image's upper layer is a tmpfs")
    first = second = None
    box_id = ""
    with kit.store_env(str(tmp_path / "store")):
        kit.oci_layout(str(tmp_path / "bb"), [kit.busybox_layer([{"name": "data", "type": "dir", "mode": 0o777}])],
                       ref="1", Env=["PATH=/bin"])
        Image.load(tmp_path / "bb", reference="tests/busybox:1", store=Store(tmp_path / "store"))
        flags = ("--profile", "default", "--best-effort")
        try:
            first = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
            box_id = base._create(first, image={"uri": "tests/busybox:1"}, timeout=900)["id"]
            prefix, headers = base._endpoint(first, box_id)
            _run(first, prefix, headers, "echo root > /data/r.txt; echo ws > /workspace/w.txt")
            _reboot(first, [_name(state_dir, box_id)], state_dir)
            second = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
            status, got = second.call("GET", f"/v1/sandboxes/{box_id}")
            assert status == 200 and got["status"]["state"] == "Paused", got
            status, body = second.call("POST", f"/v1/sandboxes/{box_id}/resume")
            assert status == 202, body
            prefix, headers = base._endpoint(second, box_id)
            assert _run(second, prefix, headers, "cat /data/r.txt /workspace/w.txt") == "root\nws"
            assert second.call("DELETE", f"/v1/sandboxes/{box_id}")[0] == 204
            assert not os.path.exists(_data(_name(state_dir, box_id)))
            box_id = ""
            assert sorted(os.listdir(state_dir)) == [".lock"]
        finally:
            if second is not None:
                if box_id:
                    second.call("DELETE", f"/v1/sandboxes/{box_id}")
                second.stop()
            if first is not None:
                first.stop()


def test_stopped_copies_written_and_removed_at_once_by_many_threads(tmp_path: Path) -> None:
    """Creates and deletes write and remove the sandboxes' copies in the server's worker threads at once, and
    removing the last copy removes their directory: every copy is written whole and every removal goes through,
    whatever the interleaving (before the copies had a lock, a copy written while another thread removed the
    directory failed with ENOENT: a create answered 500 STATE_NOT_WRITTEN, as the soak once saw)."""
    from isolate.server.stopped import STOPPED, Copy, StoppedCopies

    state_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    copies = StoppedCopies(state_fd)

    def churn(worker: int) -> None:
        for round_ in range(150):
            sandbox_id = f"{worker:08x}{round_:016x}"
            copies.write(sandbox_id, Copy({"image": {"uri": "default"}}, (1, 2), (3, 4)))
            copies.forget(sandbox_id)

    try:
        failures = in_threads(churn, 6)
        assert not failures, failures[:3]
        assert not (tmp_path / STOPPED).exists()  # the last removal took the directory
    finally:
        os.close(state_fd)
