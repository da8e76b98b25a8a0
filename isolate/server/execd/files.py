"""Files and directories (``/files``, ``/directories``) and ``/metrics``: every path resolved inside the
sandbox, as the program, through ``isolate.Sandbox``'s file methods.
"""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from ..common import api, json_body, query_int
from ..models import ApiError, absolute, bad_request, file_info, name_of, octal_mode
from ..state import ManagedSandbox
from .access import MAX_FILE, MAX_UPLOAD, WORKDIR, sandbox_for

# -- files ------------------------------------------------------------------------------------------

def _paths(request: Request) -> list[str]:
    paths = request.query_params.getlist("path")
    if not paths or any(not p or "\0" in p for p in paths):
        raise bad_request("path: at least one non-empty path is required", "MISSING_QUERY")
    return paths


def _body_paths(paths: Any, what: str) -> None:
    """Paths a JSON body names: each a non-empty string without NUL (an empty one would be the workspace)."""
    for path in paths:
        if not isinstance(path, str) or not path or "\0" in path:
            raise bad_request(f"{what}: {str(path)[:40]!r} is not a path (empty, or has NUL)", "INVALID_PATH")


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
    _body_paths(body, "path")
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
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise bad_request(f"{where}.{name}: expected a user or group name (or its id) as a string")
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
    _body_paths(body, "path")
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
    _body_paths([p for item in body for p in (item["src"], item["dest"])], "src, dest")

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
    _body_paths(body, "path")
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
        match = _RANGE.fullmatch(spec.strip())
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
