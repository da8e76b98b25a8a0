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
from ..state import room_for_session
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
    managed.sessions[session_id] = shell
    if shell.kept:
        await run_in_threadpool(managed.changed)  # its record names it: a restarted server adopts it
    return JSONResponse({"session_id": session_id})


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
    managed.sessions.pop(request.path_params["session_id"], None)
    await run_in_threadpool(shell.close)
    if shell.kept:
        await run_in_threadpool(managed.changed)
    return Response(status_code=200)
