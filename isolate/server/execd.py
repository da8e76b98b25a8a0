"""A sandbox's execution API (``/sandboxes/{id}/port/44772/...``): ping, commands, files, directories, sessions.

Each route reaches one sandbox: the request carries that sandbox's access
token (``X-EXECD-ACCESS-TOKEN``, handed out by the endpoints call) or the
server's API key. Every file operation goes through ``isolate.Sandbox``'s
file methods, so every path is resolved inside the sandbox, as the program.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import re
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from .code import LANGUAGES, CodeContext
from .common import ACCESS_TOKEN_HEADER, API_KEY_HEADER, SSE_HEADERS, LineSplitter, api, json_body, query_int, same, sse
from .models import EGRESS_PORT, EXECD_PORT, ApiError, absolute, bad_request, file_info, name_of, octal_mode
from .state import CommandRecord, ManagedSandbox, ServerState, room_for_session

#: Where relative paths start: the sandbox's workspace (its commands' default cwd).
WORKDIR = "/workspace"
#: Largest file one upload part may carry, and one download may return.
MAX_FILE = 1 << 30
#: Largest upload request (all its files).
MAX_UPLOAD = 2 << 30
#: Output of a streamed command waiting for a slow client before the command is held up.
BRIDGE_LIMIT = 8 << 20


def sandbox_for(request: Request, running: bool = True, port: int = EXECD_PORT) -> ManagedSandbox:
    state: ServerState = request.app.state.isolate
    try:
        managed = state.get(request.path_params["sandbox_id"])
    except ApiError:
        # Same answer for an unknown sandbox and a wrong token: no probing of ids.
        managed = None
    ok = managed is not None and (same(request.headers.get(ACCESS_TOKEN_HEADER), managed.token)
                                  or same(request.headers.get(API_KEY_HEADER), state.api_key))
    if managed is None or not ok:
        raise ApiError(401, "UNAUTHORIZED", f"unknown sandbox, or missing or wrong {ACCESS_TOKEN_HEADER} header")
    if request.path_params.get("port") != str(port):
        raise ApiError(404, "NOT_FOUND", "this port of the sandbox serves nothing here")
    if running:
        managed.usable()
    return managed


@api
async def ping(request: Request) -> Response:
    sandbox_for(request)
    return Response(status_code=200)


# -- commands -----------------------------------------------------------------------------

def _timeout_ms(value: object, name: str = "timeout") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"{name}: expected milliseconds (a non-negative integer)")
    return None if value == 0 else value / 1000


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


class Bridge:
    """A command's output, from its thread to the response, with back-pressure.

    When the client reads slower than the command writes, more than
    BRIDGE_LIMIT bytes waiting stops the command's thread, so the command
    blocks on its full pipe instead of the server's memory growing.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.pending = 0
        self.closed = False
        self.cond = threading.Condition()

    def put(self, kind: str, payload: Any) -> None:  # the command's thread
        size = len(payload) if isinstance(payload, bytes) else 0
        with self.cond:
            while self.pending > BRIDGE_LIMIT and not self.closed:
                self.cond.wait(1.0)
            if self.closed:
                return
            self.pending += size
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.close()

    def taken(self, payload: Any) -> None:
        with self.cond:
            self.pending -= len(payload) if isinstance(payload, bytes) else 0
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


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
    if cwd is not None and (not isinstance(cwd, str) or "\0" in cwd):
        raise bad_request("cwd: expected a path")
    background = body.get("background", False)
    if not isinstance(background, bool):
        raise bad_request("background: expected true or false")
    timeout = _timeout_ms(body.get("timeout"))
    envs = _envs(body.get("envs"))
    bridge = Bridge(asyncio.get_running_loop())
    record = await run_in_threadpool(managed.start_command, body["command"], background, cwd or None, envs, timeout,
                                     None if background else bridge.put)
    if background:
        events = [sse({"type": "init", "text": record.id}), sse({"type": "execution_complete", "execution_time": 0})]

        async def done() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return StreamingResponse(done(), media_type="text/event-stream", headers=SSE_HEADERS)
    return StreamingResponse(_stream(record, bridge), media_type="text/event-stream", headers=SSE_HEADERS)


def _command(managed: ManagedSandbox, command_id: str) -> CommandRecord:
    record = managed.commands.get(command_id)
    if record is None:
        raise ApiError(404, "COMMAND_NOT_FOUND", f"command {command_id[:64]!r} not found")
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


