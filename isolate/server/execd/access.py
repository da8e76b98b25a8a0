"""Reaching one sandbox's execution API: its access token (or the server's API key), its port, and
``ping``; the limits every part of the API shares.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from ..common import ACCESS_TOKEN_HEADER, API_KEY_HEADER, api, same
from ..models import EXECD_PORT, ApiError
from ..state import ManagedSandbox, ServerState, _Slots

#: Where relative paths start: the sandbox's workspace (its commands' default cwd).
WORKDIR = "/workspace"


#: Largest file one upload part may carry, and one download may return.
MAX_FILE = 1 << 30


#: Largest upload request (all its files).
MAX_UPLOAD = 2 << 30


#: A file's bytes move between the sandbox and the client this many at a time (one chunk in memory).
CHUNK = 1 << 20


#: An upload's metadata part, and the headers of all its parts, at most.
MAX_METADATA = 64 << 10
MAX_PART_HEADERS = 1 << 20


#: Files moving at once over the whole server (downloads, uploads, replaces): each holds a chunk or two in
#: memory and a worker thread; past this, a request is answered 503 at once rather than the server growing.
MAX_TRANSFERS = 16


TRANSFERS = _Slots(MAX_TRANSFERS)


def transfer_slot(managed: ManagedSandbox) -> Callable[[], None]:
    """Take one of the server's MAX_TRANSFERS slots for managed (503 SERVER_BUSY when none is free; 429 when the
    sandbox holds a quarter of them already, so that one sandbox's clients cannot take them all); returns its
    release."""
    most = max(1, TRANSFERS.limit // 4)
    with managed.lock:
        if managed.transfers >= most:
            raise ApiError(429, "TOO_MANY_TRANSFERS", f"a sandbox moves at most {most} files at once; wait for one "
                           "to end")
        if not TRANSFERS.take():
            raise ApiError(503, "SERVER_BUSY", f"this server moves at most {TRANSFERS.limit} files at once over all "
                           "its sandboxes; try again shortly")
        managed.transfers += 1
    given = threading.Event()

    def release() -> None:
        if not given.is_set():
            given.set()
            with managed.lock:
                managed.transfers -= 1
            TRANSFERS.give()

    return release


#: Output of a streamed command waiting for a slow client before the command is held up.
BRIDGE_LIMIT = 8 << 20


def sandbox_for(request: Request, running: bool = True, port: int = EXECD_PORT) -> ManagedSandbox:
    state: ServerState = request.app.state.isolate
    try:
        managed = state.get(request.path_params["sandbox_id"])
    except ApiError:
        # Same answer for an unknown sandbox and a wrong token: no probing of ids.
        managed = None
    ok = managed is not None and (managed.token_ok(request.headers.get(ACCESS_TOKEN_HEADER))
                                  or same(request.headers.get(API_KEY_HEADER), state.api_key))
    if managed is None or not ok:
        raise ApiError(401, "UNAUTHORIZED", f"unknown sandbox, or missing or wrong {ACCESS_TOKEN_HEADER} header")
    if request.path_params.get("port", str(port)) != str(port):
        raise ApiError(404, "NOT_FOUND", "this port of the sandbox serves nothing here")
    if running:
        managed.usable()
    managed.accessed()
    return managed


def refusal_for(request: Request, status: int, code: str, reason: str) -> ApiError:
    """A refused route of the execution or egress API: 401 without the sandbox's token or the API key
    (as its served routes answer), else the refusal. The API key alone suffices: a refusal is the
    server's, whatever the sandbox."""
    state: ServerState = request.app.state.isolate
    if not same(request.headers.get(API_KEY_HEADER), state.api_key):
        try:
            managed: ManagedSandbox | None = state.get(request.path_params["sandbox_id"])
        except ApiError:
            managed = None
        if managed is None or not managed.token_ok(request.headers.get(ACCESS_TOKEN_HEADER)):
            raise ApiError(401, "UNAUTHORIZED", f"unknown sandbox, or missing or wrong {ACCESS_TOKEN_HEADER} header")
    return ApiError(status, code, reason)


@api
async def ping(request: Request) -> Response:
    sandbox_for(request)
    return Response(status_code=200)
