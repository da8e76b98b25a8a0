"""A kept code context's process tree, signalled from the host through pidfds (a driver's, a bash context's
shell's): its pid and its descendants' are numbers the kernel gives again once their processes are reaped."""

from __future__ import annotations

import contextlib
import os
import signal

import psutil


def end_with_descendants(pidfd: int, pid: int) -> None:
    """SIGKILL a kept driver (``pidfd``; ``pid``: the same process here) and what its cells started: a driver
    leads a session of its own, detached from the exec server that would otherwise end a command's tree, so
    its children (those in a session of their own too) would outlive the context. The driver is stopped first:
    a stopped process neither ends nor forks, so its pid and its children's list stay its own while the tree
    is stopped from the top down (a child stopped cannot fork an escapee either), then killed. A grandchild a
    cell had already orphaned (a daemon's double fork) belongs to the sandbox's init, not to the context: it
    ends with the sandbox.

    A pid is a number the kernel gives again once its process is reaped (a cell may end its driver, and cycle
    the numbers): the tree is walked only while the driver's pidfd still names a live process (its number is
    then its own), and each descendant is signalled through a pidfd of its own, opened before it is checked to
    be still the process listed, a child of the tree."""
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
    stopped: list[int] = []  # pidfds of the descendants stopped
    try:
        driver = listed_driver(pidfd, pid)
        seen: set[int] = {pid}
        for _ in range(8 if driver is not None else 0):  # until none not yet stopped (a generation a round)
            try:
                listed = driver.children(recursive=True) if driver is not None else []
            except psutil.Error:
                break  # the driver is gone already (its pidfd then signals nothing either)
            if not alive(pidfd):
                break  # it ended during the listing: its number may be another process's
            fresh = [child for child in listed if child.pid not in seen]
            if not fresh:
                break
            tree = set(seen)
            seen.update(child.pid for child in fresh)
            for child in fresh:
                fd = open_descendant(child, tree | seen)
                if fd < 0:
                    continue
                stopped.append(fd)
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, signal.SIGSTOP)
    finally:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        for fd in stopped:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)


def alive(pidfd: int) -> bool:
    """Whether the process a pidfd names has not been reaped (a zombie still holds its pid)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except OSError:
        return False
    return True


def listed_driver(pidfd: int, pid: int) -> psutil.Process | None:
    """The driver as psutil sees it at ``pid``, when that number is still the driver's (its pidfd names a live
    process after psutil read the number's start time); None otherwise."""
    if pid <= 0:
        return None
    try:
        driver = psutil.Process(pid)
    except psutil.Error:
        return None
    return driver if alive(pidfd) else None


def open_descendant(child: psutil.Process, tree: set[int]) -> int:
    """A pidfd of ``child`` when it is still the process listed (its start time) and a child of the tree's (a
    listing reads each process's parent at its own moment: a number freed and taken again since is another
    process's); -1 otherwise. The pidfd is opened first: a check that passes after it is a check of its
    process (the one listed held the number from before the open until the check)."""
    try:
        fd = os.pidfd_open(child.pid)
    except OSError:
        return -1
    try:
        if child.is_running() and child.ppid() in tree and alive(fd):
            return fd
    except psutil.Error:
        pass
    os.close(fd)
    return -1