@api
async def command_status(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    record = _command(managed, request.path_params["command_id"])
    from .models import iso

    return JSONResponse({"id": record.id, "content": record.content, "running": record.running,
                         "exit_code": record.exit_code, "error": record.error, "started_at": iso(record.started_at),
                         "finished_at": iso(record.finished_at)})


@api
async def command_logs(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    record = _command(managed, request.path_params["command_id"])
    cursor = query_int(request, "cursor", 0, 0, 1 << 62)
    assert cursor is not None
    data, end = record.read_from(cursor)
    return Response(data, media_type="text/plain; charset=utf-8", headers={"EXECD-COMMANDS-TAIL-CURSOR": str(end)})


# -- bash sessions ------------------------------------------------------------------------------

@api
async def create_session(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request, required=False)
    cwd = None
    if body is not None:
        if not isinstance(body, dict) or not (body.get("cwd") is None or isinstance(body["cwd"], str)):
            raise bad_request("the body must be {\"cwd\": PATH} or empty", "INVALID_REQUEST_BODY")
        cwd = body.get("cwd")
    import secrets

    session_id = "session-" + secrets.token_hex(8)
    room_for_session(managed)
    shell = await run_in_threadpool(managed.box.shell, session_id, False)
    managed.sessions[session_id] = shell
    if cwd:
        import shlex

        out, status = await run_in_threadpool(shell.run, f"cd -- {shlex.quote(cwd)}", 30.0)
        if status != 0:
            del managed.sessions[session_id]
            await run_in_threadpool(shell.close)
            raise bad_request(f"cwd: {out.strip()[:200] or cwd}")
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
        if not isinstance(cwd, str):
            raise bad_request("cwd: expected a path")
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
    shell = managed.sessions.pop(request.path_params["session_id"], None)
    if shell is None:
        raise ApiError(404, "SESSION_NOT_FOUND", "no such session")
    await run_in_threadpool(shell.close)
    return Response(status_code=200)


# -- files ------------------------------------------------------------------------------------------

def _paths(request: Request) -> list[str]:
    paths = request.query_params.getlist("path")
    if not paths or any(not p or "\0" in p for p in paths):
        raise bad_request("path: at least one non-empty path is required", "MISSING_QUERY")
    return paths


def _info(managed: ManagedSandbox, path: str) -> dict[str, Any]:
    st = managed.box.stat(path, follow_symlinks=False)
    return file_info(absolute(path, WORKDIR), st.mode, st.size, st.mtime_ns, st.uid, st.gid)


@api
async def files_info(request: Request) -> Response:
    managed = sandbox_for(request)
    paths = _paths(request)

    def work() -> dict[str, Any]:
        return {p: _info(managed, p) for p in paths}

    return JSONResponse(await run_in_threadpool(work))


@api
async def remove_files(request: Request) -> Response:
    managed = sandbox_for(request)
    paths = _paths(request)

    def work() -> None:
        for path in paths:
            if managed.box.stat(path, follow_symlinks=False).is_dir:
                raise IsADirectoryError(21, "is a directory (use DELETE /directories)", path)
            managed.box.remove(path)

    await run_in_threadpool(work)
    return Response(status_code=200)


@api
async def remove_dirs(request: Request) -> Response:
    managed = sandbox_for(request)
    paths = _paths(request)

    def work() -> None:
        for path in paths:
            managed.box.remove(path, recursive=True)

    await run_in_threadpool(work)
    return Response(status_code=200)


@api
async def make_dirs(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not all(isinstance(v, dict) for v in body.values()):
        raise bad_request("the body must be {PATH: {\"mode\": 755}}", "INVALID_REQUEST_BODY")
    plan = [(path, _permission(perm, path, 0o755, managed)) for path, perm in body.items()]

    def work() -> None:
        for path, mode in plan:
            managed.box.mkdir(path, parents=True, exist_ok=True, mode=mode)

    await run_in_threadpool(work)
    return Response(status_code=200)


def _permission(perm: dict[str, Any], where: str, default: int, managed: ManagedSandbox | None = None) -> int:
    """The mode asked for; an owner or group is accepted only when it is the sandbox's own (files are its user's)."""
    user = managed.box.enforced.get("user", {}) if managed is not None and managed.box.backend == "native" else {}
    for name, key, kind in (("owner", "uid", "user"), ("group", "gid", "group")):
        value = perm.get(name)
        if not value:
            continue
        own = user.get(key)
        if own is None or value not in (str(own), name_of(int(own), kind)):
            raise bad_request(f"{where}.{name}: {str(value)[:40]!r}: files belong to the sandbox's own user "
                              f"({name_of(int(own), kind) if own is not None else 'unknown'}); another cannot be set")
    return octal_mode(perm.get("mode"), f"{where}.mode", default)


@api
async def chmod_files(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not all(isinstance(v, dict) for v in body.values()):
        raise bad_request("the body must be {PATH: {\"mode\": 644}}", "INVALID_REQUEST_BODY")
    plan = [(path, _permission(perm, path, 0o755, managed)) for path, perm in body.items()]

    def work() -> None:
        for path, mode in plan:
            result = managed.box.exec(["chmod", f"{mode:o}", "--", path], timeout=30)
            if result.returncode != 0:
                raise ApiError(400, "CHMOD_FAILED", result.stderr.strip()[:300] or f"chmod {path} failed")

    await run_in_threadpool(work)
    return Response(status_code=200)


@api
async def move_files(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request)
    if not isinstance(body, list) or not all(isinstance(i, dict) and isinstance(i.get("src"), str)
                                             and isinstance(i.get("dest"), str) for i in body):
        raise bad_request("the body must be [{\"src\": PATH, \"dest\": PATH}, ...]", "INVALID_REQUEST_BODY")

    def work() -> None:
        for item in body:
            managed.box.move(item["src"], item["dest"])

    await run_in_threadpool(work)
    return Response(status_code=200)


@api
async def replace_content(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request)
    if not isinstance(body, dict) or not all(isinstance(v, dict) and isinstance(v.get("old"), str) and v["old"]
                                             and isinstance(v.get("new"), str) for v in body.values()):
        raise bad_request("the body must be {PATH: {\"old\": TEXT, \"new\": TEXT}} with old not empty",
                          "INVALID_REQUEST_BODY")
    verbose = request.query_params.get("verbose", "").lower() in ("1", "true")

    def work() -> dict[str, Any]:
        counts = {}
        for path, item in body.items():
            text = managed.box.read_file(path)
            found = text.count(item["old"])
            if found:
                managed.box.write_file(path, text.replace(item["old"], item["new"]))
            counts[path] = {"replacedCount": found}
        return counts

    counts = await run_in_threadpool(work)
    return JSONResponse(counts) if verbose else Response(status_code=200)


@api
async def search_files(request: Request) -> Response:
    managed = sandbox_for(request)
    root = request.query_params.get("path")
    if not root or "\0" in root:
        raise bad_request("path: the directory to search is required", "MISSING_QUERY")
    pattern = request.query_params.get("pattern") or "**"
    matcher = re.compile(fnmatch.translate(pattern.replace("**", "*")))

    def work() -> list[dict[str, Any]]:
        if not managed.box.stat(root).is_dir:
            raise NotADirectoryError(20, "not a directory", root)
        base = absolute(root, WORKDIR)
        out = []
        for entry in managed.box.list_dir(root, depth=64):
            if entry.type == "file" and matcher.match(os.path.basename(entry.path)):
                path = os.path.join(base, entry.path)
                st = managed.box.stat(path, follow_symlinks=False)
                out.append(file_info(path, st.mode, st.size, st.mtime_ns, st.uid, st.gid))
        return out

    return JSONResponse(await run_in_threadpool(work))


@api
async def list_directory(request: Request) -> Response:
    managed = sandbox_for(request)
    root = request.query_params.get("path")
    if not root or "\0" in root:
        raise bad_request("path: the directory to list is required", "MISSING_QUERY")
    depth = query_int(request, "depth", 1, 0, 64) or 1

    def work() -> list[dict[str, Any]]:
        st = managed.box.stat(root, follow_symlinks=False)
        if st.is_symlink:
            raise bad_request("path: is a symbolic link; give the real directory")
        base = absolute(root, WORKDIR)
        return [file_info(os.path.join(base, e.path), e.mode, e.size, e.mtime_ns, st.uid, st.gid)
                for e in managed.box.list_dir(root, depth=depth)]

    return JSONResponse(await run_in_threadpool(work))


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@api
async def download_file(request: Request) -> Response:
    managed = sandbox_for(request)
    path = request.query_params.get("path")
    if not path or "\0" in path:
        raise bad_request("path: the file to download is required", "MISSING_QUERY")
    offset = query_int(request, "offset", None, 1, 1 << 40)
    limit = query_int(request, "limit", None, 0, 1 << 40)
    data: bytes = await run_in_threadpool(lambda: managed.box.read_file(path, text=False, limit=MAX_FILE))
    if offset is not None or limit is not None:
        lines = data.splitlines(keepends=True)
        start = (offset or 1) - 1
        data = b"".join(lines[start:] if limit is None else lines[start:start + limit])
    # The name is the sandbox's (any bytes but / and NUL): only a plain token goes into the header.
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", os.path.basename(path))[:128] or "file"
    headers = {"Content-Disposition": f"attachment; filename=\"{name}\""}
    spec = request.headers.get("range")
    if spec:
        match = _RANGE.match(spec.strip())
        size = len(data)
        if not match or (not match.group(1) and not match.group(2)):
            raise ApiError(416, "INVALID_RANGE", f"Range: {spec[:40]!r} is not bytes=START-END")
        if match.group(1):
            start, end = int(match.group(1)), int(match.group(2)) if match.group(2) else size - 1
        else:
            start, end = max(0, size - int(match.group(2))), size - 1
        end = min(end, size - 1)
        if start >= size or start > end:
            raise ApiError(416, "INVALID_RANGE", f"Range: not satisfiable for {size} bytes")
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return Response(data[start:end + 1], status_code=206, media_type="application/octet-stream", headers=headers)
    return Response(data, media_type="application/octet-stream", headers=headers)


@api
async def upload_files(request: Request) -> Response:
    import json

    managed = sandbox_for(request)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("the body must be multipart/form-data (metadata, file) pairs", "INVALID_REQUEST_BODY")
    total = 0

    async def receive() -> Message:
        nonlocal total
        message = await request.receive()
        if message["type"] == "http.request":
            total += len(message.get("body", b""))
            if total > MAX_UPLOAD:  # parts are spooled to disk: bound the whole body, not only each part
                raise ApiError(413, "REQUEST_TOO_LARGE", f"an upload carries at most {MAX_UPLOAD} bytes")
        return message

    try:
        form = await Request(request.scope, receive).form(max_files=10000, max_fields=10000,
                                                          max_part_size=MAX_FILE)
    except ApiError:
        raise
    except Exception as exc:
        raise bad_request(f"the multipart body cannot be read: {exc}", "INVALID_REQUEST_BODY") from None
    try:
        items = form.multi_items()
        plan: list[tuple[str, int, UploadFile | str]] = []
        pending: dict[str, Any] | None = None
        for name, value in items:
            if name == "metadata":
                raw = await value.read() if isinstance(value, UploadFile) else value.encode()
                try:
                    meta = json.loads(raw)
                except ValueError:
                    raise bad_request("metadata: not valid JSON", "INVALID_REQUEST_BODY") from None
                if not isinstance(meta, dict) or not isinstance(meta.get("path"), str) or not meta["path"]:
                    raise bad_request("metadata: expected {\"path\": PATH, \"mode\": 644}", "INVALID_REQUEST_BODY")
                pending = meta
            elif name == "file":
                if pending is None:
                    raise bad_request("file: each file part must follow its metadata part", "INVALID_REQUEST_BODY")
                plan.append((pending["path"], _permission(pending, "metadata", 0o644, managed), value))
                pending = None
        if pending is not None or not plan:
            raise bad_request("every metadata part needs a file part after it", "INVALID_REQUEST_BODY")

        for path, mode, value in plan:
            data = await value.read() if isinstance(value, UploadFile) else value.encode()
            await run_in_threadpool(managed.box.write_file, path, data, mode=mode)
    finally:
        await form.close()
    return Response(status_code=200)


@api
async def metrics(request: Request) -> Response:
    managed = sandbox_for(request)

    def work() -> dict[str, Any]:
        rss = 0
        for proc in managed.box.processes():
            try:
                rss += proc.memory_info().rss
            except Exception:
                continue
        limit = managed.box.policy.limits.value("memory")
        import psutil

        total = limit if limit is not None else psutil.virtual_memory().total
        cpus = managed.box.policy.limits.value("cpus") or float(os.cpu_count() or 1)
        return {"cpu_count": float(cpus), "cpu_used_pct": 0.0, "mem_total_mib": total / (1 << 20),
                "mem_used_mib": rss / (1 << 20), "timestamp": int(time.time() * 1000)}

    return JSONResponse(await run_in_threadpool(work))


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


@api
async def create_context(request: Request) -> Response:
    managed = sandbox_for(request)
    body = await json_body(request, required=False)
    if body is not None and not isinstance(body, dict):
        raise bad_request("the body must be {\"language\": \"python\"}", "INVALID_REQUEST_BODY")
    language = _language((body or {}).get("language"))
    room_for_session(managed)
    context = await run_in_threadpool(CodeContext, managed.box, language)
    managed.contexts[context.id] = context
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


@api
async def delete_context(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    context = _context(managed, request.path_params["context_id"])
    managed.contexts.pop(context.id, None)
    await run_in_threadpool(context.close)
    return Response(status_code=200)


@api
async def delete_contexts(request: Request) -> Response:
    managed = sandbox_for(request, running=False)
    language = _language(request.query_params.get("language"))
    for context in [c for c in managed.contexts.values() if c.language == language]:
        managed.contexts.pop(context.id, None)
        await run_in_threadpool(context.close)
    return Response(status_code=200)


@api
async def interrupt_code(request: Request) -> Response:
    managed = sandbox_for(request)
    context_id = request.query_params.get("id")
    if not context_id:
        raise bad_request("id: the context's id is required", "MISSING_QUERY")
    await run_in_threadpool(_context(managed, context_id).interrupt)
    return Response(status_code=200)


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
        default: CodeContext | None = managed.contexts.get(f"default-{language}")
        if default is None:
            room_for_session(managed)
            default = await run_in_threadpool(CodeContext, managed.box, language, f"default-{language}")
            managed.contexts[default.id] = default
        context = default
    bridge = Bridge(asyncio.get_running_loop())
    threading.Thread(target=context.run, args=(body["code"], None, bridge.put), daemon=True,
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


# -- the egress sidecar's policy (port 18080), read-only ---------------------------------------

@api
async def egress_policy(request: Request) -> Response:
    """The sandbox's network as the sidecar's policy shape; it is fixed at create (changes are refused)."""
    managed = sandbox_for(request, running=False, port=EGRESS_PORT)
    if request.method != "GET":
        raise ApiError(400, "UNSUPPORTED", "the network of a running sandbox cannot change here; create another "
                       "sandbox with the networkPolicy wanted")
    network = managed.box.policy.network
    if isinstance(network, str):
        policy: dict[str, Any] = {"defaultAction": "allow" if network == "host" else "deny", "egress": []}
    else:
        policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": h} for h in network.hosts]}
    mode = network if isinstance(network, str) else "allow-list"
    return JSONResponse({"status": "ok", "mode": mode, "enforcementMode": "isolate", "policy": policy})


PREFIX = "/sandboxes/{sandbox_id}/port/{port}"

routes = [
    Route(PREFIX + "/ping", ping, methods=["GET"]),
    Route(PREFIX + "/command", run_command, methods=["POST"]),
    Route(PREFIX + "/command", interrupt_command, methods=["DELETE"]),
    Route(PREFIX + "/command/status/{command_id}", command_status, methods=["GET"]),
    Route(PREFIX + "/command/{command_id}/logs", command_logs, methods=["GET"]),
    Route(PREFIX + "/session", create_session, methods=["POST"]),
    Route(PREFIX + "/session/{session_id}/run", run_in_session, methods=["POST"]),
    Route(PREFIX + "/session/{session_id}", delete_session, methods=["DELETE"]),
    Route(PREFIX + "/files/info", files_info, methods=["GET"]),
    Route(PREFIX + "/files", remove_files, methods=["DELETE"]),
    Route(PREFIX + "/files/mv", move_files, methods=["POST"]),
    Route(PREFIX + "/files/permissions", chmod_files, methods=["POST"]),
    Route(PREFIX + "/files/search", search_files, methods=["GET"]),
    Route(PREFIX + "/files/replace", replace_content, methods=["POST"]),
    Route(PREFIX + "/files/upload", upload_files, methods=["POST"]),
    Route(PREFIX + "/files/download", download_file, methods=["GET"]),
    Route(PREFIX + "/directories/list", list_directory, methods=["GET"]),
    Route(PREFIX + "/directories", make_dirs, methods=["POST"]),
    Route(PREFIX + "/directories", remove_dirs, methods=["DELETE"]),
    Route(PREFIX + "/metrics", metrics, methods=["GET"]),
    Route(PREFIX + "/policy", egress_policy, methods=["GET", "PATCH", "DELETE"]),
    Route(PREFIX + "/code", run_code, methods=["POST"]),
    Route(PREFIX + "/code", interrupt_code, methods=["DELETE"]),
    Route(PREFIX + "/code/context", create_context, methods=["POST"]),
    Route(PREFIX + "/code/contexts", list_contexts, methods=["GET"]),
    Route(PREFIX + "/code/contexts", delete_contexts, methods=["DELETE"]),
    Route(PREFIX + "/code/contexts/{context_id}", get_context, methods=["GET"]),
    Route(PREFIX + "/code/contexts/{context_id}", delete_context, methods=["DELETE"]),
]
