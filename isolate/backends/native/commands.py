"""Commands in a kept native sandbox: one EXEC conversation each.

The host makes the command's pipes (or a terminal) and passes their far
ends with the request; the exec server's monitor starts the command in its
own session and answers STARTED, then EXITED with the wait status, why it
ended and the usage of its whole tree. Closing the conversation (the
Python object dropped, the caller killed) ends the command's whole tree.

The monitor runs with the command's uid, so the command can kill or stop it.
The host therefore never takes a monitor's silence for an end: past the
command's timeout by GRACE with no EXITED, a conversation that breaks
without one, or a dropped command whose end the monitor does not confirm
within GRACE, and the host ends the whole sandbox itself (it holds the
sandbox's init, which no process inside can reach), so that what the
command started never outlives its timeout or its caller.
"""

from __future__ import annotations

import errno
import math
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._core import lib, step_name
from ...kernel.fdwait import poll_millis
from ...model.errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    IsolationError,
    SandboxEndedError,
    SetupError,
)
from ...model.report import Report, status_for
from .egress import summary_delta
from .protocol import REPLY_SIZE, REPLY_TIMEOUT, Connection, Reply, ServerGone, encode, encode_exec

if TYPE_CHECKING:
    from ..kept import KeptBackend

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


#: How long the host waits past a command's own timeout for the monitor's word, and for the monitor
#: to confirm that a dropped command has ended, before it ends the sandbox itself. Generous: a monitor
#: that is merely slow (a host at a load of 20, as CI's was) must not cost the user the sandbox; one
#: that was killed or stopped costs the sandbox this long after the deadline.
GRACE = 30.0


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

    def __init__(self, conn: Connection | None, argv: Sequence[str], cwd: str, environment: Sequence[str],
                 timeout: float | None, stdio: tuple[int, ...], pty: bool, enforced: Mapping[str, Any],
                 backend: str = "native", sandbox: KeptBackend | None = None, wait_started: bool = True,
                 via: Connection | None = None, detached: bool = False) -> None:
        """``stdio``: the command's three descriptors; with ``pty``, none: ``terminal`` is then its master side.
        ``sandbox``: what the host ends when the command's monitor no longer answers for it.
        ``wait_started=False`` (not with pty): return once the request is sent; the monitor's STARTED (or its
        refusal, raised then) is read with its EXITED by poll_exit, which saves the host a wake-up per command.
        ``via`` (conn None): the request goes on this connection (the sandbox's file connection) with the far
        end of a socketpair made here (``Connection.pair``), which the command's monitor answers on: no
        connect, and no wake-up of the server for one. ``detached``: the host hanging up (its process ending)
        ends nothing, and the monitor stays the subreaper of what the command left until all of it has ended
        (ISO_XS_F_DETACHED)."""
        far = None
        if conn is None:
            assert via is not None
            conn, far = Connection.pair()
        self.conn = conn
        self.sandbox = sandbox
        self.backend = backend
        self.args = list(argv)
        self.enforced = enforced
        self.started = time.monotonic()
        if timeout is not None and timeout >= MAX_TIMEOUT:
            timeout = None
        self.timeout = timeout
        self.exit: Reply | None = None
        self._report: Report | None = None
        self._cwd = cwd
        #: Until STARTED has come (wait_started=False): when the host stops waiting for it (see Connection.answer).
        self._start_deadline: float | None = None
        self.pid = 0  # inside the sandbox's PID namespace, from STARTED
        #: With pty: the master side of the terminal the monitor made (the caller owns it).
        self.terminal: int | None = None
        #: What the sandbox's egress mediator had seen when the command started (None: no egress by name).
        self._egress_start = sandbox.egress_summary() if sandbox is not None else None
        timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        # Without waiting for the start, the monitor says STARTED only for a command that runs a while:
        # a short one's EXITED says both (one wake-up of the host, not two).
        flags = int(lib.ISO_XS_F_PTY) if pty else 0 if wait_started else int(lib.ISO_XS_F_LATE_STARTED)
        if far is not None:
            flags |= int(lib.ISO_XS_F_CONVERSATION)
        if detached:
            flags |= int(lib.ISO_XS_F_DETACHED)
        try:
            packet, strings_fd = encode_exec([cwd, *self.args, *environment], len(self.args), timeout_ms, flags)
            fds = ((strings_fd,) if strings_fd is not None else ()) + tuple(stdio)
            try:
                if via is None:
                    conn.send(packet, fds)
                else:
                    try:
                        via.send_alone(packet, (far.fileno(), *fds) if far is not None else fds)
                    except ServerGone:
                        via.close()  # the next file call connects afresh
                        raise
            finally:
                if strings_fd is not None:
                    os.close(strings_fd)
        finally:
            if far is not None:
                far.close()  # the monitor holds it now (or nobody: conn then reads the hang-up)
        if not wait_started and not pty:
            self._start_deadline = self.started + REPLY_TIMEOUT
            return
        try:
            reply = conn.answer()
        except ServerGone:
            # The command may have started (and killed its monitor before it said so).
            raise self.lost("its monitor went away before it said whether the command started") from None
        self._started_reply(reply, pty)

    def _started_reply(self, reply: Reply, pty: bool) -> None:
        """The monitor's first reply: STARTED, or why the command did not start (raised)."""
        if reply.kind == lib.ISO_XS_ERROR:
            self.conn.close()
            if reply.fd is not None:
                os.close(reply.fd)
            raise _start_error(reply, self.args, self._cwd)
        if reply.kind != lib.ISO_XS_STARTED:
            self.conn.close()
            if reply.fd is not None:
                os.close(reply.fd)
            raise ServerGone("the sandbox's exec server sent an unexpected reply")
        self.pid = reply.pid
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

    @property
    def deadline(self) -> float | None:
        """When the host stops waiting for the monitor to enforce the command's timeout.

        A frozen sandbox's monitor cannot act: while this process has it frozen (the cgroup freezer) the
        deadline stays GRACE ahead, and after its resume() the monitor has GRACE again (it ends a command
        whose timeout passed meanwhile as soon as it runs). A pause by SIGSTOP moves nothing: a process
        the stop rounds missed could undo it and run on, so the timeout counts through it. A pause made
        elsewhere is not known here: it ends the sandbox.
        """
        if self._start_deadline is not None and (self.timeout is None or self.timeout + GRACE > REPLY_TIMEOUT):
            return self._start_deadline
        if self.timeout is None:
            return None
        end = self.started + self.timeout + GRACE
        box = self.sandbox
        if box is not None:
            if box.frozen:
                return time.monotonic() + GRACE
            if box.resumed_at is not None:
                end = max(end, box.resumed_at + GRACE)
        return end

    def poll_exit(self, timeout: float | None) -> Reply | None:
        """The EXITED reply, waiting at most timeout seconds (None: as long as it takes, but never past
        the deadline: there the host ends the sandbox and raises)."""
        until = None if timeout is None else time.monotonic() + timeout
        while self.exit is None:
            now = time.monotonic()
            wait = None if until is None else max(0.0, until - now)
            hard = False
            deadline = self.deadline
            if deadline is not None and (wait is None or deadline - now <= wait):
                wait, hard = max(0.0, deadline - now), True
            try:
                reply = self.conn.receive(wait, REPLY_SIZE)  # STARTED, EXITED: no payload
            except TimeoutError:
                if not hard or self.deadline is None:
                    return None
                if self._start_deadline is not None and time.monotonic() >= self._start_deadline:
                    # As Connection.answer: a late answer would be taken for another's; it is over.
                    self.conn.close()
                    raise ServerGone(f"the sandbox's exec server did not answer within {REPLY_TIMEOUT:g} s (a "
                                     "process of the sandbox stopped it, or the sandbox is paused)") from None
                if time.monotonic() < self.deadline:
                    continue  # paused or resumed meanwhile: the deadline moved
                raise self.lost(f"its timeout ({self.timeout:g} s) passed by {GRACE:g} s and its monitor did "
                                "not end it") from None
            except ServerGone:
                if self._start_deadline is not None:
                    raise self.lost("its monitor went away before it said whether the command started") from None
                raise self.lost("its monitor inside the sandbox went away before it") from None
            if self._start_deadline is not None:
                self._start_deadline = None
                if reply.kind == lib.ISO_XS_EXITED:
                    self.pid = reply.pid  # ISO_XS_F_LATE_STARTED: it ended before its STARTED was due
                else:
                    self._started_reply(reply, False)
                    continue
            if reply.fd is not None:
                os.close(reply.fd)
            if reply.kind != lib.ISO_XS_EXITED:
                raise self.lost("its monitor sent an unexpected reply")
            self.exit = reply
            self.conn.close()
        return self.exit

    def wait_exit(self) -> Reply:
        """The EXITED reply; with a timeout, never waits past the deadline (see poll_exit)."""
        reply = self.poll_exit(None)
        assert reply is not None
        return reply

    def lost(self, what: str) -> IsolationError:
        """The monitor no longer answers for the command (a process of the sandbox, same uid, killed or
        stopped it, or the sandbox ended): the host ends the sandbox itself, so that nothing the command
        started runs on. Returns the error to raise."""
        self.conn.close()
        message = f"{self.args[0]}: {what}"
        if self.sandbox is None:
            return IsolationError(f"{message}; close the sandbox to end everything in it")
        if self.sandbox.end(f"a command ({self.args[0]}) lost its monitor: {what}"):
            return SandboxEndedError(f"{message} (a process of the sandbox killed or stopped it): the sandbox was "
                                     "ended so that nothing the command started runs on")
        return SandboxEndedError(f"{message}: the sandbox has ended")

    def report(self) -> Report:
        assert self.exit is not None
        if self._report is None:
            report = report_of(self.exit, self.started, self.enforced, self.backend)
            if self._egress_start is not None and self.sandbox is not None:
                # What the mediator saw while the command ran (other commands running at the same time
                # share the sandbox's network: theirs is counted too).
                now = self.sandbox.egress_summary()
                if now is not None:
                    report.egress = summary_delta(self._egress_start, now)
            if self.sandbox is not None:
                # Denial tracing: the refusals of the command's session (the init streams them).
                stream = getattr(self.sandbox, "why_stream", lambda: None)()
                if stream is not None:
                    report.denied.extend(stream.take(self.pid))
            self._report = report
        return self._report

    @property
    def returncode(self) -> int | None:
        return None if self.exit is None else returncode_of(self.exit.wait_status)

    def close(self) -> None:
        """Drop the conversation: a command still running is ended, with its whole tree. The monitor
        confirms the end (EXITED) within GRACE, or the host ends the sandbox (a paused one: the monitor
        ends the command on hang-up once it runs again)."""
        if self.exit is None and not self.conn.closed and self.sandbox is not None and not self.sandbox.paused:
            try:
                self.conn.send(encode(lib.ISO_XS_SIGNAL, mode=int(signal.SIGKILL)))
            except ServerGone:
                pass  # the monitor may have ended it already: its EXITED is then waiting to be read
            try:
                if self.poll_exit(GRACE) is None:
                    self.lost(f"its monitor did not confirm its end within {GRACE:g} s of being dropped")
            except IsolationError:
                pass  # lost(): the sandbox was ended
        self.conn.close()


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
    # poll(), not a selector: no epoll descriptor made and closed per command.
    sel = select.poll()
    # The pipes stay blocking (no fcntl pair each): each is read only when poll says it is readable.
    for fd in (out_r, err_r):
        if fd is not None:
            sel.register(fd, select.POLLIN)
    conn_fd = command.conn.fileno()
    sel.register(conn_fd, select.POLLIN)
    view = memoryview(data)
    if stdin_w is not None:
        os.set_blocking(stdin_w, False)
        if view:
            sel.register(stdin_w, select.POLLOUT)
        else:
            os.close(stdin_w)
            stdin_w = None
    try:
        while command.exit is None:
            deadline = command.deadline  # it moves while the sandbox is paused (see Command.deadline)
            events = sel.poll(poll_millis(None if deadline is None else deadline - time.monotonic()))
            if not events and deadline is not None and time.monotonic() >= deadline:
                command.poll_exit(0)  # the monitor's word, or the end of the sandbox (it raises)
                continue
            for fd, _ in events:
                if fd == stdin_w:
                    try:
                        view = view[os.write(fd, view[:65536]):]
                    except BrokenPipeError:
                        view = view[:0]
                    if not view:
                        sel.unregister(fd)
                        os.close(fd)
                        stdin_w = None
                elif fd == conn_fd:
                    if command.poll_exit(0) is not None:  # STARTED (or a refusal, raised), then EXITED
                        break
                else:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        (out if fd == out_r else err).add(chunk)
                    else:
                        sel.unregister(fd)
        # Whatever the command wrote before it ended is in the pipes now; a
        # background process that keeps them open is not waited for.
        draining = [fd for fd in (out_r, err_r) if fd is not None]
        if stdin_w is not None:
            sel.unregister(stdin_w)
        sel.unregister(conn_fd)
        while draining:
            ready = [fd for fd, _ in sel.poll(0) if fd in draining]
            if not ready:
                break
            for fd in ready:
                chunk = os.read(fd, 65536)
                if chunk:
                    (out if fd == out_r else err).add(chunk)
                else:
                    sel.unregister(fd)
                    draining.remove(fd)
    finally:
        if stdin_w is not None:
            os.close(stdin_w)
    return bytes(out.data), bytes(err.data), out.truncated or err.truncated


