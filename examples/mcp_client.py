"""Drive ``isolate-mcp`` from the MCP Python SDK's client over stdio, as an agent's host does.

What it shows
    A policy profile (an ``isolate.Policy`` saved as TOML: no network, no
    writable host path, a file-size and a CPU-time limit) given to
    ``isolate-mcp --profile``, started by the ``mcp`` package's stdio client.
    The client lists the tools, creates a sandbox, writes a file, runs commands
    (one streams its output as progress notifications), keeps a shell session
    whose ``cd`` persists, reads a file back, sees the network refused, then
    kills the sandbox. Every sandbox the server made ends when it exits.

How to run
    pip install 'isolate[mcp]'
    python examples/mcp_client.py          # Linux; root or not; isolate-mcp on PATH or beside python

It ends with "killed; sandboxes left: 0".
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import isolate


def isolate_mcp() -> str:
    """The isolate-mcp command: PATH's, else the one beside this interpreter (a venv not activated)."""
    beside = os.path.join(os.path.dirname(sys.executable), "isolate-mcp")
    found = shutil.which("isolate-mcp") or (beside if os.access(beside, os.X_OK) else None)
    if not found:
        sys.exit("isolate-mcp is not installed: pip install 'isolate[mcp]'")
    return found


async def call(session: ClientSession, tool: str, progress: Any = None, /, **arguments: Any) -> Any:
    """Call a tool; its structured result (a list comes wrapped as {"result": [...]}), or its error."""
    result = await session.call_tool(tool, arguments, progress_callback=progress)
    text = result.content[0].text if result.content else ""  # type: ignore[union-attr]
    if result.is_error:
        raise RuntimeError(f"{tool}: {text}")
    data = result.structured_content if result.structured_content is not None else json.loads(text)
    return data["result"] if isinstance(data, dict) and set(data) == {"result"} else data


async def main(profile: str) -> int:
    # The SDK hands a server only HOME, PATH and a few more variables; isolate-mcp gets this process's
    # environment (isolate reads XDG_RUNTIME_DIR and XDG_STATE_HOME for where its sandboxes live).
    server = StdioServerParameters(command=isolate_mcp(), args=["--profile", profile], env=dict(os.environ))
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = [tool.name for tool in (await session.list_tools()).tools]
        print(f"{len(tools)} tools:", ", ".join(tools[:6]), "...")

        box = await call(session, "sandbox_create", env={"GREETING": "hello"})
        sid = box["sandbox_id"]
        print("created", sid, box["state"], "in", box["workspace"])

        await call(session, "file_write", sandbox_id=sid, path="src/job.sh", mode=755,
                   content="echo \"$GREETING from $(id -un)\"\nfor i in 1 2 3; do echo step $i; done\n")

        streamed: list[str] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            streamed.append(message or "")

        run = await call(session, "command_run", on_progress, sandbox_id=sid, command="./src/job.sh")
        print("command_run:", run["exit_code"], repr(run["stdout"]))
        print("streamed as progress:", streamed)

        await call(session, "command_create_session", sandbox_id=sid, session_id="sh")
        await call(session, "command_run_in_session", sandbox_id=sid, session_id="sh", command="cd src && N=7")
        later = await call(session, "command_run_in_session", sandbox_id=sid, session_id="sh", command="pwd; echo $N")
        print("session:", repr(later["output"]))

        await call(session, "command_run", sandbox_id=sid, command="./src/job.sh > out.txt")
        print("file_read:", repr((await call(session, "file_read", sandbox_id=sid, path="out.txt"))["content"]))

        net = await call(session, "command_run", sandbox_id=sid,
                         command="python3 -c \"import socket; socket.create_connection(('1.1.1.1', 443))\"")
        print("network:", net["exit_code"], net["stderr"].strip().splitlines()[-1])

        await call(session, "sandbox_kill", sandbox_id=sid)
        left = (await call(session, "sandbox_list"))["sandboxes"]
        print("killed; sandboxes left:", len(left))
        return 0 if run["exit_code"] == 0 and not left else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="mcp-profile-") as directory:
        path = os.path.join(directory, "agent.toml")
        isolate.Policy(write=(), network="none",
                       limits=isolate.Limits(file_size="100M", cpu_seconds=600)).save(path)
        os.chmod(directory, 0o755)
        sys.exit(anyio.run(main, path))
