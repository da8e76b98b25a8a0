"""Commands in a kept native sandbox: one EXEC conversation each.

The host makes the command's pipes (or a terminal) and passes their far
ends with the request; the exec server's monitor starts the command in its
own session and answers STARTED, then EXITED with the wait status, why it
ended and the usage of its whole tree. Closing the conversation (the
Python object dropped, the caller killed) ends the command's whole tree.
"""

from __future__ import annotations

import errno
import math
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._core import lib, step_name
from ...errors import CommandNotExecutableError, CommandNotFoundError, IsolationError, SetupError
from ...report import Report, status_for
from .protocol import Connection, Reply, ServerGone, encode

#: exec()'s default cap on each of stdout and stderr (the tail is kept).
DEFAULT_OUTPUT_LIMIT = 16 << 20
#: A timeout of this many seconds (about 31 years) or more is no timeout: larger ones overflow the
#: request's int64 milliseconds and the host's own waits (select takes at most about 292 years).
MAX_TIMEOUT = 1e9
def wait_seconds(value: float | None, name: str) -> float | None:
    """A host-side wait in seconds: None or one at least MAX_TIMEOUT waits for ever; NaN and negatives refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name}: expected a number of seconds, got {value!r}")
    return None if value >= MAX_TIMEOUT else float(value)


#: How long the host waits past a command's own timeout for the server's word.
GRACE = 10.0


@dataclass
class ExecResult:
    """What ``Sandbox.exec`` returns."""

    args: list[str]
    returncode: int
    stdout: Any
    stderr: Any
    truncated: bool = False
    report: Report = field(default_factory=Report)

    @property
    def timed_out(self) -> bool:
        return self.report.status == "timeout"

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def returncode_of(wait_status: int) -> int:
    """The shell's spelling: the exit status, or 128+N for a signal."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status) if os.WIFEXITED(wait_status) else 255


def report_of(reply: Reply, started: float, enforced: Mapping[str, Any], backend: str = "native") -> Report:
    rc = returncode_of(reply.wait_status)
    limit = {int(lib.ISO_XS_REASON_TIMEOUT): "timeout", int(lib.ISO_XS_REASON_KILLED): "killed"}.get(reply.reason)
    report = Report(backend=backend, enforced=dict(enforced))
    report.wall_seconds = round(time.monotonic() - started, 6)
    report.user_seconds = round(reply.user_usec / 1e6, 6)
    report.system_seconds = round(reply.system_usec / 1e6, 6)
    report.cpu_seconds = round((reply.user_usec + reply.system_usec) / 1e6, 6)
    report.max_rss_bytes = reply.maxrss_kib * 1024
    sub_rc = -os.WTERMSIG(reply.wait_status) if os.WIFSIGNALED(reply.wait_status) else rc
    report.status, report.exit_code, report.signal = status_for(sub_rc, limit)
    return report


def _start_error(reply: Reply, argv: Sequence[str], cwd: str) -> IsolationError:
    what = argv[0]
    if reply.step == lib.ISO_STEP_EXEC and reply.err in (errno.ENOENT, errno.ENOTDIR):
        return CommandNotFoundError(f"{what}: command not found inside the sandbox")
    if reply.step == lib.ISO_STEP_EXEC and reply.err == errno.EACCES:
        return CommandNotExecutableError(f"{what}: permission denied inside the sandbox")
    if reply.step == lib.ISO_STEP_CHDIR:
        return SetupError(f"cwd {cwd}: {os.strerror(reply.err)} inside the sandbox", "chdir", reply.err, cwd)
    step = step_name(reply.step) if reply.step else "exec-server"
    return SetupError(f"starting {what} failed at {step}: {os.strerror(reply.err)}", step, reply.err, what)


