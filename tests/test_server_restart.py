"""``isolate-run serve`` outlives itself: a server killed with SIGKILL and started again with the same
``--state-dir`` serves the sandboxes it made, under the same ids, with their files, background processes,
tokens (kept as hashes) and endpoints; one whose timeout passed meanwhile is gone; a hostile record is
skipped. The server runs as in tests/test_server.py (a subprocess on a loopback port, plain HTTP).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import test_server as base

psutil = pytest.importorskip("psutil")

FLAGS = () if base.limits_enforceable() else ("--best-effort",)


def _run(server: base.Server, prefix: str, headers: dict[str, str], command: str) -> str:
    """A command's stdout, through the execution API (server-sent events)."""
    status, body = server.call("POST", prefix + "/command", {"command": command}, key=None, headers=headers)
    assert status == 200, body
    text = body.decode() if isinstance(body, bytes) else json.dumps(body)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")] or \
        [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert not [e for e in events if e.get("type") == "error"], events
    return "\n".join(e.get("text", "") for e in events if e.get("type") == "stdout")


def _background(server: base.Server, prefix: str, headers: dict[str, str], command: str) -> str:
    """A background command's id."""
    status, body = server.call("POST", prefix + "/command", {"command": command, "background": True}, key=None,
                               headers=headers)
    assert status == 200, body
    return str(json.loads(body.decode().splitlines()[0][6:])["text"])


def _logs(server: base.Server, prefix: str, headers: dict[str, str], command_id: str,
          cursor: int = 0) -> tuple[str, int]:
    """A background command's output from cursor, and the cursor its end is at."""
    import urllib.request

    request = urllib.request.Request(f"http://{server.domain}{prefix}/command/{command_id}/logs?cursor={cursor}",
                                     headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode(), int(response.headers["EXECD-COMMANDS-TAIL-CURSOR"])


def _status(server: base.Server, prefix: str, headers: dict[str, str], command_id: str) -> dict[str, Any]:
    status, body = server.call("GET", prefix + f"/command/status/{command_id}", key=None, headers=headers)
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def _until(what: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.2)
    return got


def _recorded(state_dir: str, box_id: str, *commands: str) -> bool:
    """Whether the sandbox's record names the background commands (each, once its launcher has settled: a few
    milliseconds after its start; one a kill finds unnamed runs on, unlisted, as the docs say)."""
    with open(os.path.join(state_dir, f"{box_id}.json")) as record:
        text = record.read()
    return all(command in text for command in commands)


def _kill(server: base.Server) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    server.stop()


#: Put on a server's PYTHONPATH (``killed_after``): it kills itself (SIGKILL) right after a call of KILL_AFTER
#: (``module:function`` or ``module:Class.method``) returns, and KILL_PAUSE seconds more.
_KILLED_AFTER = """import importlib, os, signal, time
def _hook(where):
    module, _, name = where.partition(":")
    *path, attr = name.split(".")
    owner = importlib.import_module(module)
    for part in path:
        owner = getattr(owner, part)
    called = getattr(owner, attr)
    def killing(*args, **kwargs):
        result = called(*args, **kwargs)
        time.sleep(float(os.environ.get("KILL_PAUSE") or 0))
        os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(owner, attr, killing)
if os.environ.get("KILL_AFTER"):
    _hook(os.environ["KILL_AFTER"])
"""


def killed_after(tmp_path: Any, monkeypatch: Any, where: str, pause: float = 0) -> None:
    """Servers started from now on (until ``where`` is "") SIGKILL themselves right after a call of ``where``
    (``pause`` seconds after)."""
    hook = os.path.join(str(tmp_path), "hook")
    os.makedirs(hook, exist_ok=True)
    with open(os.path.join(hook, "sitecustomize.py"), "w") as file:
        file.write(_KILLED_AFTER)
    paths = os.environ.get("PYTHONPATH")
    if hook not in (paths or "").split(os.pathsep):
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([hook, *([paths] if paths else [])]))
    monkeypatch.setenv("KILL_AFTER", where)
    monkeypatch.setenv("KILL_PAUSE", str(pause))


class Restart:
    """A server that leaves its sandboxes at its end (``end_on_exit`` False), one sandbox made (``box_id``, its
    execution API's ``prefix`` and ``headers``), then the next server of its state directory (``next``)."""

    def __init__(self, state_dir: str, flags: tuple[str, ...], hook: tuple[Any, Any] | None,
                 create: dict[str, Any]) -> None:
        self.state_dir, self.flags, self.hook = state_dir, flags, hook
        self.servers = [base.Server(*flags, state_dir=state_dir, end_on_exit=False)]
        self.first = self.servers[0]
        try:
            self.box_id = base._create(self.first, **create)["id"]
        except BaseException:
            self.first.stop()
            raise
        self.prefix, self.headers = base._endpoint(self.first, self.box_id)

    def next(self, **options: Any) -> base.Server:
        """The first server dead of a SIGKILL (its own, at ``killed_after``'s step, else one sent here) and stopped,
        and the next one started on the same state directory (no step kills it)."""
        if self.hook is None and self.first.proc.poll() is None:
            self.first.proc.send_signal(signal.SIGKILL)
        assert self.first.proc.wait(60) == -signal.SIGKILL
        self.first.stop()
        if self.hook is not None:
            killed_after(*self.hook, "")
        self.servers.append(base.Server(*self.flags, state_dir=self.state_dir, **options))
        return self.servers[-1]


@contextlib.contextmanager
def restart(state_dir: str, *flags: str, tmp_path: Any = None, monkeypatch: Any = None, killed_at: str = "",
            pause: float = 0, **create: Any) -> Iterator[Restart]:
    """A ``Restart`` (``flags``: both servers'; ``create``: the sandbox's fields), its servers stopped after the block.
    ``killed_at``: the first server kills itself right after a call of it (``killed_after``)."""
    hook = (tmp_path, monkeypatch) if killed_at else None
    if hook is not None:
        killed_after(tmp_path, monkeypatch, killed_at, pause)
    made: list[Restart] = []
    try:
        made.append(Restart(state_dir, flags or FLAGS, hook, create))
        yield made[0]
    finally:
        for server in made[0].servers if made else []:
            server.stop()


def _kill_in_flight(server: base.Server, prefix: str, headers: dict[str, str], context_id: str, code: str) -> None:
    """SIGKILL the server while a cell of the context runs (its client then gets a connection error)."""
    import threading

    def in_flight() -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):
            _cell(server, prefix, headers, context_id, code)

    flight = threading.Thread(target=in_flight, daemon=True)
    flight.start()
    time.sleep(1.0)
    _kill(server)
    flight.join(30)


