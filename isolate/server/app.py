"""The ASGI application: the lifecycle API under /v1, each sandbox's execution API under /sandboxes/{id}/port/44772."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import diagnostics, execd, lifecycle, ports, snapshots
from .common import api, error_response, log
from .execd.access import refusal_for
from .lifecycle import check_key
from .models import ApiError
from .ports import PROXY_FORM
from .spec import SpecRoute, refused_routes
from .state import ServerState

#: How often the reaper looks for expired sandboxes.
REAP_INTERVAL = 1.0


async def _reaper(state: ServerState) -> None:
    while True:
        await asyncio.sleep(REAP_INTERVAL)
        now = time.time()
        for managed in state.all():
            # Its kept background commands' ends, timeouts and logs' oldest bytes (on a thread of its own).
            managed.tend_commands(now)
        for managed in state.expired(time.time()):
            log.info("sandbox %s expired", managed.id)
            try:
                await run_in_threadpool(managed.close)
            except Exception as exc:
                log.warning("closing expired sandbox %s: %s", managed.id, exc)
            state.forget(managed)
        for managed in state.ended():
            # Its init was killed (from the host, or its exec server's end ended it): let it go whole now, its
            # files, cgroups, volumes and record with it, rather than serve a sandbox that no longer answers.
            log.warning("sandbox %s ended by itself (its init is gone); removed", managed.id)
            try:
                await run_in_threadpool(managed.close)
            except Exception as exc:
                log.warning("closing ended sandbox %s: %s", managed.id, exc)
            state.forget(managed)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "HTTP_ERROR")
    return error_response(exc.status_code, code, str(exc.detail))


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RequestId:
    """Every answer carries X-Request-ID: the caller's (when it is a plain token) or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else str(uuid.uuid4())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-ID"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


_PROXY_PATH = re.compile(r"(/sandboxes/[^/]+)/proxy/([0-9]+)(/.*)?", re.DOTALL)
_RAW_PROXY_PATH = re.compile(rb"(/sandboxes/[^/]+)/proxy/([0-9]+)(/.*)?", re.DOTALL)


class ServerProxyPaths:
    """``/sandboxes/{id}/proxy/{port}/...`` (the endpoints' server-proxy form) is ``.../port/{port}/...``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            found = _PROXY_PATH.fullmatch(scope["path"])
            raw = scope.get("raw_path")
            # The path as sent (still percent-encoded) must have the same form: an encoded "proxy" or slash
            # would make the two disagree, and the routes and the forwarder read one each.
            raw_found = _RAW_PROXY_PATH.fullmatch(raw) if isinstance(raw, bytes) else None
            if found is not None and (raw is None or raw_found is not None):
                # The form the client used stays known: the app's cookies are scoped to the path it sees.
                scope = {**scope, "path": f"{found[1]}/port/{found[2]}{found[3] or ''}", PROXY_FORM: True}
                if raw_found is not None:
                    scope["raw_path"] = raw_found[1] + b"/port/" + raw_found[2] + (raw_found[3] or b"")
        await self.app(scope, receive, send)


def _refusal(route: SpecRoute) -> Route:
    """A route of the specs this server does not do: the spec's error shape, with the reason."""
    assert route.refusal is not None
    status, code, reason = route.refusal
    lifecycle_api = route.api in ("lifecycle", "diagnostic")

    @api
    async def refuse(request: Request) -> Response:
        if lifecycle_api:
            check_key(request)
            raise ApiError(status, code, reason)
        raise refusal_for(request, status, code, reason)

    path = route.server_path.replace("{sandboxId}", "{sandbox_id}")
    return Route(path, refuse, methods=[route.method], name=f"refused {route.method} {route.server_path}")


def create_app(state: ServerState) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(_reaper(state))
        try:
            yield
        finally:
            task.cancel()
            await run_in_threadpool(state.close_all)

    # Refusals first: the /v1 mount would otherwise take their paths (and answer 405).
    routes: list[BaseRoute] = [*(_refusal(r) for r in refused_routes()),
                               Mount("/v1", routes=[*lifecycle.routes, *snapshots.routes, *diagnostics.routes]),
                               *execd.routes, *ports.routes]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(RequestId), Middleware(ServerProxyPaths)])
    app.state.isolate = state
    return app
