"""``isolate-run serve`` outlives itself with every kind of sandbox: one with an egress allow-list is kept
(its mediator is a process of its own, which outlives the server and ends with the sandbox), its rules as
changed at run time still hold after a SIGKILL of the server; one whose mediator process was killed meanwhile
is ended at the next start; the warm pool's (unnamed) sandboxes end with the server and leave nothing.
The server runs as in tests/test_server.py (a subprocess on a loopback port, plain HTTP).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import test_server as base
from conftest import egress_profile
from test_server_restart import _kill, _run

FLAGS = () if base.limits_enforceable() else ("--best-effort",)


def _probe(port: int, name: str) -> str:
    """A command that connects to name:port from inside and prints what it read, or the error's type."""
    return (f"python3 -c 'import socket\ntry:\n s = socket.create_connection((\"{name}\", {port}), 5)\n"
            " print(s.recv(3).decode().strip())\nexcept OSError as e:\n print(type(e).__name__)'")


def _egress(server: base.Server, box_id: str) -> tuple[str, dict[str, str]]:
    status, body = server.call("GET", f"/v1/sandboxes/{box_id}/endpoints/18080")
    assert status == 200, body
    return "/" + body["endpoint"].split("/", 1)[1], body["headers"]


def _mediator_pids(box_id: str, state_dir: str) -> list[int]:
    """The processes listening at the sandbox's mediator control socket (found by its kept name)."""
    from isolate.server.restore import _listeners

    return _listeners(_control_path(box_id, state_dir))


def _control_path(box_id: str, state_dir: str) -> str:
    import hashlib

    from isolate.backends.native.kept import Paths

    # The name a server of this state directory gives it (Keeper.name_for: its real path's hash).
    key = hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:8]
    return Paths.of(f"osb-{key}-{box_id}").egress


def test_an_egress_sandbox_keeps_its_rules_through_a_server_sigkill(state_dir: str, upstream: int,
                                                                    tmp_path: Path) -> None:
    flags = (*FLAGS, "--image", f"egress={egress_profile(tmp_path, upstream)}")
    first = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
    box_id = ""
    second = None
    try:
        box_id = base._create(first, image={"uri": "egress"}, timeout=900)["id"]
        prefix, headers = base._endpoint(first, box_id)
        assert _run(first, prefix, headers, _probe(upstream, "web.test")) == "hi"
        assert _run(first, prefix, headers, _probe(upstream, "late.test")) == "hi"
        # A runtime change, to the mediator process (its control socket): late.test is denied from now on.
        eprefix, eheaders = _egress(first, box_id)
        status, body = first.call("DELETE", eprefix + "/policy", ["late.test"], key=None, headers=eheaders)
        assert status == 200, body
        assert _run(first, prefix, headers, _probe(upstream, "late.test")) == "gaierror"
        mediators = _mediator_pids(box_id, state_dir)
        assert len(mediators) == 1
        _kill(first)

        # The mediator outlived the server; the next one serves the sandbox with the same rules.
        assert _mediator_pids(box_id, state_dir) == mediators
        second = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
        status, got = second.call("GET", f"/v1/sandboxes/{box_id}")
        assert status == 200 and got["status"]["state"] == "Running", got
        prefix, headers = base._endpoint(second, box_id)
        assert _run(second, prefix, headers, _probe(upstream, "web.test")) == "hi"  # allowed: still reachable
        assert _run(second, prefix, headers, _probe(upstream, "late.test")) == "gaierror"  # denied: still denied
        assert _run(second, prefix, headers, _probe(upstream, "other.test")) == "gaierror"
        eprefix, eheaders = _egress(second, box_id)
        status, policy = second.call("GET", eprefix + "/policy", key=None, headers=eheaders)
        assert status == 200 and policy["policy"]["egress"] == [{"action": "allow",
                                                                 "target": f"web.test:{upstream}"}], policy
        # The restarted server changes the rules of the mediator it did not start.
        status, body = second.call("PATCH", eprefix + "/policy", [{"action": "allow",
                                                                   "target": f"late.test:{upstream}"}],
                                   key=None, headers=eheaders)
        assert status == 200, body
        assert _run(second, prefix, headers, _probe(upstream, "late.test")) == "hi"
        # A rule past what the sandbox listens on is refused, by the mediator process, as before.
        status, body = second.call("PATCH", eprefix + "/policy", [{"action": "allow", "target": "late.test:1"}],
                                   key=None, headers=eheaders)
        assert status == 400 and "listens only on the ports" in str(body), body
        # Its end ends the mediator process and its control socket.
        control = _control_path(box_id, state_dir)
        assert os.path.exists(control)
        assert second.call("DELETE", f"/v1/sandboxes/{box_id}")[0] == 204
        assert not os.path.exists(control)
        box_id = ""
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in mediators):
            assert time.monotonic() < deadline, "the mediator outlived its sandbox"
            time.sleep(0.05)
    finally:
        if box_id and second is not None:
            second.call("DELETE", f"/v1/sandboxes/{box_id}")
        if second is not None:
            second.stop()
        first.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_egress_sandbox_whose_mediator_was_killed_is_ended(state_dir: str, upstream: int,
                                                               tmp_path: Path) -> None:
    flags = (*FLAGS, "--image", f"egress={egress_profile(tmp_path, upstream)}")
    first = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first, image={"uri": "egress"}, timeout=900)["id"]
        mediators = _mediator_pids(box_id, state_dir)
        assert len(mediators) == 1
        _kill(first)
        os.kill(mediators[0], signal.SIGKILL)
        second = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
        try:
            assert second.call("GET", f"/v1/sandboxes/{box_id}")[0] == 404
            assert not os.path.exists(os.path.join(state_dir, f"{box_id}.json"))
            assert second.call("GET", "/v1/sandboxes")[1]["items"] == []
        finally:
            second.stop()
        from isolate.backends.native.named import native_names

        assert not [n for n in native_names() if n.endswith(box_id)]
    finally:
        first.stop()