def _port_get(server: base.Server, sandbox_id: str, port: int, token: str, path: str) -> tuple[int, Any]:
    return server.call("GET", f"/sandboxes/{sandbox_id}/port/{port}/{path}", key=None,
                       headers={"OpenSandbox-Secure-Access": token})


def _pvc(claim: str) -> list[dict[str, Any]]:
    return [{"name": "v", "mountPath": "/mnt/v", "pvc": {"claimName": claim, "deleteOnSandboxTermination": True}}]


def test_sigkill_and_restart_keep_the_sandbox(state_dir: str, volume_store: str) -> None:
    flags = (*FLAGS, "--volume-store", volume_store)
    first = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
    box_id = ""
    try:
        box = base._create(first, timeout=900, metadata={"team": "blue"}, volumes=_pvc("kept-vol"),
                           networkPolicy={"defaultAction": "deny"})  # a loopback of its own: its port is served
        box_id = box["id"]
        short = base._create(first, timeout=3, volumes=_pvc("short-vol"))["id"]
        assert sorted(os.listdir(volume_store)) == ["kept-vol", "short-vol"]
        prefix, headers = base._endpoint(first, box_id)
        # A file, and a process left running in the background (a web server on the sandbox's loopback).
        _run(first, prefix, headers, "echo kept > /workspace/f.txt; "
             "(setsid python3 -m http.server 8000 --bind 127.0.0.1 -d /workspace </dev/null >/dev/null 2>&1 &)")
        status, port_endpoint = first.call("GET", f"/v1/sandboxes/{box_id}/endpoints/8000")
        assert status == 200, port_endpoint
        port_token = port_endpoint["headers"]["OpenSandbox-Secure-Access"]
        deadline = time.monotonic() + 20
        while (answer := _port_get(first, box_id, 8000, port_token, "f.txt"))[0] != 200:
            assert time.monotonic() < deadline, answer
            time.sleep(0.2)
        pid_text = _run(first, prefix, headers, "pgrep -f 'http.server 8000' | head -1").strip()
        assert pid_text
        # The record holds no token: only hashes.
        records = [os.path.join(state_dir, e) for e in os.listdir(state_dir) if e.endswith(".json")]
        assert len(records) == 2
        for path in records:
            info = os.stat(path)
            assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
            with open(path) as handle:
                text = handle.read()
            assert headers["X-EXECD-ACCESS-TOKEN"] not in text and port_token not in text
        _kill(first)
        time.sleep(3.5)  # the short one's timeout passes while no server runs

        second = base.Server(*flags, state_dir=state_dir, end_on_exit=False)
        try:
            status, got = second.call("GET", f"/v1/sandboxes/{box_id}")
            assert status == 200, got
            assert got["metadata"] == {"team": "blue"} and got["expiresAt"] == box["expiresAt"]
            assert got["status"]["state"] == "Running"
            assert second.call("GET", f"/v1/sandboxes/{short}")[0] == 404  # expired while down: ended
            assert not os.path.exists(os.path.join(state_dir, f"{short}.json"))
            assert os.listdir(volume_store) == ["kept-vol"]  # the expired one's volume went with it
            # The old token works; the endpoint call gives a working one again.
            assert second.call("GET", prefix + "/ping", key=None, headers=headers)[0] == 200
            assert second.call("GET", prefix + "/ping", key=None, headers={"X-EXECD-ACCESS-TOKEN": "x" * 32})[0] \
                == 401
            new_prefix, new_headers = base._endpoint(second, box_id)
            assert new_prefix == prefix
            assert _run(second, prefix, new_headers, "cat /workspace/f.txt") == "kept"
            assert _run(second, prefix, headers, "pgrep -f 'http.server 8000' | head -1").strip() == pid_text
            # The web app's endpoint, with the token given before the restart.
            status, text = _port_get(second, box_id, 8000, port_token, "f.txt")
            assert status == 200 and "kept" in str(text), (status, text)
            assert _port_get(second, box_id, 8000, "0" * 64, "f.txt")[0] == 401
            listed = second.call("GET", "/v1/sandboxes")[1]["items"]
            assert [item["id"] for item in listed] == [box_id]
            # A new sandbox beside it, and a delete that ends the kept one and its record.
            other = base._create(second)["id"]
            assert second.call("DELETE", f"/v1/sandboxes/{box_id}")[0] == 204
            assert not os.path.exists(os.path.join(state_dir, f"{box_id}.json"))
            assert os.listdir(volume_store) == []  # its last holder ended: the volume it made goes
            second.call("DELETE", f"/v1/sandboxes/{other}")
            box_id = ""
        finally:
            second.stop()
    finally:
        if first.proc.poll() is None:
            first.stop()
        if box_id:
            from isolate.backends.native.named import native_names, remove_native

            for name in native_names():
                if name.endswith(box_id):
                    remove_native(name)


def _cell(server: base.Server, prefix: str, headers: dict[str, str], context_id: str, code: str,
          context: dict[str, str] | None = None) -> dict[str, Any]:
    """A code cell's events, by type (its result's text, its error); ``context`` instead of the id's: the context
    the request names (a language's default: {"language": LANGUAGE})."""
    status, body = server.call("POST", prefix + "/code", {"code": code, "context": context or {"id": context_id}},
                               key=None, headers=headers)
    assert status == 200, body
    text = body.decode() if isinstance(body, bytes) else json.dumps(body)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    return {e["type"]: e for e in events}


def test_a_code_context_lives_on_past_a_killed_server(state_dir: str) -> None:
    """A Python context's interpreter is a process of the kept sandbox: after SIGKILL and a start on the same
    --state-dir it is listed and keeps its variables; a cell running when the server died is interrupted and
    the next one works; a background command of the last server is served again; a delete ends the
    interpreter."""

    with restart(state_dir) as r:
        first, box_id, prefix, headers = r.first, r.box_id, r.prefix, r.headers
        status, context = first.call("POST", prefix + "/code/context", {"language": "python"}, key=None,
                                     headers=headers)
        assert status == 200, context
        assert "error" not in _cell(first, prefix, headers, context["id"], "x = 41")
        status, body = first.call("POST", prefix + "/command", {"command": "sleep 600", "background": True},
                                  key=None, headers=headers)
        command_id = json.loads(body.decode().splitlines()[0][6:])["text"]
        _until(lambda: _recorded(state_dir, box_id, command_id))  # its launcher settled, the record names it

        # A cell in flight when the server dies: its client gets a connection error.
        _kill_in_flight(first, prefix, headers, context["id"], "import time\ntime.sleep(120)")
        second = r.next()
        status, listed = second.call("GET", prefix + "/code/contexts", key=None, headers=headers)
        assert status == 200 and listed == [{"id": context["id"], "language": "python"}], listed
        got = _cell(second, prefix, headers, context["id"], "x + 1")
        assert got.get("result", {}).get("results") == {"text": "42"}, got
        assert "error" not in _cell(second, prefix, headers, context["id"], "x = 7")
        assert _cell(second, prefix, headers, context["id"], "x")["result"]["results"] == {"text": "7"}
        status, answer = second.call("GET", prefix + f"/command/status/{command_id}", key=None, headers=headers)
        assert status == 200 and answer["running"], answer  # a background command lives on too
        assert _run(second, prefix, headers, "echo next") == "next"
        assert _run(second, prefix, headers, "pgrep -fc '[-]-kept /tmp' || true") == "1"
        status, _ = second.call("DELETE", prefix + f"/code/contexts/{context['id']}", key=None, headers=headers)
        assert status == 200
        assert _run(second, prefix, headers, "pgrep -fc '[-]-kept /tmp' || true") == "0"
        assert second.call("GET", prefix + "/code/contexts", key=None, headers=headers)[1] == []


