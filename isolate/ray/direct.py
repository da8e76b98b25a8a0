"""The direct route: a call's bytes between the client and a node's host actor, without Ray in between.

Ray places the sandboxes and watches the nodes; an exec or a file call of a
sandbox goes over one TCP connection per client and node, to a port the host
actor listens on at the node's address as Ray knows it (``Listener``), many
calls at once on it (``Route``: request ids).

Every request is proved per sandbox: the host hands the client a random
secret when it starts the sandbox (through Ray, never over this route), and
each request carries an HMAC-SHA256 of the connection's nonce, its header and
its body under that sandbox's secret, checked in constant time before the
body is read as anything. A peer that sends anything else (a frame past
``MAX_FRAME``, an unknown sandbox, a wrong proof, a request id not above the
last) has its connection closed; a peer that sends nothing is closed after
``FIRST_FRAME_TIMEOUT``. Answers carry the same proof, so the client takes
nothing from another speaker. Under Ray's TLS (``RAY_USE_TLS``) the
connection is TLS with Ray's own certificates, both sides proved by the
cluster's CA (isolate/ray/channel.py); the per-sandbox proof stays.

Wire format (network byte order):

- on accept the host sends ``MAGIC`` and a 32-byte nonce of the connection;
- a request: ``REQUEST`` (body length, request id, sandbox id, proof), then
  the body: a pickle of (operation, arguments);
- an answer: ``ANSWER`` (body length, request id, proof), then a pickle of the
  result; a result past ``MAX_FRAME`` stays on the node (``Stashed``) and the
  client takes it through the actor, whose object store carries large values.

A connection may instead carry one forwarded connection to a port on a
sandbox's loopback (the server's port route, ``isolate-run serve --ray``): its
first request is ``PORT`` with the port, proved as any request; the host has a
connector started in the sandbox connect to the port
(isolate/backends/native/loopback.py: under the sandbox's own network policy,
the socket checked), answers (proved: ``"open"`` or the failure), and from
then on the connection carries the bytes both ways, unframed, until either
side ends (``open_port`` on the client's side). Forwarded connections are
counted apart from the route's (``MAX_FORWARDS``, ``MAX_FORWARDS_PER_SANDBOX``:
an app that holds its connections open never refuses the route's calls, nor
another sandbox's forwards); when one direction ends the other goes on while
bytes move and ends after ``LINGER`` idle seconds (a client that closed for
good, an app that never closes); a retired sandbox's and a closed host's
forwards end at once.

A connection that breaks names no outcome: the caller asks the node's actor
(``SandboxLostError`` when Ray says the node is gone, in the time Ray takes).
While a call waits, the reader looks every ``WATCH_SLICE`` seconds at a call
the actor never answers (``watch``): it ends when the actor does.
"""

from __future__ import annotations

import hmac
import pickle
import queue
import secrets
import select
import socket
import ssl
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..backends.native.loopback import ConnectorError
from ..model.errors import PolicyError
from .channel import Plain, Tls

__all__ = ["Broken", "Failure", "Listener", "Route", "Stashed", "TooLarge", "open_port"]

MAGIC = b"IRD1"
NONCE = 32
#: body length, request id, sandbox id (16 ASCII characters), proof
REQUEST = struct.Struct(">IQ16s32s")
#: body length, request id, proof
ANSWER = struct.Struct(">IQ32s")
#: The largest body either side reads (the length is checked before anything is read past the header).
MAX_FRAME = 4 << 20
#: How long a new connection may take to send its first proved request (its TLS handshake included), in all.
FIRST_FRAME_TIMEOUT = 10.0
#: Connections one host serves at once (clients of one cluster: one each).
MAX_CONNECTIONS = 256
#: Requests of all connections served at once (each exec waits in a thread, as the actor's calls do).
WORKERS = 512
#: How long the client waits for a connection to open before it calls through the actor.
CONNECT_TIMEOUT = 2.0
#: How long a node whose route did not open is called through its actor before the route is tried again.
RETRY_AFTER = 30.0
#: How often a waiting client looks whether Ray saw the node's actor end.
WATCH_SLICE = 1.0
#: The operation of a connection's first request that makes it a forwarded connection to a sandbox's port.
PORT = "port"
#: How long the sandbox's connector may take to connect to its port (a loopback connect is immediate, or refused).
PORT_CONNECT_TIMEOUT = 10.0
#: Forwarded connections one host relays at once (each holds two threads), and of one sandbox: counted apart from
#: MAX_CONNECTIONS, so that forwards an app holds open never refuse the route's calls nor another sandbox's forwards.
MAX_FORWARDS = 512
MAX_FORWARDS_PER_SANDBOX = 128
#: After one direction of a forwarded connection ended, how long the other may go without a byte before both end.
LINGER = 30.0
#: Closed sandboxes whose secrets are kept to answer a late call ("closed") rather than close the connection.
RETIRED = 4096


