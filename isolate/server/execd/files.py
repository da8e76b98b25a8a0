"""Files and directories (``/files``, ``/directories``) and ``/metrics``: every path resolved inside the
sandbox, as the program, through ``isolate.Sandbox``'s file methods.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import AsyncIterator
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...model.files import write_all
from ..common import api, json_body, query_int
from ..models import ApiError, absolute, bad_request, file_info, name_of, octal_mode
from ..state import ManagedSandbox
from .access import CHUNK, MAX_FILE, MAX_METADATA, MAX_PART_HEADERS, MAX_UPLOAD, WORKDIR, sandbox_for, transfer_slot

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
        counts = {}  # each file whole in memory (read_file's 64 MiB at most), one request at a time per slot
        for path, item in body.items():
            text = managed.box.read_file(path)
            found = text.count(item["old"])
            if found:
                managed.box.write_file(path, text.replace(item["old"], item["new"]))
            counts[path] = {"replacedCount": found}
        return counts

    slot = transfer_slot(managed)
    try:
        counts = await run_in_threadpool(work)
    finally:
        slot()
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


_RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})")


def _line_span(fd: int, size: int, offset: int | None, limit: int | None) -> tuple[int, int]:
    """The bytes [start, end) of lines offset.. (1-based, lines end at \\n) and at most limit of them, read a
    chunk at a time."""
    first = (offset or 1) - 1
    start = 0 if first == 0 else -1
    end, seen, pos = -1, 0, 0
    last = None if limit is None else first + limit  # lines before the span's end
    if last == first:
        end = -2  # no line: settled once start is
    while pos < size and (start < 0 or (end == -1 and last is not None)):
        chunk = os.pread(fd, min(CHUNK, size - pos), pos)
        if not chunk:
            break
        at = 0
        while True:
            found = chunk.find(b"\n", at)
            if found < 0:
                break
            seen += 1
            at = found + 1
            if seen == first and start < 0:
                start = pos + at
            if last is not None and seen == last and end == -1:
                end = pos + at
                break
        pos += len(chunk)
    if start < 0:
        return pos, pos  # fewer lines than offset
    if end == -2:
        return start, start
    return start, size if last is None else (pos if end < 0 else end)


async def _chunks(reader: Any, start: int, end: int, done: Any) -> AsyncIterator[bytes]:
    """The file's bytes [start, end), CHUNK at a time (one chunk in memory); done() once over or abandoned."""
    try:
        fd = reader.fileno()
        while start < end:
            chunk: bytes = await run_in_threadpool(os.pread, fd, min(CHUNK, end - start), start)
            if not chunk:
                return  # it shrank meanwhile: the response ends short (its length was said), the client sees it
            start += len(chunk)
            yield chunk
    finally:
        done()


def _range(spec: str, size: int) -> tuple[int, int]:
    """The bytes [start, end] a Range header asks of size bytes (416 when it cannot be served)."""
    match = _RANGE.fullmatch(spec.strip())
    if not match or (not match.group(1) and not match.group(2)):
        raise ApiError(416, "INVALID_RANGE", f"Range: {spec[:40]!r} is not bytes=START-END")
    if match.group(1):
        start, end = int(match.group(1)), int(match.group(2)) if match.group(2) else size - 1
    else:
        start, end = max(0, size - int(match.group(2))), size - 1
    end = min(end, size - 1)
    if start >= size or start > end:
        raise ApiError(416, "INVALID_RANGE", f"Range: not satisfiable for {size} bytes")
    return start, end