#: Per language: its toolchain and Debian package, a cell that defines x, one busy when the server dies, one
#: that prints x and sets it to 7.
_KEEPS = {
    "javascript": ("node", "nodejs", "var x = 41", "for (;;) {}", "console.log('out', x); x = 7"),
    "java": ("java", "default-jdk-headless", "int x = 41;", "Thread.sleep(120000);",
             'System.out.println("out " + x);\nx = 7'),
    "go": ("go", "golang-go", "", "", ""),
}


@pytest.mark.parametrize("language", ["javascript", "java", "go"])
def test_a_javascript_or_java_context_lives_on_and_a_go_context_is_served_again(state_dir: str,
                                                                                language: str) -> None:
    """A JavaScript context's Node.js realm and a Java context's JShell are processes of the kept sandbox, as a
    Python context's interpreter: after SIGKILL and a start on the same --state-dir their variables are there, a
    cell that was running is interrupted, and a delete ends the interpreter. A Go context holds no state but its
    id: it is served again."""
    tool, package, define, busy, show = _KEEPS[language]
    if shutil.which(tool) is None:
        pytest.skip(f"no {tool} on this machine (Debian: apt-get install {package})")
    import threading

    with restart(state_dir) as r:
        first, prefix, headers = r.first, r.prefix, r.headers
        status, context = first.call("POST", prefix + "/code/context", {"language": language}, key=None,
                                     headers=headers)
        assert status == 200, context
        if language == "go":
            _kill(first)
        else:
            assert "error" not in _cell(first, prefix, headers, context["id"], define)
            _kill_in_flight(first, prefix, headers, context["id"], busy)  # a cell busy in the interpreter
        second = r.next()
        status, listed = second.call("GET", prefix + "/code/contexts", key=None, headers=headers)
        assert status == 200 and listed == [{"id": context["id"], "language": language}], listed
        if language == "go":
            got = _cell(second, prefix, headers, context["id"], 'import "fmt"\nfunc main() { fmt.Print(6 * 7) }')
            assert "error" not in got, got
            return
        got = _cell(second, prefix, headers, context["id"], "x + 1")
        assert got.get("result", {}).get("results") == {"text": "42"}, got
        out = _cell(second, prefix, headers, context["id"], show)
        assert out["stdout"]["text"].rstrip("\n") == "out 41" and out["result"]["results"] == {"text": "7"}, out
        # An interrupt goes to the relay, which passes it on to the interpreter it is connected to.
        stopped: list[dict[str, Any]] = []
        flight = threading.Thread(target=lambda: stopped.append(_cell(second, prefix, headers, context["id"], busy)))
        flight.start()
        time.sleep(1.5)
        status, _ = second.call("DELETE", prefix + f"/code?id={context['id']}", key=None, headers=headers)
        assert status == 200
        flight.join(30)
        assert stopped and "error" in stopped[0], stopped
        assert _cell(second, prefix, headers, context["id"], "x")["result"]["results"] == {"text": "7"}
        assert _run(second, prefix, headers, "pgrep -fc '[-]-kept-driver' || true") == "1"
        status, _ = second.call("DELETE", prefix + f"/code/contexts/{context['id']}", key=None, headers=headers)
        assert status == 200
        # The delete ends the interpreter; a JVM takes its moment to go (ci2, as 65534 under load: still there).
        deadline = time.monotonic() + 15
        while (left := _run(second, prefix, headers, "pgrep -fc '[-]-kept-driver' || true")) != "0":
            assert time.monotonic() < deadline, left
            time.sleep(0.2)


def test_a_bash_context_lives_on_past_a_killed_server_and_a_stopped_one(state_dir: str) -> None:
    """A bash context's shell outlives its server, killed (SIGKILL) or stopped: the sandbox's exec server holds
    the server's ends of its pipes meanwhile, and the next server adopts it with its variables, functions and
    working directory; a cell that was running when the server died is interrupted, and the next cells work,
    interrupt and are deleted as before."""
    import threading

    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first)["id"]
        prefix, headers = base._endpoint(first, box_id)
        status, context = first.call("POST", prefix + "/code/context", {"language": "bash"}, key=None,
                                     headers=headers)
        assert status == 200, context
        got = _cell(first, prefix, headers, context["id"],
                    "a=(4 1); x=${a[0]}${a[1]}; cd /tmp; f() { echo fn; }; echo $$")  # an array: bash's
        assert "error" not in got, got
        shell_pid = got["stdout"]["text"].strip()
        _kill_in_flight(first, prefix, headers, context["id"], "sleep 120; echo late")
    finally:
        first.stop()
    second = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        status, listed = second.call("GET", prefix + "/code/contexts", key=None, headers=headers)
        assert status == 200 and listed == [{"id": context["id"], "language": "bash"}], listed
        got = _cell(second, prefix, headers, context["id"], "echo $((x + 1)) $PWD $$ && f")  # a line an event
        assert "error" not in got and got["stdout"]["text"].strip() == "fn", got
        got = _cell(second, prefix, headers, context["id"], "echo $((x + 1)) $PWD $$")
        # The cell in flight was interrupted, its output dropped.
        assert "error" not in got and got["stdout"]["text"].split() == ["42", "/tmp", shell_pid], got
        assert "error" in _cell(second, prefix, headers, context["id"], "false")
        assert "error" not in _cell(second, prefix, headers, context["id"], "x=7")
    finally:
        second.stop()  # stopped, not killed: it lets the shell go as it is
    third = base.Server(*FLAGS, state_dir=state_dir)
    try:
        got = _cell(third, prefix, headers, context["id"], "echo $x")
        assert got["stdout"]["text"].strip() == "7", got
        stopped: list[dict[str, Any]] = []
        flight = threading.Thread(target=lambda: stopped.append(_cell(third, prefix, headers, context["id"],
                                                                      "sleep 120")))
        flight.start()
        time.sleep(1.5)
        assert third.call("DELETE", prefix + f"/code?id={context['id']}", key=None, headers=headers)[0] == 200
        flight.join(30)
        assert stopped and "error" in stopped[0], stopped
        assert _cell(third, prefix, headers, context["id"], "echo $x")["stdout"]["text"].strip() == "7"
        assert _run(third, prefix, headers, f"test -d /proc/{shell_pid} && echo on") == "on"
        # A process a cell left in a session of its own (below the shell's monitor) ends with the context.
        assert "error" not in _cell(third, prefix, headers, context["id"], "(setsid sleep 997 >/dev/null 2>&1 &)")
        status, _ = third.call("DELETE", prefix + f"/code/contexts/{context['id']}", key=None, headers=headers)
        assert status == 200
        assert _run(third, prefix, headers, f"test -d /proc/{shell_pid} && echo on || echo gone") == "gone"
        assert _run(third, prefix, headers, "pgrep -c -x sleep || true") == "0"
        assert third.call("GET", prefix + "/code/contexts", key=None, headers=headers)[1] == []
    finally:
        third.stop()