@dataclass
class Failure:
    """An exception raised on the node, returned as a value."""

    error: BaseException


class Broken(Exception):
    """The connection broke (or spoke out of turn): the call's outcome is unknown."""


class TooLarge(Exception):
    """A request past MAX_FRAME: it goes through the actor."""


class Stashed:
    """A result too large for a frame, kept on the node under ``key`` for the client to take through the actor."""

    def __init__(self, key: str) -> None:
        self.key = key


def _proof(secret: bytes, nonce: bytes, *parts: bytes) -> bytes:
    # hmac.digest: OpenSSL's one-shot HMAC, a fifth of hmac.new's cost on a small frame (four per call)
    return hmac.digest(secret, b"".join((nonce, *parts)), "sha256")


def _recv_exact(sock: Plain | Tls, size: int) -> bytes | None:
    """Exactly ``size`` bytes, or None at the end of the stream."""
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Stream:
    """A channel read in large pieces: a frame's header, its body and the frames after it in one recv."""

    def __init__(self, channel: Plain | Tls) -> None:
        self.channel = channel
        self._buffer = bytearray()

    def take(self, size: int) -> bytes | None:
        """Exactly ``size`` bytes, or None at the end of the stream."""
        while len(self._buffer) < size:
            chunk = self.channel.recv(min(max(1 << 16, size - len(self._buffer)), 1 << 20))
            if not chunk:
                return None
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def rest(self) -> bytes:
        """What was read past the last frame taken (and is taken now)."""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


