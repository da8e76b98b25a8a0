"""Bash sessions (``/session``): a persistent bash per session (``server.code.shell.BashShell``), commands run in it
one at a time; in a kept sandbox it outlives the server.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...model.errors import CommandNotFoundError
from ..code.shell import HINT, BashShell
from ..common import SSE_HEADERS, LineSplitter, api, json_body, sse
from ..models import ApiError, bad_request
from ..state import ManagedSandbox, room_for_session
from .access import sandbox_for
from .commands import _timeout_ms

# -- bash sessions ------------------------------------------------------------------------------

@api
async def create_session(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request, required=False)
    cwd = None
    if body is not None:
        if not isinstance(body, dict) or not (body.get("cwd") is None or (isinstance(body["cwd"], str)
                                                                          and body["cwd"] and "\0" not in body["cwd"])):
            raise bad_request("the body must be {\"cwd\": PATH} or empty", "INVALID_REQUEST_BODY")
        cwd = body.get("cwd")
    import secrets

    session_id = "session-" + secrets.token_hex(8)
    room_for_session(managed)
    if managed.kept:  # its record names the shell before its ends are kept (ManagedSandbox.shell_in_doubt)
        await run_in_threadpool(managed.shell_in_doubt, session_id, True)
    try:
        managed.sessions[session_id] = await _started(managed, session_id, cwd)
    finally:
        if managed.kept:  # a session of its record now (a restarted server adopts its shell), or none
            await run_in_threadpool(managed.shell_in_doubt, session_id, False)
    return JSONResponse({"session_id": session_id})


async def _started(managed: ManagedSandbox, session_id: str, cwd: str | None) -> BashShell:
    try:
        # In a kept sandbox the session's shell outlives the server, as a bash code context's (server.code.shell).
        shell = await run_in_threadpool(BashShell, managed.box, session_id, managed.kept)
    except CommandNotFoundError as exc:
        raise bad_request(f"bash sessions run bash, and this sandbox has none ({str(exc)[:200]}): {HINT}",
                          "BASH_NOT_FOUND") from None
    if cwd:
        import shlex

        out, status = await run_in_threadpool(shell.run, f"cd -- {shlex.quote(cwd)}", 30.0)
        if status != 0:
            await run_in_threadpool(shell.close)
            raise bad_request(f"cwd: {out.strip()[:200] or cwd}")
    return shell


@api
async def run_in_session(request: Request) -> Response:
    managed = sandbox_for(request)
    shell = managed.sessions.get(request.path_params["session_id"])
    if shell is None:
        raise ApiError(404, "SESSION_NOT_FOUND", "no such session")
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("command"), str) or not body["command"].strip():
        raise bad_request("command: a non-empty string is required", "INVALID_REQUEST_BODY")
    timeout = _timeout_ms(body.get("timeout"))
    command = body["command"]
    cwd = body.get("cwd")
    if cwd is not None:
        if not isinstance(cwd, str) or not cwd or "\0" in cwd:
            raise bad_request("cwd: expected a path (not empty, no NUL)")
        import shlex

        command = f"cd -- {shlex.quote(cwd)} && {{ {command}\n}}"
    started = time.time()

    async def events() -> AsyncIterator[bytes]:
        yield sse({"type": "init", "text": request.path_params["session_id"]})
        try:
            output, status = await run_in_threadpool(shell.run, command, timeout)
        except TimeoutError as exc:
            output, status = str(exc), 124
        splitter = LineSplitter()
        for line in splitter.feed(output.encode()) + splitter.flush():
            yield sse({"type": "stdout", "text": line})
        if status == 0:
            yield sse({"type": "execution_complete", "execution_time": int((time.time() - started) * 1000)})
        else:
            yield sse({"type": "error", "error": {"ename": "CommandExecError", "evalue": str(status),
                                                   "traceback": [f"exit status {status}"]}})

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@api
async def delete_session(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    shell = managed.sessions.get(request.path_params["session_id"])
    if shell is None:
        raise ApiError(404, "SESSION_NOT_FOUND", "no such session")
    if shell.kept and managed.state != "Running":
        # Its end needs the sandbox's exec server, which holds the shell's ends and is frozen meanwhile.
        raise ApiError(409, "SANDBOX_NOT_RUNNING", f"sandbox {managed.id} is {managed.state}: a kept bash session "
                       "ends with the sandbox's help (its exec server holds the shell's ends); resume it first")
    session_id = request.path_params["session_id"]
    if shell.kept:  # its record names the shell as one to end until its ends are let go
        await run_in_threadpool(managed.shell_in_doubt, session_id, True)
    managed.sessions.pop(session_id, None)
    try:
        await run_in_threadpool(shell.close)
    finally:
        if shell.kept:
            await run_in_threadpool(managed.shell_in_doubt, session_id, False)
    return Response(status_code=200)
