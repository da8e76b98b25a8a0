"""Which cgroup hierarchies this process sits in (v1 controllers, or the v2 unified tree), read from
/proc/self/cgroup and mountinfo; what a policy's limits need; and the hint for a host that does not
delegate.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ...model.policy import Limits
from .fs import _read_text

#: What a run cgroup can provide. On v2 ``cpuacct`` (cpu.stat) and ``freezer``
#: (cgroup.freeze) are core files that need no controller.
FEATURES: frozenset[str] = frozenset({"memory", "pids", "cpu", "cpuacct", "freezer"})


#: Used when available, never required: tree memory peak and OOM count, tree CPU
#: time, and a freezer so that killing a forking tree converges.
DEFAULT_WANT: frozenset[str] = frozenset({"memory", "cpuacct", "freezer"})


#: Directory holding the run cgroups inside the caller's own cgroup.
PARENT_NAME = "isolate"


#: v2 leaf that receives the processes of the caller's own cgroup.
LEAF_NAME = "isolate-caller"


RUN_NAME = re.compile(r"^isolate-([1-9][0-9]*)-([0-9]+)$")


_V2_CONTROLLER = {"memory": "memory", "pids": "pids", "cpu": "cpu"}  # cpuacct, freezer: core files on v2


# -- parsing ------------------------------------------------------------------


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/PID/mountinfo (the fields isolate needs)."""

    root: str
    mountpoint: str
    options: frozenset[str]
    fstype: str
    super_options: frozenset[str]


@dataclass(frozen=True)
class ProcCgroup:
    """One line of /proc/PID/cgroup: ``hierarchy-id:controllers:path``."""

    hierarchy_id: int
    controllers: frozenset[str]
    path: str


