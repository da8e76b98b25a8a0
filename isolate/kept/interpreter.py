"""``Sandbox.python()``: a Python interpreter in a kept sandbox whose variables persist between runs.

    with isolate.Sandbox() as sb:
        py = sb.python()
        py.run("import math; r = 2")
        result = py.run("print('area'); math.pi * r ** 2")
        result.stdout, result.value          # ('area\\n', '12.566370614359172')

The sandbox's own ``python3`` (found on the sandbox's PATH; the host's, read
only, under the default policy) runs a small driver (``_pydriver.py``) that
the host passes on its command line, so nothing in the sandbox can replace it.
Requests go in on the command's stdin, which the driver moves to a private
descriptor before any user code runs (the code's stdin is /dev/null). The
code's stdout and stderr are the host's own pipes: whatever writes there (the
code, C code, child processes) is kept as it is, also when the interpreter
dies the next instant. Each run's result comes on a channel of its own: a
socket pair whose far end the driver gets as its descriptor 3 and moves to a
private close-on-exec descriptor at once. No other process of the sandbox
holds it, and a socket, unlike a pipe, cannot be reopened through /proc, so
nothing that prints, nor a process that reads the driver's memory, can end
or fake a run's result (before, results came on stdout under a boundary
that such a process could read and forge). The driver flushes the run's
output into the stdout pipe before it writes the result, so once the host
has the result it has the run's whole output too.

What comes back is the sandbox's word and is read as such: chunks are
length-checked, the result is capped and is JSON checked field by field,
output is kept to its tail; nothing is unpickled or evaluated on the host.
The code's own process can forge its own run's result, as any program can
lie about its output, and no more; a malformed chunk ends the interpreter
with a ``ChannelError`` result.

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
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backends.native.commands import GRACE, wait_seconds
from ..kernel.fdwait import pending_bytes
from ..kernel.fdwait import ready as wait_ready
from ..kernel.peerchannel import PeerChannel
from ..model.errors import CommandNotFoundError, IsolationError

#: The most output one run keeps of each of stdout and stderr (the tail).
OUTPUT_LIMIT = 16 << 20
#: The largest result the host accepts from the driver (the driver's own caps are below it).
MAX_RESULT = 4 << 20
#: The largest chunk of a result (as in _pydriver.py), and of a chunk's header line.
PIPE_BUF = 4096
HEADER_LIMIT = 128
#: How often a run waiting for its result checks that the interpreter is still there.
POLL = 0.25
#: The largest piece of code one run takes (the driver's cap on a request).
MAX_CODE = 64 << 20
#: How long the driver has to start and say hello.
START_TIMEOUT = 30.0
#: The driver's exit status when the code closed its channel (as in _pydriver.py).
CHANNEL_LOST = 121

_DRIVER = (Path(__file__).with_name("_pydriver.py")).read_text()


class ChannelError(IsolationError):
    """The interpreter's result channel carried a broken result chunk, or what is not one."""


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

    def add(self, chunk: bytes | bytearray) -> None:
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[:len(self.data) - self.limit]
            self.truncated = True

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", errors="replace")