def _in_session(server: base.Server, prefix: str, headers: dict[str, str], session: str, command: str) -> str:
    status, body = server.call("POST", prefix + f"/session/{session}/run", {"command": command}, key=None,
                               headers=headers)
    assert status == 200, body
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
    assert not [e for e in events if e.get("type") == "error"], events
    return "\n".join(e.get("text", "") for e in events if e.get("type") == "stdout")


def test_a_bash_session_lives_on_past_a_killed_server(state_dir: str) -> None:
    """A bash session's shell outlives its server as a bash context's does: listed in the record, adopted by the
    next server with its variables and working directory; its delete ends it and forgets it."""
    with restart(state_dir) as r:
        first, box_id, prefix, headers = r.first, r.box_id, r.prefix, r.headers
        status, made = first.call("POST", prefix + "/session", None, key=None, headers=headers)
        assert status == 200, made
        session = made["session_id"]
        assert _in_session(first, prefix, headers, session, "Y=(4 5); cd /tmp; echo $$").strip().isdigit()
        assert _recorded(state_dir, box_id, session)
        second = r.next()
        assert _in_session(second, prefix, headers, session, "echo ${Y[1]} $PWD") == "5 /tmp"
        assert second.call("DELETE", prefix + f"/session/{session}", key=None, headers=headers)[0] == 200
        assert not _recorded(state_dir, box_id, session)
        status, body = second.call("POST", prefix + f"/session/{session}/run", {"command": "true"}, key=None,
                                   headers=headers)
        assert status == 404, body


def test_a_sandbox_from_a_snapshot_snapshots_whole_after_a_restart(state_dir: str) -> None:
    """A sandbox started from a snapshot stands on the snapshot's layer; served again after a restart (attached
    by its name, its origin unknown to the new server), its snapshot still holds that layer's files."""
    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    made: list[str] = []
    snaps: list[str] = []
    try:
        source = base._create(first)["id"]
        made.append(source)
        prefix, headers = base._endpoint(first, source)
        _run(first, prefix, headers, "echo from-base > /workspace/base.txt")
        status, snap = first.call("POST", f"/v1/sandboxes/{source}/snapshots", {})
        assert status in (200, 201, 202), snap
        snaps.append(snap["id"])
        branch = base._create(first, image=None, snapshotId=snap["id"])["id"]
        made.append(branch)
        _kill(first)
        second = base.Server(*FLAGS, state_dir=state_dir)
        try:
            prefix, headers = base._endpoint(second, branch)
            _run(second, prefix, headers, "echo from-branch > /workspace/new.txt")
            status, again = second.call("POST", f"/v1/sandboxes/{branch}/snapshots", {})
            assert status in (200, 201, 202), again
            snaps.append(again["id"])
            leaf = base._create(second, image=None, snapshotId=again["id"])["id"]
            made.append(leaf)
            prefix, headers = base._endpoint(second, leaf)
            assert _run(second, prefix, headers, "cat /workspace/base.txt /workspace/new.txt").split() == \
                ["from-base", "from-branch"]
        finally:
            for snapshot_id in snaps:
                second.call("DELETE", f"/v1/snapshots/{snapshot_id}")
            second.stop()  # --end-on-exit: every sandbox ends
    finally:
        if first.proc.poll() is None:
            first.stop()


def test_a_stop_leaves_the_sandboxes_to_the_next_server(state_dir: str) -> None:
    """SIGTERM (an upgrade's stop) without --end-on-exit: the sandbox and a process it left running stay, and the
    next server serves them, the Python context with its variables; with --end-on-exit the stop ends them."""
    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first)["id"]
        prefix, headers = base._endpoint(first, box_id)
        _run(first, prefix, headers, "(setsid sleep 600 </dev/null >/dev/null 2>&1 &)")
        status, body = first.call("POST", prefix + "/code", {"code": "y = 3", "context": {"language": "python"}},
                                  key=None, headers=headers)  # the default Python context, made by its first use
        assert status == 200 and b'"error"' not in body, body
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        first.stop()
    second = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=True)
    try:
        assert _run(second, prefix, headers, "pgrep -x sleep >/dev/null && echo running") == "running"
        assert _cell(second, prefix, headers, "default-python", "y")["result"]["results"] == {"text": "3"}
    finally:
        second.stop()
    left = _leftovers(state_dir, state_dir)
    assert left["records"] == {} and left["named"] == [] and left["data"] == [], left


