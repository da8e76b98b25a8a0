"""Code contexts (``/code``): persistent interpreters (``server.code``), a cell at a time, streamed.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..code import LANGUAGES, CodeContext
from ..common import SSE_HEADERS, LineSplitter, api, json_body, sse
from ..keep import INTERPRETERS
from ..models import ApiError, bad_request
from ..state import ManagedSandbox, room_for_session
from .access import sandbox_for
from .commands import Bridge

# -- code-interpreter contexts ---------------------------------------------------------------------

def _language(value: object) -> str:
    language = value if value is not None else "python"
    if language not in LANGUAGES:
        raise bad_request(f"language: {str(language)[:40]!r} is not served here (it serves {', '.join(LANGUAGES)})",
                          "UNSUPPORTED_LANGUAGE")
    return str(language)


def _context(managed: ManagedSandbox, context_id: str) -> CodeContext:
    context: CodeContext | None = managed.contexts.get(context_id)
    if context is None:
        raise ApiError(404, "CONTEXT_NOT_FOUND", f"context {context_id[:64]!r} not found")
    return context


def _outlives(managed: ManagedSandbox, language: str) -> bool:
    """Whether a context's process outlives the server (a kept sandbox's bash shell, its ends kept by the sandbox's
    exec server, or Python, Node.js or Java driver): its record names it while it is made or deleted."""
    return managed.kept and language in (*INTERPRETERS, "bash")


def _in_doubt(managed: ManagedSandbox, language: str, context_id: str, doubt: bool) -> None:
    """Its record names the context's process as one the next server ends (``doubt``), or no longer
    (ManagedSandbox.shell_in_doubt, context_in_doubt)."""
    if language == "bash":
        managed.shell_in_doubt(f"code-{context_id}", doubt)
    else:
        managed.context_in_doubt(context_id, language, doubt)


async def _made(managed: ManagedSandbox, language: str, context_id: str) -> CodeContext:
    """A new context of the sandbox's, in its list and, kept, in its record (named as one to end from before its
    process starts until then: a server killed meanwhile leaves none that no record names)."""
    doubt = _outlives(managed, language)
    if doubt:
        await run_in_threadpool(_in_doubt, managed, language, context_id, True)
    try:
        context = await run_in_threadpool(CodeContext, managed.box, language, context_id, managed.kept)
        managed.contexts[context.id] = context
    finally:
        if doubt:  # a context of its record now (a restarted server adopts its process), or none
            await run_in_threadpool(_in_doubt, managed, language, context_id, False)
    if context.kept and not doubt:  # a Go context: its record names it, a restarted server serves it again
        await run_in_threadpool(managed.changed)
    return context


async def _ended(managed: ManagedSandbox, context: CodeContext) -> None:
    """A context taken out of the sandbox's list and ended (a kept one's process named by its record as one to end
    until it is ended: a server killed meanwhile leaves it to the next one, which serves no context of it)."""
    doubt = context.kept and _outlives(managed, context.language)
    if doubt:
        await run_in_threadpool(_in_doubt, managed, context.language, context.id, True)
    managed.contexts.pop(context.id, None)
    try:
        await run_in_threadpool(context.close)
    finally:
        if doubt:
            await run_in_threadpool(_in_doubt, managed, context.language, context.id, False)
    if context.kept and not doubt:
        await run_in_threadpool(managed.changed)


@api
async def create_context(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request, required=False)
    if body is not None and not isinstance(body, dict):
        raise bad_request("the body must be {\"language\": \"python\"}", "INVALID_REQUEST_BODY")
    language = _language((body or {}).get("language"))
    room_for_session(managed)
    context_id = f"ctx-{secrets.token_hex(8)}"
    context = await _made(managed, language, context_id)
    return JSONResponse({"id": context.id, "language": language})


@api
async def list_contexts(request: Request) -> Response:
    managed = sandbox_for(request)
    language = request.query_params.get("language")
    return JSONResponse([{"id": c.id, "language": c.language} for c in list(managed.contexts.values())
                         if language in (None, "", c.language)])


@api
async def get_context(request: Request) -> Response:
    context = _context(sandbox_for(request), request.path_params["context_id"])
    return JSONResponse({"id": context.id, "language": context.language})


def _endable(managed: ManagedSandbox, doomed: list[CodeContext]) -> None:
    """Refuse (409) to end, while the sandbox is not running, a context whose end needs it running: each would
    wait on its frozen exec server, and what it could not reach (a kept bash context's shell) would live on."""
    if managed.state != "Running" and any(c.ends_in_sandbox for c in doomed):
        raise ApiError(409, "SANDBOX_NOT_RUNNING", f"sandbox {managed.id} is {managed.state}: a kept bash context "
                       "ends with the sandbox's help (its exec server holds the shell's ends); resume it first")


@api
async def delete_context(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    context = _context(managed, request.path_params["context_id"])
    _endable(managed, [context])
    await _ended(managed, context)
    return Response(status_code=200)


@api
async def delete_contexts(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    language = _language(request.query_params.get("language"))
    doomed = [c for c in managed.contexts.values() if c.language == language]
    _endable(managed, doomed)
    for context in doomed:
        await _ended(managed, context)
    return Response(status_code=200)


@api
async def interrupt_code(request: Request) -> Response:
    managed = sandbox_for(request)
    context_id = request.query_params.get("id")
    if not context_id:
        raise bad_request("id: the context's id is required", "MISSING_QUERY")
    await run_in_threadpool(_context(managed, context_id).interrupt)
    return Response(status_code=200)


async def _default(managed: ManagedSandbox, language: str) -> CodeContext:
    """The language's default context, made at its first use: by one request at a time (two made at once would
    both be ``default-LANGUAGE``, and the second's shell or driver would replace the first's, left running)."""
    key = f"default-{language}"
    making: asyncio.Lock = managed.making.setdefault(key, asyncio.Lock())
    async with making:
        context: CodeContext | None = managed.contexts.get(key)
        if context is None:
            room_for_session(managed)
            context = await _made(managed, language, key)
    return context


@api
async def run_code(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("code"), str) or not body["code"].strip():
        raise bad_request("code: a non-empty string is required", "INVALID_REQUEST_BODY")
    spec = body.get("context") or {}
    if not isinstance(spec, dict):
        raise bad_request("context: expected {\"id\": ID, \"language\": LANGUAGE}", "INVALID_REQUEST_BODY")
    if spec.get("id"):
        context = _context(managed, str(spec["id"]))
    else:  # the language's default context, made at its first use
        language = _language(spec.get("language"))
        context = await _default(managed, language)
    bridge = Bridge(asyncio.get_running_loop())
    threading.Thread(target=context.run, args=(body["code"], bridge.put), daemon=True,
                     name=f"isolate-serve-code-{context.id}").start()
    started = time.time()

    async def events() -> AsyncIterator[bytes]:
        yield sse({"type": "init", "text": context.id})
        splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
        done = False
        try:
            while True:
                kind, payload = await bridge.queue.get()
                if kind == "done":
                    done = True
                    break
                lines = splitters[kind].feed(payload)
                bridge.taken(payload)
                for line in lines:
                    yield sse({"type": kind, "text": line})
            for kind, splitter in splitters.items():
                for line in splitter.flush():
                    yield sse({"type": kind, "text": line})
            yield sse({"type": "execution_count", "execution_count": payload.get("count")})
            if payload.get("result") is not None:
                yield sse({"type": "result", "results": {"text": payload["result"]}})
            if payload.get("error"):
                yield sse({"type": "error", "error": payload["error"]})
            else:
                yield sse({"type": "execution_complete", "execution_time": int((time.time() - started) * 1000)})
        finally:
            bridge.close()
            if not done:  # the client went away: the cell is interrupted
                context.interrupt()

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
