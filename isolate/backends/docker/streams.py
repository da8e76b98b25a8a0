"""The standard streams of a run and the hijacked engine connection that carries them."""

from __future__ import annotations

import contextlib
import errno as errno_mod
import locale
import os
import re
import socket
import ssl
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from ...kernel.fdwait import ready
from ...model.errors import UnsupportedError
from .engine import engine_address

Args = Union[str, bytes, "os.PathLike[str]", Sequence[Union[str, bytes, "os.PathLike[str]"]]]


# --------------------------------------------------------------------------
# Standard streams


@dataclass
class _Sink:
    """Where one output stream of the program goes."""

    kind: str  # "capture" | "fd" | "discard"
    fd: int = -1
    chunks: list[bytes] = field(default_factory=list)

    def write(self, data: bytes) -> None:
        if self.kind == "capture":
            self.chunks.append(data)
        elif self.kind == "fd":
            _write_all(self.fd, data)

    def value(self) -> bytes | None:
        return b"".join(self.chunks) if self.kind == "capture" else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            ready(writers=[fd], timeout=1.0)
            continue
        except OSError as exc:
            if exc.errno == errno_mod.EPIPE:
                return  # the reader went away, as a pipe to a child would
            raise
        view = view[written:]


def _fileno(stream: Any, name: str) -> int:
    if isinstance(stream, int):
        return stream
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError) as exc:
        raise ValueError(f"{name}: expected PIPE, DEVNULL, a file descriptor or a file with a fileno ({exc})") from None


def _sink(stream: Any, name: str, default_fd: int) -> _Sink:
    if stream is None:
        return _Sink("fd", default_fd)
    if stream == subprocess.PIPE:
        return _Sink("capture")
    if stream == subprocess.DEVNULL:
        return _Sink("discard")
    return _Sink("fd", _fileno(stream, name))


@dataclass
class _Streams:
    """The standard streams of one run, resolved from subprocess-style arguments."""

    stdin_data: bytes | None
    stdin_fd: int | None
    out: _Sink
    err: _Sink
    text: bool
    encoding: str
    errors: str

    @property
    def open_stdin(self) -> bool:
        return self.stdin_data is not None or self.stdin_fd is not None

    @classmethod
    def from_args(
        cls,
        *,
        input: bytes | str | None,
        stdin: Any,
        stdout: Any,
        stderr: Any,
        capture_output: bool,
        text: bool | None,
        encoding: str | None,
        errors: str | None,
    ) -> _Streams:
        if capture_output:
            if stdout is not None or stderr is not None:
                raise ValueError("stdout and stderr arguments may not be used with capture_output.")
            stdout = stderr = subprocess.PIPE
        if input is not None and stdin is not None:
            raise ValueError("stdin and input arguments may not both be used.")
        text_mode = bool(text or encoding or errors)
        enc = encoding or locale.getpreferredencoding(False)
        errs = errors or "strict"
        data: bytes | None = None
        fd: int | None = None
        if input is not None:
            if isinstance(input, str):
                if not text_mode:
                    raise TypeError("input must be bytes unless text, encoding or errors is given")
                data = input.encode(enc, errs)
            else:
                data = bytes(input)
        elif stdin is None:
            fd = _usable_fd(0)
        elif stdin in (subprocess.DEVNULL, subprocess.PIPE):
            fd = None  # PIPE without input: an empty stdin, as subprocess.run gives
        else:
            fd = _fileno(stdin, "stdin")
        out = _sink(stdout, "stdout", 1)
        if stderr == subprocess.STDOUT:
            err = out
        else:
            err = _sink(stderr, "stderr", 2)
        return cls(data, fd, out, err, text_mode, enc, errs)

    def decode(self, data: bytes | None) -> bytes | str | None:
        if data is None or not self.text:
            return data
        return data.decode(self.encoding, self.errors).replace("\r\n", "\n").replace("\r", "\n")


def _usable_fd(fd: int) -> int | None:
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


def _argv(args: Args) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        items: list[Any] = [args]
    else:
        items = list(args)
    argv = [os.fsdecode(item) for item in items]
    if not argv or not argv[0]:
        raise ValueError("args: an empty command; name a program to run")
    return argv


# --------------------------------------------------------------------------
# A hijacked engine connection (attach, exec start)


