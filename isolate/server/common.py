"""What the lifecycle and execution routes share: errors in the API's shape, bodies, keys, SSE framing."""

from __future__ import annotations

import errno
import functools
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..model.errors import IsolationError, PolicyError, SetupError, UnsupportedError
from .models import ApiError, bad_request

log = logging.getLogger("isolate.server")

#: JSON bodies larger than this are refused (uploads are multipart and not bound by it).
MAX_JSON_BODY = 4 << 20

API_KEY_HEADER = "OPEN-SANDBOX-API-KEY"
ACCESS_TOKEN_HEADER = "X-EXECD-ACCESS-TOKEN"

Handler = Callable[[Request], Awaitable[Response]]


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status)


def to_api_error(exc: BaseException) -> ApiError:
    """The API's answer for an exception: a 4xx for what the caller can fix, never a traceback."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UnsupportedError):
        return ApiError(400, "UNSUPPORTED", str(exc))
    if isinstance(exc, PolicyError):
        return ApiError(400, "INVALID_REQUEST", str(exc))
    if isinstance(exc, SetupError) and exc.step == "chdir":
        return ApiError(400, "INVALID_CWD", str(exc))
    if isinstance(exc, FileNotFoundError):
        return ApiError(404, "FILE_NOT_FOUND", _os_message(exc))
    if isinstance(exc, PermissionError):
        return ApiError(403, "PERMISSION_DENIED", _os_message(exc))
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, FileExistsError)):
        return ApiError(400, "INVALID_PATH", _os_message(exc))
    if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTEMPTY,
                                                  errno.EXDEV, errno.EFBIG, errno.ENOSPC, errno.EDQUOT,
                                                  errno.EROFS):
        return ApiError(400, "INVALID_PATH", _os_message(exc))
    if isinstance(exc, ValueError):
        return ApiError(400, "INVALID_REQUEST", str(exc))
    if isinstance(exc, IsolationError):
        return ApiError(500, "RUNTIME_ERROR", str(exc))
    log.exception("unexpected error", exc_info=exc)
    return ApiError(500, "INTERNAL_ERROR", f"internal error ({type(exc).__name__}); see the server's log")


def _os_message(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    return f"{exc.filename}: {text}" if exc.filename else text


def api(handler: Handler) -> Handler:
    """Wrap a route: every failure becomes the API's error shape."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            err = to_api_error(exc)
            return error_response(err.status, err.code, err.message)

    return wrapped


def same(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def json_body(request: Request, required: bool = True) -> Any:
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_JSON_BODY:
            raise ApiError(413, "REQUEST_TOO_LARGE", f"the body is larger than {MAX_JSON_BODY} bytes")
    if not data.strip():
        if required:
            raise bad_request("a JSON body is required", "INVALID_REQUEST_BODY")
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise bad_request("the body is not valid JSON", "INVALID_REQUEST_BODY") from None


def query_int(request: Request, name: str, default: int | None, minimum: int, maximum: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    # ASCII digits only, and few of them: int() would also take "٣", "1_0", " 5" and 4000 digits.
    if not re.fullmatch(r"-?[0-9]{1,19}", raw):
        raise bad_request(f"{name}: {raw[:32]!r} is not an integer", "INVALID_QUERY")
    value = int(raw)
    if not minimum <= value <= maximum:
        raise bad_request(f"{name}: expected {minimum}..{maximum}", "INVALID_QUERY")
    return value


def sse(event: dict[str, Any]) -> bytes:
    event.setdefault("timestamp", int(time.time() * 1000))
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_EOL = re.compile(rb"\r\n|\r|\n")
MAX_LINE = 64 << 10


class LineSplitter:
    """Output as the API streams it: one event per line, without its terminator (\\n, \\r or \\r\\n)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.after_cr = False

    def feed(self, data: bytes) -> list[str]:
        if self.after_cr and data.startswith(b"\n"):
            data = data[1:]  # the second half of a \r\n split between reads
        self.after_cr = data.endswith(b"\r")
        self.buffer += data
        *lines, tail = _EOL.split(bytes(self.buffer))
        self.buffer = bytearray(tail)
        if len(self.buffer) > MAX_LINE:  # a line without end is passed on in pieces
            lines.append(bytes(self.buffer))
            self.buffer.clear()
        return [line.decode(errors="replace") for line in lines if line]

    def flush(self) -> list[str]:
        if not self.buffer:
            return []
        line = self.buffer.decode(errors="replace")
        self.buffer.clear()
        return [line]