class Command:
    """One command started in the sandbox; ``conn`` is its conversation with the server's monitor."""

    def __init__(self, conn: Connection, argv: Sequence[str], cwd: str, environment: Sequence[str],
                 timeout: float | None, stdio: tuple[int, ...], pty: bool, enforced: Mapping[str, Any],
                 backend: str = "native") -> None:
        """``stdio``: the command's three descriptors; with ``pty``, none: ``terminal`` is then its master side."""
        self.conn = conn
        self.backend = backend
        self.args = list(argv)
        self.enforced = enforced
        self.started = time.monotonic()
        if timeout is not None and timeout >= MAX_TIMEOUT:
            timeout = None
        self.timeout = timeout
        self.exit: Reply | None = None
        timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        packet = encode(lib.ISO_XS_EXEC, [cwd, *self.args, *environment], n_argv=len(self.args),
                        timeout_ms=timeout_ms, flags=int(lib.ISO_XS_F_PTY) if pty else 0)
        conn.send(packet, stdio)
        reply = conn.answer()
        if reply.kind == lib.ISO_XS_ERROR:
            conn.close()
            raise _start_error(reply, self.args, cwd)
        if reply.kind != lib.ISO_XS_STARTED:
            conn.close()
            raise ServerGone("the sandbox's exec server sent an unexpected reply")
        self.pid = reply.pid  # inside the sandbox's PID namespace
        #: With pty: the master side of the terminal the monitor made (the caller owns it).
        self.terminal: int | None = None
        if reply.fd is not None:
            if pty and os.isatty(reply.fd):
                self.terminal = reply.fd
            else:
                os.close(reply.fd)

    def signal(self, sig: int, descendants: bool = False) -> None:
        """Send sig to the command's process group (SIGKILL: to its whole tree), or to what it started."""
        if self.exit is not None:
            return
        flags = int(lib.ISO_XS_F_DESCENDANTS) if descendants else 0
        try:
            self.conn.send(encode(lib.ISO_XS_SIGNAL, mode=int(sig), flags=flags))
        except ServerGone:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def poll_exit(self, timeout: float | None) -> Reply | None:
        """The EXITED reply, waiting at most timeout seconds (None: as long as it takes)."""
        if self.exit is not None:
            return self.exit
        try:
            reply = self.conn.receive(timeout)
        except TimeoutError:
            return None
        except ServerGone:
            raise IsolationError("the sandbox ended while the command ran") from None
        if reply.fd is not None:
            os.close(reply.fd)
        if reply.kind != lib.ISO_XS_EXITED:
            raise ServerGone("the sandbox's exec server sent an unexpected reply")
        self.exit = reply
        self.conn.close()
        return reply

    def wait_exit(self) -> Reply:
        """The EXITED reply; with a timeout, never waits past it by more than twice GRACE (see run_collecting)."""
        if self.timeout is None:
            reply = self.poll_exit(None)
            assert reply is not None
            return reply
        deadline = self.started + self.timeout + GRACE
        for _ in range(2):
            reply = self.poll_exit(max(0.0, deadline - time.monotonic()))
            if reply is not None:
                return reply
            self.kill()
            deadline = time.monotonic() + GRACE
        self.close()
        raise _unenforced(self)

    def report(self) -> Report:
        assert self.exit is not None
        return report_of(self.exit, self.started, self.enforced, self.backend)

    @property
    def returncode(self) -> int | None:
        return None if self.exit is None else returncode_of(self.exit.wait_status)

    def close(self) -> None:
        """Drop the conversation: a command still running is ended, with its whole tree."""
        self.conn.close()


def _unenforced(command: Command) -> IsolationError:
    # The monitor took neither its own timeout nor the host's kill: a process
    # of the sandbox stopped it (same uid). Say so rather than wait for ever.
    return IsolationError(f"{command.args[0]}: its timeout ({command.timeout:g} s) could not be enforced: the "
                          "sandbox's exec server does not answer (a process of the sandbox stopped it); close the "
                          "sandbox to end everything in it")


