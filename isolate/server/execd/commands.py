"""Commands (``/command``): run one in the foreground (its output streamed as server-sent events) or
in the background, its status and logs, interrupting it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..background import KeptCommand
from ..common import SSE_HEADERS, LineSplitter, api, json_body, query_int, sse
from ..models import MAX_TIMEOUT, ApiError, bad_request, bounded
from ..state import CommandRecord, ManagedSandbox
from .access import BRIDGE_LIMIT, sandbox_for

# -- commands -----------------------------------------------------------------------------

def _timeout_ms(value: object, name: str = "timeout") -> float | None:
    """Milliseconds (0: none), at most the longest a sandbox may live; checked before the division."""
    if value is None:
        return None
    if not isinstance(value, int):
        raise bad_request(f"{name}: expected milliseconds from 0 to {MAX_TIMEOUT * 1000}, a whole number")
    ms = bounded(value, name, 0, MAX_TIMEOUT * 1000, "milliseconds (0: none)")
    return None if ms == 0 else ms / 1000


def _envs(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and "=" not in k and "\0" not in k
                                              and isinstance(v, str) and "\0" not in v for k, v in value.items()):
        raise bad_request("envs: expected an object of NAME: value strings")
    return value


def _exit_events(record: CommandRecord) -> list[bytes]:
    elapsed = int(((record.finished_at or time.time()) - record.started_at) * 1000)
    if record.exit_code == 0:
        return [sse({"type": "execution_complete", "execution_time": elapsed})]
    return [sse({"type": "error", "error": {"ename": "CommandExecError", "evalue": str(record.exit_code),
                                             "traceback": [record.error or f"exit status {record.exit_code}"]}})]


#: Output waiting for slow clients over all the server's bridges: past it, a bridge with bytes of its own
#: waiting stops its command's thread too (one with none may always pass one chunk: none waits for ever).
BRIDGES_TOTAL = 64 << 20
#: Every bridge's waits and wake-ups, and the bytes waiting over all of them.
_ALL = threading.Condition()
_waiting = 0


class Bridge:
    """A command's output, from its thread to the response, with back-pressure.

    When the client reads slower than the command writes, more than
    BRIDGE_LIMIT bytes waiting (or more than BRIDGES_TOTAL over all the
    server's bridges) stops the command's thread, so the command blocks on
    its full pipe instead of the server's memory growing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.pending = 0
        self.closed = False

    def put(self, kind: str, payload: Any) -> None:  # the command's thread
        global _waiting
        size = len(payload) if isinstance(payload, bytes) else 0
        with _ALL:
            while (self.pending > BRIDGE_LIMIT or (self.pending and _waiting > BRIDGES_TOTAL)) and not self.closed:
                _ALL.wait(1.0)
            if self.closed:
                return
            self.pending += size
            _waiting += size
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.close()

    def taken(self, payload: Any) -> None:
        self._give(len(payload) if isinstance(payload, bytes) else 0)

    def _give(self, size: int) -> None:
        global _waiting
        with _ALL:
            size = min(size, self.pending)
            self.pending -= size
            _waiting -= size
            _ALL.notify_all()

    def close(self) -> None:
        """No more output: what is still queued no longer counts (the response is over)."""
        with _ALL:
            self.closed = True
        self._give(self.pending)

    def __del__(self) -> None:
        self.close()  # a response never started: its bytes no longer count


async def _stream(record: CommandRecord, bridge: Bridge) -> AsyncIterator[bytes]:
    yield sse({"type": "init", "text": record.id})
    splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
    try:
        while True:
            kind, payload = await bridge.queue.get()
            if kind == "exit":
                break
            lines = splitters[kind].feed(payload)
            bridge.taken(payload)
            for line in lines:
                yield sse({"type": kind, "text": line})
        for kind, splitter in splitters.items():
            for line in splitter.flush():
                yield sse({"type": kind, "text": line})
        for event in _exit_events(record):
            yield event
    finally:
        bridge.close()
        if record.running:  # the client went away: the command goes with it, as upstream's does
            record.proc.kill()


@api
async def run_command(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("command"), str) or not body["command"].strip():
        raise bad_request("command: a non-empty string is required", "INVALID_REQUEST_BODY")
    for name in ("uid", "gid"):
        if body.get(name) is not None:
            raise bad_request(f"{name}: commands run as the sandbox's own user; another id cannot be chosen")
    cwd = body.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd or "\0" in cwd):
        raise bad_request("cwd: expected a path (not empty, no NUL)")
    background = body.get("background", False)
    if not isinstance(background, bool):
        raise bad_request("background: expected true or false")
    timeout = _timeout_ms(body.get("timeout"))
    envs = _envs(body.get("envs"))
    bridge = Bridge(asyncio.get_running_loop())
    record = await run_in_threadpool(managed.start_command, body["command"], background, cwd or None, envs, timeout,
                                     None if background else bridge.put)
    if background or not isinstance(record, CommandRecord):
        events = [sse({"type": "init", "text": record.id}), sse({"type": "execution_complete", "execution_time": 0})]

        async def done() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return StreamingResponse(done(), media_type="text/event-stream", headers=SSE_HEADERS)
    return StreamingResponse(_stream(record, bridge), media_type="text/event-stream", headers=SSE_HEADERS)


def _command(managed: ManagedSandbox, command_id: str) -> CommandRecord | KeptCommand:
    record = managed.commands.get(command_id)
    if record is None:
        # The foreground commands of an earlier server of a kept sandbox ended with it (and their output, its
        # memory's); its background ones are served again (isolate.server.background).
        why = ("; the sandbox was served again by a restarted server, and the foreground commands of the last one "
               "ended with it (their output too)") if managed.restored else ""
        raise ApiError(404, "COMMAND_NOT_FOUND", f"command {command_id[:64]!r} not found{why}")
    return record


@api
async def interrupt_command(request: Request) -> Response:
    managed = sandbox_for(request)
    command_id = request.query_params.get("id")
    if not command_id:
        raise bad_request("id: the command's id is required", "MISSING_QUERY")
    session = managed.sessions.get(command_id)
    if session is not None:
        session.interrupt()
        return Response(status_code=200)
    record = _command(managed, command_id)
    await run_in_threadpool(managed.interrupt, record)
    return Response(status_code=200)


def _status(record: CommandRecord | KeptCommand) -> dict[str, Any]:
    from ..models import iso

    running = record.running  # a kept command's end is read first (its exit file, in the sandbox)
    return {"id": record.id, "content": record.content, "running": running, "exit_code": record.exit_code,
            "error": record.error, "started_at": iso(record.started_at), "finished_at": iso(record.finished_at)}


@api
async def command_status(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    record = _command(managed, request.path_params["command_id"])
    if isinstance(record, KeptCommand):
        return JSONResponse(await run_in_threadpool(_status, record))
    return JSONResponse(_status(record))


@api
async def command_logs(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    record = _command(managed, request.path_params["command_id"])
    cursor = query_int(request, "cursor", 0, 0, 1 << 62)
    assert cursor is not None
    if isinstance(record, KeptCommand):  # read from its file in the sandbox
        data, end = await run_in_threadpool(record.read_from, cursor)
    else:
        data, end = record.read_from(cursor)
    return Response(data, media_type="text/plain; charset=utf-8", headers={"EXECD-COMMANDS-TAIL-CURSOR": str(end)})