class _Results:
    """The driver's result channel: chunks of ``BOUNDARY ID more|end LENGTH\\n`` then LENGTH bytes,
    under a boundary drawn per run; nothing else may come on it."""

    def __init__(self, channel: PeerChannel) -> None:
        self.channel = channel
        self.buffer = bytearray()
        self.eof = False

    def fill(self, limit: int = 1 << 16) -> int:
        chunk = self.channel.read(limit)  # only the driver's bytes: a process it forked writes in vain
        if chunk is None:
            return 0
        if not chunk:
            self.eof = True
        self.buffer += chunk
        return len(chunk)

    def take(self, boundary: bytes) -> tuple[int, bool, bytes] | None:
        """The next chunk (id, last, data), or None for now; a chunk under another run's boundary (the
        driver's late answer for a run whose code forged its own) comes with id -1."""
        broken = ChannelError("the interpreter's result channel held a broken result chunk")
        end = self.buffer.find(b"\n", 0, HEADER_LIMIT)
        if end < 0:
            if len(self.buffer) >= HEADER_LIMIT or (self.eof and self.buffer):
                raise broken
            return None
        parts = bytes(self.buffer[:end]).split(b" ")
        if (len(parts) != 4 or not 16 <= len(parts[0]) <= 64 or not parts[0].isalnum() or not parts[1].isdigit()
                or parts[2] not in (b"more", b"end") or not parts[3].isdigit() or int(parts[3]) > PIPE_BUF):
            raise broken
        size = int(parts[3])
        if len(self.buffer) < end + 1 + size:
            if self.eof:
                raise broken
            return None
        data = bytes(self.buffer[end + 1:end + 1 + size])
        del self.buffer[:end + 1 + size]
        return int(parts[1]) if parts[0] == boundary else -1, parts[2] == b"end", data


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
        self._results: _Results | None = None
        self._channel: PeerChannel | None = None
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
        boundary = secrets.token_hex(16)
        ours, theirs = PeerChannel.pair()
        try:
            process = self._box.spawn([self.executable, "-I", "-c", _DRIVER, boundary], fd3=theirs.fileno())
        except CommandNotFoundError:
            ours.close()
            raise CommandNotFoundError(
                f"python: {self.executable} is not found inside the sandbox (on its PATH): the sandbox runs its "
                "own Python, not the host's; make one visible (the default policy shows the host's /usr read-only, "
                "a policy without it needs a read= path holding python3), or give python(executable=) the path "
                "of one inside, e.g. a virtualenv in the workspace") from None
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the driver holds its own copy now
        self.starts += 1
        channel = PeerChannel(ours)
        try:
            hello = self._hello(process, channel, boundary.encode())
        except BaseException:
            process.kill()
            process.close()
            channel.close()
            raise
        try:
            info = json.loads(hello)
            self.python_version = str(info.get("python", ""))[:32] if isinstance(info, dict) else ""
        except (ValueError, RecursionError):
            self.python_version = ""
        self._process, self._channel = process, channel

    def _hello(self, process: Any, channel: PeerChannel, boundary: bytes) -> bytes:
        """The driver's first chunk (what a startup file printed meanwhile is dropped); its writer is the
        driver, the only process whose results are taken from then on."""
        results = self._results = _Results(channel)
        for fd in (process.stdin_fd, process.stdout_fd, process.stderr_fd, channel.fileno()):
            os.set_blocking(fd, False)
        errors = _Tail(8192)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            chunk = results.take(boundary)
            if chunk is not None:
                if chunk[0] != 0 or not chunk[1]:
                    raise ChannelError("the interpreter did not start as the driver does")
                return chunk[2]
            wait = deadline - time.monotonic()
            if results.eof or wait <= 0:
                break
            ready = wait_ready([channel.fileno(), process.stdout_fd, process.stderr_fd], [], wait)
            if process.stderr_fd in ready:
                try:
                    errors.add(os.read(process.stderr_fd, 8192))
                except OSError:
                    pass
            if process.stdout_fd in ready:
                try:
                    os.read(process.stdout_fd, 1 << 16)
                except OSError:
                    pass
            if channel.fileno() in ready:
                results.fill()
        status = ""
        process.kill()
        try:
            status = f" (exit status {process.wait(GRACE)})"
        except Exception:  # the status is a detail of the message
            pass
        said = errors.text().strip()
        raise IsolationError(f"python: {self.executable} inside the sandbox did not start the interpreter"
                             f"{status} (it needs Python 3.7 or later)" + (f": {said[-2000:]}" if said else ""))

    def run(self, code: str, timeout: float | None = None, output_limit: int = OUTPUT_LIMIT) -> PythonResult:
        """Run code in the interpreter's namespace; see ``PythonResult``.

        ``timeout`` (seconds, None: none): past it the interpreter and
        everything it started are killed and the next run starts afresh.
        ``output_limit``: the most bytes kept of each of stdout and stderr (the tail).
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
            boundary = secrets.token_hex(16)
            payload = json.dumps({"id": self._seq, "code": code, "boundary": boundary}).encode(
                "utf-8", errors="surrogatepass")
            if len(payload) > MAX_CODE:
                raise ValueError(f"python: the code takes {len(payload)} bytes; at most {MAX_CODE} go in one run")
            return self._exchange(b"%d\n" % len(payload) + payload, boundary.encode(), timeout, output_limit)

    def _exchange(self, request: bytes, boundary: bytes, timeout: float | None, output_limit: int) -> PythonResult:
        process, results, channel = self._process, self._results, self._channel
        assert process is not None and results is not None and channel is not None
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        out, err = _Tail(output_limit), _Tail(output_limit)
        pending = memoryview(request)
        answer = bytearray()
        open_fds = {process.stdout_fd: out, process.stderr_fd: err}
        next_poll = started + POLL

        def result(value: str | None, error: PythonError | None, **flags: bool) -> PythonResult:
            return PythonResult(out.text(), err.text(), value, error, truncated=out.truncated or err.truncated,
                                seconds=round(time.monotonic() - started, 6), **flags)

        def read_into(fd: int, limit: int) -> None:
            try:
                data = os.read(fd, limit)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                open_fds.pop(fd, None)
            (out if fd == process.stdout_fd else err).add(data)

        try:
            while True:
                chunk = results.take(boundary)
                if chunk is not None:
                    number, last, data = chunk
                    if number != self._seq:
                        continue  # not this run's (a stale one): dropped
                    answer += data
                    if len(answer) > MAX_RESULT:
                        raise ChannelError(f"the interpreter's result passed {MAX_RESULT} bytes")
                    if not last:
                        continue
                    # What the run wrote before its result is in the pipes now; what a background
                    # process keeps writing is left for the next run.
                    for fd in list(open_fds):
                        read_into(fd, max(1, pending_bytes(fd)))
                    number, value, error = _parse_result(bytes(answer))
                    if number != self._seq:
                        raise ChannelError("the interpreter answered for another run")
                    return result(value, error)
                now = time.monotonic()
                if results.eof or now >= next_poll:
                    next_poll = now + POLL
                    if results.eof or process.poll() is not None:
                        return result(None, self._ended(process, out, err), ended=True)
                if deadline is not None and now >= deadline:
                    self._stop(process)
                    self._collect(process, out, err)
                    self._end(process)
                    message = (f"the run did not finish within {timeout:g} s: the interpreter and everything it "
                               "started were killed; the next run starts a new interpreter (variables are lost)")
                    return result(None, PythonError("TimeoutError", message, ""), timed_out=True, ended=True)
                wait = min(POLL, deadline - now) if deadline is not None else POLL
                readers = [channel.fileno(), *open_fds]
                writers = [process.stdin_fd] if pending else []
                ready = wait_ready(readers, writers, max(0.0, wait))
                if process.stdin_fd in ready and pending:
                    try:
                        pending = pending[os.write(process.stdin_fd, pending[:1 << 16]):]
                    except BlockingIOError:
                        pass
                    except OSError:
                        pending = pending[:0]  # the driver is gone: the poll says how
                for fd in list(open_fds):
                    if fd in ready:
                        read_into(fd, 1 << 16)
                if channel.fileno() in ready:
                    results.fill()
        except ChannelError as exc:
            self._end(process)
            message = f"{exc}; the interpreter was ended and the next run starts a new one (variables are lost)"
            return result(None, PythonError("ChannelError", message, ""), ended=True)

    def _ended(self, process: Any, out: _Tail, err: _Tail) -> PythonError:
        """The interpreter ended (or closed its result channel) during a run: keep what it wrote, say why."""
        how = ""
        try:
            process.wait(2.0)
        except Exception:  # still running with its channel closed
            how = "closed its result channel"
        self._collect(process, out, err)
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

    @staticmethod
    def _collect(process: Any, out: _Tail, err: _Tail) -> None:
        """Keep what the interpreter wrote before it ended: it is in the pipes now (a background
        child that keeps them open and goes on writing is not waited for)."""
        for fd, tail in ((process.stdout_fd, out), (process.stderr_fd, err)):
            for _ in range(64):
                try:
                    size = pending_bytes(fd)
                    if not size:
                        break
                    tail.add(os.read(fd, size))
                except OSError:
                    break

    @staticmethod
    def _stop(process: Any) -> None:
        process.kill()  # SIGKILL to its whole tree (nothing once it has ended)
        try:
            process.wait(GRACE)
        except Exception:  # closing the conversation (_end) ends it all the same
            pass

    def _end(self, process: Any) -> None:
        self._stop(process)
        process.close()
        if self._process is process:
            self._close_channel()
            self._process = None

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel, self._results = None, None

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
        self._close_channel()

    def __enter__(self) -> Interpreter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
