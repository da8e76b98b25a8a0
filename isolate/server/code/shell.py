"""The bash context: a bash session of the sandbox's (``isolate.kept.shell.Shell``, ``/bin/bash``), its status
framed out of band.

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
from ...model.errors import CommandNotFoundError
from ..background import Monitor, monitor_of, of_sandbox, stop_then_kill
from ..models import ApiError
from .driver import Emit, unavailable
from .proctree import alive, end_with_descendants, open_descendant

#: Shells whose ends the sandbox's exec server keeps at once (csrc/xs_keep.c's MAX_KEPT).
KEPT_SHELLS = 64
#: The shell: bash, as the language says (a sandbox's ``/bin/sh`` may be dash or busybox ash).
BASH = "/bin/bash"
HINT = "it needs bash inside the sandbox (Debian: apt-get install bash; Alpine: apk add bash)"


class BashContext:
    def __init__(self, box: Sandbox, name: str, kept: bool = False, fresh: bool = True) -> None:
        """``kept``: the shell outlives the server (a kept sandbox's context); ``fresh`` False: the shell of an
        earlier server of the sandbox, adopted at the context's first use."""
        self.count = 0
        self._box = box
        self._key = f"code-{name}"
        self._kept = kept
        self._shell: Shell | None = None
        # The adoption is the context's alone: a cell adopts under its own lock, a delete without it (a cell may
        # run for ever), and two adoptions at once would each hold the shell's ends, one of them for good; none
        # after the delete.
        self._adopting = threading.Lock()
        self._ended = False
        if not fresh:
            return
        try:
            shell = Shell(box, name, pty=False, argv=(BASH,), detached=kept)
        except CommandNotFoundError as exc:
            raise unavailable("bash", str(exc), HINT) from None
        if kept:
            try:
                ends, peer = shell.ends()
                box._conn().keep(self._key, ends, note=peer)
            except BaseException as exc:
                shell.close()
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise ApiError(429, "TOO_MANY_SESSIONS", f"the sandbox's exec server keeps the shells of at most "
                                   f"{KEPT_SHELLS} bash contexts past their server, and holds that many (a server "
                                   "killed as it started one leaves it there); delete a bash context first") from None
                if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
                    raise ApiError(429, "TOO_MANY_SESSIONS", "the sandbox's open-files limit leaves its exec server no "
                                   "room to keep one more bash context's shell past its server (it keeps them in "
                                   "half its descriptors); delete a bash context first, or give the sandbox a "
                                   "higher open-files limit") from None
                raise
        self._shell = shell

    def rebind(self, box: Sandbox) -> None:
        self._box = box  # the shell it holds is a process of the sandbox, whatever the handle

    def _connect(self) -> Shell:
        with self._adopting:
            if self._ended:
                raise RuntimeError("the context was deleted")
            if self._shell is None:
                self._shell = _adopt(self._box, self._key)
            return self._shell

    def run(self, code: str, emit: Emit) -> None:
        shell = self._connect()
        self.count += 1
        try:
            output, status = shell.run(code, None)
        except TimeoutError as exc:
            output, status = str(exc), 124
        emit("stdout", output.encode())
        error = None if status == 0 else {"ename": "CommandExecError", "evalue": str(status),
                                          "traceback": [f"exit status {status}"]}
        emit("done", {"count": self.count, "result": None, "error": error})

    def interrupt(self) -> None:
        if self._shell is not None:
            self._shell.interrupt()

    def detach(self) -> None:
        """Let go of a kept shell without ending it (the exec server holds its ends for the next server)."""
        with self._adopting:
            shell, self._shell = self._shell, None
        if shell is not None:
            shell.release()

    def close(self) -> None:
        """End the shell and what its cells started (a kept one's adopted first, to learn which), and let the exec
        server drop its ends."""
        with self._adopting:
            if self._shell is None and self._kept:
                with contextlib.suppress(Exception):
                    self._shell = _adopt(self._box, self._key)
            self._ended = True
            shell, self._shell = self._shell, None
        try:
            if shell is not None:
                shell.close()
        finally:
            if self._kept:
                with contextlib.suppress(Exception):
                    self._box._conn().keep(self._key, [])


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
            raise RuntimeError(f"the context's shell did not survive its last server ({exc.strerror})") from None
        # What the exec server hands back was the host's own; still, only what a shell's ends are is taken.
        kinds = [stat.S_IFMT(os.fstat(fd).st_mode) for fd in fds]
        if kinds != [stat.S_IFIFO, stat.S_IFIFO, stat.S_IFSOCK]:
            raise RuntimeError("the context's shell did not survive its last server (its ends are not pipes and a "
                               "socket)")
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
            raise RuntimeError("the context's shell did not survive its last server (it has ended)")
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
