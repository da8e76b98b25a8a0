"""``Sandbox.python()``: a Python interpreter in a kept sandbox whose variables persist between runs.

    with isolate.Sandbox() as sb:
        py = sb.python()
        py.run("import math; r = 2")
        result = py.run("print('area'); math.pi * r ** 2")
        result.stdout, result.value          # ('area\\n', '12.566370614359172')

The sandbox's own ``python3`` (found on the sandbox's PATH; the host's, read
only, under the default policy) runs a small driver (``_pydriver.py``) that
the host passes on its command line, so nothing in the sandbox can replace it.
The host and the driver talk over the command's stdin and stdout, which the
driver moves to private descriptors before any user code runs; the user's
code gets /dev/null as stdin and pipes of the driver's as stdout and stderr,
forwarded as framed chunks. What the code prints, however it prints it, is
data inside a frame and never a frame itself.

What comes back is the sandbox's word and is read as such: frames are
length-prefixed and capped, the result is JSON checked field by field, output
is kept to its tail; nothing is unpickled or evaluated on the host. Code that
deliberately writes to the driver's descriptors can forge its own run's
result (as any program can lie about its output), and no more: a malformed
frame ends the interpreter with a ``ChannelError`` result.

A run that passes its timeout is ended with the whole interpreter and
everything it started (SIGKILL to the process tree); the result says so
(``timed_out``, ``ended``) and the next ``run`` starts a new interpreter, with
no variables. The same holds when the interpreter dies during a run
(``os._exit``, a crash, the memory limit). ``interrupt()`` sends SIGINT: the
running code gets KeyboardInterrupt and the interpreter keeps its state.
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends.native.commands import GRACE, wait_seconds
from .errors import CommandNotFoundError, IsolationError

#: The most output one run keeps of each of stdout and stderr (the tail).
OUTPUT_LIMIT = 16 << 20
#: The largest frame the host accepts from the driver (the driver's own caps are below it).
MAX_FRAME = 4 << 20
#: The largest piece of code one run takes (the driver's cap on a request).
MAX_CODE = 64 << 20
#: How long the driver has to start and say hello.
START_TIMEOUT = 30.0
#: The driver's exit status when the code closed its channel (as in _pydriver.py).
CHANNEL_LOST = 121

_DRIVER = (Path(__file__).with_name("_pydriver.py")).read_text()


class ChannelError(IsolationError):
    """The interpreter sent something that is not a frame of the driver's protocol."""


@dataclass(frozen=True)
class PythonError:
    """The exception a run ended with: its class name, ``str()`` and formatted traceback."""

    type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class PythonResult:
    """What ``Interpreter.run`` returns.

    ``value``: the ``repr`` of the last expression's value when the code ends
    with an expression whose value is not None (as a REPL prints it), else
    None. ``error``: the exception the code raised (KeyboardInterrupt after
    ``interrupt()``, SystemExit after ``exit()``), or what ended the run:
    ``TimeoutError`` (``timed_out``), ``InterpreterExited`` or ``ChannelError``.
    ``ended``: the interpreter process ended during this run; its variables
    are gone and the next run starts a new one.
    """

    stdout: str
    stderr: str
    value: str | None
    error: PythonError | None
    timed_out: bool = False
    ended: bool = False
    truncated: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class _Tail:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[:len(self.data) - self.limit]
            self.truncated = True

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", errors="replace")


