"""A pause without a cgroup freezer: SIGSTOP to every process of a kept sandbox but its init.

The init runs nothing of the program, and it is what ends the sandbox when its caller dies: stopped with
the rest, it left a sandbox whose caller was killed during a pause (or a ``commit_image``, which pauses)
stopped for good. It stays running, told to hold the exec server stopped (``ISO_SIGNAL_HOLD``, until
``ISO_SIGNAL_RELEASE``; it continues a stopped exec server otherwise, as a command could stop it). Both are
sent with kill(), whose sender the kernel writes (csrc/isolate.h): a process of the sandbox cannot forge
them. An init of an isolate from before them takes no hold (the signals would end it): it is stopped with
the rest, as then. A restarted server
still tells a paused sandbox by its exec server not answering.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from ..._core import ffi, lib
from ...model.errors import IsolationError

Processes = Callable[[], list[Any]]


def stop_all(processes: Processes, init: int | None) -> None:
    """Stop the sandbox: hold the exec server, then SIGSTOP every process but the init until all stay stopped."""
    held = init if init is not None and init_takes_holds(init) else None
    if held is not None:
        hold_exec_server(held, True)
    try:
        stop_until_stopped(processes, skip=held)
    except IsolationError:
        continue_all(processes, init)  # not paused: as it was, not half stopped
        raise


def continue_all(processes: Processes, init: int | None) -> None:
    """Continue every process, then release the hold."""
    for proc in processes():
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if init is not None and init_takes_holds(init):
        hold_exec_server(init, False)
        _wait_taken(init, lib.ISO_SIGNAL_RELEASE)


#: How long continue_all waits for the init to take a release (it is never stopped: at once, but for load).
TAKE_SECONDS = 2.0


def _wait_taken(init: int, sig: int) -> None:
    """Wait until the init has read ``sig`` (pending no more): a hold sent after a release still pending would be
    read before it (by number), leaving the next pause released."""
    deadline = time.monotonic() + TAKE_SECONDS
    while _pending(init) >> (sig - 1) & 1 and time.monotonic() < deadline:
        time.sleep(0.001)


def init_takes_holds(init: int) -> bool:
    """Whether the init blocks ISO_SIGNAL_HOLD and ISO_SIGNAL_RELEASE (it reads them from its signalfd); an init
    of an isolate before them leaves them at their default action, which would end it."""
    blocked = _mask(init, "SigBlk:")
    return all(blocked >> (sig - 1) & 1 for sig in (lib.ISO_SIGNAL_HOLD, lib.ISO_SIGNAL_RELEASE))


def _pending(init: int) -> int:
    return _mask(init, "ShdPnd:") | _mask(init, "SigPnd:")


def _mask(pid: int, field: str) -> int:
    """A signal mask of /proc/PID/status (0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith(field):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def hold_exec_server(init: int, hold: bool) -> None:
    if lib.iso_hold_exec_server(init, int(hold)) < 0:
        err = ffi.errno
        if err != errno.ESRCH:  # ended meanwhile: nothing to hold
            raise IsolationError(f"pause: could not signal the sandbox's init: {os.strerror(err)}")


#: How long a SIGSTOP pause tries to see every process stopped (each round stops those still running).
STOP_SECONDS = 5.0


def stop_until_stopped(processes: Processes, skip: int | None) -> None:
    """SIGSTOP every process of ``processes()`` but ``skip`` until each is seen stopped: a process forked
    meanwhile, or continued by its parent (the exec server continues a stopped monitor), is stopped again in
    the next round. Raises IsolationError when they keep running."""
    import psutil

    deadline = time.monotonic() + STOP_SECONDS
    pause = 0.0005
    while True:
        running = []
        for proc in processes():
            if proc.pid == skip:
                continue
            try:
                if proc.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP,
                                         psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    running.append(proc)
            except psutil.Error:
                continue  # ended
        if not running:
            return
        if time.monotonic() > deadline:
            raise IsolationError(f"pause: {len(running)} of the sandbox's processes kept running through "
                                 f"{STOP_SECONDS:g} s of SIGSTOP (pid {running[0].pid}: {_seen(running[0])})")
        for proc in running:
            try:
                os.kill(proc.pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        time.sleep(pause)  # a stop takes effect when the process is next scheduled
        pause = min(pause * 2, 0.05)


def _seen(proc: Any) -> str:
    """What a process that would not stop was seen doing (its name, state and kernel wait), for the message."""
    try:
        with open(f"/proc/{proc.pid}/wchan", encoding="ascii", errors="replace") as handle:
            wchan = handle.read(64) or "-"
    except OSError:
        wchan = "?"
    try:
        return f"{proc.name()}, {proc.status()}, waiting in {wchan}"
    except Exception:  # psutil.Error: it ended as it was looked at
        return "ended"
