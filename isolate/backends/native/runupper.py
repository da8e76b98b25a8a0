"""A one-shot image run's upper layer on disk, where the private tmpfs cannot be a whole root file system.

Before Linux 6.6 a tmpfs keeps no ``user.*`` extended attributes, which an
overlay mounted in a user namespace keeps its metadata in: removing or
renaming a non-empty directory of the image then fails (EIO), which
``pip install --upgrade`` or ``rm -rf`` of an image's directory do. On such a
kernel a one-shot run from an image takes its upper layer from the state
directory (``image-runs/PID-START-TOKEN/image``, made as a kept sandbox's
``image_upper="disk"`` is, where the file system keeps those attributes) and
removes it when the run has ended. A run directory whose caller has ended is
removed by the next run's start: a caller killed before it could remove its
own leaves nothing for long. A caller holds an exclusive ``flock`` on its run
directory for as long as the run lasts (the kernel drops it with the
caller's last descriptor, a SIGKILL included); the name's PID and start time
alone cannot tell: a caller in another PID namespace (a container sharing the
state directory) has a PID that means another process, or none, here. A sweep
never sees a directory between its making and its lock (``making_in``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import secrets
from dataclasses import dataclass

from ...image import leases
from ...kernel.links import DIR_FLAGS
from ...kernel.places import lock_if_left, making_in, open_state_dir, state_dir
from ...kernel.tree import remove_dir_at
from ...model.errors import UnsupportedError
from ...model.policy import Policy
from .imageroot import HostUpper, disk_by_default, make_host_upper

RUNS = "image-runs"


@dataclass(frozen=True)
class RunUpper:
    host: HostUpper
    name: str
    identity: tuple[int, int]  # the run directory's (st_dev, st_ino)
    lock_fd: int  # the run directory, flock'ed until the run is removed


def make(policy: Policy) -> RunUpper | None:
    """A run directory with the upper layer in it; None where the tmpfs does (Linux 6.6 on, or a tmpfs size
    asked for), or where the state directory's file system keeps no ``user.*`` attributes either (the tmpfs
    then, its limit reported)."""
    if not disk_by_default(policy):
        return None
    parent = open_state_dir(RUNS)
    try:
        _sweep(parent)
        name = f"{os.getpid()}-{leases.start_time(os.getpid())}-{secrets.token_hex(6)}"
        with making_in(parent):  # a sweep (of a caller in another PID namespace, too) waits until it is locked
            os.mkdir(name, 0o700, dir_fd=parent)
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh directory: no one else holds it
        try:
            info = os.fstat(fd)
            identity = (info.st_dev, info.st_ino)
            host = make_host_upper(fd, os.path.join(state_dir(), RUNS, name))
        except UnsupportedError:
            remove_dir_at(parent, name, identity)
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        why = "on disk: a tmpfs keeps no user.* attributes before Linux 6.6; removed at the run's end"
        return RunUpper(dataclasses.replace(host, purpose=why), name, identity, fd)
    finally:
        os.close(parent)


def remove(run: RunUpper) -> None:
    """Remove the run's directory (a directory swapped in at its name is left alone)."""
    try:
        parent = open_state_dir(RUNS)
        try:
            remove_dir_at(parent, run.name, run.identity)
        finally:
            os.close(parent)
    finally:
        os.close(run.lock_fd)  # the lock goes last: a sweep never sees the directory free before it is gone


def _sweep(parent: int) -> None:
    """Remove the run directories of callers that have ended: neither a caller of this PID namespace (its PID
    and start time) nor one anywhere (its lock) holds them."""
    for name in os.listdir(parent):
        pid, _, rest = name.partition("-")
        start = rest.partition("-")[0]
        if pid.isdigit() and start.isdigit() and str(leases.start_time(int(pid))) == start:
            continue  # its caller runs (it may be between making the directory and locking it)
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError:
            continue  # not a directory (nothing isolate made): left alone
        try:
            if not lock_if_left(parent, fd):
                continue  # its caller runs, in another PID namespace
            info = os.fstat(fd)
            remove_dir_at(parent, name, (info.st_dev, info.st_ino))
        finally:
            os.close(fd)
