"""A bash of the sandbox's (``isolate.kept.shell.Shell``, ``/bin/bash``, its status framed out of band), as a bash
code context's and a bash session's (``/session``).

In a kept sandbox the shell outlives its server: it is started detached, and the server leaves copies of its
ends of the shell's pipes and channel with the sandbox's exec server (``Connection.keep``), which holds them
while no server runs, so the shell never reads the end of its input. The next server takes copies back and
adopts the shell (``Shell.adopt``): variables, functions and the working directory carry on; a cell that was
running when the last server ended is interrupted."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import stat
import threading

import psutil

from ...kept.sandbox import Sandbox
from ...kept.shell import Shell
from ...model.errors import CommandNotFoundError, IsolationError
from ..background import Monitor, monitor_of, of_sandbox, stop_then_kill
from ..models import ApiError
from .driver import Emit, unavailable
from .proctree import alive, end_with_descendants, open_descendant

#: Shells whose ends the sandbox's exec server keeps at once (csrc/xs_keep.c's MAX_KEPT).
KEPT_SHELLS = 64
#: The shell: bash, as the language says (a sandbox's ``/bin/sh`` may be dash or busybox ash).
BASH = "/bin/bash"
HINT = "it needs bash inside the sandbox (Debian: apt-get install bash; Alpine: apk add bash)"


class BashShell:
    """A bash of the sandbox's, a bash context's or a bash session's; ``kept``: it outlives the server (a kept
    sandbox's), its ends left with the exec server under ``key``; ``fresh`` False: the shell of an earlier
    server of the sandbox, adopted at its first use."""

    def __init__(self, box: Sandbox, key: str, kept: bool = False, fresh: bool = True) -> None:
        self.kept = kept
        self._box, self._key = box, key
        self._shell: Shell | None = None
        # The adoption is this shell's alone: a run adopts under this lock, as a delete does (a run may last for
        # ever, so a delete does not wait for the run's own lock), and two adoptions at once would each hold the
        # shell's ends, one of them for good; none after the delete.
        self._adopting = threading.Lock()
        self._ended = False
        if not fresh:
            return
        shell = Shell(box, key, pty=False, argv=(BASH,), detached=kept)  # CommandNotFoundError: no bash there
        if kept:
            try:
                ends, peer = shell.ends()
                box._conn().keep(key, ends, note=peer)
            except BaseException as exc:
                shell.close()
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise ApiError(429, "TOO_MANY_SESSIONS", f"the sandbox's exec server keeps the shells of at most "
                                   f"{KEPT_SHELLS} bash contexts and sessions past their server, and holds that many "
                                   "(a server killed as it started one leaves it there until that shell ends); "
                                   "delete one first") from None
                if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
                    raise ApiError(429, "TOO_MANY_SESSIONS", "the sandbox's open-files limit leaves its exec server no "
                                   "room to keep one more bash shell past its server (it keeps them in half its "
                                   "descriptors); delete a bash context or session first, or give the sandbox a "
                                   "higher open-files limit") from None
                if isinstance(exc, OSError):
                    raise IsolationError(f"the shell could not be kept past the server: the sandbox's exec server "
                                         f"refused its ends ({exc.strerror or exc})") from None
                raise
        self._shell = shell

    def rebind(self, box: Sandbox) -> None:
        self._box = box  # the shell it holds is a process of the sandbox, whatever the handle

    def shell(self) -> Shell:
        with self._adopting:
            if self._ended:
                raise RuntimeError("it was deleted")
            if self._shell is None:
                self._shell = _adopt(self._box, self._key)
            return self._shell

    def run(self, command: str, timeout: float | None) -> tuple[str, int]:
        return self.shell().run(command, timeout)

    def interrupt(self) -> None:
        shell = self._shell
        if shell is not None:
            shell.interrupt()

    def detach(self) -> None:
        """Let go of a kept shell without ending it (the exec server holds its ends for the next server)."""
        with self._adopting:
            shell, self._shell = self._shell, None
        if shell is not None:
            shell.release()

    def close(self) -> None:
        """End the shell and what its commands started (a kept one's adopted first, to learn which), and let the
        exec server drop its ends. In a paused sandbox the exec server does not answer (the server refuses to
        delete a kept bash context there): a kept shell not adopted yet then ends with the sandbox, and its ends
        stay held until the exec server needs their place (it lets go of an ended shell's first)."""
        paused = bool(getattr(getattr(self._box, "_impl", None), "paused", False))
        with self._adopting:
            if self._shell is None and self.kept and not paused:
                with contextlib.suppress(Exception):
                    self._shell = _adopt(self._box, self._key)
            self._ended = True
            shell, self._shell = self._shell, None
        try:
            if shell is not None:
                shell.close()
        finally:
            if self.kept and not paused:
                with contextlib.suppress(Exception):
                    self._box._conn().keep(self._key, [])


class BashContext:
    """A bash code context: its cells run in a ``BashShell``."""

    def __init__(self, box: Sandbox, name: str, kept: bool = False, fresh: bool = True) -> None:
        self.count = 0
        try:
            self._bash = BashShell(box, f"code-{name}", kept, fresh)
        except CommandNotFoundError as exc:
            raise unavailable("bash", str(exc), HINT) from None

    def run(self, code: str, emit: Emit) -> None:
        self.count += 1
        try:
            output, status = self._bash.run(code, None)
        except TimeoutError as exc:
            output, status = str(exc), 124
        emit("stdout", output.encode())
        error = None if status == 0 else {"ename": "CommandExecError", "evalue": str(status),
                                          "traceback": [f"exit status {status}"]}
        emit("done", {"count": self.count, "result": None, "error": error})

    def interrupt(self) -> None:
        self._bash.interrupt()

    def detach(self) -> None:
        self._bash.detach()

    def rebind(self, box: Sandbox) -> None:
        self._bash.rebind(box)

    def close(self) -> None:
        self._bash.close()


def _adopt(box: Sandbox, key: str) -> Shell:
    """The kept shell whose ends the exec server holds under ``key``, adopted."""
    conn = box._conn()
    fds: list[int] = []
    try:
        try:
            for index in range(3):
                fd, peer = conn.take(key, index)
                fds.append(fd)
        except OSError as exc:
            raise RuntimeError(f"the shell did not survive its last server ({exc.strerror})") from None
        # What the exec server hands back was the host's own; still, only what a shell's ends are is taken.
        kinds = [stat.S_IFMT(os.fstat(fd).st_mode) for fd in fds]
        if kinds != [stat.S_IFIFO, stat.S_IFIFO, stat.S_IFSOCK]:
            raise RuntimeError("the shell did not survive its last server (its ends are not pipes and a socket)")
        channel = socket.socket(fileno=fds[2])
        fds.pop()
        try:
            process = _AdoptedShell(box, peer, fds[0], fds[1])
        except BaseException:
            channel.close()
            raise
        fds.clear()  # the process's now
        try:
            return Shell.adopt(key, process, channel, process.pid)
        except BaseException:
            process.close()
            channel.close()
            raise
    finally:
        for fd in fds:
            os.close(fd)


def _reads(pid: int, stdin_fd: int) -> bool:
    """Whether the process ``pid`` reads the pipe ``stdin_fd`` writes to, as its standard input: the shell, not
    another process that got its number once it was reaped (checked while a pidfd holds the number, before the
    pidfd is found still alive). A process the shell started may read it too, but none but the sandbox's own."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/fd/0"), os.fstat(stdin_fd)
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


class _AdoptedShell:
    """A kept shell as ``Shell`` drives it (stdin_fd, stdout_fd, poll, signal, kill, close), through a pidfd of its
    process: a process of the sandbox, checked once the pidfd is open (its pid came from the last server, and
    is given again once its process is reaped)."""

    def __init__(self, box: Sandbox, pid: int, stdin_fd: int, stdout_fd: int) -> None:
        self.pid = pid
        self.master_fd = -1
        self._pidfd = -1
        if pid > 0:
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(pid)
        try:
            held = (self._pidfd >= 0 and of_sandbox(box, pid) and _reads(pid, stdin_fd)
                    and alive(self._pidfd))
        except psutil.Error:
            held = False
        if not held:
            if self._pidfd >= 0:
                os.close(self._pidfd)
            raise RuntimeError("the shell did not survive its last server (it has ended)")
        self.stdin_fd, self.stdout_fd = stdin_fd, stdout_fd
        # Its monitor, the subreaper of what its cells left (double forks included): what ends with it.
        self._monitor: Monitor | None = None
        with contextlib.suppress(psutil.Error):
            self._monitor = monitor_of(box, psutil.Process(pid))

    def poll(self) -> int | None:
        return None if self._pidfd >= 0 and alive(self._pidfd) else -1

    def signal(self, sig: int, descendants: bool = False) -> None:
        if self._pidfd < 0 or not alive(self._pidfd):
            return
        if not descendants:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, sig)
            return
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return
        if not alive(self._pidfd):
            return  # it ended during the listing: its number may be another process's
        tree = {self.pid, *(child.pid for child in children)}
        for child in children:
            fd = open_descendant(child, tree)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, sig)
                os.close(fd)

    def kill(self) -> None:
        """The shell, what its cells started, and what they left below its monitor."""
        if self._pidfd >= 0:
            end_with_descendants(self._pidfd, self.pid)
        if self._monitor is not None:
            stop_then_kill(self._monitor.descendants)

    def release(self) -> None:
        self.close()

    def close(self) -> None:
        for fd in (self.stdin_fd, self.stdout_fd, self._pidfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.stdin_fd = self.stdout_fd = self._pidfd = -1
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
