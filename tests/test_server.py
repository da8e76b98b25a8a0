"""``isolate-run serve``: the OpenSandbox SDK's own examples, run unchanged against the server.

The server runs as a subprocess on a free port of 127.0.0.1 (as a user
starts it); the SDK (``opensandbox``, the ``server-test`` extra) is the
client. Skipped only when the ``server`` extra or the SDK is not installed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ISOLATE_RUN

pytest.importorskip("starlette", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("uvicorn", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("multipart", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("opensandbox", reason="the OpenSandbox SDK is not installed: pip install 'isolate[server-test]'")

psutil = pytest.importorskip("psutil")

KEY = "test-key-" + "0123456789abcdef"


class Server:
    """``isolate-run serve`` on a free port. Its state directory (its sandboxes' records) is ``state_dir``, else
    one of its own, removed at ``stop``; ``end_on_exit``: its stop ends its sandboxes (as tests want)."""

    def __init__(self, *extra: str, state_dir: str | None = None, end_on_exit: bool = True,
                 key_args: tuple[str, ...] = ("--api-key", KEY)) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.domain = f"127.0.0.1:{self.port}"
        # A request's wait: a create on a Ray cluster (serve --ray) may try node after node, each node's host a
        # Ray worker started on first use (seconds each on a loaded host: CI runs two suites and the VM on two
        # cores), and a pull refused by the registry is tried on every node before the create says so.
        self.call_timeout = 120.0 if "--ray" in extra else 30.0
        self.own_state = state_dir is None
        self.state_dir = state_dir if state_dir is not None else tempfile.mkdtemp(prefix="isolate-serve-state-")
        env = dict(os.environ, OPENSANDBOX_DISABLE_METRICS="1")
        self.proc = subprocess.Popen(
            [ISOLATE_RUN, "serve", "--listen", self.domain, *key_args,
             "--image", "ubuntu=default", "--state-dir", self.state_dir,
             *(("--end-on-exit",) if end_on_exit else ()), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        # A start on a loaded host (CI: two suites and the VM on two cores) after a kill may take a while: its
        # restore ends and sweeps what the killed one left.
        deadline = time.monotonic() + 120
        while True:
            try:
                self.call("GET", "/v1/sandboxes")
                break
            except (ConnectionError, urllib.error.URLError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    # Ended first: its output is read to its end, which a server still running never reaches.
                    self.proc.kill()
                    self.proc.wait()
                    out = self.proc.stdout.read().decode() if self.proc.stdout else ""
                    raise RuntimeError(f"the server did not start: {out}") from None
                time.sleep(0.1)

    def call(self, method: str, path: str, body: Any = None, key: str | None = KEY,
             headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(f"http://{self.domain}{path}", data=data, method=method)
        if key is not None:
            request.add_header("OPEN-SANDBOX-API-KEY", key)
        request.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=self.call_timeout) as response:
                text = response.read()
                status = response.status
        except urllib.error.HTTPError as err:
            text, status = err.read(), err.code
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def sandbox_pids(self) -> set[int]:
        return {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if self.own_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def limits_enforceable() -> bool:
    """Whether this host lets the caller enforce the SDK's default limits (a cgroup it may write)."""
    import isolate

    try:
        with isolate.Sandbox(isolate.Policy(limits=isolate.Limits(memory="2G", cpus=1.0))):
            return True
    except isolate.UnsupportedError:
        return False


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # The SDK asks for 1 CPU and 2 GiB by default; where this caller has no cgroup (uid 65534 here), the
    # examples run with --best-effort (test_limits_enforced_or_refused covers the refusal).
    srv = Server(*(() if limits_enforceable() else ("--best-effort",)))
    try:
        yield srv
    finally:
        srv.stop()


def run_example(server: Server, code: str, timeout: float = 120) -> str:
    """Run an SDK example as its own program (as a user would), with this server's domain and key."""
    env = dict(os.environ, OPEN_SANDBOX_DOMAIN=server.domain, OPEN_SANDBOX_API_KEY=KEY,
               OPENSANDBOX_DISABLE_METRICS="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def sdk_readme(code: str, server: Server) -> str:
    """An example of the SDK's README, with its placeholder domain and key pointed at this server."""
    code = textwrap.dedent(code)
    return code.replace('"api.opensandbox.io"', repr(server.domain)).replace('"your-api-key"', repr(KEY))


# The SDK README's "Quick Start" (asynchronous), unchanged but for the domain and key.
HELLO_ASYNC = '''
import asyncio
from opensandbox.sandbox import Sandbox
from opensandbox.config import ConnectionConfig
from opensandbox.exceptions import SandboxException

async def main():
    # 1. Configure connection
    config = ConnectionConfig(
        domain="api.opensandbox.io",
        api_key="your-api-key"
    )

    # 2. Create a Sandbox
    try:
        sandbox = await Sandbox.create(
            "ubuntu",
            connection_config=config
        )
        try:
            # 3. Execute a shell command
            execution = await sandbox.commands.run("echo 'Hello Sandbox!'")

            # 4. Print output
            print(execution.logs.stdout[0].text)
        finally:
            # 5. Terminate the remote sandbox and close local resources
            await sandbox.destroy()

    except SandboxException as e:
        # Handle Sandbox specific exceptions
        print(f"Sandbox Error: [{e.error.code}] {e.error.message}")
        # Server logs can be correlated by this request id (if available)
        print(f"Request ID: {e.request_id}")
    except Exception as e:
        print(f"Error: {e}")

if __name__ == "__main__":
    asyncio.run(main())
'''

# The SDK README's "Synchronous Quick Start", unchanged but for the domain and key.
HELLO_SYNC = '''
from datetime import timedelta

import httpx
from opensandbox import SandboxSync
from opensandbox.config import ConnectionConfigSync

config = ConnectionConfigSync(
    domain="api.opensandbox.io",
    api_key="your-api-key",
    request_timeout=timedelta(seconds=30),
    transport=httpx.HTTPTransport(limits=httpx.Limits(max_connections=20)),
)

sandbox = SandboxSync.create("ubuntu", connection_config=config)
try:
    execution = sandbox.commands.run("echo 'Hello Sandbox!'")
    print(execution.logs.stdout[0].text)
finally:
    sandbox.destroy()
'''


def test_sdk_quick_start_async(server: Server) -> None:
    before = server.sandbox_pids()
    assert run_example(server, sdk_readme(HELLO_ASYNC, server)) == "Hello Sandbox!\n"
    # destroy() ended the sandbox: none of its processes is left under the server.
    assert server.sandbox_pids() <= before
    assert server.call("GET", "/v1/sandboxes")[1]["items"] == []


def test_readme_example(server: Server) -> None:
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    section = readme.split("## OpenSandbox-compatible server", 1)[1].split("\n## ", 1)[0]
    lines = section.split("(`tests/test_server.py` runs this block):\n\n", 1)[1].splitlines()
    block = "\n".join(line for line in lines[:next(i for i, t in enumerate(lines) if t and not t.startswith(" "))])
    code = textwrap.dedent(block).replace('"127.0.0.1:8080"', repr(server.domain)).replace('"KEY"', repr(KEY))
    assert run_example(server, code) == "hi\n"


def test_sdk_quick_start_sync(server: Server) -> None:
    assert run_example(server, sdk_readme(HELLO_SYNC, server)) == "Hello Sandbox!\n"
    assert server.call("GET", "/v1/sandboxes")[1]["items"] == []


# The README's sections 1 (lifecycle), 3 (streaming with handlers) and 4 (files), in one program: each snippet
# is as printed there; around them, the create and destroy of its quick start.
SECTIONS = '''
import asyncio
from opensandbox.sandbox import Sandbox
from opensandbox.config import ConnectionConfig

async def main():
    config = ConnectionConfig(domain="api.opensandbox.io", api_key="your-api-key")
    sandbox = await Sandbox.create("ubuntu", connection_config=config)
    try:
%s
    finally:
        await sandbox.destroy()

asyncio.run(main())
'''

LIFECYCLE = '''
from datetime import timedelta

# Renew the sandbox
# This resets the expiration time to (current time + duration)
await sandbox.renew(timedelta(minutes=30))

# Pause execution (suspends all processes)
await sandbox.pause()

# Resume execution
sandbox = await Sandbox.resume(
    sandbox_id=sandbox.id,
    connection_config=config,
)

# Get current status
info = await sandbox.get_info()
print(f"State: {info.status.state}")
print(f"Expires: {info.expires_at}")  # None when no automatic expiration is configured
'''

STREAMING = '''
from opensandbox.models.execd import ExecutionHandlers, RunCommandOpts

# Define async handlers for streaming output
async def handle_stdout(msg):
    print(f"STDOUT: {msg.text}")

async def handle_stderr(msg):
    print(f"STDERR: {msg.text}")

async def handle_complete(complete):
    print(f"Command finished in {complete.execution_time_in_millis}ms")

# Create handlers (all handlers must be async)
handlers = ExecutionHandlers(
    on_stdout=handle_stdout,
    on_stderr=handle_stderr,
    on_execution_complete=handle_complete
)

# Execute command with handlers
result = await sandbox.commands.run(
    "for i in {1..5}; do echo \\"Count $i\\"; sleep 0.5; done",
    handlers=handlers
)
'''

FILES = '''
from opensandbox.models.filesystem import WriteEntry, SearchEntry

# 1. Write file
await sandbox.files.write_files([
    WriteEntry(
        path="/tmp/hello.txt",
        data="Hello World",
        mode=644
    )
])

# 2. Read file
content = await sandbox.files.read_file("/tmp/hello.txt")
print(f"Content: {content}")

# 3. List/Search files
files = await sandbox.files.search(
    SearchEntry(
        path="/tmp",
        pattern="*.txt"
    )
)
for f in files:
    print(f"Found: {f.path}")

# 4. Delete file
await sandbox.files.delete_files(["/tmp/hello.txt"])
print("left:", [f.path for f in await sandbox.files.search(SearchEntry(path="/tmp", pattern="*.txt"))])
'''


def section(snippet: str, server: Server) -> str:
    body = textwrap.indent(textwrap.dedent(snippet), " " * 8)
    return sdk_readme(SECTIONS % body, server)


def test_sdk_lifecycle_example_pause_resume_renew(server: Server) -> None:
    out = run_example(server, section(LIFECYCLE, server))
    lines = out.splitlines()
    assert lines[0] == "State: Running"
    assert lines[1].startswith("Expires: 20")


def test_sdk_streaming_example_in_order(server: Server) -> None:
    started = time.monotonic()
    out = run_example(server, section(STREAMING, server))
    lines = out.splitlines()
    assert lines[:5] == [f"STDOUT: Count {i}" for i in range(1, 6)]
    assert lines[5].startswith("Command finished in ") and lines[5].endswith("ms")
    assert int(lines[5].split()[3][:-2]) >= 2000  # five half-second sleeps
    assert time.monotonic() - started < 60


def test_sdk_files_example(server: Server) -> None:
    out = run_example(server, section(FILES, server))
    assert "Content: Hello World" in out.splitlines()
    assert "Found: /tmp/hello.txt" in out.splitlines()
    assert "left: []" in out.splitlines()


def test_sdk_output_is_live(server: Server) -> None:
    """Each line reaches the handler while the command still runs (not all at its end)."""
    code = section('''
import time
from opensandbox.models.execd import ExecutionHandlers
seen = []
async def on_stdout(msg):
    seen.append((msg.text, time.monotonic()))
start = time.monotonic()
await sandbox.commands.run("echo first; sleep 2; echo second", handlers=ExecutionHandlers(on_stdout=on_stdout))
end = time.monotonic()
print([t for t, _ in seen], round(end - seen[0][1], 1) >= 1.5)
''', server)
    assert run_example(server, code).strip() == "['first', 'second'] True"


def test_sdk_exit_code_stderr_env_cwd(server: Server) -> None:
    code = section('''
from opensandbox.models.execd import RunCommandOpts
r = await sandbox.commands.run("echo out; echo err >&2; exit 3")
print(r.exit_code, [m.text for m in r.logs.stdout], [m.text for m in r.logs.stderr])
opts = RunCommandOpts(envs={"GREETING": "hi"}, working_directory="/tmp")
r = await sandbox.commands.run("echo $GREETING; pwd", opts=opts)
print(r.exit_code, [m.text for m in r.logs.stdout])
r = await sandbox.commands.run("true")
print(r.exit_code)
''', server)
    assert run_example(server, code).splitlines() == ["3 ['out'] ['err']", "0 ['hi', '/tmp']", "0"]


def test_sdk_background_command_status_and_logs(server: Server) -> None:
    code = section('''
import asyncio
from opensandbox.models.execd import RunCommandOpts
bg = await sandbox.commands.run("echo one; sleep 1; echo two; exit 4", opts=RunCommandOpts(background=True))
status = await sandbox.commands.get_command_status(bg.id)
print("running", status.running)
while status.running:
    await asyncio.sleep(0.2)
    status = await sandbox.commands.get_command_status(bg.id)
print("exit", status.exit_code)
logs = await sandbox.commands.get_background_command_logs(bg.id)
print(repr(logs.content), logs.cursor)
more = await sandbox.commands.get_background_command_logs(bg.id, cursor=4)
print(repr(more.content), more.cursor)
''', server)
    assert run_example(server, code).splitlines() == ["running True", "exit 4", "'one\\ntwo\\n' 8", "'two\\n' 8"]


def test_sdk_interrupt(server: Server) -> None:
    code = section('''
import asyncio, time
from opensandbox.models.execd import ExecutionHandlers, RunCommandOpts
ids = []
async def on_init(init):
    ids.append(init.id)
async def interrupter():
    while not ids:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    await sandbox.commands.interrupt(ids[0])
start = time.monotonic()
task = asyncio.create_task(interrupter())
r = await sandbox.commands.run("echo started; sleep 60", handlers=ExecutionHandlers(on_init=on_init))
await task
print(r.exit_code, [m.text for m in r.logs.stdout], time.monotonic() - start < 20)
bg = await sandbox.commands.run("sleep 60", opts=RunCommandOpts(background=True))
await sandbox.commands.interrupt(bg.id)
status = await sandbox.commands.get_command_status(bg.id)
print(status.running, status.exit_code)
''', server)
    assert run_example(server, code).splitlines() == ["143 ['started'] True", "False 143"]


def test_sdk_files_and_directories(server: Server) -> None:
    code = section('''
from opensandbox.models.filesystem import (ContentReplaceEntry, MoveEntry, SearchEntry, WriteEntry,
                                           DirectoryListEntry)
await sandbox.files.create_directories([WriteEntry(path="/workspace/d/e", mode=755)])
await sandbox.files.write_file("/workspace/d/a.txt", "alpha beta alpha")
await sandbox.files.write_file("/workspace/d/e/b.py", b"print(1)\\n", mode=600)
await sandbox.files.replace_contents([ContentReplaceEntry(path="/workspace/d/a.txt", old_content="alpha",
                                                          new_content="gamma")])
print(await sandbox.files.read_file("/workspace/d/a.txt"))
await sandbox.files.move_files([MoveEntry(src="/workspace/d/a.txt", dest="/workspace/d/c.txt")])
info = await sandbox.files.get_file_info(["/workspace/d/c.txt", "/workspace/d/e/b.py"])
print(sorted((p, i.size, i.mode) for p, i in info.items()))
found = await sandbox.files.search(SearchEntry(path="/workspace", pattern="*.py"))
print([f.path for f in found])
listed = await sandbox.files.list_directory(DirectoryListEntry(path="/workspace/d", depth=2))
print(sorted(e.path for e in listed))
await sandbox.files.delete_directories(["/workspace/d"])
print(await sandbox.files.search(SearchEntry(path="/workspace", pattern="*")))
''', server)
    assert run_example(server, code).splitlines() == [
        "gamma beta gamma",
        "[('/workspace/d/c.txt', 16, 755), ('/workspace/d/e/b.py', 9, 600)]",
        "['/workspace/d/e/b.py']",
        "['/workspace/d/c.txt', '/workspace/d/e', '/workspace/d/e/b.py']",
        "[]",
    ]


def test_file_outside_the_sandbox_view_is_refused(server: Server) -> None:
    """Paths resolve inside the sandbox, as the program: the host's files are not reachable."""
    code = section('''
from opensandbox.exceptions import SandboxException
for path in ["/etc/shadow", "/root/x", "../../../../etc/shadow"]:
    try:
        await sandbox.files.read_file(path)
        print("read", path)
    except SandboxException as e:
        print("refused", path)
''', server)
    assert run_example(server, code).splitlines() == ["refused /etc/shadow", "refused /root/x",
                                                      "refused ../../../../etc/shadow"]


# -- the API's errors ---------------------------------------------------------------------------

def test_wrong_or_missing_key_is_401_with_the_error_shape(server: Server) -> None:
    for key in (None, "wrong", KEY + "x", ""):
        status, body = server.call("GET", "/v1/sandboxes", key=key)
        assert status == 401
        assert body["code"] == "UNAUTHORIZED" and body["message"]


def test_malformed_requests_get_4xx_and_the_error_shape(server: Server) -> None:
    cases: list[tuple[str, str, Any, bytes | None]] = [
        ("POST", "/v1/sandboxes", None, b"{not json"),
        ("POST", "/v1/sandboxes", None, b""),
        ("POST", "/v1/sandboxes", [1, 2], None),
        ("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "timeout": "soon"}, None),
        ("POST", "/v1/sandboxes", None, b'{"image":{"uri":"ubuntu"},"timeout":NaN}'),
        ("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "resourceLimits": {"memory": "lots"}}, None),
        ("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "resourceLimits": {"gpu": "1"}}, None),
        ("POST", "/v1/sandboxes", {"image": {"uri": "python:3.11"}}, None),
        ("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "volumes": [{"name": "v", "mountPath": "/v"}]}, None),
        ("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "networkPolicy": {"defaultAction": "allow",
                                                                                 "egress": [{"action": "deny",
                                                                                             "target": "x.com"}]}},
         None),
        ("POST", "/v1/sandboxes", {"snapshotId": "snap"}, None),
        ("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "surprise": 1}, None),
        ("GET", "/v1/sandboxes?page=0", None, None),
        ("GET", "/v1/sandboxes?pageSize=abc", None, None),
        ("GET", "/v1/sandboxes/nope", None, None),
        ("DELETE", "/v1/sandboxes/nope", None, None),
        ("GET", "/v1/nowhere", None, None),
    ]
    for method, path, body, raw in cases:
        status, answer = server.call(method, path, body, raw=raw)
        assert 400 <= status < 500, (method, path, body, status, answer)
        assert isinstance(answer, dict) and set(answer) == {"code", "message"}, (path, body, answer)
        assert "Traceback" not in answer["message"]


def _create(server: Server, **fields: Any) -> dict[str, Any]:
    status, body = server.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, **fields})
    assert status == 202, body
    return body  # type: ignore[no-any-return]


def _endpoint(server: Server, sandbox_id: str) -> tuple[str, dict[str, str]]:
    status, body = server.call("GET", f"/v1/sandboxes/{sandbox_id}/endpoints/44772")
    assert status == 200, body
    return "/" + body["endpoint"].split("/", 1)[1], body["headers"]


def run_command(server: Server, sandbox_id: str, command: str) -> str:
    """A command's stdout, through the sandbox's execution API (its endpoint and token; server-sent events)."""
    prefix, headers = _endpoint(server, sandbox_id)
    status, body = server.call("POST", prefix + "/command", {"command": command}, key=None, headers=headers)
    assert status == 200, body
    text = body.decode() if isinstance(body, bytes) else json.dumps(body)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert not [e for e in events if e.get("type") == "error"], events
    return "\n".join(e.get("text", "") for e in events if e.get("type") == "stdout")


def test_execd_needs_the_sandbox_token_and_bad_bodies_are_4xx(server: Server) -> None:
    box = _create(server)
    try:
        prefix, headers = _endpoint(server, box["id"])
        assert server.call("GET", prefix + "/ping", key=None, headers=headers)[0] == 200
        assert server.call("GET", prefix + "/ping", key=None)[0] == 401
        assert server.call("GET", prefix + "/ping", key=None, headers={"X-EXECD-ACCESS-TOKEN": "x"})[0] == 401
        other = _create(server)
        try:
            # One sandbox's token does not reach another sandbox.
            other_prefix, _ = _endpoint(server, other["id"])
            assert server.call("GET", other_prefix + "/ping", key=None, headers=headers)[0] == 401
        finally:
            server.call("DELETE", f"/v1/sandboxes/{other['id']}")
        for method, path, body, raw in [
            ("POST", "/command", None, b"[["),
            ("POST", "/command", {"command": ""}, None),
            ("POST", "/command", {"command": "id", "uid": 0}, None),
            ("POST", "/command", {"command": "id", "timeout": -5}, None),
            ("POST", "/command", {"command": "id", "envs": {"A=B": "c"}}, None),
            ("POST", "/command", {"command": "pwd", "cwd": "/does/not/exist"}, None),
            ("GET", "/command/status/nope", None, None),
            ("GET", "/command/nope/logs?cursor=-1", None, None),
            ("DELETE", "/command", None, None),
            ("GET", "/files/download?path=/nope", None, None),
            ("GET", "/files/download", None, None),
            ("GET", "/files/info?path=/nope", None, None),
            ("POST", "/files/mv", {"src": "a"}, None),
            ("POST", "/files/replace", {"/x": {"old": "", "new": "y"}}, None),
            ("POST", "/directories", {"/workspace/x": {"mode": 999}}, None),
            ("POST", "/directories", {"/workspace/x": {"mode": 755, "owner": "root"}}, None),
            ("POST", "/files/upload", None, b"not multipart"),
            ("GET", "/directories/list?path=/workspace&depth=x", None, None),
            ("GET", "/nothing", None, None),
        ]:
            status, answer = server.call(method, prefix + path, body, key=None, headers=headers, raw=raw)
            assert 400 <= status < 500, (method, path, body, status, answer)
            assert isinstance(answer, dict) and set(answer) == {"code", "message"}, (path, answer)
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_create_maps_limits_env_and_refuses_what_it_cannot_honour(server: Server) -> None:
    box = _create(server, env={"FROM_CREATE": "yes"}, resourceLimits={"cpu": "500m", "memory": "256Mi"},
                  metadata={"team": "a"})
    try:
        listed = server.call("GET", "/v1/sandboxes?metadata=team%3Da&state=RUNNING")[1]
        assert [item["id"] for item in listed["items"]] == [box["id"]]
        assert server.call("GET", "/v1/sandboxes?metadata=team%3Db")[1]["items"] == []
        prefix, headers = _endpoint(server, box["id"])
        request = urllib.request.Request(f"http://{server.domain}{prefix}/command", method="POST",
                                         data=json.dumps({"command": "echo $FROM_CREATE"}).encode(),
                                         headers={**headers, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            events = [json.loads(line[6:]) for line in response.read().decode().splitlines()
                      if line.startswith("data: ")]
        assert [e["type"] for e in events] == ["init", "stdout", "execution_complete"]
        assert events[1]["text"] == "yes"
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_limits_enforced_or_refused() -> None:
    """Without --best-effort, resourceLimits are enforced (a cgroup) or the create is refused (400), never dropped."""
    srv = Server()
    try:
        status, body = srv.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"},
                                                          "resourceLimits": {"memory": "128Mi", "cpu": "1"}})
        if not limits_enforceable():
            assert status == 400 and body["code"] == "UNSUPPORTED", body
            assert "cgroup" in body["message"]
            return
        assert status == 202, body
        try:
            info = srv.call("GET", f"/v1/sandboxes/{body['id']}")[1]
            assert "memory: cgroup" in info["status"]["message"], info
            prefix, headers = _endpoint(srv, body["id"])
            request = urllib.request.Request(
                f"http://{srv.domain}{prefix}/command", method="POST",
                data=json.dumps({"command": "python3 -c 'b = bytearray(512 << 20); print(len(b))'"}).encode(),
                headers={**headers, "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                events = [json.loads(line[6:]) for line in response.read().decode().splitlines()
                          if line.startswith("data: ")]
            assert events[-1]["type"] == "error", events  # killed or MemoryError: not 512 MiB
            assert not any(e.get("text") == str(512 << 20) for e in events)
        finally:
            srv.call("DELETE", f"/v1/sandboxes/{body['id']}")
    finally:
        srv.stop()


def test_expiry_reaps_the_sandbox_and_its_processes(server: Server) -> None:
    before = server.sandbox_pids()
    box = _create(server, timeout=2)
    assert box["expiresAt"]
    during = server.sandbox_pids() - before
    assert during, "the sandbox has processes under the server"
    deadline = time.monotonic() + 15
    while server.call("GET", f"/v1/sandboxes/{box['id']}")[0] == 200:
        assert time.monotonic() < deadline, "not reaped"
        time.sleep(0.2)
    time.sleep(0.5)
    assert not (server.sandbox_pids() & during)


def test_stop_with_end_on_exit_reaps_what_the_server_made() -> None:
    """A server stopped by SIGTERM with --end-on-exit leaves nothing running (uvicorn re-raises the signal on its
    way out); a restart without it keeps them (tests/test_server_restart.py)."""
    second = Server()
    try:
        box_id = _create(second)["id"]
        pids = second.sandbox_pids()
        assert pids
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(30) in (0, -signal.SIGTERM)
        _wait_gone(pids)
        assert not [e for e in os.listdir(second.state_dir) if e.startswith(box_id)]  # its record went too
    finally:
        second.stop()


def _wait_gone(pids: list[int]) -> None:
    """Every one of pids ends (or is a zombie) within 10 s: a killed init takes a moment to take its tree."""

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, "sandbox processes outlived their server"
        time.sleep(0.1)


# -- opensandbox-mcp, driven by an MCP client ---------------------------------------------------

MCP_DRIVER = '''
import asyncio, json, os, sys
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

async def main():
    params = StdioServerParameters(command=sys.executable, args=["-m", "opensandbox_mcp"], env=dict(os.environ))
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            tools = sorted(t.name for t in (await session.list_tools()).tools)
            results = {}

            async def call(name, **args):
                r = await session.call_tool(name, args)
                results[name] = "error: " + "".join(getattr(c, "text", "") for c in r.content)[:200] \\
                    if r.is_error else "ok"
                return r.structured_content

            created = await call("sandbox_create", image="ubuntu", resource={"cpu": "1", "memory": "512Mi"})
            sid = created["sandbox_id"]
            await call("sandbox_get_info", sandbox_id=sid)
            await call("sandbox_list")
            await call("sandbox_renew", sandbox_id=sid, timeout_seconds=900)
            await call("sandbox_healthcheck", sandbox_id=sid)
            await call("sandbox_get_metrics", sandbox_id=sid)
            await call("sandbox_get_endpoint", sandbox_id=sid, port=44772)
            out = await call("command_run", sandbox_id=sid, command="echo mcp-hello")
            assert "mcp-hello" in json.dumps(out), out
            bg = await call("command_run", sandbox_id=sid, command="sleep 60", background=True)
            await call("command_interrupt", sandbox_id=sid, execution_id=bg["id"])
            await call("file_create_directories", sandbox_id=sid, entries=[{"path": "/workspace/m", "mode": 755}])
            await call("file_write", sandbox_id=sid, path="/workspace/m/a.txt", content="one two")
            await call("file_replace_contents", sandbox_id=sid,
                       entries=[{"path": "/workspace/m/a.txt", "old_content": "one", "new_content": "three"}])
            assert "three two" in json.dumps(await call("file_read", sandbox_id=sid, path="/workspace/m/a.txt"))
            await call("file_move", sandbox_id=sid,
                       entries=[{"src": "/workspace/m/a.txt", "dest": "/workspace/m/b.txt"}])
            found = await call("file_search", sandbox_id=sid, path="/workspace", pattern="*.txt")
            assert "/workspace/m/b.txt" in json.dumps(found), found
            await call("file_delete", sandbox_id=sid, paths=["/workspace/m/b.txt"])
            await call("file_delete_directories", sandbox_id=sid, paths=["/workspace/m"])
            await call("sandbox_connect", sandbox_id=sid)
            await call("sandbox_kill", sandbox_id=sid)
            print(json.dumps({name: results.get(name, "not called") for name in tools}))

asyncio.run(main())
'''


def test_opensandbox_mcp_every_tool(server: Server) -> None:
    """opensandbox-mcp (its stdio server) driven by the mcp client: every one of its tools works here."""
    pytest.importorskip("mcp", reason="the mcp client is not installed: pip install 'isolate[server-test]'")
    pytest.importorskip("opensandbox_mcp", reason="opensandbox-mcp is missing: pip install 'isolate[server-test]'")
    lines = run_example(server, MCP_DRIVER, timeout=180).strip().splitlines()
    results = json.loads(lines[-1])
    assert len(results) >= 19, results
    assert all(value == "ok" for value in results.values()), results


def test_client_going_away_ends_its_command(server: Server) -> None:
    """A foreground command whose client disconnects is ended with everything it started (as upstream's)."""
    box = _create(server)
    try:
        prefix, headers = _endpoint(server, box["id"])
        request = urllib.request.Request(f"http://{server.domain}{prefix}/command", method="POST",
                                         data=json.dumps({"command": "echo up; sleep 300"}).encode(),
                                         headers={**headers, "Content-Type": "application/json"})
        response = urllib.request.urlopen(request, timeout=30)
        init = json.loads(response.readline().decode()[6:])
        assert init["type"] == "init"
        assert json.loads((response.readline(), response.readline())[1].decode()[6:])["text"] == "up"
        response.close()
        deadline = time.monotonic() + 15
        while True:
            status = server.call("GET", f"{prefix}/command/status/{init['text']}", key=None, headers=headers)[1]
            if not status["running"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["exit_code"] == 137
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_benchmark_runs() -> None:
    """benchmarks/opensandbox.py runs (one round, no Docker); its figures are not asserted."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from benchmarks import opensandbox as bench
    finally:
        sys.path.pop(0)
    results = bench.run(1, False, lambda message: None)
    assert all(results[name]["n"] == 1 for name in ("sdk-default-limits", "sdk-no-limits", "sdk-pooled",
                                                     "sdk-from-snapshot"))
    assert "skipped" in results["docker-backend-direct"]


def test_network_policy_maps_to_network_modes(server: Server) -> None:
    """deny → no network (the server's own port is unreachable from inside); allow → the host's network."""
    probe = f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {server.port}), 3); print(1)'"
    code = sdk_readme(f'''
import asyncio
from opensandbox.sandbox import Sandbox
from opensandbox.config import ConnectionConfig
from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule
from opensandbox.exceptions import SandboxException

PROBE = {probe!r}

async def main():
    config = ConnectionConfig(domain="api.opensandbox.io", api_key="your-api-key")
    for action in ("deny", "allow"):
        sandbox = await Sandbox.create("ubuntu", connection_config=config,
                                       network_policy=NetworkPolicy(defaultAction=action))
        try:
            policy = await sandbox.get_egress_policy()
            r = await sandbox.commands.run(PROBE)
            print(action, policy.default_action, r.exit_code, [m.text for m in r.logs.stdout])
            try:
                await sandbox.patch_egress_rules([NetworkRule(action="allow", target="example.com")])
                print("patched")
            except SandboxException:
                print("patch refused")
        finally:
            await sandbox.destroy()

asyncio.run(main())
''', server)
    lines = run_example(server, code).splitlines()
    assert lines[0].startswith("deny deny 1 [")
    assert "'1'" not in lines[0]
    assert lines[1] == "patch refused"
    assert lines[2] == "allow allow 0 ['1']"
    assert lines[3] == "patch refused"


def test_upload_total_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload's whole body is bounded (its parts are spooled to the server's disk), not only each part."""
    from starlette.testclient import TestClient

    from isolate.server import create_app
    from isolate.server.execd import files as execd

    monkeypatch.setattr(execd, "MAX_UPLOAD", 64 << 10)
    import isolate

    with TestClient(create_app(KEY, {"ubuntu": isolate.Policy()})) as client:  # type: ignore[arg-type]
        created = client.post("/v1/sandboxes", json={"image": {"uri": "ubuntu"}}, headers={"OPEN-SANDBOX-API-KEY": KEY})
        assert created.status_code == 202, created.text
        sid = created.json()["id"]
        endpoint = client.get(f"/v1/sandboxes/{sid}/endpoints/44772", headers={"OPEN-SANDBOX-API-KEY": KEY}).json()
        prefix = "/" + endpoint["endpoint"].split("/", 1)[1]

        def upload(size: int) -> Any:
            files = [("metadata", ("metadata", json.dumps({"path": "/tmp/f", "mode": 644}), "application/json")),
                     ("file", ("f", b"x" * size, "application/octet-stream"))]
            return client.post(prefix + "/files/upload", files=files, headers=endpoint["headers"])

        assert upload(1000).status_code == 200
        too_big = upload(100 << 10)
        assert too_big.status_code == 413 and too_big.json()["code"] == "REQUEST_TOO_LARGE"
        assert client.delete(f"/v1/sandboxes/{sid}", headers={"OPEN-SANDBOX-API-KEY": KEY}).status_code == 204


def test_sdk_bash_session_keeps_state(server: Server) -> None:
    code = section('''
from datetime import timedelta
sid = await sandbox.commands.create_session(working_directory="/tmp")
r = await sandbox.commands.run_in_session(sid, "X=5; cd /workspace; f() { echo \\"f:$1\\"; }")
print(r.exit_code)
r = await sandbox.commands.run_in_session(sid, "echo $X; pwd; f arg")
print(r.exit_code, [m.text for m in r.logs.stdout])
r = await sandbox.commands.run_in_session(sid, "pwd", working_directory="/tmp")
print([m.text for m in r.logs.stdout])
r = await sandbox.commands.run_in_session(sid, "false")
print(r.exit_code)
r = await sandbox.commands.run_in_session(sid, "sleep 30", timeout=timedelta(seconds=1))
r = await sandbox.commands.run_in_session(sid, "echo still $X")
print([m.text for m in r.logs.stdout])
await sandbox.commands.delete_session(sid)
try:
    await sandbox.commands.run_in_session(sid, "true")
    print("ran")
except Exception:
    print("gone")
''', server)
    assert run_example(server, code).splitlines() == ["0", "0 ['5', '/workspace', 'f:arg']", "['/tmp']", "1",
                                                      "['still 5']", "gone"]


def test_code_interpreter_contexts(server: Server) -> None:
    """opensandbox-code-interpreter: Python contexts keep state, give results, errors and streams; bash too."""
    pytest.importorskip("code_interpreter", reason="the code-interpreter SDK is missing: pip install "
                        "'isolate[server-test]'")
    code = section('''
import asyncio, time
from code_interpreter import CodeInterpreter
from code_interpreter.models.code import SupportedLanguage
# No Jupyter behind this server: its strict health check (a Jupyter port) is skipped.
interpreter = await CodeInterpreter.create(sandbox=sandbox, skip_health_check=True)
context = await interpreter.codes.create_context(SupportedLanguage.PYTHON)
r = await interpreter.codes.run("x = 41\\nprint('hello')\\nx + 1", context=context)
print([m.text for m in r.logs.stdout], [x.text for x in r.result], r.error, r.execution_count)
r = await interpreter.codes.run("import sys; print('e', file=sys.stderr); 1/0", context=context)
print([m.text for m in r.logs.stderr], r.error.name, r.error.value)
r = await interpreter.codes.run("x", context=context)
print([x.text for x in r.result], r.execution_count)
print([m.text for m in (await interpreter.codes.run("print('default')")).logs.stdout])
bash = await interpreter.codes.create_context(SupportedLanguage.BASH)
await interpreter.codes.run("Y=(2 3)", context=bash)  # an array: bash, not a POSIX sh
print([m.text for m in (await interpreter.codes.run("echo again ${Y[1]}", context=bash)).logs.stdout])
async def stop():
    await asyncio.sleep(1)
    await interpreter.codes.interrupt(context.id)
start = time.monotonic()
task = asyncio.create_task(stop())
r = await interpreter.codes.run("import time\\ntime.sleep(60)", context=context)
await task
print(r.error.name, time.monotonic() - start < 20)
r = await interpreter.codes.run("x * 2", context=context)
print([x.text for x in r.result])
print(len(await interpreter.codes.list_contexts(SupportedLanguage.PYTHON)))
''', server)
    assert run_example(server, code).splitlines() == [
        "['hello'] ['42'] None 1", "['e'] ZeroDivisionError division by zero", "['41'] 3", "['default']",
        "['again 3']", "KeyboardInterrupt True", "['82']", "2"]


def test_one_sandbox_cannot_take_the_servers_commands_or_sessions() -> None:
    # Commands, bash sessions and code contexts each hold a thread and descriptors of the server's; one
    # client could start them without end (only 256 running commands per sandbox, no bound on sessions,
    # none over all sandboxes). Now: --max-commands over all sandboxes, a quarter of it per sandbox, and
    # at most 32 sessions and contexts per sandbox.
    srv = Server("--max-commands", "8")
    try:
        first, second = _create(srv), _create(srv)
        (prefix_a, headers_a), (prefix_b, headers_b) = _endpoint(srv, first["id"]), _endpoint(srv, second["id"])
        background = {"command": "sleep 60", "background": True}
        assert [srv.call("POST", prefix_a + "/command", background, headers=headers_a)[0] for _ in range(2)] \
            == [200, 200]
        status, body = srv.call("POST", prefix_a + "/command", background, headers=headers_a)
        assert status == 429 and body["code"] == "TOO_MANY_COMMANDS", body
        assert [srv.call("POST", prefix_b + "/command", background, headers=headers_b)[0] for _ in range(2)] \
            == [200, 200]  # the other sandbox is not starved
        made = [srv.call("POST", prefix_a + "/session", None, headers=headers_a)[0] for _ in range(32)]
        assert made == [200] * 32, made
        status, body = srv.call("POST", prefix_a + "/session", None, headers=headers_a)
        assert status == 429 and body["code"] == "TOO_MANY_SESSIONS", body
        status, body = srv.call("POST", prefix_a + "/code/context", {"language": "bash"}, headers=headers_a)
        assert status == 429 and body["code"] == "TOO_MANY_SESSIONS", body
        assert srv.call("POST", prefix_b + "/session", None, headers=headers_b)[0] == 200
    finally:
        srv.stop()


def test_max_sandboxes() -> None:
    srv = Server("--max-sandboxes", "2")
    try:
        first, _second = _create(srv), _create(srv)
        status, body = srv.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}})
        assert status == 429 and body["code"] == "TOO_MANY_SANDBOXES", body
        assert srv.call("DELETE", f"/v1/sandboxes/{first['id']}")[0] == 204
        _create(srv)
    finally:
        srv.stop()


def test_docker_profile_is_refused(tmp_path: Any) -> None:
    """A profile on the Docker backend is refused at create, clearly (commands and files need the native one)."""
    profile = tmp_path / "docker.toml"
    profile.write_text('backend = "docker"\nimage = "isolate-test:busybox"\n')
    srv = Server("--image", f"busybox={profile}")
    try:
        status, body = srv.call("POST", "/v1/sandboxes", {"image": {"uri": "busybox"}})
        assert status == 400 and body["code"] == "UNSUPPORTED" and "native backend only" in body["message"], body
        assert srv.call("GET", "/v1/sandboxes")[1]["items"] == []
    finally:
        srv.stop()


def test_pause_stops_the_sandbox_and_refuses_execution(server: Server) -> None:
    box = _create(server)
    sid = box["id"]
    try:
        prefix, headers = _endpoint(server, sid)

        def lines() -> int:
            status, body = server.call("GET", f"{prefix}/files/download?path=/tmp/ticks", key=None, headers=headers)
            assert status == 200, body
            return len(body.splitlines()) if isinstance(body, bytes) else len(str(body).splitlines())

        run = {"command": "while true; do echo t >> /tmp/ticks; sleep 0.05; done", "background": True}
        request = urllib.request.Request(f"http://{server.domain}{prefix}/command", method="POST",
                                         data=json.dumps(run).encode(),
                                         headers={**headers, "Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()
        time.sleep(0.5)
        assert server.call("POST", f"/v1/sandboxes/{sid}/pause")[0] == 202
        assert server.call("GET", f"/v1/sandboxes/{sid}")[1]["status"]["state"] == "Paused"
        assert server.call("POST", f"/v1/sandboxes/{sid}/pause")[0] == 409
        status, body = server.call("GET", f"{prefix}/ping", key=None, headers=headers)
        assert status == 409 and body["code"] == "SANDBOX_NOT_RUNNING"
        time.sleep(2)
        assert server.call("POST", f"/v1/sandboxes/{sid}/resume")[0] == 202
        after_resume = lines()
        time.sleep(1)
        later = lines()
        # Paused for 2 s, nothing was written then; running 1 s, about 20 lines were.
        assert later - after_resume >= 5, (after_resume, later)
        assert after_resume <= 20, after_resume  # ~0.5 s of ticks before the pause, not 2.5 s
    finally:
        server.call("DELETE", f"/v1/sandboxes/{sid}")


def test_download_of_a_hostile_file_name(server: Server) -> None:
    """A file name made inside (quotes, CR/LF, non-Latin-1) does not reach the response's headers as such."""
    box = _create(server)
    try:
        prefix, headers = _endpoint(server, box["id"])
        name = 'a"b\r\nX-Injected: 1\u2603'
        run = {"command": f"printf data > {shlex.quote('/tmp/' + name)}"}
        request = urllib.request.Request(f"http://{server.domain}{prefix}/command", method="POST",
                                         data=json.dumps(run).encode(),
                                         headers={**headers, "Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()
        query = urllib.parse.urlencode({"path": "/tmp/" + name})
        request = urllib.request.Request(f"http://{server.domain}{prefix}/files/download?{query}", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.read() == b"data"
            assert response.headers.get("X-Injected") is None
            assert response.headers["Content-Disposition"] == 'attachment; filename="a_b__X-Injected__1_"'
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


#: A cell that reads the last word of its own command line (where the end marker's token was) and prints a
#: forged end with it, then ends with 'real'.
FORGING_CELL = """import sys
words = open('/proc/self/cmdline', 'rb').read().split(bytes(1))
print(chr(10) + words[-2].decode() + '{"count": 7, "result": "FORGED", "error": null}')
'real'
"""


def test_code_context_answers_come_only_from_its_driver(server: Server) -> None:
    """A cell's end came as a marker on stdout whose token was on the driver's command line: a cell, or any
    process of the sandbox, read it (sys.argv, /proc/PID/cmdline) and ended the cell with a result of its
    own (before: FORGED, count 7). The answer now comes on a channel only the driver holds."""
    pytest.importorskip("code_interpreter", reason="the code-interpreter SDK is missing: pip install "
                        "'isolate[server-test]'")
    code = section('''
import asyncio
from code_interpreter import CodeInterpreter
from code_interpreter.models.code import SupportedLanguage
interpreter = await CodeInterpreter.create(sandbox=sandbox, skip_health_check=True)
context = await interpreter.codes.create_context(SupportedLanguage.PYTHON)
r = await asyncio.wait_for(interpreter.codes.run(CELL, context=context), 20)
print([x.text for x in r.result], r.error, r.execution_count)
print("alive", (await sandbox.commands.run("echo ok")).logs.stdout[0].text)
'''.replace("CELL", repr(FORGING_CELL)), server)
    assert run_example(server, code).splitlines() == ["[\"'real'\"] None 1", "alive ok"]


#: A cell whose child, forked by libc (Python's at-fork hooks do not run: it keeps the driver's answer
#: channel), answers the next cell before that cell ends.
FORKING_CELL = r'''
import ctypes, os, stat, time
ch = [int(f) for f in os.listdir('/proc/self/fd') if int(f) >= 512 and stat.S_ISSOCK(os.fstat(int(f)).st_mode)][0]
if ctypes.CDLL(None).fork() == 0:
    time.sleep(1.0)
    os.write(ch, b'{"count": 2, "result": "FORGED", "error": null}\n')
    os._exit(0)
"cell 1"
'''


def test_a_cells_forked_child_cannot_answer_the_next_cell() -> None:
    """A child a cell forks inherits the driver's answer channel: it answered the next cell (before:
    FORGED, after 1 s of a cell that sleeps 3), and every answer after came one cell late. The server takes
    answers from the driver's pid only (SO_PASSCRED)."""
    from isolate.kept.sandbox import Sandbox
    from isolate.server.code import CodeContext

    def run(context: Any, code: str) -> list[Any]:
        events: list[Any] = []
        context.run(code, lambda kind, value: events.append((kind, value)))
        return [value for kind, value in events if kind == "done"]

    with Sandbox() as box:
        context = CodeContext(box, "python")
        try:
            assert run(context, FORKING_CELL)[0]["result"] == "'cell 1'"
            assert run(context, "import time\ntime.sleep(3)\n42")[0]["result"] == "42"
            assert run(context, "1 + 1")[0]["result"] == "2"
        finally:
            context.close()


def test_the_api_key_comes_from_a_file_or_the_environment_and_may_start_with_a_dash(tmp_path: Any) -> None:
    # On the command line a key is every local user's to read (ps); and one a random generator began with "-"
    # was taken by argparse for an option (the example's server then did not start, 1 run in 64).
    key = "-" + KEY
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o644)
    refused = subprocess.run([ISOLATE_RUN, "serve", "--api-key-file", str(key_file)], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 125 and "others may read it" in refused.stderr, refused
    key_file.chmod(0o600)
    both = subprocess.run([ISOLATE_RUN, "serve", "--api-key", KEY, "--api-key-file", str(key_file)],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 125 and "give one" in both.stderr, both
    short = subprocess.run([ISOLATE_RUN, "serve"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "ISOLATE_API_KEY": "short"})
    assert short.returncode == 125 and "ISOLATE_API_KEY" in short.stderr and "16" in short.stderr, short
    srv = Server(key_args=("--api-key-file", str(key_file)))
    try:
        assert srv.call("GET", "/v1/sandboxes", key=key)[0] == 200
        assert srv.call("GET", "/v1/sandboxes", key=KEY)[0] == 401
    finally:
        srv.stop()


# A bad option of serve is isolate-run's own refusal, as every subcommand's: one line and 125 (argparse printed
# its usage and exited 2), and no server starts.
# An empty value too (--profile "" dropped the profile in silence, --volume-store "" the store given).
@pytest.mark.parametrize("args", [["--listen", ""], ["--listen", "h:99999"], ["--warm", "-1"],
                                  ["--max-sandboxes", "x"], ["--max-commands", "1e400"], ["bogus"],
                                  ["--profile", ""], ["--volume-store", ""], ["--volume-root", ""], ["--image", ""]])
def test_a_bad_serve_option_is_one_line_and_125(args: list[str]) -> None:
    done = subprocess.run([ISOLATE_RUN, "serve", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 125 and len(done.stderr.splitlines()) == 1, done
    assert done.stderr.startswith("isolate-run serve: ") and "Traceback" not in done.stderr and not done.stdout
