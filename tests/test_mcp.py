"""isolate-mcp, driven by the MCP client of the ``mcp`` package over stdio, as an agent's host drives it.

Every tool is called and its result checked against what really happened in
the sandbox; the server runs as a separate process (``python -m``), as a
client starts it. Root and uid 65534 (tests/run-all.sh).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import NAMESPACES_WHY, descriptors_past_fd_setsize, policy, processes_with

pytest.importorskip("mcp", reason="the mcp package is not installed (pip install 'isolate[mcp]')")

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")

#: The installed console script, as a client's configuration names it (else the module, as -m runs it).
SCRIPT = os.path.join(os.path.dirname(sys.executable), "isolate-mcp")
SERVER = [SCRIPT] if os.access(SCRIPT, os.X_OK) else [sys.executable, "-m", "isolate.integrations.mcp_server"]


def profile(tmp: Path, **changes: Any) -> str:
    """A policy profile file, as a user would write one (here: the tests' policy, saved as TOML)."""
    path = tmp / f"profile-{secrets.token_hex(3)}.toml"
    policy(write=(), **changes).save(path)
    return str(path)


class Client:
    """An MCP client session; ``call`` returns a tool's structured result and fails on a tool error."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.called: set[str] = set()

    async def call(self, name: str, progress: Callable[..., Any] | None = None, /, **arguments: Any) -> Any:
        result = await self.session.call_tool(name, arguments, progress_callback=progress)
        text = result.content[0].text if result.content else ""  # type: ignore[union-attr]
        assert not result.is_error, f"{name}({arguments}) failed: {text}"
        self.called.add(name)
        if result.structured_content is None:
            return json.loads(text)
        data = result.structured_content
        # A list (or other non-object) result is wrapped as {"result": ...}.
        return data["result"] if set(data) == {"result"} else data

    async def error(self, name: str, /, **arguments: Any) -> str:
        """Call a tool that must fail: its error, which must be one line and no traceback."""
        result = await self.session.call_tool(name, arguments)
        assert result.is_error, f"{name}({arguments}) should have failed: {result}"
        text: str = result.content[0].text  # type: ignore[union-attr]
        assert "\n" not in text.strip() and "Traceback" not in text, text
        return text


@asynccontextmanager
async def server(*args: str) -> AsyncIterator[Client]:
    params = StdioServerParameters(command=SERVER[0], args=[*SERVER[1:], *args], cwd="/tmp")
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield Client(session)


def gone(marker: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


async def started(marker: str, within: float = 10.0) -> bool:
    """A process with ``marker`` runs (a command just started may not have exec'd yet on a loaded host)."""
    deadline = time.monotonic() + within
    while not processes_with(marker):
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.05)
    return True


async def ended(marker: str, within: float = 10.0) -> bool:
    """``gone``, letting the client's event loop go on meanwhile (it may have a cancellation to send)."""
    deadline = time.monotonic() + within
    while processes_with(marker):
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.1)
    return True


