"""A sandbox's own ports (``/sandboxes/{id}/port/{port}/...``): HTTP and WebSocket forwarded to its loopback.

The endpoints call hands out this URL and a token for one port of one sandbox
(``OpenSandbox-Secure-Access``: an HMAC of the sandbox's execution token and
the port, so that whoever is given a web app's endpoint cannot run commands
with it); the server's API key works too (the SDK's server-proxy mode).
Neither is passed on to the sandbox, and neither is ever a cookie. The connection to the app comes from
the sandbox's connector (isolate.server.connector), not from the network;
the server speaks HTTP on it itself (h11), or makes the WebSocket handshake
with the app and relays messages (wsproto).

What the app answers reaches the browser on the API's own origin, so it is
served as a page that cannot act there (docs/threat-model.md, "A sandbox's
ports and the API's origin"): every answer carries ``Content-Security-Policy:
sandbox`` without ``allow-same-origin`` (its documents get an opaque origin:
no same-origin requests, storage or service workers of the API's origin),
its ``Set-Cookie`` is scoped to the port's own path (``Path`` forced to
``/sandboxes/{id}/port/{port}``, ``Domain`` dropped), and the headers that
act on the whole origin (``Service-Worker-Allowed``, ``Clear-Site-Data``)
are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

import h11
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from .common import ACCESS_TOKEN_HEADER, API_KEY_HEADER, api, log, same
from .connector import forwarder_of
from .models import EGRESS_PORT, EXECD_PORT, ApiError, bad_request
from .state import ManagedSandbox, ServerState

PORT_TOKEN_HEADER = "OpenSandbox-Secure-Access"
#: How long the app may take to start its answer, and to send more of it.
RESPONSE_TIMEOUT = 300.0

#: Hop-by-hop headers (RFC 9110 7.6.1) and the server's own credentials: never passed on.
_DROP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
         "transfer-encoding", "upgrade", "host", "content-length",
         API_KEY_HEADER.lower(), ACCESS_TOKEN_HEADER.lower(), PORT_TOKEN_HEADER.lower()}


#: What every answer of a sandbox's port is sandboxed with: scripts, forms, popups and downloads work; the
#: page's origin is opaque (no allow-same-origin) and it cannot navigate the top window away.
PORT_CSP = b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"
#: Headers of the app that act on the whole origin: never passed on.
_ORIGIN_WIDE = {"service-worker-allowed", "clear-site-data", "set-cookie2"}
#: The ASGI scope's mark of a request that came by the server-proxy form (/sandboxes/{id}/proxy/{port}).
PROXY_FORM = "isolate.proxy_form"


def public_prefix(request: HTTPConnection, port: int) -> str:
    """The path of the port as the client named it (the port form or the server-proxy form)."""
    kind = "proxy" if request.scope.get(PROXY_FORM) else "port"
    return f"/sandboxes/{request.path_params['sandbox_id']}/{kind}/{port}"


def scoped_cookie(value: bytes, prefix: str) -> bytes:
    """A Set-Cookie of the app, made to reach only the app's own path: its Path is the port's prefix
    (whatever the app said: a cookie for / would reach the API and every other sandbox's ports), its Domain
    goes (host-only), its other attributes stay."""
    name_value, *attributes = value.split(b";")
    kept = [a for a in attributes if a.strip().partition(b"=")[0].strip().lower() not in (b"path", b"domain")]
    return b";".join([name_value, *kept, b" Path=" + prefix.encode()])


def _response_headers(headers: list[tuple[bytes, bytes]], prefix: str) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for key, value in headers:
        name = key.decode("latin-1").lower()
        if name in (_DROP - {"content-length"}) | _ORIGIN_WIDE:
            continue
        out.append((name.encode(), scoped_cookie(value, prefix) if name == "set-cookie" else value))
    # Added to the app's own policy, never replacing it: a browser enforces every policy it is given.
    out.append((b"content-security-policy", PORT_CSP))
    return out


def port_token(managed: ManagedSandbox, port: int) -> str:
    return hmac.new(managed.token.encode(), f"port {port}".encode(), hashlib.sha256).hexdigest()


def _authorized(request: HTTPConnection, state: ServerState) -> tuple[ManagedSandbox, int]:
    raw = request.path_params["port"]
    try:
        managed: ManagedSandbox | None = state.get(request.path_params["sandbox_id"])
    except ApiError:
        managed = None  # same answer for an unknown sandbox and a wrong token: no probing of ids
    port = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 5 else 0
    ok = managed is not None and (same(request.headers.get(API_KEY_HEADER), state.api_key)
                                  or (port > 0 and managed.port_token_ok(port, request.headers.get(PORT_TOKEN_HEADER))))
    if managed is None or not ok:
        raise ApiError(401, "UNAUTHORIZED", f"unknown sandbox, or missing or wrong {PORT_TOKEN_HEADER} header")
    if not 1 <= port <= 65535:
        raise bad_request(f"port: {raw[:16]!r} is not a port number (1-65535)", "INVALID_PORT")
    if port in (EXECD_PORT, EGRESS_PORT):
        raise ApiError(404, "NOT_FOUND", f"port {port} is this server's own API here; no such route")
    managed.usable()
    managed.accessed()
    return managed, port


def _target(request: HTTPConnection) -> bytes:
    """The request target as the app sees it: the path after the port (still percent-encoded), and the query."""
    raw = request.scope.get("raw_path") or request.scope["path"].encode()
    prefix = f"/sandboxes/{request.path_params['sandbox_id']}/port/{request.path_params['port']}".encode()
    path = raw[len(prefix):] if raw.startswith(prefix) else b"/"
    path = path if path.startswith(b"/") else b"/" + path
    query = request.scope.get("query_string", b"")
    return path + (b"?" + query if query else b"")


def _request_headers(request: HTTPConnection, port: int) -> list[tuple[bytes, bytes]]:
    named = {h.strip().lower() for h in request.headers.get("connection", "").split(",") if h.strip()}
    out = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _DROP | named]
    out.append((b"host", f"127.0.0.1:{port}".encode()))
    out.append((b"connection", b"close"))
    out.append((b"x-forwarded-host", request.headers.get("host", "").encode("latin-1")))
    out.append((b"x-forwarded-proto", request.url.scheme.encode()))
    out.append((b"x-forwarded-prefix", public_prefix(request, port).encode()))
    if request.headers.get("content-length") is not None:
        out.append((b"content-length", request.headers["content-length"].encode("latin-1")))
    elif "transfer-encoding" in request.headers:
        out.append((b"transfer-encoding", b"chunked"))
    return out


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await asyncio.wait_for(reader.read(65536), RESPONSE_TIMEOUT)
        conn.receive_data(data)


@api
async def forward(request: Request) -> Response:
    state: ServerState = request.app.state.isolate
    managed, port = _authorized(request, state)
    if request.headers.get("upgrade", "").lower() == "websocket":  # uvicorn without a WebSocket library
        raise ApiError(501, "WEBSOCKET_UNSUPPORTED", "this server was installed without wsproto: WebSocket is not "
                       "forwarded (pip install 'isolate[server]')")
    sock = await forwarder_of(managed).connect(port)
    reader, writer = await asyncio.open_connection(sock=sock)
    conn = h11.Connection(h11.CLIENT)
    try:
        head = h11.Request(method=request.method.encode(), target=_target(request),
                           headers=_request_headers(request, port))
        writer.write(conn.send(head) or b"")
        async for chunk in request.stream():
            if chunk:
                writer.write(conn.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        event = await _next_event(conn, reader)
        while isinstance(event, h11.InformationalResponse):  # 100 Continue: the body is sent already
            event = await _next_event(conn, reader)
        if not isinstance(event, h11.Response):
            raise h11.RemoteProtocolError("no response")
    except (h11.ProtocolError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
        writer.close()
        raise ApiError(502, "BAD_GATEWAY", f"port {port}: the app's answer is not HTTP/1.x ({exc or 'closed'})") \
            from None
    except BaseException:
        writer.close()
        raise
    raw_headers = _response_headers(list(event.headers), public_prefix(request, port))

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                part = await _next_event(conn, reader)
                if isinstance(part, h11.Data):
                    yield bytes(part.data)
                elif isinstance(part, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return
        except (h11.ProtocolError, OSError, asyncio.TimeoutError) as exc:
            log.info("forward to sandbox %s port %d ended early: %s", managed.id, port, exc)
        finally:
            writer.close()

    response = StreamingResponse(body(), status_code=event.status_code)
    response.raw_headers = raw_headers
    return response


async def _ws_open(websocket: WebSocket, port: int, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> Any:
    """The WebSocket handshake with the app inside; its AcceptConnection, or None (refused)."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, RejectConnection, RejectData
    from wsproto.events import Request as WsRequest

    ws = WSConnection(ConnectionType.CLIENT)
    skip = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol"}
    headers = [(k, v) for k, v in _request_headers(websocket, port)
               if k.decode("latin-1").lower() not in skip | {"host", "connection", "content-length",
                                                             "transfer-encoding"}]
    writer.write(ws.send(WsRequest(host=f"127.0.0.1:{port}", target=_target(websocket).decode("latin-1"),
                                   subprotocols=list(websocket.scope.get("subprotocols", [])),
                                   extra_headers=headers)))
    await writer.drain()
    while True:
        data = await asyncio.wait_for(reader.read(65536), RESPONSE_TIMEOUT)
        ws.receive_data(data or None)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return ws, event
            if isinstance(event, (RejectConnection, RejectData)):
                return None
        if not data:
            return None


async def forward_websocket(websocket: WebSocket) -> None:
    """A WebSocket to a sandbox's own port: the handshake with the app inside, then messages both ways."""
    from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

    state: ServerState = websocket.app.state.isolate
    try:
        managed, port = _authorized(websocket, state)
        sock = await forwarder_of(managed).connect(port)
    except ApiError as exc:
        await websocket.close(code=1008, reason=f"{exc.code}: {exc.message}"[:120])  # before accept: HTTP 403
        return
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        try:
            opened = await _ws_open(websocket, port, reader, writer)
        except (OSError, asyncio.TimeoutError, h11.ProtocolError, Exception) as exc:
            log.info("WebSocket to sandbox %s port %d: %s", managed.id, port, exc)
            opened = None
        if opened is None:
            await websocket.close(code=1011, reason=f"port {port}: the app refused the WebSocket")
            return
        ws, accepted = opened
        await websocket.accept(subprotocol=accepted.subprotocol)

        async def up() -> None:  # the client's messages to the app
            while True:
                try:
                    message = await websocket.receive()
                except WebSocketDisconnect:
                    return
                if message["type"] == "websocket.disconnect":
                    with contextlib.suppress(Exception):
                        writer.write(ws.send(CloseConnection(code=message.get("code", 1000))))
                    return
                text: str | None = message.get("text")
                if text is not None:
                    writer.write(ws.send(TextMessage(data=text)))
                else:
                    writer.write(ws.send(BytesMessage(data=bytes(message.get("bytes") or b""))))
                await writer.drain()

        async def down() -> None:  # the app's messages to the client
            parts: dict[type, list[Any]] = {TextMessage: [], BytesMessage: []}
            data = b"-"  # what came with the handshake's answer is in ws already: its events first
            while True:
                for event in ws.events():
                    if isinstance(event, (TextMessage, BytesMessage)):
                        parts[type(event)].append(event.data)
                        if event.message_finished:
                            if isinstance(event, TextMessage):
                                await websocket.send_text("".join(parts[TextMessage]))
                            else:
                                await websocket.send_bytes(b"".join(parts[BytesMessage]))
                            parts[type(event)].clear()
                    elif isinstance(event, Ping):
                        writer.write(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        with contextlib.suppress(Exception):
                            writer.write(ws.send(event.response()))
                        await websocket.close(code=event.code if event.code >= 1000 else 1000)
                        return
                if not data:
                    await websocket.close(code=1011)
                    return
                data = await reader.read(65536)
                ws.receive_data(data or None)

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
    finally:
        writer.close()


_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

routes = [
    Route("/sandboxes/{sandbox_id}/port/{port}", forward, methods=_METHODS),
    Route("/sandboxes/{sandbox_id}/port/{port}/{rest:path}", forward, methods=_METHODS),
    WebSocketRoute("/sandboxes/{sandbox_id}/port/{port}", forward_websocket),
    WebSocketRoute("/sandboxes/{sandbox_id}/port/{port}/{rest:path}", forward_websocket),
]
