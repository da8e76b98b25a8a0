"""``isolate-run serve`` outlives itself with every kind of sandbox: one with an egress allow-list is kept
(its mediator is a process of its own, which outlives the server and ends with the sandbox), its rules as
changed at run time still hold after a SIGKILL of the server; one whose mediator process was killed meanwhile
is ended at the next start; the warm pool's (unnamed) sandboxes end with the server and leave nothing.
The server runs as in tests/test_server.py (a subprocess on a loopback port, plain HTTP).
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_server as base
from test_server_restart import _kill, _run

FLAGS = () if base.limits_enforceable() else ("--best-effort",)


@pytest.fixture
def state_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="isolate-serve-keepall-")
    try:
        yield path
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def upstream() -> Iterator[int]:
    """A loopback server that answers every connection "hi\\n": the names of the allow-list map to it."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"hi\n")
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in held:
            conn.close()


def _profile(tmp_path: Path, port: int) -> str:
    profile = tmp_path / "egress.toml"
    profile.write_text(f'[network]\negress = ["web.test:{port}", "late.test:{port}"]\n'
                       'add_hosts = {"web.test" = "127.0.0.1", "late.test" = "127.0.0.1"}\n')
    profile.chmod(0o644)
    tmp_path.chmod(0o755)
    return str(profile)


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
    flags = (*FLAGS, "--image", f"egress={_profile(tmp_path, upstream)}")
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
    flags = (*FLAGS, "--image", f"egress={_profile(tmp_path, upstream)}")
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