def test_every_tool_does_what_it_says(tmp_path: Path) -> None:
    marker = f"3000.{secrets.randbelow(10**6):06d}"  # an argument of sleep no other process has
    left = f"3001.{secrets.randbelow(10**6):06d}"
    listed: list[str] = []
    called: set[str] = set()

    async def main() -> None:
        async with server("--profile", profile(tmp_path)) as c:
            listed.extend(t.name for t in (await c.session.list_tools()).tools)

            box = await c.call("sandbox_create", env={"GREETING": "hello"}, metadata={"task": "t1"})
            sid = box["sandbox_id"]
            assert box["state"] == "running" and box["workspace"] == "/workspace"
            assert [b["sandbox_id"] for b in (await c.call("sandbox_list"))["sandboxes"]] == [sid]
            info = await c.call("sandbox_get_info", sandbox_id=sid)
            assert info["metadata"] == {"task": "t1"} and info["enforced"], info
            assert (await c.call("sandbox_healthcheck", sandbox_id=sid))["healthy"] is True

            # Files: written, read back (whole and a range), edited.
            assert (await c.call("file_write", sandbox_id=sid, path="src/app.sh",
                                 content="echo v1\n", mode=755))["status"] == "written"
            assert (await c.call("file_read", sandbox_id=sid, path="src/app.sh"))["content"] == "echo v1\n"
            assert (await c.call("file_read", sandbox_id=sid, path="/workspace/src/app.sh",
                                 range_header="bytes=0-3"))["content"] == "echo"
            replaced = await c.call("file_replace_contents", sandbox_id=sid, entries=[
                {"path": "src/app.sh", "old_content": "v1", "new_content": "v2", "count": 1}])
            assert replaced == [{"path": "src/app.sh", "replaced": 1}]

            # A command: its output, exit status, the sandbox's env, and its output streamed as progress.
            progress: list[str] = []

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                progress.append(message or "")

            run = await c.call("command_run", on_progress, sandbox_id=sid,
                               command="./src/app.sh; echo $GREETING; sleep 0.2; echo oops >&2; exit 4")
            assert (run["exit_code"], run["stdout"], run["stderr"]) == (4, "v2\nhello\n", "oops\n"), run
            streamed = {"stdout": "", "stderr": ""}
            for message in progress:
                stream, _, text = message.partition(": ")
                streamed[stream] += text
            assert streamed == {"stdout": "v2\nhello\n", "stderr": "oops\n"}, progress
            run = await c.call("command_run", sandbox_id=sid, command="pwd", working_directory="/tmp")
            assert run["stdout"] == "/tmp\n"

            # A background command: running, measured, interrupted (and everything it started with it).
            bg = await c.call("command_run", sandbox_id=sid, command=f"sleep {marker}", background=True)
            status = await c.call("command_get_status", sandbox_id=sid, execution_id=bg["id"])
            assert status["status"] == "running" and status["exit_code"] is None
            assert await started(marker)
            metrics = await c.call("sandbox_get_metrics", sandbox_id=sid)
            assert metrics["processes"] >= 2 and metrics["memory_used_in_mib"] > 0, metrics
            assert (await c.call("command_interrupt", sandbox_id=sid, execution_id=bg["id"]))["status"] == \
                "interrupted"
            for _ in range(100):
                status = await c.call("command_get_status", sandbox_id=sid, execution_id=bg["id"])
                if status["status"] != "running":
                    break
                await anyio.sleep(0.1)
            assert status["exit_code"] == 137, status
            assert await ended(marker)

            # A persistent shell: cd and variables persist.
            session = (await c.call("command_create_session", sandbox_id=sid, session_id="s1"))["session_id"]
            assert session == "s1"
            first = await c.call("command_run_in_session", sandbox_id=sid, session_id="s1",
                                 command="cd /tmp && X=42")
            assert first == {"output": "", "exit_code": 0}
            later = await c.call("command_run_in_session", sandbox_id=sid, session_id="s1",
                                 command="pwd; echo $X; false")
            assert later == {"output": "/tmp\n42\n", "exit_code": 1}
            there = await c.call("command_run_in_session", sandbox_id=sid, session_id="s1", command="pwd",
                                 working_directory="/workspace/src")
            assert there["output"] == "/workspace/src\n"
            assert (await c.call("sandbox_get_info", sandbox_id=sid))["sessions"] == ["s1"]
            assert (await c.call("command_delete_session", sandbox_id=sid, session_id="s1"))["status"] == "deleted"

            # Directories, listing, status, glob, grep, move, delete.
            await c.call("file_create_directories", sandbox_id=sid, entries=[{"path": "a/b", "mode": 700}])
            stats = await c.call("file_get_info", sandbox_id=sid, paths=["a/b", "src/app.sh"])
            assert (stats["a/b"]["type"], stats["a/b"]["mode"]) == ("dir", "700")
            assert (stats["src/app.sh"]["type"], stats["src/app.sh"]["mode"], stats["src/app.sh"]["size"]) == \
                ("file", "755", 8)
            listing = await c.call("file_list", sandbox_id=sid, path=".", depth=2)
            assert {"a", "a/b", "src", "src/app.sh"} <= {e["path"] for e in listing["entries"]}, listing
            found = await c.call("file_search", sandbox_id=sid, path=".", pattern="**/*.sh")
            assert [f["path"] for f in found] == ["src/app.sh"]
            grep = await c.call("file_grep", sandbox_id=sid, pattern=r"echo v\d", glob="*.sh")
            assert [(m["path"], m["line_number"], m["line"]) for m in grep["matches"]] == \
                [("src/app.sh", 1, "echo v2")], grep
            await c.call("file_move", sandbox_id=sid, entries=[{"source": "src/app.sh", "destination": "a/b/x.sh"}])
            assert (await c.call("file_read", sandbox_id=sid, path="a/b/x.sh"))["content"] == "echo v2\n"
            assert "No such file" in await c.error("file_read", sandbox_id=sid, path="src/app.sh")
            await c.call("file_delete", sandbox_id=sid, paths=["a/b/x.sh"])
            assert "No such file" in await c.error("file_get_info", sandbox_id=sid, paths=["a/b/x.sh"])
            await c.call("file_delete_directories", sandbox_id=sid, paths=["a"])
            assert (await c.call("command_run", sandbox_id=sid, command="ls -A"))["stdout"] == "src\n"

            # Pause: nothing runs, and the tools say so at once; resume: it goes on.
            mechanism = (await c.call("sandbox_pause", sandbox_id=sid))["mechanism"]
            assert mechanism in ("cgroup-freezer", "sigstop")
            assert (await c.call("sandbox_get_info", sandbox_id=sid))["state"] == "paused"
            assert "paused" in await c.error("command_run", sandbox_id=sid, command="true")
            assert (await c.call("sandbox_resume", sandbox_id=sid))["status"] == "running"
            assert (await c.call("command_run", sandbox_id=sid, command="echo back"))["stdout"] == "back\n"

            # Kill: it and everything in it end.
            await c.call("command_run", sandbox_id=sid, command=f"sleep {marker} >/dev/null 2>&1 &")
            assert await started(marker)
            assert (await c.call("sandbox_kill", sandbox_id=sid))["status"] == "killed"
            assert await ended(marker)
            assert (await c.call("sandbox_list"))["sandboxes"] == []

            # What the server still holds when it exits ends with it.
            other = (await c.call("sandbox_create"))["sandbox_id"]
            await c.call("command_run", sandbox_id=other, command=f"sleep {left} >/dev/null 2>&1 &")
            assert await started(left)
            called.update(c.called)

    anyio.run(main)
    assert gone(left), "a sandbox of the server outlived it"
    # sandbox_connect needs a kept sandbox of an earlier server: test_a_kept_sandbox_outlives_the_server.
    assert set(listed) - called == {"sandbox_connect"}, set(listed) - called
    assert len(listed) == 26, listed


