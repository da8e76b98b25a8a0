"""``isolate-mcp``: an MCP server whose tools create and use ``isolate.Sandbox`` es.

    isolate-mcp --profile agent.toml        # stdio; the profile decides what every sandbox may do

The tools take the names and parameters of OpenSandbox's MCP server where the
two overlap (``sandbox_create``, ``command_run``, ``file_read``, ...), so that
prompts written for one work with the other; what OpenSandbox has no tool for
is named in its style (``sandbox_pause``, ``file_grep``, ...). A parameter this
server cannot honour (resource limits, a network policy: the profile fixes
those) is refused, never dropped. ``image`` is the sandbox's root file system
under the profile's policy: an image of the caller's store, pulled from its
registry when the store lacks it (docs/images.md).

The server itself runs nothing: every command and every file operation goes
through a sandbox, as the program inside. Sandboxes it created end when it
exits, except those created with a ``name`` and ``keep=true`` (they stay for
``sandbox_connect`` or ``isolate-run sandbox``, until their ttl, their idle
timeout or ``isolate-run sandbox rm``).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer

from ..kept.sandbox import Sandbox
from ..model.errors import IsolationError, PolicyError, UnsupportedError
from ..model.policy import Policy
from ..model.units import whole_number
from .mcp_state import (
    DEFAULT_MAX_SANDBOXES,
    MAX_COMMANDS,
    MAX_SESSIONS,
    READ_LIMIT,
    ContentReplaceEntry,
    DirectoryEntry,
    F,
    MoveEntry,
    _Entry,
    _entry_info,
    _Execution,
    _octal_mode,
    _one_line,
    _Pending,
    _range,
    _State,
    _thread,
    _tool_errors,
)

__all__ = ["build_server", "main"]


def build_server(policy: Policy | None = None, *, profile: str | None = None,
                 max_sandboxes: int = DEFAULT_MAX_SANDBOXES) -> tuple[MCPServer, _State]:
    """The MCP server (not yet running) and its state; every sandbox it creates gets ``policy``."""
    state = _State(policy if policy is not None else Policy(), profile, max_sandboxes)

    @asynccontextmanager
    async def lifespan(_server: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await _thread(state.close_all)

    server = MCPServer(
        "isolate",
        instructions=(
            "Sandboxes confined by the Linux kernel (isolate). sandbox_create returns a sandbox_id; pass it to "
            "every other tool. Commands run in /workspace by default (command_run; command_run_in_session keeps "
            "cd and variables); file paths are relative to /workspace. What a sandbox may do (network, writable "
            "paths, limits) is fixed by the server's profile."
        ),
        lifespan=lifespan,
    )

    def tool(fn: F) -> F:
        server.tool()(_tool_errors(fn))
        return fn

    # -- sandboxes -----------------------------------------------------------------------

    @tool
    async def sandbox_create(ctx: Context | None = None, *, name: str | None = None, keep: bool = False,
                             timeout_seconds: float | None = None, idle_timeout_seconds: float | None = None,
                             env: dict[str, str] | None = None, metadata: dict[str, str] | None = None,
                             image: str | None = None, resource: dict[str, str] | None = None,
                             network_policy: dict[str, Any] | None = None) -> dict[str, Any]:
        """Create a sandbox (what it may do comes from the server's profile) and return its sandbox_id.

        name: keep it under this name (also reachable with `isolate-run sandbox`); keep: leave it running when
        this server exits (needs a name; sandbox_connect reaches it again). timeout_seconds: end it after that
        long whatever happens; idle_timeout_seconds: after that long with nothing running (a named sandbox
        defaults to an hour). env: variables every command gets. metadata: strings kept with it.
        image: an OCI image (e.g. registry.example/team/app:1) as its root file system, under the profile's
        policy; pulled when this machine does not have it. resource, network_policy: refused (the profile fixes
        them).
        """
        policy = state.policy
        if image is not None and image != state.policy.image:
            if ctx is not None:
                await ctx.report_progress(0.05, 1.0, f"image {image}")
            policy = await _thread(_with_image, policy, image)
        if resource:
            raise UnsupportedError("resource: limits come from the server's profile (--profile); leave resource out")
        if network_policy:
            raise UnsupportedError("network_policy: network access comes from the server's profile (--profile); "
                                   "leave network_policy out")
        if keep and name is None:
            raise PolicyError("keep: only a named sandbox can be kept; give a name", "keep")
        for key, value in (env or {}).items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise PolicyError(f"env: {key!r} is not a variable name, or its value holds a NUL byte", "env")
        sandbox_id = name if name is not None else "sbx-" + secrets.token_hex(4)
        if sandbox_id in state.entries:
            raise IsolationError(f"a sandbox {sandbox_id!r} exists in this server already")
        if len(state.entries) >= state.max_sandboxes:
            raise IsolationError(f"this server holds {len(state.entries)} sandboxes, its most (--max-sandboxes); "
                                 "sandbox_kill one first")
        if env:
            policy = dataclasses.replace(policy, env={**policy.env, **env})
        if ctx is not None:
            await ctx.report_progress(0.1, 1.0, "starting the sandbox")
        box = Sandbox(policy, name=name, ttl=timeout_seconds, idle_timeout=idle_timeout_seconds)
        await _thread(box.start)
        entry = _Entry(sandbox_id, box, time.time(), keep, dict(metadata or {}))
        if sandbox_id in state.entries or len(state.entries) >= state.max_sandboxes:  # concurrent calls
            await _thread(box.close)
            raise IsolationError(f"a sandbox {sandbox_id!r} exists in this server already, or it holds its most "
                                 "sandboxes (--max-sandboxes)")
        state.entries[sandbox_id] = entry
        if ctx is not None:
            await ctx.report_progress(1.0, 1.0, "started")
        return entry.info()

    @tool
    async def sandbox_connect(sandbox_id: str, *, keep: bool = True) -> dict[str, Any]:
        """Reach a kept (named) sandbox again, e.g. one a previous run of this server kept.

        Only a sandbox whose policy is this server's profile (environment aside) is accepted.
        keep: leave it running when this server exits (default), else end it then.
        """
        if sandbox_id in state.entries:
            return state.entries[sandbox_id].info()
        box = await _thread(Sandbox.attach, sandbox_id)
        if dataclasses.replace(box.policy, env=state.policy.env) != state.policy:
            await _thread(box.detach)
            raise PolicyError(f"sandbox {sandbox_id!r} was made with another policy than this server's profile; "
                              "connect to it from a server started with that profile", "sandbox_id")
        if len(state.entries) >= state.max_sandboxes:
            await _thread(box.detach)
            raise IsolationError(f"this server holds {len(state.entries)} sandboxes, its most (--max-sandboxes); "
                                 "sandbox_kill one first")
        entry = _Entry(sandbox_id, box, time.time(), keep, {})
        state.entries[sandbox_id] = entry
        return entry.info()

    @tool
    async def sandbox_list() -> dict[str, Any]:
        """The sandboxes this server holds, with their state."""
        return {"sandboxes": [e.info() for e in state.entries.values()], "profile": state.profile or "default"}

    @tool
    async def sandbox_get_info(sandbox_id: str) -> dict[str, Any]:
        """One sandbox: state, name, workspace, running commands, shell sessions, and what is enforced."""
        entry = state.get(sandbox_id, running=False)
        info = entry.info()
        if entry.box.backend == "native":
            info["enforced"] = entry.box.enforced
        return info

    @tool
    async def sandbox_kill(sandbox_id: str) -> dict[str, str]:
        """End a sandbox and everything in it (a kept one too)."""
        entry = state.get(sandbox_id, running=False)
        state.entries.pop(sandbox_id, None)
        for execution in entry.executions.values():
            await _thread(execution.close)
        if entry.paused:
            await _thread(entry.box.resume)
        await _thread(entry.box.close)
        return {"status": "killed"}

    @tool
    async def sandbox_pause(sandbox_id: str) -> dict[str, str]:
        """Stop every process of a sandbox (nothing runs until sandbox_resume)."""
        entry = state.get(sandbox_id)
        entry.paused = await _thread(entry.box.pause)
        return {"status": "paused", "mechanism": entry.paused}

    @tool
    async def sandbox_resume(sandbox_id: str) -> dict[str, str]:
        """Let a paused sandbox's processes run again."""
        entry = state.get(sandbox_id, running=False)
        if not entry.paused:
            raise IsolationError(f"sandbox {sandbox_id!r} is not paused")
        mechanism = await _thread(entry.box.resume)
        entry.paused = None
        return {"status": "running", "mechanism": mechanism}

    @tool
    async def sandbox_healthcheck(sandbox_id: str) -> dict[str, Any]:
        """Whether the sandbox answers (its exec server inside)."""
        entry = state.get(sandbox_id, running=False)
        if entry.paused:
            return {"sandbox_id": sandbox_id, "healthy": False, "reason": "paused"}
        try:
            await _thread(entry.box.exec, "true", timeout=30)
        except Exception as exc:
            return {"sandbox_id": sandbox_id, "healthy": False, "reason": _one_line(exc)}
        return {"sandbox_id": sandbox_id, "healthy": True}

    @tool
    async def sandbox_get_metrics(sandbox_id: str) -> dict[str, Any]:
        """What the sandbox's processes use now: their number, memory (RSS) and CPU time."""
        entry = state.get(sandbox_id, running=False)

        def measure() -> dict[str, Any]:
            rss = cpu = 0.0
            count = 0
            for process in entry.box.processes():
                try:
                    with process.oneshot():
                        rss += process.memory_info().rss
                        times = process.cpu_times()
                        cpu += times.user + times.system
                        count += 1
                except Exception:  # it ended meanwhile
                    continue
            return {"sandbox_id": sandbox_id, "processes": count, "memory_used_in_mib": round(rss / 2**20, 3),
                    "cpu_seconds": round(cpu, 3), "timestamp": time.time()}

        return dict(await _thread(measure))

    # -- commands ------------------------------------------------------------------------

    @tool
    async def command_run(sandbox_id: str, command: str, ctx: Context | None = None, *, background: bool = False,
                          working_directory: str | None = None, timeout_seconds: float | None = None,
                          env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run a shell command line (pipes, redirections) in the sandbox; returns exit_code, stdout, stderr.

        Output is streamed as it comes, as progress notifications ("stdout: ..." / "stderr: ...") when the
        call asks for progress.
        background: return at once with an id (command_get_status, command_interrupt).
        working_directory: where it starts (default /workspace). timeout_seconds: end it, and everything it
        started, after that long. Each output keeps its last 1 MiB (truncated says so).
        """
        entry = state.get(sandbox_id)
        box = entry.box
        if len(entry.executions) >= MAX_COMMANDS:
            raise IsolationError(f"sandbox {sandbox_id!r} holds {len(entry.executions)} commands, its most: collect "
                                 "the ended ones (command_get_status) or end one (command_interrupt) first")
        process = await _thread(box.spawn, command, cwd=working_directory, env=env, timeout=timeout_seconds)
        if background:
            execution = _Execution(process, timeout_seconds)
            entry.executions[execution.id] = execution
            return {"id": execution.id, "status": "running"}
        pending = _Pending()
        execution = _Execution(process, timeout_seconds, pending.add if ctx is not None else None)
        entry.executions[execution.id] = execution
        sent = 0
        try:
            while True:
                ended = not execution.running  # read before taking: nothing comes after the end
                for name, text, size in pending.take() if ctx is not None else ():
                    assert ctx is not None
                    sent += size
                    # The output is the progress message, named by its stream (MCP's logging is deprecated).
                    await ctx.report_progress(sent, None, f"{name}: {text}")
                if ended:
                    break
                await anyio.sleep(0.05)
            return execution.result()
        finally:
            entry.executions.pop(execution.id, None)
            with anyio.CancelScope(shield=True):  # also when the client cancelled: the command ends with the call
                await _thread(execution.close)

    @tool
    async def command_get_status(sandbox_id: str, execution_id: str) -> dict[str, Any]:
        """A background command's status, exit code once ended, and output so far (forgotten once ended)."""
        entry = state.get(sandbox_id, running=False)
        execution = entry.executions.get(execution_id)
        if execution is None:
            raise IsolationError(f"no command {execution_id!r} in sandbox {sandbox_id!r}")
        result = await _thread(execution.result)
        # Forgotten only once a result said it ended: the command may end between result() and here, and
        # a "running" answer must leave it there for the next call.
        if result["status"] != "running":
            entry.executions.pop(execution_id, None)
            await _thread(execution.close)
        return dict(result)

    @tool
    async def command_interrupt(sandbox_id: str, execution_id: str) -> dict[str, str]:
        """End a background command and everything it started."""
        entry = state.get(sandbox_id)
        execution = entry.executions.get(execution_id)
        if execution is None:
            raise IsolationError(f"no command {execution_id!r} in sandbox {sandbox_id!r}")
        await _thread(execution.kill)
        return {"status": "interrupted"}

    # -- persistent shells (OpenSandbox's "sessions") ----------------------------------------

    @tool
    async def command_create_session(sandbox_id: str, session_id: str | None = None) -> dict[str, str]:
        """Open a persistent shell: cd, variables and functions persist between command_run_in_session calls."""
        entry = state.get(sandbox_id)
        session_id = session_id or "session-" + secrets.token_hex(3)
        if session_id in entry.sessions:
            raise IsolationError(f"session {session_id!r} is open already in sandbox {sandbox_id!r}")
        if len(entry.sessions) >= MAX_SESSIONS:
            raise IsolationError(f"sandbox {sandbox_id!r} has {len(entry.sessions)} sessions open, its most: "
                                 "command_delete_session one first")
        entry.sessions[session_id] = await _thread(entry.box.shell, session_id)
        return {"session_id": session_id}

    @tool
    async def command_run_in_session(sandbox_id: str, session_id: str, command: str, *,
                                     working_directory: str | None = None,
                                     timeout_seconds: float = 60) -> dict[str, Any]:
        """Run a command line in a session's shell; returns its output (stdout and stderr as printed) and exit code.

        working_directory: cd there first (it persists, as a typed cd). A timeout interrupts the command
        (SIGINT) and the shell goes on.
        """
        entry = state.get(sandbox_id)
        shell = entry.sessions.get(session_id)
        if shell is None:
            raise IsolationError(f"no session {session_id!r} in sandbox {sandbox_id!r}; command_create_session first")
        if working_directory is not None:
            quoted = "'" + working_directory.replace("'", "'\\''") + "'"
            command = f"cd -- {quoted} && {{ {command}\n}}"
        output, code = await _thread(shell.run, command, timeout_seconds)  # a shell that exited says so
        return {"output": output, "exit_code": code}

    @tool
    async def command_delete_session(sandbox_id: str, session_id: str) -> dict[str, str]:
        """Close a session's shell (and what it runs)."""
        entry = state.get(sandbox_id, running=False)
        shell = entry.sessions.pop(session_id, None)
        if shell is None:
            raise IsolationError(f"no session {session_id!r} in sandbox {sandbox_id!r}")
        await _thread(shell.close)
        return {"status": "deleted"}

    # -- files -----------------------------------------------------------------------------

    @tool
    async def file_read(sandbox_id: str, path: str, *, encoding: str = "utf-8",
                        range_header: str | None = None) -> dict[str, Any]:
        """Read a file (as the program sees it; relative to /workspace). encoding "base64" reads any bytes.

        range_header: "bytes=0-1023" (HTTP's spelling) reads part of it.
        """
        entry = state.get(sandbox_id)
        data: bytes = await _thread(entry.box.read_file, path, text=False, limit=READ_LIMIT)
        size = len(data)
        if range_header is not None:
            data = data[_range(range_header, size)]
        if encoding == "base64":
            content = base64.b64encode(data).decode()
        else:
            try:
                content = data.decode(encoding)
            except LookupError:
                raise PolicyError(f"encoding: {encoding!r} is not a known encoding", "encoding") from None
            except UnicodeDecodeError as exc:
                raise PolicyError(f"{path}: not {encoding} at byte {exc.start}; read it with encoding=\"base64\"",
                                  "encoding") from None
        return {"path": path, "content": content, "size": size}

    @tool
    async def file_write(sandbox_id: str, path: str, content: str, *, encoding: str = "utf-8",
                         mode: int | str = 644, append: bool = False, owner: str | None = None,
                         group: str | None = None) -> dict[str, str]:
        """Write a file (parents are made), as the program. encoding "base64" writes decoded bytes.

        mode: octal digits (644, 755). owner, group: refused (files belong to the sandbox's user).
        """
        if owner is not None or group is not None:
            raise UnsupportedError("owner/group: files are written as the sandbox's user; leave owner and group out")
        file_mode = _octal_mode(mode, "mode")
        entry = state.get(sandbox_id)
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except ValueError:
                raise PolicyError("content: not valid base64", "content") from None
        else:
            try:
                data = content.encode(encoding)
            except LookupError:
                raise PolicyError(f"encoding: {encoding!r} is not a known encoding", "encoding") from None
        await _thread(entry.box.write_file, path, data, append=append, mode=file_mode)
        return {"status": "written"}

    @tool
    async def file_replace_contents(sandbox_id: str, entries: list[ContentReplaceEntry]) -> list[dict[str, Any]]:
        """Edit files: replace old_content (exact text) by new_content, in each entry's path.

        Every occurrence is replaced, or with count exactly that many must exist (count 1: a unique match).
        An entry whose text does not occur fails the call (the entries before it are done).
        """
        entry = state.get(sandbox_id)
        results = []
        for item in entries:
            if item.count is not None and item.count < 1:
                raise PolicyError(f"count: expected a positive number, got {item.count}", "count")
            replaced = await _thread(entry.box.replace_text, item.path, item.old_content, item.new_content,
                                     item.count)
            results.append({"path": item.path, "replaced": replaced})
        return results

    @tool
    async def file_list(sandbox_id: str, path: str = ".", *, depth: int = 1) -> dict[str, Any]:
        """List a directory (depth levels down): each entry's path, type, size, mode and mtime."""
        entry = state.get(sandbox_id)
        found = await _thread(entry.box.list_dir, path, depth)
        return {"path": path, "entries": [
            {"path": e.path, "type": e.type, "size": e.size, "mode": f"{e.mode & 0o7777:o}",
             "modified_at": e.mtime_ns / 1e9} for e in found]}

    @tool
    async def file_get_info(sandbox_id: str, paths: list[str]) -> dict[str, Any]:
        """Status of files (stat, following links): type, size, mode, owner, group, mtime."""
        entry = state.get(sandbox_id)
        out = {}
        for path in paths:
            out[path] = _entry_info(path, await _thread(entry.box.stat, path))
        return out

    @tool
    async def file_search(sandbox_id: str, path: str, pattern: str) -> list[dict[str, Any]]:
        """Find files by glob pattern ("*.py", "**/*.py") under path."""
        entry = state.get(sandbox_id)

        def search() -> list[dict[str, Any]]:
            found = entry.box.glob(pattern, path)
            out = []
            for name in found:
                full = os.path.normpath(os.path.join(path, name))
                try:
                    out.append(_entry_info(full, entry.box.stat(full, follow_symlinks=False)))
                except OSError:  # gone meanwhile
                    continue
            return out

        return list(await _thread(search))

    @tool
    async def file_grep(sandbox_id: str, pattern: str, path: str = ".", *, glob: str | None = None,
                        max_matches: int = 1000) -> dict[str, Any]:
        """Search file contents for a regular expression (Python syntax) under path, in files matching glob."""
        if isinstance(max_matches, bool) or max_matches < 1:
            raise PolicyError(f"max_matches: expected a positive number, got {max_matches}", "max_matches")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise PolicyError(f"pattern: not a regular expression: {exc}", "pattern") from None
        entry = state.get(sandbox_id)
        matches = await _thread(entry.box.grep, pattern, glob, root=path, max_matches=max_matches)
        return {"matches": [{"path": m.path, "line_number": m.line_number, "line": m.line} for m in matches],
                "truncated": len(matches) >= max_matches}

    @tool
    async def file_move(sandbox_id: str, entries: list[MoveEntry]) -> dict[str, str]:
        """Move or rename files and directories (a destination that exists is replaced)."""
        entry = state.get(sandbox_id)
        for item in entries:
            await _thread(entry.box.move, item.source, item.destination)
        return {"status": "moved"}

    @tool
    async def file_delete(sandbox_id: str, paths: list[str]) -> dict[str, str]:
        """Delete files (not directories: file_delete_directories)."""
        entry = state.get(sandbox_id)
        for path in paths:
            info = await _thread(entry.box.stat, path, follow_symlinks=False)
            if info.is_dir:
                raise IsADirectoryError(21, "is a directory; use file_delete_directories", path)
            await _thread(entry.box.remove, path)
        return {"status": "deleted"}

    @tool
    async def file_create_directories(sandbox_id: str, entries: list[DirectoryEntry]) -> dict[str, str]:
        """Create directories, with their parents (existing ones are fine)."""
        entry = state.get(sandbox_id)
        for item in entries:
            await _thread(entry.box.mkdir, item.path, mode=_octal_mode(item.mode, "mode"))
        return {"status": "created"}

    @tool
    async def file_delete_directories(sandbox_id: str, paths: list[str]) -> dict[str, str]:
        """Delete directories and everything in them."""
        entry = state.get(sandbox_id)
        for path in paths:
            info = await _thread(entry.box.stat, path, follow_symlinks=False)
            if not info.is_dir:
                raise NotADirectoryError(20, "not a directory; use file_delete", path)
            await _thread(entry.box.remove, path, recursive=True)
        return {"status": "deleted"}

    return server, state


def _with_image(policy: Policy, image: str) -> Policy:
    """The profile's policy on an image's root: natively, the image of the caller's store (pulled when it lacks
    it); with the Docker backend, Docker's image."""
    if policy.backend == "docker":
        return policy.replace(image=image)
    from ..image import Image, Reference

    try:
        Reference.parse(image)
        if Image.find(image) is None:
            Image.pull(image)
    except IsolationError as exc:
        raise IsolationError(str(exc) if str(exc).startswith("image ") else f"image {image}: {exc}") from None
    return policy.replace(image=image)


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="isolate-mcp",
        description="An MCP server (stdio) whose tools create and use isolate sandboxes.")
    parser.add_argument("--profile", metavar="FILE",
                        help="a policy profile (TOML, as isolate.Policy.load reads) every created sandbox gets; "
                             "default: isolate.Policy() (no network, writes only in the sandbox's own places)")
    parser.add_argument("--max-sandboxes", type=whole_number, default=DEFAULT_MAX_SANDBOXES, metavar="N",
                        help=f"the most sandboxes it holds at once (default {DEFAULT_MAX_SANDBOXES})")
    args = parser.parse_args(argv)
    if args.max_sandboxes < 1:
        parser.error("--max-sandboxes: expected a positive number")
    try:
        policy = Policy.load(args.profile) if args.profile else Policy()
    except IsolationError as exc:
        print(f"isolate-mcp: {_one_line(exc)}", file=sys.stderr)
        return 125
    server, state = build_server(policy, profile=args.profile, max_sandboxes=args.max_sandboxes)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)
    try:
        server.run("stdio")
    except KeyboardInterrupt:
        pass
    finally:
        state.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