class _Tail:
    """A byte buffer that keeps the last `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[:len(self.data) - self.limit]
            self.truncated = True


def run_collecting(command: Command, stdin_w: int | None, data: bytes, out_r: int, err_r: int | None,
                   output_limit: int) -> tuple[bytes, bytes, bool]:
    """Feed stdin, collect stdout/stderr (keeping each one's tail), until the command's EXITED."""
    out, err = _Tail(output_limit), _Tail(output_limit)
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r):
        if fd is not None:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
    sel.register(command.conn.fileno(), selectors.EVENT_READ)
    view = memoryview(data)
    if stdin_w is not None:
        os.set_blocking(stdin_w, False)
        if view:
            sel.register(stdin_w, selectors.EVENT_WRITE)
        else:
            os.close(stdin_w)
            stdin_w = None
    deadline = None if command.timeout is None else command.started + command.timeout + GRACE
    killed = False
    try:
        while command.exit is None:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = sel.select(wait)
            if not events and deadline is not None and time.monotonic() >= deadline:
                if killed:
                    # The monitor took neither its own timeout nor the kill: a
                    # process of the sandbox stopped it (same uid). Say so
                    # rather than wait for ever.
                    command.close()
                    raise _unenforced(command)
                command.kill()
                killed = True
                deadline = time.monotonic() + GRACE
            for key, _ in events:
                fd = int(key.fd)
                if fd == stdin_w:
                    try:
                        view = view[os.write(fd, view[:65536]):]
                    except BrokenPipeError:
                        view = view[:0]
                    if not view:
                        sel.unregister(fd)
                        os.close(fd)
                        stdin_w = None
                elif fd == command.conn.fileno():
                    sel.unregister(fd)
                    command.poll_exit(None)
                    break
                else:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        (out if fd == out_r else err).add(chunk)
                    else:
                        sel.unregister(fd)
        # Whatever the command wrote before it ended is in the pipes now; a
        # background process that keeps them open is not waited for.
        for fd, tail in ((out_r, out), (err_r, err)):
            if fd is None:
                continue
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                tail.add(chunk)
    finally:
        sel.close()
        if stdin_w is not None:
            os.close(stdin_w)
    return bytes(out.data), bytes(err.data), out.truncated or err.truncated


class SandboxProcess:
    """A command started by ``Sandbox.spawn``: stream ``stdout``/``stderr``, ``write()``, ``kill()``, ``wait()``."""

    def __init__(self, impl: Any, argv: list[str], cwd: str, environment: list[str],
                 timeout: float | None, pty: bool, fd3: int = -1) -> None:
        """``fd3``: a descriptor of the caller's that the command gets as its descriptor 3 (the caller
        keeps its own; a persistent shell's out-of-band status channel)."""
        self.args = argv
        self.master_fd = -1
        stdio: tuple[int, ...] = ()
        closers: list[int] = []
        if pty:
            # The monitor makes the terminal in the sandbox's devpts and sends its master with STARTED.
            self.stdin_fd = self.stdout_fd = self.stderr_fd = -1
        else:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            stdio = (in_r, out_w, err_w)
            closers = [in_r, out_w, err_w]
            self.stdin_fd, self.stdout_fd, self.stderr_fd = in_w, out_r, err_r
        try:
            self._command = Command(impl.connect(), argv, cwd, environment, timeout,
                                    stdio + ((fd3,) if fd3 >= 0 else ()), pty, impl.report_enforced, impl.backend)
            if pty:
                master = self._command.terminal
                if master is None:
                    self._command.close()
                    raise ServerGone("the sandbox's exec server sent no terminal")
                self.master_fd = self.stdin_fd = self.stdout_fd = master
        except BaseException:
            for fd in {self.stdin_fd, self.stdout_fd, self.stderr_fd} - {-1}:
                os.close(fd)
            raise
        finally:
            for fd in closers:
                os.close(fd)
        self.stdout = os.fdopen(self.stdout_fd, "rb", buffering=0, closefd=not pty)
        self.stderr = os.fdopen(self.stderr_fd, "rb", buffering=0) if self.stderr_fd >= 0 else None
        self.pid = self._command.pid

    def __iter__(self) -> Iterator[bytes]:
        """stdout, line by line (a terminal's output with pty=True)."""
        buffered = b""
        while True:
            try:
                chunk = os.read(self.stdout_fd, 65536)
            except OSError:  # EIO: the terminal's last user is gone
                chunk = b""
            if not chunk:
                if buffered:
                    yield buffered
                return
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                yield line + b"\n"

    def write(self, data: str | bytes) -> None:
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(self.stdin_fd, view):]

    def close_stdin(self) -> None:
        if self.master_fd < 0 and self.stdin_fd >= 0:
            os.close(self.stdin_fd)
            self.stdin_fd = -1

    def signal(self, sig: int, descendants: bool = False) -> None:
        self._command.signal(sig, descendants)

    def kill(self) -> None:
        """End the command and everything it started."""
        self._command.kill()

    def poll(self) -> int | None:
        self._command.poll_exit(0)
        return self._command.returncode

    def wait(self, timeout: float | None = None) -> int:
        timeout = wait_seconds(timeout, "timeout")
        if self._command.poll_exit(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        rc = self._command.returncode
        assert rc is not None
        return rc

    @property
    def returncode(self) -> int | None:
        return self._command.returncode

    @property
    def report(self) -> Any:
        return self._command.report() if self._command.exit is not None else None

    def close(self) -> None:
        self._command.close()
        for fd in {self.stdin_fd, self.master_fd}:  # with pty, one descriptor: closed once
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdin_fd = self.master_fd = -1
        self.stdout.close()
        if self.stderr is not None:
            self.stderr.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