def _unnamed_of(pid: int) -> list[str]:
    """What unnamed sandboxes of the process ``pid`` left: data directories and runtime files."""
    from isolate.kernel.places import runtime_dir, state_dir

    found = []
    for directory in (os.path.join(state_dir(), "sandboxes"), runtime_dir()):
        try:
            found += [e for e in os.listdir(directory) if e.startswith(f"anon-{pid}-")]
        except FileNotFoundError:
            pass
    return found


def test_the_warm_pools_sandboxes_end_with_a_killed_server_and_leave_nothing(state_dir: str) -> None:
    first = base.Server(*FLAGS, "--warm", "1", state_dir=state_dir, end_on_exit=False)
    try:
        # The SDK's default create takes the pool's sandbox (unnamed: it ends with the server).
        box_id = base._create(first, resourceLimits={"cpu": "1", "memory": "2Gi"},
                              entrypoint=["tail", "-f", "/dev/null"], timeout=900)["id"]
        pid = first.proc.pid
        assert _unnamed_of(pid)  # its data directory, socket and description
        _kill(first)
        second = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
        try:
            assert second.call("GET", f"/v1/sandboxes/{box_id}")[0] == 404
            assert not os.path.exists(os.path.join(state_dir, f"{box_id}.json"))
            assert _unnamed_of(pid) == []
        finally:
            second.stop()
    finally:
        first.stop()


def test_snapshots_outlive_a_simulated_reboot(state_dir: str) -> None:
    """A reboot cannot be made here: it is simulated by what it does to a snapshot. Every process of the
    sandbox and of the server ends (the sandbox is deleted, the server killed with SIGKILL), and the
    descriptions the runtime directory held (a tmpfs a reboot empties) are removed: the server's and
    isolate's. The snapshot's files (isolate's state directory, on disk) and the server's state directory
    (on disk here) stay, as they would. The next server serves the snapshot again, and a sandbox starts
    from it with its file; its deletion removes the copy too."""
    from isolate.kept.snapshots import _meta_dir
    from isolate.kernel.places import runtime_subdir, state_key

    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    snapshot_id = ""
    second = None
    try:
        source = base._create(first)["id"]
        prefix, headers = base._endpoint(first, source)
        _run(first, prefix, headers, "echo before-reboot > /workspace/f.txt")
        status, snap = first.call("POST", f"/v1/sandboxes/{source}/snapshots", {"name": "kept"})
        assert status in (200, 201, 202), snap
        snapshot_id = snap["id"]
        assert first.call("DELETE", f"/v1/sandboxes/{source}")[0] == 204
        _kill(first)
        # What the reboot's emptying of the runtime directory takes of the snapshot: both descriptions.
        for description in (os.path.join(runtime_subdir(f"opensandbox-snapshots-{state_key()}"),
                                          f"{snapshot_id}.json"),
                            os.path.join(_meta_dir(), f"{snapshot_id}.json")):
            os.unlink(description)

        second = base.Server(*FLAGS, state_dir=state_dir)
        status, got = second.call("GET", f"/v1/snapshots/{snapshot_id}")
        assert status == 200 and got.get("name") == "kept", got
        branch = base._create(second, image=None, snapshotId=snapshot_id)["id"]
        prefix, headers = base._endpoint(second, branch)
        assert _run(second, prefix, headers, "cat /workspace/f.txt") == "before-reboot"
        assert second.call("DELETE", f"/v1/sandboxes/{branch}")[0] == 204
        assert second.call("DELETE", f"/v1/snapshots/{snapshot_id}")[0] == 204
        snapshot_id = ""
        assert not os.path.exists(os.path.join(state_dir, "snapshots"))
    finally:
        if second is not None:
            if snapshot_id:
                second.call("DELETE", f"/v1/snapshots/{snapshot_id}")
            second.stop()
        first.stop()


def test_a_snapshot_whose_files_were_replaced_is_not_put_back(state_dir: str) -> None:
    """The copy of a snapshot's description names the identity of its files: a directory put in their place
    (while the runtime directory was emptied) is not used; the copy goes and the start says so."""
    import shutil

    from isolate.kept.snapshots import _meta_dir
    from isolate.kernel.places import runtime_subdir, state_key
    from isolate.kernel.places import state_dir as isolate_state

    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        source = base._create(first)["id"]
        status, snap = first.call("POST", f"/v1/sandboxes/{source}/snapshots", {})
        assert status in (200, 201, 202), snap
        snapshot_id = snap["id"]
        first.call("DELETE", f"/v1/sandboxes/{source}")
        _kill(first)
        for description in (os.path.join(runtime_subdir(f"opensandbox-snapshots-{state_key()}"),
                                          f"{snapshot_id}.json"),
                            os.path.join(_meta_dir(), f"{snapshot_id}.json")):
            os.unlink(description)
        files = os.path.join(isolate_state(), "snapshots", snapshot_id)
        os.rename(files, files + ".old")  # held while the other is made: it cannot get the same inode
        os.mkdir(files, 0o700)  # another directory of the same name
        shutil.rmtree(files + ".old")
        second = base.Server(*FLAGS, state_dir=state_dir)
        try:
            assert second.call("GET", f"/v1/snapshots/{snapshot_id}")[0] == 404
            assert not os.path.exists(os.path.join(state_dir, "snapshots"))
        finally:
            second.stop()
        os.rmdir(files)
    finally:
        first.stop()