@api
async def download_file(request: Request) -> Response:
    managed = sandbox_for(request)
    path = request.query_params.get("path")
    if not path or "\0" in path:
        raise bad_request("path: the file to download is required", "MISSING_QUERY")
    offset = query_int(request, "offset", None, 1, 1 << 40)
    limit = query_int(request, "limit", None, 0, 1 << 40)
    slot = transfer_slot(managed)
    reader: Any = None
    try:
        if hasattr(managed.box, "open_file"):
            reader = await run_in_threadpool(managed.box.open_file, path, "rb")
        else:  # a sandbox on a Ray node: its file comes whole (at most MAX_FILE), then is served from memory
            reader = _Whole(await run_in_threadpool(lambda: managed.box.read_file(path, text=False, limit=MAX_FILE)))
        size = os.fstat(reader.fileno()).st_size
        if size > MAX_FILE:
            raise ApiError(413, "FILE_TOO_LARGE", f"{path}: larger than the {MAX_FILE} bytes a download carries")
        start, end = 0, size
        if offset is not None or limit is not None:
            start, end = await run_in_threadpool(_line_span, reader.fileno(), size, offset, limit)
        # The name is the sandbox's (any bytes but / and NUL): only a plain token goes into the header.
        name = re.sub(r"[^A-Za-z0-9._+-]", "_", os.path.basename(path))[:128] or "file"
        headers = {"Content-Disposition": f"attachment; filename=\"{name}\""}
        status = 200
        spec = request.headers.get("range")
        if spec:
            first, last = _range(spec, end - start)
            headers["Content-Range"] = f"bytes {first}-{last}/{end - start}"
            start, end, status = start + first, start + last + 1, 206
        headers["Content-Length"] = str(end - start)
        done = _once(reader, slot)
        return StreamingResponse(_chunks(reader, start, end, done), status_code=status,
                                 media_type="application/octet-stream", headers=headers)
    except BaseException:
        _once(reader, slot)()
        raise


class _Whole:
    """A file read whole (a remote sandbox's), served as if it were open here: a sealed memfd."""

    def __init__(self, data: bytes) -> None:
        self.fd = os.memfd_create("isolate-download", os.MFD_CLOEXEC)
        try:
            write_all(self.fd, data)
        except BaseException:
            os.close(self.fd)
            raise

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _once(reader: Any, slot: Any) -> Any:
    """Close reader and give the transfer slot back, once however often called."""
    state = {"done": False}

    def done() -> None:
        if state["done"]:
            return
        state["done"] = True
        try:
            if reader is not None:
                reader.close()
        finally:
            slot()

    return done