def test_a_kept_sandbox_outlives_the_server(tmp_path: Path) -> None:
    name = f"mcp-kept-{secrets.token_hex(4)}"
    mine = profile(tmp_path)
    other = profile(tmp_path, network="host")

    async def main() -> None:
        async with server("--profile", mine) as c:
            await c.error("sandbox_create", keep=True)  # only a named one can be kept
            await c.call("sandbox_create", name=name, keep=True)
            await c.call("file_write", sandbox_id=name, path="kept.txt", content="still here\n")
        async with server("--profile", other) as c:
            assert "another policy" in await c.error("sandbox_connect", sandbox_id=name)
        async with server("--profile", mine) as c:
            info = await c.call("sandbox_connect", sandbox_id=name)
            assert info["sandbox_id"] == name and info["kept"] is True
            assert (await c.call("file_read", sandbox_id=name, path="kept.txt"))["content"] == "still here\n"
            assert (await c.call("sandbox_kill", sandbox_id=name))["status"] == "killed"
        async with server("--profile", mine) as c:
            assert "no running sandbox" in await c.error("sandbox_connect", sandbox_id=name)

    try:
        anyio.run(main)
    finally:
        from isolate import Sandbox

        try:
            Sandbox.attach(name, ping=False).close()
        except Exception:
            pass


def test_the_profile_decides_and_what_cannot_be_honoured_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with server("--profile", profile(tmp_path, env={"FROM_PROFILE": "yes"}, limits={"file_size": "1k"}),
                          "--max-sandboxes", "1") as c:
            sid = (await c.call("sandbox_create"))["sandbox_id"]
            assert "--max-sandboxes" in await c.error("sandbox_create")
            run = await c.call("command_run", sandbox_id=sid,
                               command="echo $FROM_PROFILE; head -c 4096 /dev/zero > big; stat -c %s big")
            assert run["stdout"].split() == ["yes", "1024"], run
            for arguments, says in (
                ({"resource": {"cpu": "1"}}, "resource:"),
                ({"network_policy": {"default_action": "allow"}}, "network_policy:"),
                ({"image": "127.0.0.1:9/absent/image:1"}, "image 127.0.0.1:9/absent"),  # pull fails: none listens
            ):
                assert says in await c.error("sandbox_create", **arguments)
            assert "owner/group" in await c.error("file_write", sandbox_id=sid, path="f", content="", owner="root")
            assert "octal" in await c.error("file_write", sandbox_id=sid, path="f", content="", mode=999)
            assert "does not occur" in await c.error("file_replace_contents", sandbox_id=sid, entries=[
                {"path": "big", "old_content": "nothing like it", "new_content": "x"}])
            assert "no sandbox 'nope'" in await c.error("command_run", sandbox_id="nope", command="true")
            assert "is a directory" in await c.error("file_delete", sandbox_id=sid, paths=["/tmp"])
            assert "not a directory" in await c.error("file_delete_directories", sandbox_id=sid, paths=["big"])
            assert "not valid base64" in await c.error("file_write", sandbox_id=sid, path="f", content="@@",
                                                       encoding="base64")
            # Bytes that are not text come back as base64 when asked.
            await c.call("file_write", sandbox_id=sid, path="bin", content="/wA=", encoding="base64")
            assert (await c.call("file_read", sandbox_id=sid, path="bin", encoding="base64"))["content"] == "/wA="
            assert "base64" in await c.error("file_read", sandbox_id=sid, path="bin")

    anyio.run(main)