class SandboxProcess:
    """A command started by ``Sandbox.spawn``: stream ``stdout``/``stderr``, ``write()``, ``kill()``, ``wait()``."""

    def __init__(self, impl: Any, argv: list[str], cwd: str, environment: list[str],
                 timeout: float | None, pty: bool, fd3: int = -1, stdin: int = -1,
                 stderr_to_stdout: bool = False, detached: bool = False) -> None:
        """``fd3``: a descriptor of the caller's that the command gets as its descriptor 3 (the caller
        keeps its own; a persistent shell's out-of-band status channel). ``stdin``: one the command gets as
        its standard input instead of a pipe (a file, a sealed memfd; the caller keeps its own).
        ``stderr_to_stdout``: its stderr is its stdout's pipe (one stream, in the order written).
        ``detached``: see Command."""
        self.args = argv
        self.master_fd = -1
        self._detached = detached
        stdio: tuple[int, ...] = ()
        closers: list[int] = []
        if pty:
            # The monitor makes the terminal in the sandbox's devpts and sends its master with STARTED.
            self.stdin_fd = self.stdout_fd = self.stderr_fd = -1
        else:
            in_r, in_w = os.pipe2(os.O_CLOEXEC) if stdin < 0 else (os.dup(stdin), -1)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = (-1, out_w) if stderr_to_stdout else os.pipe2(os.O_CLOEXEC)
            stdio = (in_r, out_w, err_w)
            closers = list({in_r, out_w, err_w})
            self.stdin_fd, self.stdout_fd, self.stderr_fd = in_w, out_r, err_r
        try:
            self._command = Command(impl.connect(), argv, cwd, environment, timeout,
                                    stdio + ((fd3,) if fd3 >= 0 else ()), pty, impl.report_enforced, impl.backend,
                                    impl, detached=detached)
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
        if self.stdin_fd < 0:
            raise ValueError("the command's standard input is closed, or is not a pipe of this process")
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

    def release(self) -> None:
        """Let go of a detached command without ending it (``close`` ends one still running): its conversation
        and this process's ends of its pipes are closed, and it runs on (a kept shell whose ends the sandbox's
        exec server holds, for the next host)."""
        if not self._detached:
            raise ValueError("release: only a detached command runs on without its host")
        self._command.conn.close()
        self.close()

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