def test_a_paused_sandbox_stays_paused_and_resumes(state_dir: str) -> None:
    """Paused when the server was killed (the cgroup freezer where it has a cgroup, else SIGSTOP): served again
    as Paused, refusing commands, and resumed by the new server, which holds no handle on its cgroup."""
    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first, resourceLimits={"cpu": "1", "memory": "512Mi"})["id"]
        short = base._create(first, timeout=2, resourceLimits={"cpu": "1", "memory": "512Mi"})["id"]
        prefix, headers = base._endpoint(first, box_id)
        for sandbox_id in (box_id, short):
            assert first.call("POST", f"/v1/sandboxes/{sandbox_id}/pause")[0] == 202
        _kill(first)
        time.sleep(2.5)  # the short one expires, paused, while no server runs
    finally:
        first.stop()
    second = base.Server(*FLAGS, state_dir=state_dir)
    try:
        assert second.call("GET", f"/v1/sandboxes/{short}")[0] == 404
        assert _leftovers(state_dir, state_dir)["bound"] == [box_id]  # the frozen one ended all the same
        status, got = second.call("GET", f"/v1/sandboxes/{box_id}")
        assert status == 200 and got["status"]["state"] == "Paused", got
        assert second.call("POST", prefix + "/command", {"command": "true"}, key=None, headers=headers)[0] == 409
        assert second.call("POST", f"/v1/sandboxes/{box_id}/resume")[0] == 202
        assert _run(second, prefix, headers, "echo awake") == "awake"
        assert second.call("POST", f"/v1/sandboxes/{box_id}/pause")[0] == 202
        assert second.call("POST", f"/v1/sandboxes/{box_id}/resume")[0] == 202
        assert _run(second, prefix, headers, "echo again") == "again"
        assert second.call("POST", f"/v1/sandboxes/{box_id}/pause")[0] == 202
        assert second.call("DELETE", f"/v1/sandboxes/{box_id}")[0] == 204  # paused, it ends all the same
        assert _leftovers(state_dir, state_dir)["bound"] == []
    finally:
        second.stop()


def test_a_sandbox_ended_while_no_server_ran_is_let_go(state_dir: str) -> None:
    """As after a reboot, for a sandbox the server keeps no copy of (one of a server before those copies, or
    whose copy was lost): the sandbox's processes and its runtime files are gone; the next server lets its
    record go and removes its workspace's files (with a copy it is kept stopped: test_server_reboot.py)."""
    from isolate.kernel.places import runtime_dir
    from isolate.kernel.places import state_dir as isolate_state

    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first)["id"]
        pids = first.sandbox_pids()
        _kill(first)
    finally:
        first.stop()
    name = next(n[:-5] for n in os.listdir(runtime_dir()) if n.endswith(f"{box_id}.json"))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    base._wait_gone(list(pids))
    for suffix in (".json", ".sock"):
        os.unlink(os.path.join(runtime_dir(), name + suffix))
    os.unlink(os.path.join(state_dir, "stopped", f"{box_id}.json"))
    assert os.path.isdir(os.path.join(isolate_state(), "sandboxes", name))
    second = base.Server(*FLAGS, state_dir=state_dir)
    try:
        assert second.call("GET", f"/v1/sandboxes/{box_id}")[0] == 404
        assert not os.path.exists(os.path.join(state_dir, f"{box_id}.json"))
        assert not os.path.exists(os.path.join(isolate_state(), "sandboxes", name))
    finally:
        second.stop()


MAKE_KEPT = """
import math, os, sys
import isolate
box = isolate.Sandbox(name=sys.argv[1], idle_timeout=math.inf)
box.start()
print(box.processes()[0].pid, flush=True)
os._exit(0)  # as a server killed once its sandbox started
"""