def _unescape(field_: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """The mounts of a mountinfo text; malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 4:
            continue
        mounts.append(
            MountEntry(
                root=_unescape(fields[3]),
                mountpoint=_unescape(fields[4]),
                options=frozenset(fields[5].split(",")),
                fstype=fields[sep + 1],
                super_options=frozenset(fields[sep + 3].split(",")),
            )
        )
    return mounts


def parse_proc_cgroup(text: str) -> list[ProcCgroup]:
    """The lines of a /proc/PID/cgroup text; malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            continue
        controllers = frozenset(c for c in parts[1].split(",") if c)
        out.append(ProcCgroup(int(parts[0]), controllers, parts[2]))
    return out


@dataclass(frozen=True)
class Hierarchy:
    """A cgroup hierarchy the caller belongs to, and where its own cgroup is.

    ``version`` is 1 or 2; ``controllers`` are the v1 controllers of the
    hierarchy (empty for v2, whose controllers are read from the own cgroup);
    ``directory`` is the caller's own cgroup in the file system, or None with
    ``problem`` saying why it is not reachable.
    """

    version: int
    name: str
    controllers: frozenset[str]
    cgroup_path: str
    mountpoint: str | None
    mount_root: str | None
    directory: str | None
    problem: str | None = None

    @property
    def label(self) -> str:
        return "cgroup-v2" if self.version == 2 else "cgroup-v1"

    def root_directory(self) -> str | None:
        """The hierarchy's top cgroup as mounted here, if the mount shows the real root."""
        if self.mountpoint is None or self.mount_root != "/":
            return None
        return self.mountpoint


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` ("" when equal), or None when outside it."""
    if root == "/":
        return path.lstrip("/")
    root = root.rstrip("/")
    if path == root:
        return ""
    if path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return None


def find_hierarchies(proc_cgroup: str, mountinfo: str) -> list[Hierarchy]:
    """The hierarchies of the caller (from /proc/self/cgroup) matched to their mounts."""
    lines = parse_proc_cgroup(proc_cgroup)
    mounts = parse_mountinfo(mountinfo)
    v1_names: set[str] = set()
    for line in lines:
        if line.hierarchy_id != 0:
            v1_names |= line.controllers
    out = []
    for line in lines:
        if line.hierarchy_id == 0:
            version, name = 2, "unified"
            candidates = [m for m in mounts if m.fstype == "cgroup2"]
        else:
            version, name = 1, ",".join(sorted(line.controllers))
            candidates = [
                m
                for m in mounts
                if m.fstype == "cgroup"
                and line.controllers <= m.super_options
                and not ((m.super_options & v1_names) - line.controllers)
            ]
        if version == 1 and not line.controllers:
            continue
        chosen: MountEntry | None = None
        directory: str | None = None
        for candidate in candidates:
            rel = _under(line.path, candidate.root)
            if rel is not None:
                chosen = candidate
                directory = os.path.join(candidate.mountpoint, rel) if rel else candidate.mountpoint
                break
        problem = None
        if not candidates:
            problem = f"{name} hierarchy is not mounted here"
        elif chosen is None:
            roots = ", ".join(sorted({m.root for m in candidates}))
            problem = f"own cgroup {line.path} is outside every mount of the {name} hierarchy (mount roots: {roots})"
        mount = chosen or (candidates[0] if candidates else None)
        out.append(
            Hierarchy(
                version=version,
                name=name,
                controllers=line.controllers if version == 1 else frozenset(),
                cgroup_path=line.path,
                mountpoint=mount.mountpoint if mount else None,
                mount_root=mount.root if mount else None,
                directory=directory,
                problem=problem,
            )
        )
    return out


def discover() -> list[Hierarchy]:
    """The hierarchies of this process, read from /proc/self/cgroup and /proc/self/mountinfo."""
    try:
        return find_hierarchies(_read_text("/proc/self/cgroup"), _read_text("/proc/self/mountinfo"))
    except OSError:
        return []


def _parse_keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def required_features(limits: Limits) -> frozenset[str]:
    """The features a cgroup must have to enforce the tree-wide limits that are set."""
    need = set()
    if limits.memory is not None:
        need.add("memory")
    if limits.pids is not None:
        need.add("pids")
    if limits.cpus is not None:
        need.add("cpu")
    if limits.cpu_seconds is not None:
        need.add("cpuacct")
    return frozenset(need)


# -- delegation hint -------------------------------------------------------------


def delegation_hint(
    hierarchies: Iterable[Hierarchy], features: Iterable[str] = (), versions: Iterable[int] = (1, 2)
) -> str:
    """How to give this user a cgroup it may write, for the versions mounted here (and considered)."""
    from .. import hostinfo

    if hostinfo.container() == "kubernetes":
        # The runtime mounts a pod's cgroup file system read-only unless the pod is
        # privileged: neither mkdir nor a systemd scope is a way out there.
        return ("inside a Kubernetes pod the cgroup file system is read-only (unless the pod is privileged): "
                "the pod's resources.limits bound all its sandboxes together; --best-effort falls back to "
                "RLIMIT_AS / RLIMIT_NPROC per process")
    versions = set(versions)
    hierarchies = [h for h in hierarchies if h.version in versions]
    wanted = set(features) or {"memory", "pids", "cpu"}
    tips = []
    if any(h.version == 2 for h in hierarchies) and not any(h.version == 1 and h.controllers for h in hierarchies):
        tips.append(
            "run under a delegated systemd scope, e.g. `systemd-run --user --scope -p Delegate=yes -- isolate-run ...`"
            " (or a service with Delegate=yes)"
        )
    else:
        dirs = sorted(
            {
                os.path.join(h.directory, PARENT_NAME)
                for h in hierarchies
                if h.version == 1 and h.directory and (h.controllers & wanted)
            }
        )
        if dirs:
            tips.append(
                "let root create the parent cgroups and hand them to you: "
                f"`sudo mkdir -p {' '.join(dirs)} && sudo chown -R {os.geteuid()} {' '.join(dirs)}`"
            )
        if any(h.version == 2 for h in hierarchies):
            tips.append("or, for cgroup v2, `systemd-run --user --scope -p Delegate=yes -- isolate-run ...`")
    return "; ".join(tips) if tips else "mount a cgroup file system (v2 at /sys/fs/cgroup) and delegate a subtree"