def test_a_profile_that_cannot_be_read_is_one_line_and_125(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("network = 'sometimes'\n")
    for args in (["--profile", str(bad)], ["--profile", str(tmp_path / "missing.toml")]):
        done = subprocess.run([*SERVER, *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL, env={**os.environ})
        assert done.returncode == 125, done
        assert done.stderr.startswith("isolate-mcp: ") and done.stderr.count("\n") == 1, done.stderr


def test_a_flood_is_streamed_bounded_and_a_cancelled_call_ends_its_command(tmp_path: Path) -> None:
    marker = f"3002.{secrets.randbelow(10**6):06d}"

    async def main() -> None:
        async with server("--profile", profile(tmp_path)) as c:
            sid = (await c.call("sandbox_create"))["sandbox_id"]
            seen: list[tuple[float, str]] = []

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                seen.append((done, message or ""))

            run = await c.call("command_run", on_progress, sandbox_id=sid,
                               command="head -c 50000000 /dev/zero | tr '\\0' x; echo; echo end")
            assert run["exit_code"] == 0 and run["truncated"] is True
            assert len(run["stdout"]) == 1 << 20 and run["stdout"].endswith("x\nend\n")
            # Every byte is counted in the progress, but what the client could not take was not queued.
            assert seen[-1][0] == 50_000_005, seen[-1][0]
            assert any("bytes not streamed" in m for _, m in seen)
            assert sum(len(m) for _, m in seen) < 20_000_000

            # A call the client gives up on (it sends notifications/cancelled) ends its command.
            with pytest.raises(Exception, match=r"(?i)timed out|timeout"):
                await c.session.call_tool("command_run", {"sandbox_id": sid, "command": f"sleep {marker}"},
                                          read_timeout_seconds=2)
            assert await ended(marker)
            assert (await c.call("command_run", sandbox_id=sid, command="echo alive"))["stdout"] == "alive\n"

            # A session whose shell exited says so (it is not replaced by a fresh one behind the agent's back).
            await c.call("command_create_session", sandbox_id=sid, session_id="s")
            await c.call("command_run_in_session", sandbox_id=sid, session_id="s", command="cd /tmp")
            await c.error("command_run_in_session", sandbox_id=sid, session_id="s", command="exit 3")
            assert "ended" in await c.error("command_run_in_session", sandbox_id=sid, session_id="s", command="pwd")
            await c.call("command_delete_session", sandbox_id=sid, session_id="s")

    anyio.run(main)


def test_a_docker_profile_works_as_a_native_one(tmp_path: Path) -> None:
    from test_docker import ENGINE_OK, ENGINE_WHY, IMAGE

    if not ENGINE_OK:
        pytest.skip(f"no usable Docker engine: {ENGINE_WHY}")
    import isolate

    path = tmp_path / "docker.toml"
    isolate.Policy(backend="docker", image=IMAGE).save(path)

    async def main() -> None:
        async with server("--profile", str(path)) as c:
            box = await c.call("sandbox_create", image=IMAGE)  # the profile's own image is accepted
            sid = box["sandbox_id"]
            assert box["backend"] == "docker" and box["workspace"] is None
            run = await c.call("command_run", sandbox_id=sid, command="echo in; echo err >&2; exit 2")
            assert (run["exit_code"], run["stdout"], run["stderr"]) == (2, "in\n", "err\n"), run
            # The Docker backend keeps the same exec server in the container: the rest works as natively.
            bg = await c.call("command_run", sandbox_id=sid, command="sleep 0.2; echo done", background=True)
            await c.call("file_write", sandbox_id=sid, path="x", content="on docker\n")
            assert (await c.call("file_read", sandbox_id=sid, path="x"))["content"] == "on docker\n"
            await c.call("sandbox_pause", sandbox_id=sid)
            await c.call("sandbox_resume", sandbox_id=sid)
            for _ in range(100):
                status = await c.call("command_get_status", sandbox_id=sid, execution_id=bg["id"])
                if status["status"] != "running":
                    break
                await anyio.sleep(0.1)
            assert status["exit_code"] == 0 and status["stdout"] == "done\n", status
            assert (await c.call("sandbox_kill", sandbox_id=sid))["status"] == "killed"

    anyio.run(main)


def test_without_the_mcp_package_the_command_says_so_in_one_line() -> None:
    code = ("import sys; sys.modules['mcp'] = None\n"  # as if the extra were not installed
            "from isolate.integrations.mcp_command import main; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 125, done
    assert done.stderr.startswith("isolate-mcp: ") and done.stderr.count("\n") == 1 and "[mcp]" in done.stderr, \
        done.stderr


def test_a_command_that_closes_its_output_or_stops_its_monitor_is_still_followed(tmp_path: Path) -> None:
    async def main() -> None:
        async with server("--profile", profile(tmp_path)) as c:
            sid = (await c.call("sandbox_create"))["sandbox_id"]
            # Its output closed, the command goes on: it is running until it ends, then its status is known.
            bg = await c.call("command_run", sandbox_id=sid, command="exec >&- 2>&-; sleep 2; exit 5",
                              background=True)
            await anyio.sleep(0.5)
            status = await c.call("command_get_status", sandbox_id=sid, execution_id=bg["id"])
            assert status["status"] == "running", status
            run = await c.call("command_run", sandbox_id=sid, command="exec >&- 2>&-; sleep 1; exit 5")
            assert run["exit_code"] == 5, run
            # A command that stops the sandbox's exec servers (same uid) cannot make the call hang: the
            # server continues a stopped monitor when it can (the timeout then ends the command); when it
            # cannot, past the timeout, the kill and twice 10 s, the call fails saying why.
            stop = ("for p in /proc/[0-9]*; do grep -q exec-server $p/cmdline 2>/dev/null && "
                    "kill -STOP ${p#/proc/}; done; sleep 100")
            result = await c.session.call_tool("command_run", {"sandbox_id": sid, "timeout_seconds": 1,
                                                               "command": stop}, read_timeout_seconds=60)
            text = result.content[0].text  # type: ignore[union-attr]
            if result.is_error:
                assert "does not answer" in text and "\n" not in text, text
            else:
                assert result.structured_content["status"] == "timeout", text  # type: ignore[index]
            assert (await c.call("sandbox_kill", sandbox_id=sid))["status"] == "killed"

    anyio.run(main)


def test_an_agent_cannot_make_the_server_hold_commands_or_sessions_without_end(tmp_path: Path) -> None:
    # Each background command costs the server descriptors, a thread and up to 2 MiB of output until it is
    # collected; each session a shell. An agent that starts them in a loop must hit a limit, not the host's.
    from isolate.integrations.mcp_state import MAX_COMMANDS, MAX_SESSIONS

    marker = f"3002.{secrets.randbelow(10**6):06d}"

    async def main() -> None:
        async with server("--profile", profile(tmp_path)) as c:
            sid = (await c.call("sandbox_create"))["sandbox_id"]
            ids = [(await c.call("command_run", sandbox_id=sid, command=f"sleep {marker}", background=True))["id"]
                   for _ in range(MAX_COMMANDS)]
            assert "its most" in await c.error("command_run", sandbox_id=sid, command="true", background=True)
            await c.call("command_interrupt", sandbox_id=sid, execution_id=ids[0])
            for _ in range(100):  # collected once ended: room for one more
                if (await c.call("command_get_status", sandbox_id=sid, execution_id=ids[0]))["status"] != "running":
                    break
                await anyio.sleep(0.1)
            assert (await c.call("command_run", sandbox_id=sid, command="echo one more"))["stdout"] == "one more\n"
            for i in range(MAX_SESSIONS):
                await c.call("command_create_session", sandbox_id=sid, session_id=f"s{i}")
            assert "its most" in await c.error("command_create_session", sandbox_id=sid, session_id="extra")

    anyio.run(main)
    assert gone(marker)


def test_a_command_is_followed_when_the_server_holds_descriptors_past_fd_setsize() -> None:
    # Many sandboxes and commands put the server's descriptors past 1024, where select() fails.
    from isolate import Sandbox
    from isolate.integrations.mcp_state import _Execution

    with Sandbox(policy(write=())) as box, descriptors_past_fd_setsize():
        execution = _Execution(box.spawn("echo past FD_SETSIZE"), 30.0)
        assert execution.done.wait(30.0)
        result = execution.result()
        execution.close()
        assert result["stdout"] == "past FD_SETSIZE\n" and result["exit_code"] == 0