def test_what_a_killed_create_left_is_ended(state_dir: str) -> None:
    """A kept sandbox whose server was killed before it described it (its socket, no description) under a
    record of its start, and one described but with no record: the next start ends both, with their files."""
    import hashlib
    import subprocess
    import sys

    from isolate.kernel.places import runtime_dir
    from isolate.kernel.places import state_dir as isolate_state

    key = hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:8]
    half, orphan = "d" * 24, "e" * 24
    inits = {}
    for sandbox_id in (half, orphan):
        done = subprocess.run([sys.executable, "-c", MAKE_KEPT, f"osb-{key}-{sandbox_id}"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        inits[sandbox_id] = int(done.stdout.split()[0])
    # Not described yet: the description was being written (a temporary file beside it).
    os.rename(os.path.join(runtime_dir(), f"osb-{key}-{half}.json"),
              os.path.join(runtime_dir(), f"osb-{key}-{half}.json.0badc0de"))
    record = {"version": 1, "id": half, "image": "ubuntu", "entrypoint": [], "metadata": {}, "createdAt": 1.0,
              "expiresAt": None, "kept": True, "state": "Starting", "renewOnAccess": None,
              "tokenHashes": ["0" * 64], "portHashes": {}, "volumes": [], "credentials": 0, "pending": False}
    with open(os.path.join(state_dir, f"{half}.json"), "w") as handle:
        json.dump(record, handle)
    server = base.Server(*FLAGS, state_dir=state_dir)
    try:
        assert server.call("GET", "/v1/sandboxes")[1]["items"] == []
    finally:
        server.stop()
    base._wait_gone(list(inits.values()))
    assert _leftovers(state_dir, state_dir)["bound"] == []  # nothing of theirs listens any more
    for sandbox_id in (half, orphan):
        name = f"osb-{key}-{sandbox_id}"
        assert not [e for e in os.listdir(runtime_dir()) if e.startswith(name)]
        assert not os.path.exists(os.path.join(isolate_state(), "sandboxes", name))
    assert os.listdir(state_dir) == [".lock"]


def test_hostile_records_are_skipped(state_dir: str) -> None:
    """What the state directory holds is checked: a malformed record, a link and a foreign entry are skipped
    and said, never followed or trusted; a record whose sandbox is gone is let go."""
    with open(os.path.join(state_dir, "0123456789abcdef01234567.json"), "w") as handle:
        json.dump({"version": 1, "id": "../../etc"}, handle)
    os.symlink("/etc/passwd", os.path.join(state_dir, "aaaaaaaaaaaaaaaaaaaaaaaa.json"))
    gone = {"version": 1, "id": "bbbbbbbbbbbbbbbbbbbbbbbb", "image": "ubuntu", "entrypoint": [], "metadata": {},
            "createdAt": 1.0, "expiresAt": None, "kept": True, "state": "Running", "renewOnAccess": None,
            "tokenHashes": ["0" * 64], "portHashes": {}, "volumes": [], "credentials": 0,
            "pending": False}
    with open(os.path.join(state_dir, "bbbbbbbbbbbbbbbbbbbbbbbb.json"), "w") as handle:
        json.dump(gone, handle)
    lost = dict(gone, id="cccccccccccccccccccccccc", kept=False, credentials=3)
    with open(os.path.join(state_dir, "cccccccccccccccccccccccc.json"), "w") as handle:
        json.dump(lost, handle)
    server = base.Server(*FLAGS, state_dir=state_dir)
    try:
        assert server.call("GET", "/v1/sandboxes")[1]["items"] == []
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        out = server.proc.stdout.read().decode() if server.proc.stdout else ""
        server.stop()
    assert "0123456789abcdef01234567.json: skipped" in out, out
    assert "aaaaaaaaaaaaaaaaaaaaaaaa.json: skipped" in out, out
    assert "3 credentials were lost with the last server" in out, out
    assert os.path.islink(os.path.join(state_dir, "aaaaaaaaaaaaaaaaaaaaaaaa.json"))  # left, not followed
    assert not os.path.exists(os.path.join(state_dir, "bbbbbbbbbbbbbbbbbbbbbbbb.json"))


def test_state_dir_others_may_write_is_refused(state_dir: str) -> None:
    os.chmod(state_dir, 0o777)
    server = None
    try:
        with pytest.raises(RuntimeError, match="others may write it"):
            server = base.Server(*FLAGS, state_dir=state_dir)
    finally:
        if server is not None:
            server.stop()


def test_a_state_dir_empty_or_not_makeable_is_one_clear_refusal(tmp_path: Any) -> None:
    from isolate.model.errors import IsolationError
    from isolate.server.keep import Keeper

    # "" would be the working directory, whose every file would be read as a record.
    with pytest.raises(IsolationError, match=r"^--state-dir: empty"):
        Keeper("")
    with pytest.raises(IsolationError, match=r"^--state-dir \S+/no/such: cannot be made \(No such file"):
        Keeper(str(tmp_path / "no" / "such"))


def test_one_server_per_state_dir(state_dir: str) -> None:
    first = base.Server(*FLAGS, state_dir=state_dir)
    try:
        with pytest.raises(RuntimeError, match="another isolate-run serve uses it"):
            base.Server(*FLAGS, state_dir=state_dir)
    finally:
        first.stop()


def _leftovers(state_dir: str, volume_store: str) -> dict[str, Any]:
    """What the state directory, the runtime directory, isolate's state directory and the volume store hold
    for this server's sandboxes."""
    import hashlib

    from isolate.backends.native.named import native_names
    from isolate.kernel.places import state_dir as isolate_state

    prefix = f"osb-{hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:8]}-"
    records: dict[str, Any] = {}
    for entry in os.listdir(state_dir):
        if entry.endswith(".json"):
            with open(os.path.join(state_dir, entry)) as handle:
                records[entry[:-5]] = json.load(handle)
    try:
        data = sorted(e[len(prefix):] for e in os.listdir(os.path.join(isolate_state(), "sandboxes"))
                      if e.startswith(prefix))
    except FileNotFoundError:
        data = []
    from isolate.kernel.places import runtime_dir

    # The runtime directory holds a socket and a description per kept sandbox, nothing else of theirs.
    runtime = sorted(e for e in os.listdir(runtime_dir()) if e.startswith(prefix)
                     and not (e.endswith((".sock", ".json")) and e[len(prefix):-5].strip(".") in records))
    # A socket bound at a kept sandbox's path, its file removed or not, is a sandbox still listening.
    with open("/proc/net/unix") as table:
        bound = sorted({os.path.basename(f[7])[len(prefix):-5] for f in (line.split() for line in table)
                        if len(f) >= 8 and os.path.basename(f[7]).startswith(prefix)})
    return {"records": records, "named": sorted(n[len(prefix):] for n in native_names() if n.startswith(prefix)),
            "runtime": runtime, "bound": bound,
            "data": data, "volumes": sorted(os.listdir(volume_store)),
            "stray": [e for e in os.listdir(state_dir) if e not in (".lock",) and not e.endswith(".json")]}


def test_a_records_code_contexts_are_checked() -> None:
    """A record's code contexts are ids the server makes, in a language whose contexts outlive it (Python, Java,
    JavaScript, TypeScript, Go, bash): nothing else is read back (the id makes the path of the interpreter's socket in
    the sandbox); a record of an earlier server has none."""
    from isolate.server.keep import BadRecord, parse_record

    sandbox_id = "f" * 24
    record = {"version": 1, "id": sandbox_id, "image": "ubuntu", "entrypoint": [], "metadata": {}, "createdAt": 1.0,
              "expiresAt": None, "kept": True, "state": "Running", "renewOnAccess": None,
              "tokenHashes": ["0" * 64], "portHashes": {}, "volumes": [], "credentials": 0, "pending": False}
    assert parse_record(record, sandbox_id).contexts == []
    good = [["ctx-0123456789abcdef", "python"], ["default-python", "python"], ["ctx-0123456789abcdee", "javascript"],
            ["default-typescript", "typescript"], ["ctx-0123456789abcded", "go"], ["default-java", "java"],
            ["default-bash", "bash"]]
    assert parse_record(dict(record, contexts=good), sandbox_id).contexts == [tuple(c) for c in good]
    for bad in ([["../../../tmp/x", "python"]], [["ctx-0123456789abcdef", "ruby"]], [["default-bash", "sh"]],
                [["ctx-01", "python"]],
                [["ctx-0123456789abcdef\n", "python"]], "ctx", [["ctx-0123456789abcdef"]], [[1, "python"]],
                [["default-python", "python"]] * 300):
        with pytest.raises(BadRecord):
            parse_record(dict(record, contexts=bad), sandbox_id)
    # A bash session's id is the key its shell's ends are kept under in the exec server: only ids it makes.
    assert parse_record(dict(record, sessions=["session-0123456789abcdef"]), sandbox_id).sessions \
        == ["session-0123456789abcdef"]
    for bad in (["session-../x"], ["session-0123456789ABCDEF"], ["code-ctx-0123456789abcdef"], "session-0", [1],
                ["session-0123456789abcdef"] * 300):
        with pytest.raises(BadRecord):
            parse_record(dict(record, sessions=bad), sandbox_id)
    # Interpreters the next server ends (a server killed as it made or deleted them): a context of a language
    # whose driver is a process of its own, written only when there are some (a server before refuses the field).
    ending = [["ctx-0123456789abcdef", "python"], ["default-java", "java"]]
    parsed = parse_record(dict(record, endingContexts=ending), sandbox_id)
    assert parsed.ending_contexts == [tuple(c) for c in ending] and parsed.to_json()["endingContexts"] == ending
    assert "endingContexts" not in parse_record(record, sandbox_id).to_json()
    for bad in ([["default-bash", "bash"]], [["ctx-0123456789abcded", "go"]], [["../x", "python"]], "x"):
        with pytest.raises(BadRecord):
            parse_record(dict(record, endingContexts=bad), sandbox_id)
    # A newer server's record (a downgrade) is left alone, and the line says so, naming what this one lacks.
    with pytest.raises(BadRecord, match=r"unknown to this server, written by a newer isolate\? \(laterField\)"):
        parse_record(dict(record, laterField=1), sandbox_id)
    with pytest.raises(BadRecord, match=r"version 2 unknown to this server"):
        parse_record(dict(record, version=2), sandbox_id)
    with pytest.raises(BadRecord, match="fields missing: pending"):
        parse_record({k: v for k, v in record.items() if k != "pending"}, sandbox_id)


def test_a_background_command_lives_on_past_a_killed_server(state_dir: str) -> None:
    """A background command of a kept sandbox is a process of the sandbox: it runs on past a SIGKILL of its
    server, and the next server of the state directory serves its status and its logs (with the lines written
    before, during and after the restart, read from any cursor), then its exit code; an interrupt after the
    restart ends it and what it started (its children, one in a session of its own included); its timeout holds.
    The create's entrypoint, a background command, lives on likewise."""
    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first, entrypoint=["/bin/sh", "-c", "echo entry up; exec tail -f /dev/null"])["id"]
        prefix, headers = base._endpoint(first, box_id)
        ticking = _background(first, prefix, headers, "i=0; while [ ! -e /tmp/stop ]; do i=$((i+1)); "
                              "echo line $i; sleep 1; done; echo last; exit 3")
        parent = _background(first, prefix, headers, "sleep 1001 & setsid sleep 1002 & (sleep 1003 &); "
                             "echo started; wait")
        status, body = first.call("POST", prefix + "/command", {"command": "exec tail -f /dev/null",
                                                                "background": True, "timeout": 4000},
                                  key=None, headers=headers)
        timed = json.loads(body.decode().splitlines()[0][6:])["text"]
        _until(lambda: "line 2" in _logs(first, prefix, headers, ticking)[0])
        assert _logs(first, prefix, headers, parent)[0] == "started\n"
        _until(lambda: _recorded(state_dir, box_id, ticking, parent, timed))
        _kill(first)
    finally:
        first.stop()
    second = base.Server(*FLAGS, state_dir=state_dir)
    try:
        status = _status(second, prefix, headers, ticking)
        assert status["running"] and status["exit_code"] is None, status
        text, end = _logs(second, prefix, headers, ticking)
        assert text.startswith("line 1\nline 2\n"), text
        seen = int(text.splitlines()[-1].split()[1])
        # Lines written after the restart, read from the cursor the last read ended at.
        more = _until(lambda: _logs(second, prefix, headers, ticking, end)[0])
        assert more.startswith(f"line {seen + 1}\n"), (text, more)
        assert _logs(second, prefix, headers, ticking, 7)[0].startswith((text + more)[7:])
        _run(second, prefix, headers, "touch /tmp/stop")
        status = _until(lambda: (s := _status(second, prefix, headers, ticking))["exit_code"] is not None and s)
        assert not status["running"] and status["exit_code"] == 3 and status["finished_at"], status
        text, end = _logs(second, prefix, headers, ticking)
        assert text.endswith("last\n") and end == len(text.encode()), text
        assert _logs(second, prefix, headers, ticking, end - 5) == ("last\n", end)
        # Its timeout, recorded, is enforced by the new server.
        status = _until(lambda: (s := _status(second, prefix, headers, timed))["exit_code"] is not None and s)
        assert status["exit_code"] == 137 and status["error"] == "timed out", status
        # The entrypoint (a background command too) runs on, its output in the sandbox's diagnostics.
        status, logs = second.call("GET", f"/v1/sandboxes/{box_id}/diagnostics/logs?scope=container")
        assert status == 200 and logs["content"] == "entry up\n", logs
        # An interrupt from the new server: the command and what it started end.
        assert _run(second, prefix, headers, "pgrep -cx sleep || true") == "3"
        assert second.call("DELETE", prefix + f"/command?id={parent}", key=None, headers=headers)[0] == 200
        status = _status(second, prefix, headers, parent)
        assert not status["running"] and status["exit_code"] == 143, status
        assert _run(second, prefix, headers, "pgrep -cx sleep || true") == "0"
    finally:
        second.stop()


def test_a_background_command_cannot_make_the_next_server_read_a_host_file_or_hang(state_dir: str) -> None:
    """A background command's files are the sandbox's: one that replaces its log by a link to a host file, or its
    log and exit file by FIFOs, gets from the restarted server what its sandbox's own view holds there (nothing),
    at once: the server reads them through the sandbox's file API, never through a link, never blocking."""
    secret_dir = tempfile.mkdtemp(prefix="isolate-serve-secret-")
    secret = os.path.join(secret_dir, "secret.txt")
    with open(secret, "w") as handle:
        handle.write("HOST SECRET\n")
    with restart(state_dir) as r:
        first, box_id, prefix, headers = r.first, r.box_id, r.prefix, r.headers
        linked = _background(first, prefix, headers, f"log=$(readlink /proc/$$/fd/1); echo before; rm $log; "
                             f"ln -s {secret} $log; echo linked >/tmp/linked; sleep 600")
        fifos = _background(first, prefix, headers, "log=$(readlink /proc/$$/fd/1); rm $log; mkfifo $log "
                            "${log%.log}.exit; echo made >/tmp/fifos; exit 5")
        _until(lambda: _run(first, prefix, headers, "cat /tmp/linked /tmp/fifos 2>/dev/null; true") == "linked\nmade")
        _until(lambda: _recorded(state_dir, box_id, linked, fifos))
        # The file it wrote (when the server opened it before the swap), or nothing: never what the link names.
        assert _logs(first, prefix, headers, linked)[0] in ("before\n", "")
        second = r.next()
        start = time.monotonic()
        assert _status(second, prefix, headers, linked)["running"]
        assert _logs(second, prefix, headers, linked) == ("", 0)
        # Its wrapper is stuck opening its exit FIFO (the sandbox's own doing): it runs, and says nothing.
        assert _status(second, prefix, headers, fifos)["running"]
        assert _logs(second, prefix, headers, fifos) == ("", 0)
        assert second.call("DELETE", prefix + f"/command?id={fifos}", key=None, headers=headers)[0] == 200
        status = _status(second, prefix, headers, fifos)
        assert not status["running"] and status["exit_code"] == 137, status
        assert time.monotonic() - start < 20  # the interrupt's grace (3 s) included
        import shutil

        shutil.rmtree(secret_dir, ignore_errors=True)


def test_a_background_commands_log_keeps_its_last_bytes(state_dir: str) -> None:
    """A background command's log file in the sandbox's /tmp holds its last OUTPUT_LIMIT bytes, as the server's
    memory held them: the older ones are freed (a hole: the offsets, the API's cursors, stay), while it runs and
    when it ends."""
    from isolate.server.state import OUTPUT_LIMIT

    server = base.Server(*FLAGS, state_dir=state_dir)
    try:
        prefix, headers = base._endpoint(server, base._create(server)["id"])
        size = OUTPUT_LIMIT + (4 << 20)
        running = _background(server, prefix, headers, f"head -c {size} /dev/zero | tr '\\0' x; echo end; sleep 600")
        ended = _background(server, prefix, headers, f"head -c {size} /dev/zero | tr '\\0' y; echo end")

        def held(command_id: str) -> int:
            return int(_run(server, prefix, headers, f"stat -c %b /tmp/.isolate-cmd-{command_id}.log")) * 512

        assert _until(lambda: _status(server, prefix, headers, ended)["exit_code"] == 0)
        for command_id in (running, ended):
            _until(lambda: held(command_id) <= OUTPUT_LIMIT + (64 << 10))  # noqa: B023 (called at once)
            text, end = _logs(server, prefix, headers, command_id)
            assert end == size + 4 and len(text) == OUTPUT_LIMIT and text.endswith("end\n"), (end, len(text))
            assert _logs(server, prefix, headers, command_id, end - 4) == ("end\n", end)
    finally:
        server.stop()


def test_a_records_background_commands_are_checked() -> None:
    """A record's background commands are read as data, each field checked: an id the server makes (it names
    the command's files in the sandbox), bounded numbers and text, an entry command among them."""
    from isolate.server.keep import MAX_COMMANDS, MAX_CONTENT, BadRecord, parse_record

    sandbox_id = "e" * 24
    record = {"version": 1, "id": sandbox_id, "image": "ubuntu", "entrypoint": [], "metadata": {}, "createdAt": 1.0,
              "expiresAt": None, "kept": True, "state": "Running", "renewOnAccess": None,
              "tokenHashes": ["0" * 64], "portHashes": {}, "volumes": [], "credentials": 0, "pending": False}
    assert parse_record(record, sandbox_id).commands == []
    good = {"id": "0123456789abcdef", "content": "sleep 1", "startedAt": 2.0, "pid": 4321, "pidStart": 1.5,
            "group": 7, "deadline": None}
    parsed = parse_record(dict(record, commands=[good], entryCommand=good["id"]), sandbox_id)
    assert [(c.id, c.pid, c.group) for c in parsed.commands] == [("0123456789abcdef", 4321, 7)]
    assert parsed.entry_command == good["id"]
    for bad in ({"id": "../../etc/passwd"}, {"id": "0123456789ABCDEF"}, {"content": "x" * (MAX_CONTENT + 1)},
                {"pid": -1}, {"pid": True}, {"pid": 1 << 40}, {"group": 0}, {"startedAt": float("nan")},
                {"deadline": "soon"}, {"extra": 1}):
        with pytest.raises(BadRecord):
            parse_record(dict(record, commands=[dict(good, **bad)]), sandbox_id)
    for commands, entry in (([good, good], None), ([good], "fedcba9876543210"), ("x", None),
                            ([dict(good, id=f"{i:016x}") for i in range(MAX_COMMANDS + 1)], None)):
        with pytest.raises(BadRecord):
            parse_record(dict(record, commands=commands, entryCommand=entry), sandbox_id)


def test_what_a_background_command_double_forked_ends_with_it(state_dir: str) -> None:
    """A process a background command double-forked into a session of its own (``setsid -f``: its parent ends
    at once, it is orphaned) ends with the command's timeout and interrupt, and with an interrupt from the next
    server after a SIGKILL of the first: the command's monitor in the sandbox stays their subreaper."""
    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)

    def left(server: base.Server, pattern: str) -> int:
        # The pattern's bracket keeps it from matching the shell that runs pgrep.
        return int(_run(server, prefix, headers, f"pgrep -cf '{pattern}' || true") or 0)

    ended: dict[str, int] = {}
    try:
        box_id = base._create(first)["id"]
        prefix, headers = base._endpoint(first, box_id)
        status, body = first.call("POST", prefix + "/command", {"command": "setsid -f sleep 1011; sleep 1010",
                                                                "background": True, "timeout": 2000},
                                  key=None, headers=headers)
        assert status == 200, body
        timed = json.loads(body.decode().splitlines()[0][6:])["text"]
        interrupted = _background(first, prefix, headers, "setsid -f sleep 1021; sleep 1020")
        restarted = _background(first, prefix, headers, "setsid -f sleep 1031; sleep 1030")
        _until(lambda: left(first, "^sleep 10[23][01]$") == 4)
        _until(lambda: _recorded(state_dir, box_id, timed, interrupted, restarted))
        status = _until(lambda: (s := _status(first, prefix, headers, timed))["exit_code"] is not None and s)
        assert status["error"] == "timed out", status
        ended["timeout"] = left(first, "^sleep 101[01]$")
        assert first.call("DELETE", prefix + f"/command?id={interrupted}", key=None, headers=headers)[0] == 200
        ended["interrupt"] = left(first, "^sleep 102[01]$")
        _kill(first)
    finally:
        first.stop()
    second = base.Server(*FLAGS, state_dir=state_dir)
    try:
        assert _status(second, prefix, headers, restarted)["running"]
        assert second.call("DELETE", prefix + f"/command?id={restarted}", key=None, headers=headers)[0] == 200
        ended["restart"] = left(second, "^sleep 103[01]$")
    finally:
        second.stop()
    assert ended == {"timeout": 0, "interrupt": 0, "restart": 0}


