"""A one-shot image run's upper layer on disk, where the private tmpfs cannot be a whole root file system.

Before Linux 6.6 a tmpfs keeps no ``user.*`` extended attributes, which an
overlay mounted in a user namespace keeps its metadata in: removing or
renaming a non-empty directory of the image then fails (EIO), which
``pip install --upgrade`` or ``rm -rf`` of an image's directory do. On such a
kernel a one-shot run from an image takes its upper layer from the state
directory (``image-runs/PID-START-TOKEN/image``, made as a kept sandbox's
``image_upper="disk"`` is, where the file system keeps those attributes) and
removes it when the run has ended. A run directory whose caller (PID, its
start time) has ended is removed by the next run's start: a caller killed
before it could remove its own leaves nothing for long.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass

from ...image import leases
from ...kernel.links import DIR_FLAGS
from ...kernel.places import open_state_dir, state_dir
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
        os.mkdir(name, 0o700, dir_fd=parent)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        try:
            info = os.fstat(fd)
            identity = (info.st_dev, info.st_ino)
            try:
                host = make_host_upper(fd, os.path.join(state_dir(), RUNS, name))
            except UnsupportedError:
                remove_dir_at(parent, name, identity)
                return None
        finally:
            os.close(fd)
        why = "on disk: a tmpfs keeps no user.* attributes before Linux 6.6; removed at the run's end"
        return RunUpper(dataclasses.replace(host, purpose=why), name, identity)
    finally:
        os.close(parent)


def remove(run: RunUpper) -> None:
    """Remove the run's directory (a directory swapped in at its name is left alone)."""
    parent = open_state_dir(RUNS)
    try:
        remove_dir_at(parent, run.name, run.identity)
    finally:
        os.close(parent)


def _sweep(parent: int) -> None:
    """Remove the run directories of callers that have ended."""
    for name in os.listdir(parent):
        pid, _, rest = name.partition("-")
        start = rest.partition("-")[0]
        if pid.isdigit() and start.isdigit() and str(leases.start_time(int(pid))) == start:
            continue  # its caller runs: its run may too
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError:
            continue  # not a directory (nothing isolate made): left alone
        try:
            info = os.fstat(fd)
        finally:
            os.close(fd)
        remove_dir_at(parent, name, (info.st_dev, info.st_ino))
