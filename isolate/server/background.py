"""Background commands of a kept sandbox: processes of the sandbox, not of the server.

A command the exec server runs ends when its host hangs up, so a background
command run as the server's would end with the server (a killed one too).
In a kept sandbox (isolate.server.keep) the server instead runs a launcher
(``LAUNCHER``, the sandbox's own shell) that starts a wrapper in the
background and ends at once. The launcher is spawned detached
(``Sandbox.spawn(detached=True)``): its monitor in the sandbox ends nothing
when the server hangs up, and once the launcher has ended it stays the
subreaper of what it left, reaping until nothing is left, so the wrapper
and the command under it run on past the server, below that monitor.
The wrapper runs the command as the exec server would (``SHELL -c
CONTENT``, its cwd and environment), its stdout and stderr appended to a
log file of the sandbox's private /tmp, and writes the command's exit
status to a second file when it ends.

What the server holds, and what the next server finds through the
sandbox's record (its ``commands``):

- the wrapper's process on the host, named by its pid and start time (told
  apart from a reused pid), held as a pidfd while it runs: the command has
  ended when its wrapper has; signals go to its processes from the host.
  Its parent is the monitor (``_monitor``: not the sandbox's init, held by a
  pidfd while its descendants are listed), which a restarted server finds
  the same way;
- the log file, made by the launcher (mode 0600) and opened by the server
  once the launcher ended, through the sandbox's file API (opened inside,
  as the program, O_NOFOLLOW, a regular file checked from the host): read
  with ``pread`` at the API's cursors, which are the file's offsets. Its
  bytes before the last OUTPUT_LIMIT are freed (FALLOC_FL_PUNCH_HOLE: the
  offsets stay) by the server's reaper while a server runs, and at its end;
  while none runs, the file grows with the command's output within /tmp's
  size, and the next server frees it down again;
- after a restart, and after the command ended, both files are opened
  again the same way: a path resolves as the program's would, inside its
  own view (a link it planted leads to nothing of the host's), a FIFO is
  opened without blocking and refused, as anything not a regular file is,
  and an exit file is read up to a few bytes. What the files hold is the
  sandbox's word, as a command's output always is.

The launcher's end is waited for off the request's path (``_settle``), so a
start costs what the exec server's spawn costs. An interrupt sends SIGTERM to
the command's process group (what the exec server does), and once that ended
it or after the grace, stops then kills what is left of its session and every
descendant of its monitor, as its timeout does. A process the command
double-forked into a session of its own (``setsid -f``, a daemon) is one of
them: the wrapper, a shell, cannot be a subreaper, but the monitor is, and
an orphan goes to the nearest living subreaper above it. Only a command that
killed its own monitor (a process of the sandbox, of its uid) puts them
under the sandbox's init, where they end with the sandbox. A command that
ended by itself leaves what it started running (as a foreground command
does), below the monitor until that ends. A foreground command streams to
the client that asked for it and ends with its server, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psutil

from ..backends.native import files as native_files
from ..kept.sandbox import Sandbox
from ..kernel.fdwait import ready
from ..model.errors import IsolationError
from .keep import COMMAND_ID, RecordedCommand

#: Started with ``sh -c LAUNCHER isolate-bg ID SHELL CONTENT``: the log made (mode 0600; exit status 3: it
#: cannot be), the wrapper (the subshell) runs on when the launcher ends; its process group and session are the
#: launcher's (the exec server makes each command lead its own). The TERM trap lets the wrapper outlive an
#: interrupt's SIGTERM to write the command's status.
LAUNCHER = r'''f=/tmp/.isolate-cmd-$1
s=$2
[ -x "$s" ] || s=/bin/sh
(umask 077; : >>"$f.log") || exit 3
( trap : TERM
  "$s" -c "$3"
  echo $? >"$f.exit" ) </dev/null >>"$f.log" 2>&1 &
echo "$$ $!"
'''
#: An exit file: the status the wrapper wrote, or the server's (with how it ended the command).
_EXIT = re.compile(rb"([0-9]{1,3})(?: (killed|timeout))?\n?")
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
#: Rounds of listing a command's processes and stopping the new ones (each round stops a generation).
_STOP_ROUNDS = 8
#: The launcher's longest run (it starts the wrapper and ends).
LAUNCH_TIMEOUT = 30.0
#: How long what needs a new command's wrapper waits for it to be found (a few milliseconds, usually).
SETTLE_WAIT = 40.0
#: Processes looked at when finding a wrapper or a command's processes (a sandbox may fork many).
_MOST_PROCESSES = 1 << 16


def paths(command_id: str) -> tuple[str, str]:
    """The command's log and exit files, inside the sandbox (its id is the server's, hex)."""
    if not COMMAND_ID.fullmatch(command_id):
        raise ValueError(f"not a command id: {command_id[:64]!r}")
    base = f"/tmp/.isolate-cmd-{command_id}"
    return base + ".log", base + ".exit"


def _status_fields(pid: int, names: tuple[str, ...]) -> dict[str, list[int]]:
    fields: dict[str, list[int]] = {}
    with open(f"/proc/{pid}/status", "rb") as status:
        for line in status.read(1 << 16).splitlines():
            name, _, rest = line.partition(b":")
            if name.decode(errors="replace") in names:
                fields[name.decode()] = [int(v) for v in rest.split()]
    return fields


def _init_of(box: Sandbox) -> int | None:
    impl: Any = getattr(box, "_impl", None)
    init_pid = getattr(impl, "_init_pid", None)
    pid = init_pid() if callable(init_pid) else None
    return pid if isinstance(pid, int) else None


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children", "rb") as children:
                found += [int(v) for v in children.read().split()]
    return found


def host_process(box: Sandbox, ns_pid: int, group: int | None = None) -> psutil.Process | None:
    """The host's process of the sandbox whose pid there is ns_pid, at the sandbox's own PID namespace's depth (a
    process of a namespace the sandbox made below its own is not it), never its init: ns_pid is what a process of
    the sandbox said (a launcher's line, which any of them can write through /proc/PID/fd/1), and the init is
    nobody's wrapper or driver (an interrupt killed it, which the sandbox itself cannot). ``group``: it must be in
    that process group there (a background command's wrapper is in its launcher's). The three generations below
    the sandbox's init are looked at first, then every process of the sandbox: a background command's wrapper is
    its launcher's monitor's child (a subreaper, detached: it stays), below the exec server, or (the monitor was
    killed) the init's; a kept code context's driver is the init's (its launcher ended)."""
    init = _init_of(box)
    if init is None:
        return None
    try:
        depth = len(_status_fields(init, ("NSpid",))["NSpid"])
    except (OSError, KeyError, ValueError):
        return None

    def candidates() -> Iterator[int]:
        first = _children(init)
        yield from first
        # The launcher's monitor (a subreaper) is the exec server's child, the wrapper the monitor's.
        second = [pid for parent in first for pid in _children(parent)]
        yield from second
        third = [pid for parent in second for pid in _children(parent)]
        yield from third
        near = {*first, *second, *third}
        yield from (p.pid for p in box.processes()[:_MOST_PROCESSES] if p.pid not in near)

    for pid in candidates():
        if pid == init:
            continue
        try:
            ids = _status_fields(pid, ("NSpid", "NSpgid"))
            nspid = ids.get("NSpid", [])
            if len(nspid) == depth and nspid[-1] == ns_pid and nspid[-1] != 1 and \
                    (group is None or ids.get("NSpgid", [0])[-1] == group):
                return psutil.Process(pid)
        except (OSError, ValueError, psutil.Error):
            continue
    return None


def of_sandbox(box: Sandbox, pid: int) -> bool:
    """Whether the host's process ``pid`` is the sandbox's, at its own PID namespace's depth (``host_process`` finds
    it by its pid there). Asked after a pidfd of ``pid`` is opened, and while that pidfd names a live process, the
    answer is that pidfd's process's: a number is given again only once its process is reaped."""
    try:
        inner = _status_fields(pid, ("NSpid",))["NSpid"][-1]
    except (OSError, KeyError, IndexError, ValueError):
        return False
    found = host_process(box, inner)
    return found is not None and found.pid == pid


def _punch(fd: int, length: int) -> None:
    """Free the file's first ``length`` bytes (they read as zeros; its size and offsets stay)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, ctypes.c_long(0),
                      ctypes.c_long(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def stop_then_kill(listing: Callable[[], list[psutil.Process]]) -> None:
    """SIGKILL every process ``listing`` names, leaving none a gap to fork an escapee in: what it names is
    stopped, and it is asked again until it names none not yet stopped; then all are killed. A stopped process
    neither ends nor forks, so its pid and children stay its own meanwhile; psutil checks a process is still the
    one listed (its start time) before each signal."""
    stopped: list[psutil.Process] = []
    seen: set[int] = set()
    try:
        for _ in range(_STOP_ROUNDS):
            fresh = [p for p in listing() if p.pid not in seen]
            if not fresh:
                break
            for process in fresh:
                seen.add(process.pid)
                with contextlib.suppress(psutil.Error):
                    process.suspend()
                    stopped.append(process)
    finally:
        for process in stopped:
            with contextlib.suppress(psutil.Error):
                process.kill()


@dataclasses.dataclass(frozen=True)
class Monitor:
    """A background command's monitor in the sandbox, held (its pidfd) while its descendants are listed."""

    process: psutil.Process
    pidfd: int

    def descendants(self) -> list[psutil.Process]:
        """Its descendants; none once it has ended (a listing made after that could be another's, of its pid
        reused: while its pidfd is not readable it ran throughout)."""
        try:
            found = self.process.children(recursive=True)
        except psutil.Error:
            return []
        return [] if ready([self.pidfd], timeout=0) else found

    def close(self) -> None:
        os.close(self.pidfd)


def monitor_of(box: Sandbox, command: psutil.Process) -> Monitor | None:
    """The monitor in the sandbox of a command spawned detached (a background command's wrapper, a kept shell):
    its parent, a subreaper that every process the command left (whatever it did with sessions and double forks)
    is a descendant of, until all have ended. None when its parent is the sandbox's init (the monitor was killed:
    the sandbox's processes can, they share its uid) or not of the sandbox. The caller closes it."""
    init = _init_of(box)
    if init is None:
        return None
    pidfd = -1
    try:
        pid = command.ppid()
        if pid in (0, 1, init):
            return None
        # Held while it is checked: a parent that ended meanwhile (its pid reused) is not taken for it.
        pidfd = os.pidfd_open(pid)
        if command.ppid() != pid:
            return None
        # The exec server's child, as a monitor is (that server the init's): the command's pid may have come
        # from a line any process of the sandbox could write, naming a monitor or the exec server itself, whose
        # parent would take every command of the sandbox for this one's.
        if psutil.Process(psutil.Process(pid).ppid()).ppid() != init:
            return None
        monitor = psutil.Process(pid)  # its start time, against a reuse of its pid from now on
        depth = len(_status_fields(init, ("NSpid",))["NSpid"])
        nspid = _status_fields(pid, ("NSpid",)).get("NSpid", [])
        if ready([pidfd], timeout=0) or len(nspid) != depth or nspid[-1] == 1:
            return None
        held, pidfd = Monitor(monitor, pidfd), -1
        return held
    except (OSError, KeyError, ValueError, psutil.Error):
        return None
    finally:
        if pidfd >= 0:
            os.close(pidfd)


class KeptCommand:
    """One background command of a kept sandbox (see the module's docstring), read as
    isolate.server.state.CommandRecord is for status and logs."""

    background = True

    def __init__(self, sandbox: Callable[[], Sandbox | None], recorded: RecordedCommand, limit: int,
                 on_end: Callable[[], None]) -> None:
        #: The sandbox, when its file API answers (None while it is paused: its exec server is frozen).
        self.sandbox = sandbox
        self.recorded = recorded
        self.id, self.content, self.started_at = recorded.id, recorded.content, recorded.started_at
        self.finished_at: float | None = None
        self.exit_code: int | None = None
        self.error = ""
        self.report_status = ""
        #: Why the server is killing it ("timeout", "killed"): said by whichever thread sees its end first (a
        #: status call's refresh may, before ``kill`` itself does).
        self._killing = ""
        self.limit = limit
        self._on_end = on_end
        self._lock = threading.RLock()
        self._pidfd = -1
        self._log_fd = -1
        self._freed = 0
        #: Let go of by the server (its sandbox ended, or the server): nothing is held or recorded for it again.
        self._closed = False
        self.log_path, self.exit_path = paths(recorded.id)
        #: Its wrapper looked for (``recorded`` names it, or it had ended): what needs its process waits for this.
        self.settled = threading.Event()
        self.settled.set()

    # -- its start, and a restarted server's ---------------------------------------------------------------

    @classmethod
    def start(cls, sandbox: Callable[[], Sandbox | None], command_id: str, content: str, shell: str,
              cwd: str | None, env: Mapping[str, str] | None, timeout: float | None, limit: int,
              on_end: Callable[[], None], on_settled: Callable[[], None]) -> KeptCommand:
        """Start its launcher. The rest is done on a thread of its own, off the request's path, as a command's
        output pump is: the launcher's end waited for (the exec server would end what it started if its host hung
        up first), the wrapper found, the log opened; what needs them waits for that. ``on_settled`` then (the
        sandbox's record, naming it, is written)."""
        box = sandbox()
        if box is None:
            raise OSError(errno.EAGAIN, "the sandbox is not running")
        started = time.time()
        deadline = None if timeout is None else started + timeout
        # bash's background jobs keep SIGINT's default action; sh's ignore it (and cannot undo that).
        launcher = shell if shell == "/bin/bash" else "/bin/sh"
        try:
            proc = box.spawn([launcher, "-c", LAUNCHER, "isolate-bg", command_id, shell, content], cwd=cwd,
                             env=env, timeout=LAUNCH_TIMEOUT, detached=True)
        except FileNotFoundError:
            if launcher == "/bin/sh":
                raise
            proc = box.spawn(["/bin/sh", "-c", LAUNCHER, "isolate-bg", command_id, shell, content], cwd=cwd,
                             env=env, timeout=LAUNCH_TIMEOUT, detached=True)
        command = cls(sandbox, RecordedCommand(command_id, content, started, 0, 0.0, proc.pid, deadline), limit,
                      on_end)
        command.settled.clear()
        threading.Thread(target=command._settle, args=(box, proc, on_settled), daemon=True,
                         name=f"isolate-serve-bg-{command_id}").start()
        return command

    def _settle(self, box: Sandbox, proc: Any, on_settled: Callable[[], None]) -> None:
        """The launcher's word (its pid there, its wrapper's) and end, then the wrapper's process on the host."""
        failed = ""
        try:
            proc.close_stdin()
            # Its one line, not its end of file: a process of the sandbox can reopen the launcher's stdout
            # (/proc/PID/fd/1, a pipe) and hold it open for ever. Within LAUNCH_TIMEOUT, whatever it holds.
            said, deadline = b"", time.monotonic() + LAUNCH_TIMEOUT
            while b"\n" not in said and len(said) < 64:
                left = deadline - time.monotonic()
                if left <= 0 or not ready([proc.stdout_fd], timeout=left):
                    break
                chunk = os.read(proc.stdout_fd, 64 - len(said))
                if not chunk:
                    break
                said += chunk
            rc = proc.wait(LAUNCH_TIMEOUT + 5)
            match = re.fullmatch(rb"([0-9]{1,10}) ([0-9]{1,10})\n", said)
            if rc == 3 and not said:
                failed = f"no file for its output could be made in the sandbox's /tmp ({self.log_path})"
            elif rc != 0 or match is None or int(match.group(1)) != self.recorded.group:
                failed = f"its launcher failed (exit status {rc})"
            else:
                log_fd = self._open_log(os.O_RDWR)  # the file the launcher made, checked (regular, not a link)
                with self._lock:
                    if self._closed or self._log_fd >= 0:
                        if log_fd >= 0:
                            os.close(log_fd)
                    else:
                        self._log_fd = log_fd
                wrapper = host_process(box, int(match.group(2)), group=self.recorded.group)
                if wrapper is not None:  # else it ended already (its exit file says how)
                    with contextlib.suppress(psutil.Error):
                        self.recorded = dataclasses.replace(self.recorded, pid=wrapper.pid,
                                                            pid_start=wrapper.create_time())
        except Exception as exc:  # the sandbox ended under it
            failed = f"its launcher failed ({exc})"
        finally:
            with contextlib.suppress(OSError):
                proc.close()
        try:
            if failed:
                with self._lock:
                    self.error = failed
            self._hold()
        finally:
            self.settled.set()
        if not self._closed:  # else let go of meanwhile: its sandbox ended (and its record with it), or the server
            on_settled()

    def _wait_settled(self) -> None:
        if not self.settled.is_set():
            self.settled.wait(SETTLE_WAIT)

    @classmethod
    def served_again(cls, sandbox: Callable[[], Sandbox | None], recorded: RecordedCommand, limit: int,
                     on_end: Callable[[], None]) -> KeptCommand:
        """A command an earlier server of the sandbox started: its wrapper held again if it still runs (its log is
        opened when first needed)."""
        command = cls(sandbox, recorded, limit, on_end)
        command._hold()
        return command

    def _hold(self) -> None:
        """A pidfd of the wrapper, if the process of that pid is still the one recorded; else it has ended."""
        pid, pidfd = self.recorded.pid, -1
        if pid > 0 and not self._closed:
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(pid)
        if pidfd >= 0:
            try:
                same = psutil.Process(pid).create_time() == self.recorded.pid_start  # checked after the open
            except psutil.Error:
                same = False
            if not same:
                os.close(pidfd)
                pidfd = -1
        with self._lock:
            if self._closed or self.finished_at is not None:  # let go of meanwhile (the sandbox or server ended)
                if pidfd >= 0:
                    os.close(pidfd)
                return
            self._pidfd = pidfd
        if pidfd < 0:
            self._ended()

    # -- its state --------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        self.refresh()
        return self.finished_at is None

    def refresh(self) -> None:
        """Its end, once its wrapper ended (its pidfd readable): then its exit status is read."""
        self._wait_settled()
        pidfd = self._pidfd
        if self.finished_at is None and (pidfd < 0 or ready([pidfd], timeout=0)):
            self._ended()

    def _ended(self, how: str = "") -> None:
        """Its end: the exit status its wrapper wrote, or (none: it was killed) the server's word, written too
        for the next server. While the sandbox is paused that waits for its resume."""
        with self._lock:
            if self.finished_at is not None:
                return
            box = self.sandbox()
            if box is None:
                return
            code, said = self._read_exit(box)
            if code is None and self.error:  # its launcher failed: it never ran
                code = 255
            elif code is None:
                code, said = 137, how or self._killing or "killed"
                with contextlib.suppress(OSError, IsolationError):
                    box.write_file(self.exit_path, f"{code} {said}\n")
            self.exit_code, self.report_status = code, said
            if code != 0 and not self.error:
                self.error = {"timeout": "timed out", "killed": "killed"}.get(said, f"exit status {code}")
            self.finished_at = time.time()
            fd = self._log_fd if self._log_fd >= 0 else self._open_log(os.O_RDWR)
            if fd >= 0 and fd != self._log_fd:
                self._log_fd = fd
            self._free()  # what it wrote last, past the limit (the reaper's last round may not have seen it)
            self._release()
        self._on_end()

    def _read_exit(self, box: Sandbox) -> tuple[int | None, str]:
        try:
            data = native_files.read_bytes(box._conn(), self.exit_path, 32)
        except (OSError, ValueError, IsolationError):
            return None, ""
        match = _EXIT.fullmatch(data)
        if match is None or int(match.group(1)) > 255:
            return None, ""
        return int(match.group(1)), (match.group(2) or b"").decode()

    def _release(self) -> None:
        for name in ("_pidfd", "_log_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)

    # -- its output -------------------------------------------------------------------------------------

    def _open_log(self, flags: int) -> int:
        """The log file, opened inside as the program (a link is not followed, a FIFO is refused); -1 if none
        (or the sandbox is paused)."""
        box = self.sandbox()
        if box is None:
            return -1
        try:
            fd, info = native_files.open_fd(box._conn(), self.log_path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, ValueError, IsolationError):
            return -1
        if not info.is_file:
            os.close(fd)
            return -1
        os.set_blocking(fd, True)
        return fd

    def _reader(self) -> int:
        """A descriptor of the log to read (the caller closes it), -1 if none."""
        with self._lock:
            if self._log_fd >= 0:
                return os.dup(self._log_fd)
        return self._open_log(os.O_RDONLY)

    @property
    def output_base(self) -> int:
        """The offset of the first byte kept (those before are freed)."""
        fd = self._reader()
        if fd < 0:
            return 0
        try:
            return max(0, os.fstat(fd).st_size - self.limit)
        finally:
            os.close(fd)

    def read_from(self, cursor: int) -> tuple[bytes, int]:
        """The output from ``cursor`` (a file offset; the last ``limit`` bytes are kept), and its end."""
        fd = self._reader()
        if fd < 0:
            return b"", cursor
        try:
            size = os.fstat(fd).st_size
            at = max(cursor, size - self.limit, 0)
            if at >= size:
                return b"", size
            chunks = []
            while at < size:
                chunk = os.pread(fd, min(1 << 20, size - at), at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
            return b"".join(chunks), at
        finally:
            os.close(fd)

    # -- the reaper's round, interrupts -----------------------------------------------------------------

    def tend(self, now: float) -> None:
        """The server's reaper: its end noticed, its timeout enforced, its log's oldest bytes freed."""
        self.refresh()
        if self.finished_at is not None or self.sandbox() is None:
            return
        deadline = self.recorded.deadline
        if deadline is not None and now >= deadline:
            self.kill("timeout")
            return
        with self._lock:
            if self._log_fd < 0:
                self._log_fd = self._open_log(os.O_RDWR)  # a restarted server's, to free its oldest bytes
            self._free()

    def _free(self) -> None:
        """Free the log's bytes before its last ``limit`` (whole pages; under the lock)."""
        fd = self._log_fd
        if fd < 0:
            return
        excess = (os.fstat(fd).st_size - self.limit) & ~0xFFF
        if excess > self._freed:
            with contextlib.suppress(OSError):  # a file system without holes keeps it whole
                _punch(fd, excess)
                self._freed = excess

    def _wrapper(self) -> psutil.Process | None:
        if self._pidfd < 0:
            return None
        try:
            process = psutil.Process(self.recorded.pid)
            return process if process.create_time() == self.recorded.pid_start else None
        except psutil.Error:
            return None

    def _monitor(self, box: Sandbox) -> Monitor | None:
        """The monitor of the command's launcher in the sandbox (spawned detached): the wrapper's parent (see
        ``monitor_of``). None when the wrapper has ended. The caller closes it."""
        wrapper = self._wrapper()
        return monitor_of(box, wrapper) if wrapper is not None else None

    def _processes(self, box: Sandbox, session: bool, monitor: Monitor | None = None) -> list[psutil.Process]:
        """The command's processes on the host: its process group (``session``: its session too) inside the
        sandbox, every descendant of its wrapper and (``monitor``, found once per interrupt: it outlives the
        wrapper) of its monitor."""
        found: dict[int, psutil.Process] = {}
        wrapper = self._wrapper()
        if wrapper is not None:
            with contextlib.suppress(psutil.Error):
                found[wrapper.pid] = wrapper
                for child in wrapper.children(recursive=True):
                    found[child.pid] = child
        if monitor is not None:
            found.update((p.pid, p) for p in monitor.descendants())
        init = _init_of(box)
        try:
            depth = len(_status_fields(init, ("NSpid",))["NSpid"]) if init is not None else 0
        except (OSError, KeyError, ValueError):
            depth = 0
        if not depth:
            return list(found.values())
        for process in box.processes()[1:_MOST_PROCESSES]:
            if process.pid in found:
                continue
            try:
                ids = _status_fields(process.pid, ("NSpid", "NSpgid", "NSsid"))
            except (OSError, ValueError):
                continue
            if len(ids.get("NSpid", [])) != depth:
                continue
            if ids.get("NSpgid", [0])[-1] == self.recorded.group or \
                    (session and ids.get("NSsid", [0])[-1] == self.recorded.group):
                found[process.pid] = process
        return list(found.values())

    def interrupt(self, grace: float) -> None:
        """SIGTERM to its process group (as the exec server's interrupt); once that ended it, or after ``grace``,
        SIGKILL to what is left of what it started: its session, and its wrapper's descendants (those listed
        before the SIGTERM too: one in a session of its own is orphaned when its parent ends)."""
        box = self.sandbox()
        if box is None or not self.running:
            return
        self._wait_settled()
        monitor = self._monitor(box)
        try:
            before = self._processes(box, session=True, monitor=monitor)
            for process in self._processes(box, session=False):
                with contextlib.suppress(psutil.Error):
                    process.send_signal(signal.SIGTERM)
            pidfd = self._pidfd
            if pidfd >= 0:
                ready([pidfd], timeout=grace)
            self.kill("killed", before, monitor)
        finally:
            if monitor is not None:
                monitor.close()

    def kill(self, how: str, before: Sequence[psutil.Process] = (), monitor: Monitor | None = None) -> None:
        """SIGKILL to everything it started (``how``: "killed" or "timeout", said when it leaves no status;
        ``before``: its processes listed earlier, killed too if they still run; ``monitor``: its monitor, found
        earlier, while its wrapper ran, which the caller closes). The monitor itself is left to reap them and
        end."""
        box = self.sandbox()
        if box is None:
            return
        self._killing = self._killing or how
        self._wait_settled()
        found = None if monitor is not None else self._monitor(box)
        try:
            stop_then_kill(lambda: [*before, *self._processes(box, session=True, monitor=monitor or found)])
        finally:
            if found is not None:
                found.close()
        pidfd = self._pidfd
        if pidfd >= 0:
            ready([pidfd], timeout=5.0)
        self._ended(how)

    def ended_with_sandbox(self) -> None:
        """The sandbox ended (and the command with it)."""
        with self._lock:
            self._closed = True
            self._release()
            if self.finished_at is not None:
                return
            self.finished_at, self.error = time.time(), "the sandbox ended"
        self._on_end()

    def close(self) -> None:
        """Let go of it (the server ends; the command runs on for the next)."""
        with self._lock:
            self._closed = True
            self._release()

    def forget(self) -> None:
        """It is no longer listed: its files in the sandbox go."""
        self.close()
        box = self.sandbox()
        if box is None:
            return
        for path in (self.log_path, self.exit_path):
            with contextlib.suppress(OSError, ValueError, IsolationError):
                box.remove(path)