class _Upload:
    """The multipart parser's callbacks for one upload (run in a worker thread): each file part is written
    into the sandbox as it arrives, CHUNK at a time, as the program (``Sandbox.open_file``)."""

    def __init__(self, managed: ManagedSandbox) -> None:
        self.managed = managed
        self.name = b""
        self.header_field = b""
        self.header_value = b""
        self.header_bytes = 0
        self.meta: bytearray | None = None
        self.pending: dict[str, Any] | None = None
        self.out: Any = None
        self.whole: bytearray | None = None  # a sandbox on a Ray node: the part, then write_file
        self.target: tuple[str, int] = ("", 0)
        self.written = 0
        self.files = 0
        self.in_file = False

    def callbacks(self) -> Any:
        return {"on_part_begin": self.part_begin, "on_header_field": self.field, "on_header_value": self.value,
                "on_header_end": self.header_end, "on_headers_finished": self.headers_finished,
                "on_part_data": self.data, "on_part_end": self.part_end}

    def part_begin(self) -> None:
        self.name, self.header_field, self.header_value, self.in_file = b"", b"", b"", False

    def _count(self, size: int) -> None:
        self.header_bytes += size
        if self.header_bytes > MAX_PART_HEADERS:
            raise bad_request(f"the parts' headers take more than {MAX_PART_HEADERS} bytes", "INVALID_REQUEST_BODY")

    def field(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        self.header_field += data[start:end]

    def value(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        self.header_value += data[start:end]

    def header_end(self) -> None:
        if self.header_field.lower() == b"content-disposition":
            _, options = parse_options_header(self.header_value)
            self.name = options.get(b"name", b"")
        self.header_field, self.header_value = b"", b""

    def headers_finished(self) -> None:
        if self.name == b"metadata":
            self.meta = bytearray()
        elif self.name == b"file":
            if self.pending is None:
                raise bad_request("file: each file part must follow its metadata part", "INVALID_REQUEST_BODY")
            path, mode = self.pending["path"], _permission(self.pending, "metadata", 0o644, self.managed)
            self.target, self.written, self.in_file = (path, mode), 0, True
            if hasattr(self.managed.box, "open_file"):
                self.out = self.managed.box.open_file(path, "wb", perms=mode)
            else:
                self.whole = bytearray()

    def data(self, data: bytes, start: int, end: int) -> None:
        if self.meta is not None:
            self.meta += data[start:end]
            if len(self.meta) > MAX_METADATA:
                raise bad_request(f"metadata: larger than {MAX_METADATA} bytes", "INVALID_REQUEST_BODY")
        elif self.in_file:
            self.written += end - start
            if self.written > MAX_FILE:
                raise ApiError(413, "REQUEST_TOO_LARGE", f"a file part carries at most {MAX_FILE} bytes")
            if self.out is not None:
                write_all(self.out.fileno(), memoryview(data)[start:end])
            elif self.whole is not None:
                self.whole += data[start:end]

    def part_end(self) -> None:
        if self.meta is not None:
            raw, self.meta = bytes(self.meta), None
            try:
                meta = json.loads(raw)
            except ValueError:
                raise bad_request("metadata: not valid JSON", "INVALID_REQUEST_BODY") from None
            if not isinstance(meta, dict) or not isinstance(meta.get("path"), str) or not meta["path"]:
                raise bad_request("metadata: expected {\"path\": PATH, \"mode\": 644}", "INVALID_REQUEST_BODY")
            self.pending = meta
        elif self.in_file:
            self.in_file, self.pending = False, None
            self.files += 1
            if self.whole is not None:
                data, self.whole = bytes(self.whole), None
                self.managed.box.write_file(self.target[0], data, mode=self.target[1])
            self.close()

    def finish(self) -> None:
        if self.in_file or self.meta is not None:
            raise bad_request("the multipart body ends inside a part", "INVALID_REQUEST_BODY")
        if self.pending is not None or not self.files:
            raise bad_request("every metadata part needs a file part after it", "INVALID_REQUEST_BODY")

    def close(self) -> None:
        out, self.out = self.out, None
        if out is not None:
            out.close()


@api
async def upload_files(request: Request) -> Response:
    """Each file part goes into the sandbox as it arrives (nothing spooled, one chunk in memory): the files
    before a part that fails are written."""
    managed = sandbox_for(request)
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise bad_request("the body must be multipart/form-data (metadata, file) pairs", "INVALID_REQUEST_BODY")
    slot = transfer_slot(managed)
    upload = _Upload(managed)
    try:
        parser = MultipartParser(boundary, upload.callbacks())
        total, pending = 0, bytearray()  # the body's small pieces gathered up to CHUNK: one worker hop each
        async for chunk in request.stream():
            total += len(chunk)
            if total > MAX_UPLOAD:
                raise ApiError(413, "REQUEST_TOO_LARGE", f"an upload carries at most {MAX_UPLOAD} bytes")
            pending += chunk
            if len(pending) >= CHUNK:
                await run_in_threadpool(_feed, parser, bytes(pending))
                pending.clear()
        if pending:
            await run_in_threadpool(_feed, parser, bytes(pending))
        await run_in_threadpool(parser.finalize)
        upload.finish()
    finally:
        try:
            await run_in_threadpool(upload.close)
        finally:
            slot()
    return Response(status_code=200)


def _feed(parser: Any, chunk: bytes) -> None:
    try:
        parser.write(chunk)
    except MultipartParseError as exc:
        raise bad_request(f"the multipart body cannot be read: {exc}", "INVALID_REQUEST_BODY") from None
