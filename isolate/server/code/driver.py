"""A context's driver: one process inside the sandbox that runs the cells it is sent, one at a time.

The Python, Java and Node.js drivers share this protocol. The host and the
driver hold the two ends of a socket pair; the driver gets its end as
descriptor 3, and no other process of the sandbox holds it (a socket cannot
be reopened through /proc). The host sends a cell as ``<length>\\n<UTF-8
source>`` on it, and the driver answers each with one line of JSON (execution
count, result, error) after flushing the cell's output: the host has all of
the output with the answer. The driver's first bytes, before any cell, are its
hello; their writer is the only process whose answers count (``PeerChannel``),
so a process a cell forks cannot answer for a later one. What the driver
writes before its hello (a JVM's notices) is not any cell's output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...kept.sandbox import Sandbox
from ...kernel.fdwait import pending_bytes, ready
from ...kernel.peerchannel import PeerChannel
from ...model.errors import CommandNotFoundError
from ..models import ApiError

#: How long a driver has to start (a JVM and its compiler take a few seconds on a loaded host).
HELLO_TIMEOUT = 60.0
#: The largest answer (count, result, error) a cell may give.
MAX_ANSWER = 16 << 20
#: How often a run waiting for its answer asks whether the driver is still there.
POLL = 1.0
Emit = Callable[[str, Any], None]


def unavailable(language: str, reason: str, hint: str) -> ApiError:
    """The refusal of a context whose interpreter cannot start in this sandbox: the cause, and the way out."""
    return ApiError(400, "UNSUPPORTED_LANGUAGE", f"the {language} context did not start: {reason[:300]}; {hint}")


class _NoHello(Exception):
    """The driver did not say hello: why, in a few words."""


class Driver:
    """A started driver: send a cell, stream its output, take its answer."""

    def __init__(self, box: Sandbox, argv: Sequence[str], env: Mapping[str, str], language: str,
                 hint: str, stdin: int | None = None) -> None:
        """``stdin``: a descriptor the driver reads as its standard input (the Java driver's sealed source)."""
        self.count = 0
        #: A kept Node.js driver's pid inside the sandbox, from its hello (which its relay passes on).
        self.said_pid: int | None = None
        ours, theirs = PeerChannel.pair()
        try:
            self._proc = box.spawn(list(argv), env=dict(env), fd3=theirs.fileno(), stdin=stdin)
        except CommandNotFoundError as exc:
            ours.close()
            raise unavailable(language, str(exc), hint) from None
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the driver holds its own copy now
        self._channel = PeerChannel(ours)
        self._out, self._err = self._proc.stdout_fd, self._proc.stderr_fd
        for fd in (self._out, self._err, ours.fileno()):
            os.set_blocking(fd, False)
        self._closed = False
        self._running = False  # a run polls the descriptors: close() leaves them to it (see close)
        self._guard = threading.Lock()
        try:
            self._hello()
        except _NoHello as exc:
            self.close()
            raise unavailable(language, str(exc), hint) from None

    @property
    def peer(self) -> int | None:
        """The driver's pid in the server's PID namespace (the writer of its hello)."""
        return self._channel.peer

    def _hello(self) -> None:
        """Wait for the hello; what the driver printed before it is kept only to say why it did not come."""
        deadline = time.monotonic() + HELLO_TIMEOUT
        said, noise = b"", b""
        watched = [self._out, self._err, self._channel.fileno()]
        while b"\n" not in said:
            left = deadline - time.monotonic()
            found = ready(watched, timeout=left) if left > 0 else set()
            if not found:
                raise _NoHello(f"no answer in {HELLO_TIMEOUT:.0f} s")
            for fd in (self._out, self._err):
                if fd in found:
                    chunk = read_some(fd)
                    if chunk is None:
                        watched.remove(fd)
                    else:
                        noise = (noise + chunk)[-4096:]
            if self._channel.fileno() in found:
                chunk = self._channel.read(16)
                if chunk == b"":
                    # Its last words that say something (V8 and the JVM end with lines of "#" alone).
                    lines = [line.strip(" #") for line in noise.decode(errors="replace").splitlines()
                             if any(c.isalnum() for c in line)]
                    raise _NoHello(lines[-1] if lines else "it ended without a word")
                said += chunk or b""
        said_pid = re.fullmatch(rb"hello(?: ([0-9]{1,9}))?\n", said)
        if said_pid is None:
            raise _NoHello("its first words were not its hello")
        self.said_pid = int(said_pid[1]) if said_pid[1] is not None else None

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        sock = self._channel.sock
        while view:
            if not ready(writers=[sock.fileno()], timeout=30.0):
                raise TimeoutError("the interpreter takes no more input")
            try:
                view = view[sock.send(view):]
            except BlockingIOError:
                continue

    def run(self, code: str, emit: Emit) -> None:
        """Run one cell: emit ("stdout"|"stderr", bytes) as it comes, then ("done", {count, result, error})."""
        with self._guard:
            if self._closed:
                raise RuntimeError("the context is closed")
            self._running = True
        try:
            self._run(code, emit)
        finally:
            with self._guard:
                self._running = False
                release = self._closed
            if release:  # closed during the run: its descriptors were left to it
                self._release()

    def _run(self, code: str, emit: Emit) -> None:
        data = code.encode()
        self._send(f"{len(data)}\n".encode() + data)
        channel = self._channel.fileno()
        answer = b""
        watched = [self._out, self._err, channel]
        next_poll = time.monotonic() + POLL
        while b"\n" not in answer:
            found = ready(watched, timeout=POLL)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + POLL
                # The channel's end is not the driver's: a process it left behind may hold the socket.
                if self._proc.poll() is not None:
                    for fd, kind in ((self._out, "stdout"), (self._err, "stderr")):
                        if fd in watched and (left := read_pending(fd)):
                            emit(kind, left)
                    emit("done", {"count": self.count, "result": None,
                                  "error": {"ename": "ContextDied", "evalue": "the interpreter ended",
                                            "traceback": []}})
                    return
            for fd, kind in ((self._out, "stdout"), (self._err, "stderr")):
                if fd in found:
                    chunk = read_some(fd)
                    if chunk is None:
                        watched.remove(fd)
                    elif chunk:
                        emit(kind, chunk)
            if channel in found:
                chunk = self._channel.read()  # only the driver's: what a process it forked writes is dropped
                if chunk is None:
                    continue
                if not chunk:
                    emit("done", {"count": self.count, "result": None,
                                  "error": {"ename": "ContextDied", "evalue": "the interpreter ended",
                                            "traceback": []}})
                    return
                answer += chunk
                if len(answer) > MAX_ANSWER:
                    raise ValueError(f"the interpreter's answer passed {MAX_ANSWER} bytes")
        # What the cell wrote before its answer is in the pipes now (the driver flushed first): that much,
        # no more. A process the cell left writing would otherwise keep this run from ever ending.
        for fd, kind in ((self._out, "stdout"), (self._err, "stderr")):
            if fd in watched and (left := read_pending(fd)):
                emit(kind, left)
        emit("done", self._answer(answer.split(b"\n", 1)[0]))

    def _answer(self, line: bytes) -> dict[str, Any]:
        """The answer's well-formed parts only: it comes from inside (the cell's own process can write it)."""
        try:
            info = json.loads(line)
        except ValueError:
            info = None
        info = info if isinstance(info, dict) else {}
        count = info.get("count")
        self.count = count if isinstance(count, int) and not isinstance(count, bool) else self.count + 1
        result = info.get("result")
        error = info.get("error")
        if not (isinstance(error, dict) and all(isinstance(error.get(k), str) for k in ("ename", "evalue"))):
            error = None
        else:
            trace = error.get("traceback")
            error = {"ename": error["ename"], "evalue": error["evalue"],
                     "traceback": [str(t) for t in trace] if isinstance(trace, list) else []}
        return {"count": self.count, "result": result if isinstance(result, str) else None, "error": error}

    def interrupt(self) -> None:
        self._proc.signal(signal.SIGINT)

    def close(self) -> None:
        with self._guard:
            if self._closed:
                return
            self._closed = True
            busy = self._running
        try:
            self._proc.kill()
        finally:
            if busy:
                # A run still polls and reads these descriptors: closed here, their numbers could go to the
                # server's next pipe or socket (another sandbox's) and the run would read that as the cell's
                # output. The channel's shutdown ends the run's wait; the run closes them on its way out.
                try:
                    self._channel.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            else:
                self._release()

    def _release(self) -> None:
        try:
            self._proc.close()
        finally:
            self._channel.close()


def read_some(fd: int) -> bytes | None:
    """What is there to read: b"" when nothing now, None at the end."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return b""
    except OSError:
        return None
    return chunk or None


def read_pending(fd: int) -> bytes:
    """What the pipe holds now, and no more (a writer that goes on writing is not waited for)."""
    try:
        size = pending_bytes(fd)
        return os.read(fd, size) if size > 0 else b""
    except OSError:
        return b""