class _Workers:
    """Threads that run the requests (each exec waits in one, as the actor's calls do): at most ``most``, one
    started only when none is idle. Lighter than a ThreadPoolExecutor per request (no future, no semaphore)."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads that finished their request and take the next (each counted for one request)
        self._threads = 0
        self._owed = 0  # requests queued while every thread was busy
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("closed")
            start = False
            if self._idle:
                self._idle -= 1  # that thread takes this request (or another's: each request has its thread)
            elif self._threads < self._most:
                start, self._threads = True, self._threads + 1
            else:
                self._owed += 1  # every thread busy: the next to finish takes it (and is not counted idle)
        self._queue.put((fn, args))
        if start:
            threading.Thread(target=self._work, name="isolate-direct", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            fn(*args)
            with self._lock:
                if self._closed:
                    return
                if self._owed:
                    self._owed -= 1
                else:
                    self._idle += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)


def _dumps(result: Any) -> bytes:
    try:
        return pickle.dumps(result, protocol=5)
    except Exception as exc:  # an exception (or value) that does not pickle: its words still reach the caller
        from ..model.errors import IsolationError

        return pickle.dumps(Failure(IsolationError(f"{type(result).__name__} could not be sent: {exc}")), protocol=5)


# -- the node's side ---------------------------------------------------------------------------


class Listener:
    """The host actor's port: ``serve(sid, operation, args)`` answers each proved request (never raises);
    ``open_port(sid, port)`` connects to a port on sandbox ``sid``'s loopback for a forwarded connection."""

    def __init__(self, ip: str, serve: Callable[[str, str, tuple[Any, ...]], Any],
                 tls: ssl.SSLContext | None = None,
                 open_port: Callable[[str, int], socket.socket] | None = None) -> None:
        self._serve = serve
        self.tls = tls
        self._open_port = open_port
        self._lock = threading.Lock()
        self._secrets: dict[str, bytes] = {}
        self._retired: OrderedDict[str, bytes] = OrderedDict()
        self._stash: dict[str, bytes] = {}
        self._connections: set[socket.socket] = set()
        self._forwards: set[_Pair] = set()  # forwarded connections (not in _connections: counted apart)
        self._closed = False
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self._sock = socket.create_server((ip, 0), family=family, backlog=128)
        self.address = (ip, int(self._sock.getsockname()[1]))
        self._workers = _Workers(WORKERS)
        threading.Thread(target=self._accept, name="isolate-direct-accept", daemon=True).start()

    def admit(self, sid: str) -> bytes:
        """A new secret for sandbox ``sid``: its calls are served from now on."""
        secret = secrets.token_bytes(32)
        with self._lock:
            self._secrets[sid] = secret
        return secret

    def retire(self, sid: str) -> None:
        """Sandbox ``sid`` closed: a late call is answered (closed), for a while, rather than refused."""
        with self._lock:
            secret = self._secrets.pop(sid, None)
            if secret is not None:
                self._retired[sid] = secret
                while len(self._retired) > RETIRED:
                    self._retired.popitem(last=False)
            for key in [k for k in self._stash if k.startswith(sid + "/")]:
                del self._stash[key]
            ended = [pair for pair in self._forwards if pair.sid == sid]
        for pair in ended:  # its forwarded connections end with it
            pair.shut()

    def take(self, key: str) -> bytes | None:
        with self._lock:
            return self._stash.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._connections)
            forwards = list(self._forwards)
        self._sock.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for pair in forwards:  # the app's side too: an idle app's relay ends now, not when it closes
            pair.shut()
        self._workers.close()

    def _secret(self, sid: str) -> bytes | None:
        with self._lock:
            return self._secrets.get(sid) or self._retired.get(sid)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                refused = self._closed or len(self._connections) >= MAX_CONNECTIONS
                if not refused:
                    self._connections.add(conn)
            if refused:
                conn.close()
                continue
            threading.Thread(target=self._connection, args=(conn,), name="isolate-direct-conn", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        nonce = secrets.token_bytes(NONCE)
        send = threading.Lock()
        # FIRST_FRAME_TIMEOUT bounds the whole unproved start (the TLS handshake, the first frame), not each read:
        # a peer that trickles a byte now and then is shut when it is over.
        watchdog = threading.Timer(FIRST_FRAME_TIMEOUT, _shut, (conn,))
        watchdog.name, watchdog.daemon = "isolate-direct-watch", True
        watchdog.start()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(FIRST_FRAME_TIMEOUT)  # each read's too
            channel = Plain(conn) if self.tls is None else Tls(conn, self.tls, server_side=True)
            channel.sendall(MAGIC + nonce)
            stream = _Stream(channel)
            last = 0
            while True:
                header = stream.take(REQUEST.size)
                if header is None:
                    return
                length, rid, sid_bytes, proof = REQUEST.unpack(header)
                if length > MAX_FRAME or rid <= last:
                    return
                secret = self._secret(sid_bytes.decode("ascii", "replace"))
                if secret is None:
                    return
                body = stream.take(length)
                if body is None or not hmac.compare_digest(proof, _proof(secret, nonce, header[:-32], body)):
                    return
                watchdog.cancel()  # proved
                if last == 0 and self._open_port is not None:
                    operation, args = pickle.loads(body)  # proved: the client that holds this sandbox's secret
                    if operation == PORT:
                        self._forward(conn, stream, nonce, rid, sid_bytes.decode("ascii"), secret, tuple(args))
                        return
                last = rid
                conn.settimeout(None)  # a proved client: its connection stays while it is idle
                self._workers.submit(self._answer, channel, send, nonce, rid, sid_bytes.decode("ascii"), secret, body)
        except (OSError, RuntimeError):  # a broken peer, or the workers closed
            return
        finally:
            watchdog.cancel()
            with self._lock:
                self._connections.discard(conn)
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _forward(self, conn: socket.socket, stream: _Stream, nonce: bytes, rid: int, sid: str, secret: bytes,
                 args: tuple[Any, ...]) -> None:
        """A forwarded connection: the sandbox's port connected, the proved answer sent, then the bytes relayed
        both ways until either side ends (in this connection's thread and one more). It leaves the route's
        connections for a forward's place (MAX_FORWARDS, MAX_FORWARDS_PER_SANDBOX), or is refused in words."""
        assert self._open_port is not None
        keep_alive(conn)  # a client gone without a word (its machine off the network) ends the forward too
        pair = _Pair(sid)
        pair.add(conn)
        with self._lock:
            live = sid in self._secrets and not self._closed  # a retired sandbox's secret opens no forward
            mine = sum(1 for p in self._forwards if p.sid == sid)
            full = len(self._forwards) >= MAX_FORWARDS or mine >= MAX_FORWARDS_PER_SANDBOX
            if live and not full:
                self._forwards.add(pair)  # from now a retire or a close shuts it
                self._connections.discard(conn)
        upstream: socket.socket | None = None
        try:
            try:
                port = args[0] if len(args) == 1 else None
                if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                    raise PolicyError(f"port: expected a port number (1-65535), got {port!r}", "port")
                if not live:
                    raise ConnectorError("FORWARD_FAILED", f"port {port}: sandbox {sid} is closed")
                if full:
                    raise ConnectorError("FORWARD_FAILED", f"port {port}: the node's host relays "
                                         f"{MAX_FORWARDS_PER_SANDBOX} forwarded connections of a sandbox at most "
                                         f"and {MAX_FORWARDS} in all; try again when one ended")
                upstream = self._open_port(sid, port)
                pair.add(upstream)  # shut at once if the sandbox was retired or the host closed meanwhile
                result: Any = "open"
            except Exception as exc:
                result = Failure(exc)
            blob = _dumps(result)
            head = struct.pack(">IQ", len(blob), rid)
            try:
                stream.channel.sendall(head + _proof(secret, nonce, b"R", head, blob) + blob)
            except OSError:
                return
            if upstream is None:
                return
            stream.channel.sock.settimeout(None)
            upstream.settimeout(None)
            other = threading.Thread(target=pair.relay, args=(upstream, stream.channel), name="isolate-direct-port",
                                     daemon=True)
            other.start()
            pair.relay(stream.channel, upstream, stream.rest())
            other.join()
        finally:
            with self._lock:
                self._forwards.discard(pair)
            if upstream is not None:
                upstream.close()

    def _answer(self, channel: Plain | Tls, send: threading.Lock, nonce: bytes, rid: int, sid: str, secret: bytes,
                body: bytes) -> None:
        try:
            operation, args = pickle.loads(body)  # proved: the client that holds this sandbox's secret
            result = self._serve(sid, str(operation), tuple(args))
        except Exception as exc:
            result = Failure(exc)
        blob = _dumps(result)
        if len(blob) > MAX_FRAME:
            key = f"{sid}/{uuid.uuid4().hex}"
            with self._lock:
                self._stash[key] = blob
            blob = _dumps(Stashed(key))
        head = struct.pack(">IQ", len(blob), rid)
        frame = head + _proof(secret, nonce, b"R", head, blob) + blob
        try:
            with send:
                channel.sendall(frame)
        except OSError:
            pass  # the client is gone: it asks the actor what became of the node


class _Pair:
    """A forwarded connection's two sides, relayed both ways (``relay``, one thread each way); ``shut()`` ends
    both (a retired sandbox, a closed host, a side that broke, an idle half). ``add`` names a side's socket."""

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self._sockets: list[socket.socket] = []
        self._state = threading.Condition()
        self._shut = False
        self._ended = 0  # directions ended
        self._moved = 0  # bytes relayed (either way): whether the remaining direction still moves

    def add(self, sock: socket.socket) -> None:
        with self._state:
            self._sockets.append(sock)
            shut = self._shut
        if shut:
            _shut(sock)

    def shut(self) -> None:
        with self._state:
            self._shut = True
            sockets = list(self._sockets)
            self._state.notify_all()
        for sock in sockets:
            _shut(sock)

    def relay(self, source: Plain | Tls | socket.socket, sink: Plain | Tls | socket.socket, first: bytes = b"") -> None:
        """Bytes from source to sink (``first``, then what source sends) until source ends (then sink's writing
        side is shut) or either breaks (then both sides are shut, which ends the other direction too). Then, if
        the other direction goes on, it is given LINGER seconds without a byte before both are shut: a client
        that closed for good reads nothing more, and an app that never closes holds nothing past that. A TLS
        side's end is its TCP connection's: the bytes of a forwarded connection are the app's, which frames its
        own."""
        try:
            if first:
                sink.sendall(first)
            while True:
                data = source.recv(1 << 16)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    break
                sink.sendall(data)
                self._moved += len(data)  # the other direction ended (or goes on): only a change is looked at
        except OSError:
            self.shut()
        with self._state:
            self._ended += 1
            self._state.notify_all()
            seen = -1
            while self._ended < 2 and not self._shut and self._moved != seen:
                seen = self._moved
                self._state.wait(LINGER)
            idle = self._ended < 2 and not self._shut
        if idle:
            self.shut()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# -- the client's side --------------------------------------------------------------------------


class _Waiter:
    """One call's wait: ``wake()`` lets its thread look again (its answer came, or it is to read for all); a
    lock held while nothing is to be seen, cheaper than an Event (a Condition) on every call."""

    __slots__ = ("_signal", "done", "error", "result", "secret")

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._signal = threading.Lock()
        self._signal.acquire()
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def wake(self) -> None:
        try:
            self._signal.release()
        except RuntimeError:  # woken already and not yet looked: once is enough
            pass

    def sleep(self) -> None:
        self._signal.acquire()


class Route:
    """This client's connection to one node's host (see the module's docstring). ``ended()`` says whether Ray
    saw the node's actor end; it is asked while a call waits longer than WATCH_SLICE. With ``tls`` (a client
    context of Ray's certificates) the host's certificate must name the node's address."""

    def __init__(self, address: tuple[str, int], ended: Callable[[], bool], tls: ssl.SSLContext | None = None) -> None:
        self._ended = ended
        self._sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._channel = Plain(self._sock) if tls is None else Tls(self._sock, tls, False, address[0])
            hello = _recv_exact(self._channel, len(MAGIC) + NONCE)
        except OSError:
            self._sock.close()
            raise
        if hello is None or not hello.startswith(MAGIC):
            self._sock.close()
            raise ConnectionRefusedError(f"{address[0]}:{address[1]} did not greet as an isolate host")
        self._nonce = hello[len(MAGIC):]
        self._sock.settimeout(WATCH_SLICE)
        self._send = threading.Lock()
        self._reading = threading.Lock()
        self._pending: dict[int, _Waiter] = {}
        self._next = 0
        self._buffer = bytearray()
        self.broken: BaseException | None = None
        self.tls = self._channel.tls

    def close(self) -> None:
        self._break(Broken("closed"))

    def stale(self) -> bool:
        """Broken, or closed by the node while idle (readable with nothing asked: its end)."""
        with self._send:
            if self.broken is None and not self._pending:
                try:
                    ended = bool(select.select([self._sock], [], [], 0)[0])
                except (OSError, ValueError):
                    ended = True
                if ended:
                    self._break_locked(Broken("the node closed the connection"))
            return self.broken is not None

    def call(self, sid: str, secret: bytes, operation: str, args: tuple[Any, ...]) -> Any:
        """The node's answer to (operation, args) for sandbox ``sid``: a value, a Failure or Stashed. Raises
        TooLarge (nothing sent) or Broken (the outcome is unknown)."""
        body = pickle.dumps((operation, args), protocol=5)
        if len(body) > MAX_FRAME:
            raise TooLarge(operation)
        name = sid.encode("ascii")
        if len(name) != 16:
            raise ValueError(f"sandbox id {sid!r}: expected 16 characters")
        waiter = _Waiter(secret)
        with self._send:
            if self.broken is not None:
                raise Broken(str(self.broken))
            self._next += 1
            rid = self._next
            self._pending[rid] = waiter
            header = struct.pack(">IQ16s", len(body), rid, name)
            try:
                self._channel.sendall(header + _proof(secret, self._nonce, header, body) + body)
            except OSError as exc:
                self._break_locked(Broken(f"send: {exc}"))
        return self._wait(waiter)

    def _wait(self, waiter: _Waiter) -> Any:
        # The first waiter to take the read lock reads for everyone until its own answer came, then hands the
        # reading to another waiter: the answer of a lone call is read by its own thread (no hand-off).
        while not waiter.done:
            if self._reading.acquire(blocking=False):
                try:
                    while not waiter.done:
                        self._read_one()
                except Broken as exc:
                    self._break(exc)
                except OSError as exc:
                    self._break(Broken(f"receive: {exc}"))
                finally:
                    self._reading.release()
                    with self._send:
                        heir = next((w for w in self._pending.values() if not w.done), None)
                    if heir is not None:
                        heir.wake()
            else:
                waiter.sleep()
        if waiter.error is not None:
            raise waiter.error
        return waiter.result

    def _fill(self, size: int) -> None:
        while len(self._buffer) < size:
            try:
                chunk = self._channel.recv(max(1 << 16, size - len(self._buffer)))
            except TimeoutError:
                if self._ended():
                    raise Broken("Ray says the node's host ended") from None
                continue
            if not chunk:
                raise Broken("the node closed the connection")
            self._buffer += chunk

    def _read_one(self) -> None:
        self._fill(ANSWER.size)
        length, rid, proof = ANSWER.unpack_from(self._buffer)
        if length > MAX_FRAME:
            raise Broken(f"an answer of {length} bytes (past {MAX_FRAME})")
        self._fill(ANSWER.size + length)
        head = bytes(self._buffer[:12])
        blob = bytes(self._buffer[ANSWER.size:ANSWER.size + length])
        del self._buffer[:ANSWER.size + length]
        with self._send:
            waiter = self._pending.get(rid)
        if waiter is None or not hmac.compare_digest(proof, _proof(waiter.secret, self._nonce, b"R", head, blob)):
            raise Broken("an answer not proved by the sandbox's secret")
        result = pickle.loads(blob)  # proved: the node's host, which holds the secret
        with self._send:
            del self._pending[rid]
        waiter.result, waiter.done = result, True
        waiter.wake()

    def _break(self, exc: BaseException) -> None:
        with self._send:
            self._break_locked(exc)

    def _break_locked(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        for waiter in self._pending.values():
            waiter.error, waiter.done = Broken(str(exc)), True
            waiter.wake()
        self._pending.clear()


#: A forwarded connection idle this long is probed (TCP keepalive), every KEEPALIVE_INTERVAL, KEEPALIVE_PROBES times.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_PROBES = 30, 10, 3


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive on a forwarded connection: a node that died without a word (no FIN, no reset: its machine
    off the network) ends the connection about a minute after it fell silent, not when the app's client leaves
    (a WebSocket waits on it for as long as the browser stays)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


def open_port(address: tuple[str, int], sid: str, secret: bytes, port: int,
              tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connection of its own to the node's host at ``address`` that carries one connection to ``port`` on the
    loopback of sandbox ``sid`` (see the module's docstring): after the host's proved answer, the bytes of the
    app. With ``tls`` (the node's route speaks TLS) the socket returned is one end of a local pair whose bytes
    two threads carry over the TLS connection. Raises the host's failure
    (isolate.backends.native.loopback.ConnectorError: nothing listens there...), OSError, or Broken (an answer
    not proved by the sandbox's secret)."""
    name = sid.encode("ascii")
    if len(name) != 16:
        raise ValueError(f"sandbox id {sid!r}: expected 16 characters")
    sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock)
        channel = Plain(sock) if tls is None else Tls(sock, tls, False, address[0])
        hello = _recv_exact(channel, len(MAGIC) + NONCE)
        if hello is None or not hello.startswith(MAGIC):
            raise ConnectionRefusedError(f"{address[0]}:{address[1]} did not greet as an isolate host")
        nonce = hello[len(MAGIC):]
        body = pickle.dumps((PORT, (port,)), protocol=5)
        header = struct.pack(">IQ16s", len(body), 1, name)
        channel.sendall(header + _proof(secret, nonce, header, body) + body)
        sock.settimeout(PORT_CONNECT_TIMEOUT + CONNECT_TIMEOUT)
        head = _recv_exact(channel, ANSWER.size)
        if head is None:
            raise Broken("the node closed the connection")
        length, rid, proof = ANSWER.unpack(head)
        if length > MAX_FRAME or rid != 1:
            raise Broken(f"an answer of {length} bytes to request {rid}")
        blob = _recv_exact(channel, length)
        if blob is None or not hmac.compare_digest(proof, _proof(secret, nonce, b"R", head[:12], blob)):
            raise Broken("an answer not proved by the sandbox's secret")
        result = pickle.loads(blob)  # proved: the node's host, which holds the secret
        if isinstance(result, Failure):
            raise result.error
        if result != "open":
            raise Broken(f"the host answered {type(result).__name__}")
        sock.settimeout(None)
        if isinstance(channel, Plain):
            return sock
        ours, theirs = socket.socketpair()
    except BaseException:
        sock.close()
        raise
    pair = _Pair(sid)
    pair.add(sock)
    pair.add(theirs)

    def carry() -> None:
        other = threading.Thread(target=pair.relay, args=(channel, theirs), name="isolate-direct-port", daemon=True)
        other.start()
        pair.relay(theirs, channel)
        other.join()
        theirs.close()
        sock.close()

    threading.Thread(target=carry, name="isolate-direct-port", daemon=True).start()
    return ours
