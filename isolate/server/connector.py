"""The connector: how the server reaches a port on a sandbox's own loopback without its network.

The server holds no route into the sandbox's network namespace (and an
unprivileged server could not enter it). A connector
(isolate/backends/native/loopback.py), a small python3 program the server
starts inside the sandbox (as its program, under its policy), connects to
the port for each forwarded connection and passes the connected socket back.
So the sandbox's network policy is unchanged: the connector can reach what
the sandbox's own programs can (its loopback under ``loopback`` and egress
policies, the host's loopback under ``host``; nothing under ``none``, which
has no loopback). What comes back is checked before use; a sandbox that
sends anything else, or stalls its connector, only breaks its own forwards.
A sandbox on a Ray node (``serve --ray``) has its node's host do the same
there and relay the bytes (``NodeForwarder``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import anyio
import anyio.to_thread
from starlette.concurrency import run_in_threadpool

from ..backends.native.loopback import CONNECTOR, ConnectorError, checked, unavailable
from ..model.errors import IsolationError, SandboxLostError, UnsupportedError
from .models import ApiError
from .state import ManagedSandbox

#: How long the connector may take to answer (a loopback connect is immediate, or refused).
CONNECT_TIMEOUT = 10.0

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
            raise _api_error(unavailable()) from None
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
                    try:
                        channel = await run_in_threadpool(self._start)
                    except IsolationError as exc:  # its spawn failed (the sandbox's exec server busy, ending)
                        self._stop()
                        if attempt == 2:
                            raise ApiError(502, "FORWARD_FAILED", f"the sandbox's connector could not start ({exc})") \
                                from None
                        continue
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
        try:
            return checked(fds, message, port)
        except ConnectorError as exc:
            raise _api_error(exc) from None

    def close(self) -> None:
        self.closed = True
        self._stop()


def _api_error(exc: ConnectorError) -> ApiError:
    return ApiError(502, exc.code, str(exc))


class NodeForwarder:
    """The ports of a sandbox on a Ray node (``serve --ray``): each connection is one of the direct route's
    forwarded connections (isolate.ray.Sandbox.open_port): the node's host has a connector inside the sandbox
    connect, then relays the bytes between this server and it.

    Each connect waits in a thread (up to the node's connect timeout and the route's: a connector stalled from
    inside answers nothing), taken from this sandbox's own few (``CONNECTS``), never from the server's shared
    ones: a stalled connector holds its own sandbox's forwards only, as a local sandbox's does.
    """

    #: Connects of one sandbox waiting at once (the rest wait their turn on the event loop, holding no thread).
    CONNECTS = 4

    def __init__(self, managed: ManagedSandbox) -> None:
        self.managed = managed
        self.closed = False
        self._threads: anyio.CapacityLimiter | None = None  # made on the event loop, at the first connect

    async def connect(self, port: int) -> socket.socket:
        if self.closed:
            raise ApiError(404, "SANDBOX_NOT_FOUND", f"sandbox {self.managed.id} is gone")
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(self.CONNECTS)
        try:
            box: Any = self.managed.box  # an isolate.ray.Sandbox
            sock: socket.socket = await anyio.to_thread.run_sync(box.open_port, port, limiter=self._threads)
        except ConnectorError as exc:
            raise _api_error(exc) from None
        except UnsupportedError as exc:
            raise ApiError(502, "FORWARD_UNAVAILABLE", str(exc)) from None
        except SandboxLostError:
            raise
        except IsolationError as exc:
            raise ApiError(502, "FORWARD_FAILED", str(exc)) from None
        return sock

    def close(self) -> None:
        self.closed = True


def forwarder_of(managed: ManagedSandbox) -> Forwarder | NodeForwarder:
    with managed.lock:
        if managed.forwarder is None:
            on_node = callable(getattr(managed.box, "open_port", None))  # an isolate.ray.Sandbox
            managed.forwarder = NodeForwarder(managed) if on_node else Forwarder(managed)
        forwarder: Forwarder | NodeForwarder = managed.forwarder
        return forwarder