class _Conn:
    """The raw socket behind an upgraded engine request: multiplexed output, raw stdin."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.leftover = b""
        try:
            reader = response.raw._fp.fp
            raw = reader.raw
            sock = getattr(raw, "_sock", raw)
        except AttributeError:
            raise UnsupportedError(
                f"docker: the connection to {engine_address()} cannot be used for streaming; "
                "use a unix:// or tcp:// DOCKER_HOST"
            ) from None
        if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket):
            response.close()
            raise UnsupportedError(
                f"docker: streaming over {engine_address()} (TLS or ssh) is not supported; "
                "use a unix:// DOCKER_HOST (an ssh -L tunnel to the remote socket works) or plain tcp://"
            )
        self.sock = sock
        sock.setblocking(False)
        with contextlib.suppress(Exception):
            buffered = reader.peek()  # bytes the HTTP reader took past the headers
            if buffered:
                self.leftover = reader.read(len(buffered))
        self._write_closed = False
        self._lock = threading.Lock()

    def recv(self) -> bytes | None:
        """Bytes, ``b""`` at the end of the stream, ``None`` when nothing is ready."""
        if self.leftover:
            data, self.leftover = self.leftover, b""
            return data
        try:
            return self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return None
        except ConnectionResetError:
            return b""

    def send_all(self, data: bytes, stop: threading.Event) -> bool:
        view = memoryview(data)
        while view:
            if stop.is_set():
                return False
            if not ready(writers=[self.sock.fileno()], timeout=0.1):
                continue
            try:
                sent = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                continue
            view = view[sent:]
        return True

    def close_write(self) -> None:
        with self._lock:
            if not self._write_closed:
                self._write_closed = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.response.close()
        with contextlib.suppress(OSError):
            self.sock.close()


def _attach(api: Any, container_id: str, open_stdin: bool) -> _Conn:
    params = {"stdin": int(open_stdin), "stdout": 1, "stderr": 1, "stream": 1}
    response = api.post(
        api._url("/containers/{0}/attach", container_id),
        params=params,
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        stream=True,
    )
    api._raise_for_status(response)
    return _Conn(response)


def _exec_start(api: Any, exec_id: str) -> _Conn:
    response = api._post_json(
        api._url("/exec/{0}/start", exec_id),
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        data={"Tty": False, "Detach": False},
        stream=True,
    )
    api._raise_for_status(response)
    return _Conn(response)


class _Demux:
    """Splits the engine's multiplexed stream (8-byte headers) into (stream, payload)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buffer += data
        frames: list[tuple[int, bytes]] = []
        while len(self.buffer) >= 8:
            size = int.from_bytes(self.buffer[4:8], "big")
            if len(self.buffer) < 8 + size:
                break
            frames.append((self.buffer[0], bytes(self.buffer[8 : 8 + size])))
            del self.buffer[: 8 + size]
        return frames


_TINI_FAILURE = re.compile(rb"^\[FATAL tini \(\d+\)\] exec (.*) failed: (.*?)\s*$", re.DOTALL)
_RUNTIME_EXEC_FAILURE = re.compile(rb"^OCI runtime exec failed: .*?exec: (.*?): (.*?)(: unknown)?\s*$", re.DOTALL)


@dataclass(frozen=True)
class _HoldRule:
    """Output that may be an exec failure reported by tini or the runtime rather than the program's own."""

    stream: int
    prefix: bytes
    pattern: re.Pattern[bytes]


_TINI_HOLD = _HoldRule(2, b"[FATAL tini (", _TINI_FAILURE)
_EXEC_HOLD = _HoldRule(1, b"OCI runtime exec failed", _RUNTIME_EXEC_FAILURE)


class _Holder:
    """Holds back the start of one stream while it may still be a failure message (it may come in pieces)."""

    def __init__(self, rule: _HoldRule | None, sink: _Sink) -> None:
        self.rule = rule
        self.sink = sink
        self.buffer = bytearray()
        self.held: bytes | None = None

    def feed(self, payload: bytes) -> None:
        rule = self.rule
        if rule is None:
            self.sink.write(payload)
            return
        self.buffer += payload
        size = min(len(self.buffer), len(rule.prefix))
        if bytes(self.buffer[:size]) != rule.prefix[:size]:
            self.release()
        elif b"\n" in self.buffer:
            self.finish()

    def finish(self) -> None:
        """Decide with what has come: a failure message is kept, anything else goes on to the sink."""
        if self.rule is not None and self.buffer and self.rule.pattern.match(bytes(self.buffer)):
            self.held = bytes(self.buffer)
            self.buffer.clear()
            self.rule = None
        else:
            self.release()

    def release(self) -> None:
        self.rule = None
        if self.buffer:
            data = bytes(self.buffer)
            self.buffer.clear()
            self.sink.write(data)


def _feed_stdin(conn: _Conn, streams: _Streams, stop: threading.Event) -> None:
    try:
        if streams.stdin_data is not None:
            conn.send_all(streams.stdin_data, stop)
        elif streams.stdin_fd is not None:
            while not stop.is_set():
                if not ready([streams.stdin_fd], timeout=0.1):
                    continue
                try:
                    chunk = os.read(streams.stdin_fd, 65536)
                except (BlockingIOError, InterruptedError):
                    continue  # a non-blocking stdin with nothing to read after all
                if not chunk or not conn.send_all(chunk, stop):
                    break
    except OSError:
        pass  # the program closed its stdin or the engine went away: nothing more to feed
    finally:
        conn.close_write()