class _Frames:
    """Frames ``KIND LENGTH\\n DATA`` from the driver's channel, read without trusting any of it."""

    KINDS = (b"h", b"o", b"e", b"r")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()
        self.eof = False

    def parse(self) -> tuple[bytes, bytes] | None:
        """The next complete frame in the buffer, or None; ChannelError for what is not a frame."""
        end = self.buffer.find(b"\n", 0, 24)
        if end < 0:
            if len(self.buffer) >= 24:
                raise ChannelError("the interpreter's channel carried something that is not a frame")
            return None
        parts = bytes(self.buffer[:end]).split(b" ")
        if len(parts) != 2 or parts[0] not in self.KINDS or not parts[1].isdigit():
            raise ChannelError("the interpreter's channel carried something that is not a frame")
        size = int(parts[1])
        if size > MAX_FRAME:
            raise ChannelError(f"the interpreter sent a frame of {size} bytes (at most {MAX_FRAME})")
        if len(self.buffer) < end + 1 + size:
            return None
        data = bytes(self.buffer[end + 1:end + 1 + size])
        del self.buffer[:end + 1 + size]
        return parts[0], data

    def fill(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
        self.buffer += chunk


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ChannelError(f"the interpreter's result has a {what} that is not a string")
    # JSON may carry lone surrogates (from bytes the code decoded with surrogateescape): make them printable.
    return value.encode("utf-8", errors="replace").decode("utf-8")


def _parse_result(data: bytes) -> tuple[int, str | None, PythonError | None]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise ChannelError("the interpreter's result is not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {"id", "value", "error"}:
        raise ChannelError("the interpreter's result does not have the driver's fields")
    number, value, error = doc["id"], doc["value"], doc["error"]
    if isinstance(number, bool) or not isinstance(number, int):
        raise ChannelError("the interpreter's result has no run number")
    text = None if value is None else _text(value, "value")
    exc = None
    if error is not None:
        if not isinstance(error, dict) or set(error) != {"type", "message", "traceback"}:
            raise ChannelError("the interpreter's result has a malformed error")
        exc = PythonError(_text(error["type"], "type"), _text(error["message"], "message"),
                          _text(error["traceback"], "traceback"))
    return number, text, exc


class Interpreter:
    """A persistent Python interpreter in a sandbox (see the module's docstring)."""

    def __init__(self, box: Any, name: str, executable: str = "python3") -> None:
        if not isinstance(executable, str) or not executable or "\0" in executable:
            raise ValueError(f"python: {executable!r} is not a usable interpreter name")
        self._box = box
        self.name = name
        self.executable = executable
        #: How many interpreter processes this object started (a timeout or a death starts another).
        self.starts = 0
        #: The sandbox's Python version, as its interpreter said at start ("3.11.2").
        self.python_version = ""
        self._process: Any = None
        self._frames: _Frames | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._closed = False
        self._start()

    def __repr__(self) -> str:
        return f"Interpreter(name={self.name!r}, python={self.python_version!r}, alive={self.alive})"

    @property
    def alive(self) -> bool:
        """The interpreter process is running (False after close, or until the next run after its end)."""
        process = self._process
        return process is not None and process.poll() is None

    def _start(self) -> None:
        try:
            process = self._box.spawn([self.executable, "-c", _DRIVER])
        except CommandNotFoundError:
            raise CommandNotFoundError(
                f"python: {self.executable} is not found inside the sandbox (on its PATH): the sandbox runs its "
                "own Python, not the host's; make one visible (the default policy shows the host's /usr read-only, "
                "a policy without it needs a read= path holding python3), or give python(executable=) the path "
                "of one inside, e.g. a virtualenv in the workspace") from None
        self.starts += 1
        frames = _Frames(process.stdout_fd)
        os.set_blocking(process.stdout_fd, False)
        assert process.stderr is not None
        os.set_blocking(process.stderr_fd, False)
        errors = _Tail(8192)
        deadline = time.monotonic() + START_TIMEOUT
        hello = None
        try:
            while hello is None:
                frame = frames.parse()
                if frame is not None:
                    if frame[0] != b"h":
                        raise ChannelError("the interpreter spoke before it said hello")
                    hello = frame[1]
                    break
                if frames.eof:
                    break
                wait = deadline - time.monotonic()
                if wait <= 0:
                    break
                ready, _, _ = select.select([process.stdout_fd, process.stderr_fd], [], [], wait)
                if process.stderr_fd in ready:
                    try:
                        chunk = os.read(process.stderr_fd, 8192)
                    except OSError:
                        chunk = b""
                    errors.add(chunk)
                if process.stdout_fd in ready:
                    frames.fill()
        except BaseException:
            process.close()
            raise
        if hello is None:
            process.kill()
            status = ""
            try:
                status = f" (exit status {process.wait(GRACE)})"
            except Exception:  # the status is a detail of the message
                pass
            process.close()
            said = errors.text().strip()
            raise IsolationError(f"python: {self.executable} inside the sandbox did not start the interpreter"
                                 f"{status} (it needs Python 3.7 or later)" + (f": {said[-2000:]}" if said else ""))
        try:
            info = json.loads(hello)
            self.python_version = str(info.get("python", ""))[:32] if isinstance(info, dict) else ""
        except (ValueError, RecursionError):
            self.python_version = ""
        self._process, self._frames = process, frames

    def run(self, code: str, timeout: float | None = None, output_limit: int = OUTPUT_LIMIT) -> PythonResult:
        """Run code in the interpreter's namespace; see ``PythonResult``.

        ``timeout`` (seconds, None: none): past it the interpreter and
        everything it started are killed and the next run starts afresh.
        """
        if not isinstance(code, str):
            raise TypeError("python: code must be a str")
        timeout = wait_seconds(timeout, "timeout")
        if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 1:
            raise ValueError(f"output_limit: expected a positive number of bytes, got {output_limit!r}")
        with self._lock:
            if self._closed:
                raise IsolationError(f"python {self.name!r} is closed")
            if self._process is None:
                self._start()
            self._seq += 1
            payload = json.dumps({"id": self._seq, "code": code}).encode("utf-8", errors="surrogatepass")
            if len(payload) > MAX_CODE:
                raise ValueError(f"python: the code takes {len(payload)} bytes; at most {MAX_CODE} go in one run")
            return self._exchange(b"%d\n" % len(payload) + payload, timeout, output_limit)

    def _exchange(self, request: bytes, timeout: float | None, output_limit: int) -> PythonResult:
        process, frames = self._process, self._frames
        assert process is not None and frames is not None
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        out, err = _Tail(output_limit), _Tail(output_limit)
        pending = memoryview(request)
        os.set_blocking(process.stdin_fd, False)

        def result(value: str | None, error: PythonError | None, **flags: bool) -> PythonResult:
            return PythonResult(out.text(), err.text(), value, error, truncated=out.truncated or err.truncated,
                                seconds=round(time.monotonic() - started, 6), **flags)

        try:
            while True:
                frame = frames.parse()
                if frame is not None:
                    kind, data = frame
                    if kind == b"o":
                        out.add(data)
                    elif kind == b"e":
                        err.add(data)
                    elif kind == b"r":
                        number, value, error = _parse_result(data)
                        if number == self._seq and not pending:
                            return result(value, error)
                        # A stale result (a child the code forked, say): not this run's.
                    else:
                        raise ChannelError("the interpreter said hello twice")
                    continue
                if frames.eof:
                    return result(None, self._ended(process), ended=True)
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    self._end(process)
                    message = (f"the run did not finish within {timeout:g} s: the interpreter and everything it "
                               "started were killed; the next run starts a new interpreter (variables are lost)")
                    return result(None, PythonError("TimeoutError", message, ""), timed_out=True, ended=True)
                writers = [process.stdin_fd] if pending else []
                readable, writable, _ = select.select([frames.fd], writers, [], wait)
                if writable:
                    try:
                        pending = pending[os.write(process.stdin_fd, pending[:1 << 16]):]
                    except BlockingIOError:
                        pass
                    except OSError:
                        pending = pending[:0]  # the driver is gone: its channel's end says how
                if readable:
                    frames.fill()
        except ChannelError as exc:
            self._end(process)
            message = f"{exc}; the interpreter was ended and the next run starts a new one (variables are lost)"
            return result(None, PythonError("ChannelError", message, ""), ended=True)

    def _ended(self, process: Any) -> PythonError:
        """The interpreter's channel ended during a run: say why, and make sure it is gone."""
        how = ""
        try:
            process.wait(2.0)
        except Exception:  # still running with its channel closed (os.closerange, say)
            how = "closed its channel to the host"
        self._end(process)
        if not how:
            report = process.report
            if report is not None and report.signal:
                name = signal.Signals(report.signal).name if report.signal in signal.valid_signals() else ""
                how = f"was killed by signal {report.signal}" + (f" ({name})" if name else "")
                if report.status not in ("signaled", "killed", ""):
                    how += f": {report.status}"
            elif process.returncode == CHANNEL_LOST:
                how = "lost its channel to the host (the code closed the driver's descriptors)"
            else:
                how = f"exited with status {process.returncode}"
        return PythonError("InterpreterExited", f"the interpreter {how} during the run; the next run starts a "
                           "new one (variables are lost)", "")

    def _end(self, process: Any) -> None:
        process.kill()  # SIGKILL to its whole tree
        try:
            process.wait(GRACE)
        except Exception:  # closing the conversation below ends it all the same
            pass
        process.close()
        if self._process is process:
            self._process, self._frames = None, None

    def interrupt(self) -> None:
        """SIGINT to the interpreter (and what it started in its process group): KeyboardInterrupt in the code.

        Code that catches KeyboardInterrupt or ignores SIGINT goes on; a
        run's timeout ends it in any case.
        """
        process = self._process
        if process is not None:
            process.signal(signal.SIGINT)

    def close(self) -> None:
        """End the interpreter and everything it started; this object then refuses runs."""
        self._closed = True
        process = self._process
        if process is not None:
            process.kill()
            process.close()
            self._process = None

    def __enter__(self) -> Interpreter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
