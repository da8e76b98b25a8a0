"""Control groups for the whole process tree of a run (cgroup v1 and v2).

One ``RunCgroup`` per run. It is a fresh cgroup named ``isolate-<ownerpid>-<n>``
inside a directory ``isolate`` that sits in the *caller's own* cgroup:

* cgroup v2: ``<mount>/<own path>/isolate/isolate-<pid>-<n>``. The controllers a
  run needs are enabled in ``cgroup.subtree_control`` of the own cgroup and of
  ``isolate``. Because of v2's "no internal processes" rule this moves the
  processes of the own cgroup (the caller among them) into a leaf
  ``<own path>/isolate-caller`` first; that is done only where the own cgroup is
  ours to reorganise (delegated by systemd, owned by the caller, or holding only
  the caller). Root in a cgroup it may not reorganise falls back to the root of
  the hierarchy (``<mount>/isolate/...``), as Docker's cgroupfs driver does.
* cgroup v1: one directory per hierarchy that holds a wanted controller
  (memory, pids, cpu, cpuacct, freezer; co-mounted ones share it), each under
  the caller's own cgroup of that hierarchy as read from ``/proc/self/cgroup``
  and ``/proc/self/mountinfo``.

The owner holds a ``flock`` on every directory of its runs. ``sweep_stale``
removes only directories named ``isolate-<pid>-<n>`` whose owner pid is gone,
whose lock is free and which hold no process; it never touches anything else.

Nothing here writes to the kernel before ``RunCgroup.create``; discovery and
``doctor_info`` only read (``doctor_info`` creates and removes one probe
directory per hierarchy to tell whether it is really writable)."""

from __future__ import annotations

from .doctor import doctor_info
from .fs import CgroupUnavailableError
from .fs import _ensure_dir as _ensure_dir
from .fs import _lock_dir as _lock_dir
from .fs import _rmdir_quiet as _rmdir_quiet
from .hierarchy import (
    DEFAULT_WANT,
    FEATURES,
    Hierarchy,
    delegation_hint,
    discover,
    find_hierarchies,
    parse_mountinfo,
    parse_proc_cgroup,
    required_features,
)
from .hierarchy import _parse_keyed as _parse_keyed
from .run import CgroupUsage, RunCgroup, check_available, sweep_stale
from .run import _parent_dirs as _parent_dirs
from .v2 import _v2_base as _v2_base
from .v2 import _v2_delegated as _v2_delegated

__all__ = [
    "DEFAULT_WANT",
    "FEATURES",
    "CgroupUnavailableError",
    "CgroupUsage",
    "Hierarchy",
    "RunCgroup",
    "check_available",
    "delegation_hint",
    "discover",
    "doctor_info",
    "find_hierarchies",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "required_features",
    "sweep_stale",
]