def test_a_sandbox_ends_at_once_though_a_process_took_its_kept_contexts_socket(state_dir: str) -> None:
    """A sandbox's end ends its kept contexts' interpreters with it (its PID namespace): it does not connect to
    them first. A process of the sandbox that took a context's socket and listens without a word held the end
    of the sandbox for the hello's wait (60 s), one context after another (a record names up to 256)."""
    with restart(state_dir) as r:
        first, box_id, prefix, headers = r.first, r.box_id, r.prefix, r.headers
        status, context = first.call("POST", prefix + "/code/context", {"language": "python"}, key=None,
                                     headers=headers)
        assert status == 200, context
        second = r.next()
        path = f"/tmp/.isolate-code-{context['id']}.sock"
        _background(second, prefix, headers,
                    f"exec python3 -c \"import os, socket, time; os.unlink('{path}'); "
                    f"s = socket.socket(socket.AF_UNIX); s.bind('{path}'); s.listen(8); "
                    "open('/tmp/squatting', 'w').close(); time.sleep(600)\"")
        _until(lambda: _run(second, prefix, headers, "test -e /tmp/squatting && echo yes || true") == "yes")
        started = time.monotonic()
        assert second.call("DELETE", f"/v1/sandboxes/{box_id}")[0] == 204
        assert time.monotonic() - started < 20, "the sandbox's end waited on the squatter's silence"
