"""A sandbox's own ports (``/sandboxes/{id}/port/{port}/...``): HTTP and WebSocket forwarded to its loopback.

The endpoints call hands out this URL and a token for one port of one sandbox
(``OpenSandbox-Secure-Access``: an HMAC of the sandbox's execution token and
the port, so that whoever is given a web app's endpoint cannot run commands
with it); the server's API key works too (the SDK's server-proxy mode).
Neither is passed on to the sandbox.

The forward does not go through the network: the server holds no route into
the sandbox's network namespace (and an unprivileged server could not enter
it). A connector, a small python3 program the server starts inside the
sandbox (as its program, under its policy) with a private socket pair as its
descriptor 3, connects to ``127.0.0.1:PORT`` (then ``[::1]:PORT``) for each
forwarded connection and passes the connected socket back over that pair
(SCM_RIGHTS); the server then speaks HTTP on it itself (h11), or makes the
WebSocket handshake with the app and relays messages (wsproto). So the sandbox's
network policy is unchanged: the connector can reach what the sandbox's own
programs can (its loopback under ``loopback`` and egress policies, the
host's loopback under ``host``; nothing under ``none``, which has no
loopback). What comes back is checked before use (a TCP socket whose peer is
a loopback address on that port); a sandbox that sends anything else, or
stalls its connector, only breaks its own forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator
from typing import Any

import h11
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from .common import ACCESS_TOKEN_HEADER, API_KEY_HEADER, api, log, same
from .models import EGRESS_PORT, EXECD_PORT, ApiError, bad_request
from .state import ManagedSandbox, ServerState

PORT_TOKEN_HEADER = "OpenSandbox-Secure-Access"
#: How long the connector may take to answer (a loopback connect is immediate, or refused).
CONNECT_TIMEOUT = 10.0
#: How long the app may take to start its answer, and to send more of it.
RESPONSE_TIMEOUT = 300.0

CONNECTOR = r'''
import errno, os, socket, struct, sys
channel = socket.socket(fileno=3)
while True:
    message = channel.recv(16)
    if len(message) != 2:
        break
    port = struct.unpack("!H", message)[0]
    conn, error = None, errno.ECONNREFUSED
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            error = exc.errno or error
            continue
        s.settimeout(5)
        try:
            s.connect((host, port))
            conn = s
            break
        except OSError as exc:
            error = exc.errno or error
            s.close()
    if conn is None:
        channel.send(b"E%d" % error)
        continue
    conn.setblocking(True)
    socket.send_fds(channel, [b"K"], [conn.fileno()])
    conn.close()
'''

#: Hop-by-hop headers (RFC 9110 7.6.1) and the server's own credentials: never passed on.
_DROP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
         "transfer-encoding", "upgrade", "host", "content-length",
         API_KEY_HEADER.lower(), ACCESS_TOKEN_HEADER.lower(), PORT_TOKEN_HEADER.lower()}


def port_token(managed: ManagedSandbox, port: int) -> str:
    return hmac.new(managed.token.encode(), f"port {port}".encode(), hashlib.sha256).hexdigest()


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class Forwarder:
    """One sandbox's connector: a connected socket to one of its loopback ports at a time.

    The conversation with it waits on the event loop, not in a thread: a
    connector stalled from inside (SIGSTOP) holds none of the server's
    threads, only its own sandbox's forwards, each for CONNECT_TIMEOUT.
    """

    def __init__(self, managed: ManagedSandbox) -> None:
        self.managed = managed
        self.lock = asyncio.Lock()
        self.proc: Any = None
        self.channel: socket.socket | None = None
        self.closed = False

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = self.managed.box.spawn(["python3", "-I", "-c", CONNECTOR], fd3=theirs.fileno())
        except FileNotFoundError:
            ours.close()
            raise ApiError(502, "FORWARD_UNAVAILABLE", "a sandbox's ports are forwarded by a connector run by "
                           "the sandbox's python3, which its policy does not provide") from None
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the connector holds its own copy now
        ours.setblocking(False)
        self.channel = ours
        return ours

    def _stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.kill()
            with contextlib.suppress(Exception):
                self.proc.close()
            self.proc = None

    @staticmethod
    async def _receive(channel: socket.socket) -> tuple[bytes, list[int]]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(channel, 64, 1)
                return message, fds
            except (BlockingIOError, InterruptedError):
                pass
            ready = loop.create_future()
            loop.add_reader(channel.fileno(), _wake, ready)
            try:
                await ready
            finally:
                loop.remove_reader(channel.fileno())

    async def connect(self, port: int) -> socket.socket:
        async with self.lock:
            for attempt in (1, 2):  # a connector that ended (killed from inside) is started again, once
                if self.closed:
                    raise ApiError(404, "SANDBOX_NOT_FOUND", f"sandbox {self.managed.id} is gone")
                channel = self.channel
                if channel is None:
                    channel = await run_in_threadpool(self._start)
                try:
                    channel.send(struct.pack("!H", port))  # 2 bytes into an empty socket: never blocks
                    message, fds = await asyncio.wait_for(self._receive(channel), CONNECT_TIMEOUT)
                except (OSError, asyncio.TimeoutError) as exc:
                    self._stop()
                    if attempt == 2 or isinstance(exc, asyncio.TimeoutError):
                        raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector did not answer "
                                       f"({exc or 'timed out'})") from None
                    continue
                if not message and not fds:
                    self._stop()
                    continue
                break
            else:
                raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector keeps ending")
        if message.startswith(b"E") and not fds:
            code = int(message[1:]) if message[1:].isdigit() else 0
            raise ApiError(502, "PORT_NOT_LISTENING", f"port {port}: nothing accepts connections on the sandbox's "
                           f"loopback ({os.strerror(code) if code else 'refused'})")
        return _checked(fds, message, port)

    def close(self) -> None:
        self.closed = True
        self._stop()


def _checked(fds: list[int], message: bytes, port: int) -> socket.socket:
    """The connector's socket, if it is what was asked for: TCP, connected to a loopback address on port."""
    for extra in fds[1:]:
        os.close(extra)
    if message != b"K" or len(fds) != 1:
        for fd in fds[:1]:
            os.close(fd)
        raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector answered something else than a connection")
    fd = fds[0]
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError("not a socket")
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        raise ApiError(502, "FORWARD_FAILED", "the sandbox's connector sent something else than a socket") from None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            raise OSError("not a TCP socket")
        peer = sock.getpeername()
        address = ipaddress.ip_address(peer[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_loopback or peer[1] != port:
            raise OSError(f"connected to {peer[0]} port {peer[1]}")
    except OSError as exc:
        sock.close()
        raise ApiError(502, "FORWARD_FAILED", f"the sandbox's connector sent a wrong connection ({exc})") from None
    return sock


def _forwarder(managed: ManagedSandbox) -> Forwarder:
    with managed.lock:
        if managed.forwarder is None:
            managed.forwarder = Forwarder(managed)
        forwarder: Forwarder = managed.forwarder
        return forwarder


def _authorized(request: HTTPConnection, state: ServerState) -> tuple[ManagedSandbox, int]:
    raw = request.path_params["port"]
    try:
        managed: ManagedSandbox | None = state.get(request.path_params["sandbox_id"])
    except ApiError:
        managed = None  # same answer for an unknown sandbox and a wrong token: no probing of ids
    port = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 5 else 0
    ok = managed is not None and (same(request.headers.get(API_KEY_HEADER), state.api_key)
                                  or (port > 0 and same(request.headers.get(PORT_TOKEN_HEADER),
                                                        port_token(managed, port))))
    if managed is None or not ok:
        raise ApiError(401, "UNAUTHORIZED", f"unknown sandbox, or missing or wrong {PORT_TOKEN_HEADER} header")
    if not 1 <= port <= 65535:
        raise bad_request(f"port: {raw[:16]!r} is not a port number (1-65535)", "INVALID_PORT")
    if port in (EXECD_PORT, EGRESS_PORT):
        raise ApiError(404, "NOT_FOUND", f"port {port} is this server's own API here; no such route")
    managed.usable()
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
    out.append((b"x-forwarded-prefix", f"/sandboxes/{request.path_params['sandbox_id']}/port/{port}".encode()))
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
    sock = await _forwarder(managed).connect(port)
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
    raw_headers = [(k, v) for k, v in event.headers if k.decode("latin-1").lower() not in _DROP - {"content-length"}]

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

    response = StreamingResponse(body(), status_code=event.status_code, )
    response.raw_headers = [(k.lower(), v) for k, v in raw_headers]
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
        sock = await _forwarder(managed).connect(port)
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
