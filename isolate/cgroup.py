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
directory per hierarchy to tell whether it is really writable).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .errors import SetupError, UnsupportedError
from .policy import Limits

__all__ = [
    "DEFAULT_WANT",
    "FEATURES",
    "CgroupUnavailableError",
    "CgroupUsage",
    "Hierarchy",
    "RunCgroup",
    "check_available",
    "doctor_info",
    "find_hierarchies",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "required_features",
    "sweep_stale",
]

log = logging.getLogger(__name__)

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
_CFS_PERIOD_US = 100_000
_counter = itertools.count()
_counter_lock = threading.Lock()
_swept = False


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


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


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


# -- small file-system helpers -------------------------------------------------


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_pids(directory: str) -> list[int]:
    try:
        text = _read_text(os.path.join(directory, "cgroup.procs"))
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_dir(path: str, blocking: bool) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when someone else holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rmdir_quiet(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _rmdir_parent(path: str) -> None:
    """Remove an empty v1 ``isolate`` parent that this user made (never one an admin handed over)."""
    try:
        if os.stat(path).st_uid == os.geteuid():
            os.rmdir(path)
    except OSError:
        pass


def _why(exc: OSError, what: str) -> str:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"cannot {what}: permission denied for uid {os.geteuid()} (not delegated to it)"
    if exc.errno == errno.EROFS:
        return f"cannot {what}: the cgroup file system is mounted read-only"
    return f"cannot {what}: {reason}"


class _NotHere(Exception):
    """This hierarchy/version cannot host the run; ``str(self)`` says why."""


class CgroupUnavailableError(UnsupportedError):
    """No cgroup this process may write can enforce what was asked.

    ``reasons`` lists why each candidate failed; ``hint`` says how to delegate one.
    """

    def __init__(self, message: str, reasons: tuple[str, ...], hint: str) -> None:
        super().__init__(message)
        self.reasons = reasons
        self.hint = hint


# -- delegation hint -------------------------------------------------------------


def delegation_hint(
    hierarchies: Iterable[Hierarchy], features: Iterable[str] = (), versions: Iterable[int] = (1, 2)
) -> str:
    """How to give this user a cgroup it may write, for the versions mounted here (and considered)."""
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


# -- the run cgroup --------------------------------------------------------------


@dataclass(frozen=True)
class CgroupUsage:
    """What the whole tree used. None where the cgroup cannot tell."""

    cpu_user_seconds: float | None
    cpu_system_seconds: float | None
    peak_memory_bytes: int | None
    oom_kills: int
    pids_max_hit: bool

    @property
    def cpu_seconds(self) -> float | None:
        if self.cpu_user_seconds is None or self.cpu_system_seconds is None:
            return None
        return self.cpu_user_seconds + self.cpu_system_seconds


@dataclass
class _Plan:
    """Where the run directories go: parent directory -> the features it provides."""

    version: int
    parents: dict[str, set[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


class RunCgroup:
    """A fresh cgroup (one per v1 hierarchy, or one v2 directory) for one run.

    Build it with ``RunCgroup.create``; it is removed by ``remove()`` or on
    leaving a ``with`` block.
    """

    def __init__(self, version: int, name: str, dirs: dict[str, set[str]], limits: Limits) -> None:
        self._version = version
        self.name = name
        #: run directory -> features it provides
        self._dirs = dirs
        self._by_feature = {feature: d for d, features in dirs.items() for feature in features}
        self.limits = limits
        self.warnings: list[str] = []
        #: Wanted features that could not be had, and why.
        self.skipped: dict[str, str] = {}
        self._locks: dict[str, int] = {}
        self._procs_fds: list[int] = []
        self._kill_lock = threading.RLock()
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self._removed = False
        self._final_usage: CgroupUsage | None = None
        #: The limit the watchdog enforced by killing the tree ("cpu"), or None.
        self.limit_hit: str | None = None

    # -- creation --

    @classmethod
    def create(
        cls,
        limits: Limits | None = None,
        *,
        need: Iterable[str] = (),
        want: Iterable[str] = DEFAULT_WANT,
        version: str | None = None,
        sweep: bool = True,
    ) -> RunCgroup:
        """A new run cgroup enforcing the tree-wide parts of ``limits``.

        ``need`` adds features that must be present (e.g. ``{"freezer"}`` for
        pause/resume); ``want`` features are used where available. ``version``
        ("cgroup-v1" or "cgroup-v2") forces one version; by default a pure v2
        host uses v2, a v1 or hybrid host v1 then v2. The first call of a
        process sweeps stale run cgroups of dead owners (``sweep=False`` skips it).
        Raises ``CgroupUnavailableError`` (an ``UnsupportedError``) with a
        delegation hint when no writable cgroup can provide the needed features.
        """
        global _swept
        limits = limits if limits is not None else Limits()
        need = set(need)
        unknown = (need | set(want)) - FEATURES
        if unknown:
            raise ValueError(f"unknown cgroup features {sorted(unknown)}; known: {sorted(FEATURES)}")
        required = set(required_features(limits)) | need
        wanted = set(want) - required
        hierarchies = discover()
        if sweep and not _swept:
            _swept = True
            try:
                sweep_stale(hierarchies)
            except OSError as exc:  # pragma: no cover - defensive: a sweep never blocks a run
                log.debug("sweep of stale cgroups failed: %s", exc)
        if version not in (None, "cgroup-v1", "cgroup-v2"):
            raise ValueError(f"version must be 'cgroup-v1' or 'cgroup-v2', not {version!r}")
        has_v1 = any(h.version == 1 and h.controllers & FEATURES for h in hierarchies)
        has_v2 = any(h.version == 2 for h in hierarchies)
        if version == "cgroup-v1":
            order = [1]
        elif version == "cgroup-v2" or (has_v2 and not has_v1):
            order = [2]
        else:
            order = [1, 2] if has_v2 else [1]
        reasons: list[str] = []
        for v in order:
            try:
                if v == 1:
                    return cls._create_v1(hierarchies, required, wanted, limits)
                return cls._create_v2(hierarchies, required, wanted, limits)
            except _NotHere as exc:
                reasons.append(f"cgroup-v{v}: {exc}")
        what = ", ".join(sorted(required)) or "grouping the process tree"
        hint = delegation_hint(hierarchies, required, order)
        message = (
            f"a cgroup for {what} is needed but none this process may write can provide it "
            f"({'; '.join(reasons) or 'no cgroup hierarchy is mounted'}); way out: {hint}"
        )
        raise CgroupUnavailableError(message, tuple(reasons), hint)

    @classmethod
    def _create_v1(
        cls, hierarchies: list[Hierarchy], required: set[str], wanted: set[str], limits: Limits
    ) -> RunCgroup:
        plan = _Plan(1)
        for feature in sorted(required | wanted):
            hier = next((h for h in hierarchies if h.version == 1 and feature in h.controllers), None)
            try:
                if hier is None:
                    raise _NotHere(f"no {feature} hierarchy is mounted")
                if hier.directory is None:
                    raise _NotHere(hier.problem or f"{feature}: own cgroup not reachable")
                parent = os.path.join(hier.directory, PARENT_NAME)
                _ensure_dir(parent)
                if not os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
                    raise _NotHere(f"cannot create a cgroup in {parent}: permission denied for uid {os.geteuid()}")
            except _NotHere as exc:
                if feature in required:
                    raise _NotHere(f"{feature}: {exc}") from None
                plan.skipped[feature] = str(exc)
                continue
            plan.parents.setdefault(parent, set()).add(feature)
        if not plan.parents:
            raise _NotHere("no v1 hierarchy with a usable controller")
        return cls._materialise(plan, limits)

    @classmethod
    def _create_v2(
        cls, hierarchies: list[Hierarchy], required: set[str], wanted: set[str], limits: Limits
    ) -> RunCgroup:
        hier = next((h for h in hierarchies if h.version == 2), None)
        if hier is None:
            raise _NotHere("cgroup2 is not mounted")
        if hier.directory is None:
            raise _NotHere(hier.problem or "own cgroup not reachable")
        parent, enabled, skipped = _v2_prepare(hier, required, wanted)
        plan = _Plan(2, {parent: {"cpuacct", "freezer"} | {f for f in _V2_CONTROLLER if f in enabled}}, skipped)
        return cls._materialise(plan, limits, required)

    @classmethod
    def _materialise(cls, plan: _Plan, limits: Limits, required: set[str] | None = None) -> RunCgroup:
        pid = os.getpid()
        for _attempt in range(100):
            with _counter_lock:
                name = f"isolate-{pid}-{next(_counter)}"
            made: list[str] = []
            try:
                for parent in plan.parents:
                    path = os.path.join(parent, name)
                    try:
                        _mkdir_cgroup(path)
                    except FileNotFoundError:  # a sweep removed the empty parent meanwhile
                        _ensure_dir(parent)
                        _mkdir_cgroup(path)
                    made.append(path)
            except FileExistsError:
                for path in made:
                    _rmdir_quiet(path)
                continue
            except OSError as exc:
                for path in made:
                    _rmdir_quiet(path)
                raise _NotHere(_why(exc, f"create a cgroup in {parent}")) from None
            run = cls(plan.version, name, {os.path.join(p, name): set(f) for p, f in plan.parents.items()}, limits)
            run.skipped = dict(plan.skipped)
            try:
                for path in run._dirs:
                    fd = _lock_dir(path, blocking=True)
                    assert fd is not None
                    run._locks[path] = fd
                if plan.version == 2:
                    run._v2_check_core(required or set())
                run._apply_limits()
            except _NotHere:
                run.remove()
                raise
            except OSError as exc:
                run.remove()
                raise _NotHere(_why(exc, f"set the limits of {name}")) from None
            return run
        raise _NotHere("could not find a free cgroup name after 100 tries")

    def _v2_check_core(self, required: set[str]) -> None:
        (directory,) = self._dirs
        if not os.path.exists(os.path.join(directory, "cgroup.freeze")):
            self._dirs[directory].discard("freezer")
            self._by_feature.pop("freezer", None)
            if "freezer" in required:
                raise _NotHere("cgroup.freeze is missing (kernel older than 5.2)")

    def _apply_limits(self) -> None:
        limits = self.limits
        memory = limits.memory
        if memory is not None:
            assert isinstance(memory, int)
            directory = self._by_feature["memory"]
            if self._version == 1:
                _write(os.path.join(directory, "memory.limit_in_bytes"), str(memory))
                memsw = os.path.join(directory, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(memsw, str(memory))
                elif _swap_total() > 0:
                    _write(os.path.join(directory, "memory.swappiness"), "0")
                    self.warnings.append(
                        "swap is not accounted (no memory.memsw.*): swappiness 0 keeps the tree out of swap, "
                        "boot with swapaccount=1 to make the memory limit cover swap"
                    )
            else:
                _write(os.path.join(directory, "memory.max"), str(memory))
                swap = os.path.join(directory, "memory.swap.max")
                if os.path.exists(swap):
                    _write(swap, "0")
                elif _swap_total() > 0:
                    self.warnings.append("memory.swap.max is missing: the tree may use swap beyond the memory limit")
        pids = limits.pids
        if pids is not None:
            _write(os.path.join(self._by_feature["pids"], "pids.max"), str(pids))
        cpus = limits.cpus
        if cpus is not None:
            assert isinstance(cpus, float)
            quota = max(1000, round(cpus * _CFS_PERIOD_US))
            directory = self._by_feature["cpu"]
            if self._version == 1:
                _write(os.path.join(directory, "cpu.cfs_period_us"), str(_CFS_PERIOD_US))
                _write(os.path.join(directory, "cpu.cfs_quota_us"), str(quota))
            else:
                _write(os.path.join(directory, "cpu.max"), f"{quota} {_CFS_PERIOD_US}")

    # -- facts --

    @property
    def version(self) -> str:
        """The version: ``"cgroup-v1"`` or ``"cgroup-v2"``."""
        return f"cgroup-v{self._version}"

    @property
    def features(self) -> frozenset[str]:
        """The features this run cgroup provides."""
        return frozenset(self._by_feature)

    @property
    def directories(self) -> tuple[str, ...]:
        """The run's cgroup directories (one for v2, one per hierarchy for v1)."""
        return tuple(self._dirs)

    @property
    def dir_fd(self) -> int | None:
        """v2 only: an O_DIRECTORY fd of the run cgroup, usable for clone3(CLONE_INTO_CGROUP).

        It belongs to this object (closed by ``remove``); None on v1.
        """
        if self._version != 2 or self._removed:
            return None
        return self._locks.get(next(iter(self._dirs)))

    def enforced(self) -> dict[str, str]:
        """For the report: each tree-wide limit that is set -> "cgroup-v1"/"cgroup-v2".

        ``cpu_seconds`` is enforced by the watchdog (``start_watchdog``) reading
        the cgroup's CPU time.
        """
        out = {}
        for name in ("memory", "pids", "cpus", "cpu_seconds"):
            if getattr(self.limits, name) is not None:
                out[name] = self.version
        return out

    def pids(self) -> list[int]:
        """Every process in the run cgroup(s), in this process's pid namespace."""
        seen: set[int] = set()
        for directory in self._dirs:
            seen.update(_read_pids(directory))
        return sorted(seen)

    # -- attaching --

    def procs_fds(self) -> list[int]:
        """Write-only fds of the ``cgroup.procs`` files (one per directory), for a spawner to write a pid to.

        Writing the decimal pid to each of them is what ``attach`` does. The
        fds belong to this object (close-on-exec, closed by ``remove``).
        """
        if self._removed:
            raise ValueError(f"cgroup {self.name} has been removed")
        if not self._procs_fds:
            fds = []
            try:
                for directory in self._dirs:
                    fds.append(os.open(os.path.join(directory, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
            except OSError as exc:
                for fd in fds:
                    os.close(fd)
                raise SetupError(
                    f"cannot open {directory}/cgroup.procs: {exc.strerror}",
                    step="cgroup-attach",
                    errno=exc.errno or 0,
                    detail=directory,
                ) from None
            self._procs_fds = fds
        return list(self._procs_fds)

    def attach(self, pid: int) -> None:
        """Move process ``pid`` (and its threads) into the run cgroup(s). Raises ``SetupError``."""
        for directory in self._dirs:
            try:
                _write(os.path.join(directory, "cgroup.procs"), str(pid))
            except OSError as exc:
                raise SetupError(
                    f"cannot move process {pid} into cgroup {directory}: {exc.strerror}; "
                    "the caller needs write access to the cgroup (and, on v2, to the common ancestor)",
                    step="cgroup-attach",
                    errno=exc.errno or 0,
                    detail=directory,
                ) from None

    # -- accounting --

    def _cpu_ns(self) -> tuple[int, int, int] | None:
        """(total, user, system) CPU nanoseconds of the tree, or None without cpuacct."""
        directory = self._by_feature.get("cpuacct")
        if directory is None:
            return None
        if self._version == 2:
            stat = _parse_keyed(_read_text(os.path.join(directory, "cpu.stat")))
            return stat["usage_usec"] * 1000, stat.get("user_usec", 0) * 1000, stat.get("system_usec", 0) * 1000
        total = int(_read_text(os.path.join(directory, "cpuacct.usage")))
        try:
            user = int(_read_text(os.path.join(directory, "cpuacct.usage_user")))
            system = int(_read_text(os.path.join(directory, "cpuacct.usage_sys")))
        except FileNotFoundError:  # old kernels: split the precise total by the tick counts
            ticks = _parse_keyed(_read_text(os.path.join(directory, "cpuacct.stat")))
            both = ticks.get("user", 0) + ticks.get("system", 0)
            user = total * ticks.get("user", 0) // both if both else total
            system = total - user
        return total, user, system

    def cpu_seconds(self) -> float | None:
        """CPU seconds the whole tree used so far (None without CPU accounting)."""
        ns = self._cpu_ns()
        return None if ns is None else ns[0] / 1e9

    def usage(self) -> CgroupUsage:
        """Accounting of the whole tree; after ``remove``, the last reading taken before removal."""
        if self._removed:
            if self._final_usage is None:
                raise ValueError(f"cgroup {self.name} was removed before its usage could be read")
            return self._final_usage
        ns = self._cpu_ns()
        user = system = None
        if ns is not None:
            user, system = ns[1] / 1e9, ns[2] / 1e9
        peak = None
        oom_kills = 0
        memory = self._by_feature.get("memory")
        if memory is not None:
            if self._version == 1:
                peak = int(_read_text(os.path.join(memory, "memory.max_usage_in_bytes")))
                oom_kills = _parse_keyed(_read_text(os.path.join(memory, "memory.oom_control"))).get("oom_kill", 0)
            else:
                try:
                    peak = int(_read_text(os.path.join(memory, "memory.peak")))
                except FileNotFoundError:
                    peak = None
                oom_kills = _parse_keyed(_read_text(os.path.join(memory, "memory.events"))).get("oom_kill", 0)
        pids_hit = False
        pids = self._by_feature.get("pids")
        if pids is not None:
            try:
                pids_hit = _parse_keyed(_read_text(os.path.join(pids, "pids.events"))).get("max", 0) > 0
            except FileNotFoundError:
                pids_hit = False
        return CgroupUsage(user, system, peak, oom_kills, pids_hit)

    # -- freezing and killing --

    def _freeze_raw(self, frozen: bool, timeout: float) -> bool:
        directory = self._by_feature.get("freezer")
        if directory is None:
            return False
        deadline = time.monotonic() + timeout
        if self._version == 2:
            _write(os.path.join(directory, "cgroup.freeze"), "1" if frozen else "0")
            while True:
                events = _parse_keyed(_read_text(os.path.join(directory, "cgroup.events")))
                if events.get("frozen", 0) == int(frozen) or time.monotonic() > deadline:
                    return events.get("frozen", 0) == int(frozen)
                time.sleep(0.002)
        _write(os.path.join(directory, "freezer.state"), "FROZEN" if frozen else "THAWED")
        goal = "FROZEN" if frozen else "THAWED"
        while True:
            state = _read_text(os.path.join(directory, "freezer.state")).strip()
            if state == goal or time.monotonic() > deadline:
                return state == goal
            time.sleep(0.002)

    def freeze(self, timeout: float = 5.0) -> None:
        """Stop every process of the tree (pause). Raises ``UnsupportedError`` without a freezer."""
        if "freezer" not in self._by_feature:
            raise UnsupportedError(
                "pausing needs the cgroup freezer (v1 freezer hierarchy or v2 cgroup.freeze), "
                "which this run cgroup lacks; create it with need={'freezer'}"
            )
        if not self._freeze_raw(True, timeout):
            raise SetupError(f"the tree in {self.name} did not freeze within {timeout} s", step="cgroup-freeze")

    def thaw(self, timeout: float = 5.0) -> None:
        """Resume a tree stopped by ``freeze``."""
        if "freezer" not in self._by_feature:
            raise UnsupportedError("resuming needs the cgroup freezer, which this run cgroup lacks")
        if not self._freeze_raw(False, timeout):
            raise SetupError(f"the tree in {self.name} did not thaw within {timeout} s", step="cgroup-freeze")

    def kill(self, timeout: float = 5.0) -> bool:
        """SIGKILL every process of the tree and wait until the cgroup is empty.

        v2 uses ``cgroup.kill`` where present; otherwise the tree is frozen (if
        a freezer is available), every listed pid is sent SIGKILL, the tree is
        thawed so that v1-frozen tasks can die, and this repeats until empty.
        True when the cgroup is empty at the end.
        """
        with self._kill_lock:
            deadline = time.monotonic() + timeout
            if self._removed:
                return True
            if self._version == 2:
                (directory,) = self._dirs
                kill_file = os.path.join(directory, "cgroup.kill")
                if os.path.exists(kill_file):
                    _write(kill_file, "1")
                    while time.monotonic() < deadline:
                        if not _read_pids(directory):
                            return True
                        time.sleep(0.002)
                    return not _read_pids(directory)
            while True:
                victims = self.pids()
                if not victims:
                    return True
                if time.monotonic() > deadline:
                    log.warning("processes %s of %s survived SIGKILL for %.1f s", victims, self.name, timeout)
                    return False
                frozen = self._freeze_raw(True, 0.2)
                for pid in set(victims) | set(self.pids()):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if frozen or "freezer" in self._by_feature:
                    self._freeze_raw(False, 0.2)
                settle = time.monotonic() + 0.1
                while self.pids() and time.monotonic() < settle:
                    time.sleep(0.002)

    # -- watchdog --

    def start_watchdog(
        self,
        cpu_seconds: float | None = None,
        on_limit: Callable[[str], None] | None = None,
        *,
        interval: float = 0.025,
    ) -> None:
        """Poll the tree's CPU time every ``interval`` s in a daemon thread.

        When it reaches ``cpu_seconds`` (default: ``limits.cpu_seconds``) while
        processes remain, the tree is killed, ``limit_hit`` becomes "cpu" and
        ``on_limit("cpu")`` is called from the watchdog thread. No-op when no
        CPU limit is set. The overshoot is at most about ``interval`` times the
        number of CPUs. The thread runs until ``stop_watchdog``/``remove``.
        """
        limit = cpu_seconds if cpu_seconds is not None else self.limits.cpu_seconds
        if limit is None:
            return
        assert isinstance(limit, (int, float))
        if "cpuacct" not in self._by_feature:
            raise UnsupportedError("a CPU-time limit for the tree needs CPU accounting (v1 cpuacct or v2 cpu.stat)")
        if self._watchdog is not None:
            raise RuntimeError("the watchdog of this cgroup is already running")
        limit_ns = int(float(limit) * 1e9)

        def watch() -> None:
            while not self._stop.wait(interval):
                try:
                    ns = self._cpu_ns()
                except OSError:
                    return
                if ns is not None and ns[0] >= limit_ns:
                    if not self.pids():
                        return  # the tree finished on its own before the check: nothing was cut short
                    self.limit_hit = "cpu"
                    try:
                        self.kill()
                    except OSError as exc:
                        log.warning("watchdog could not kill %s: %s", self.name, exc)
                    if on_limit is not None:
                        try:
                            on_limit("cpu")
                        except Exception:  # the callback's failure must not go unnoticed, nor kill the thread
                            log.exception("on_limit callback of %s failed", self.name)
                    return

        thread = threading.Thread(target=watch, name=f"isolate-watchdog-{self.name}", daemon=True)
        self._watchdog = thread
        thread.start()

    def stop_watchdog(self) -> None:
        """Stop polling (idempotent)."""
        self._stop.set()
        thread = self._watchdog
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    # -- removal --

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill what is left, remove the run cgroup(s) and release the locks.

        Retries ``rmdir`` while the cgroup drains. True when everything is gone;
        otherwise the leftovers are logged and swept by a later start.
        """
        self.stop_watchdog()
        with self._kill_lock:
            if self._removed:
                return True
            deadline = time.monotonic() + timeout
            left = list(self._dirs)
            if self.pids():
                self.kill(timeout)
            try:
                self._final_usage = self.usage()
            except (OSError, ValueError, KeyError) as exc:
                log.debug("could not read the usage of %s: %s", self.name, exc)
            while left:
                left = [d for d in left if not _rmdir_quiet(d)]
                if not left or time.monotonic() > deadline:
                    break
                if self.pids():
                    self.kill(max(0.1, deadline - time.monotonic()))
                time.sleep(0.005)
            self._removed = True
            for fd in [*self._locks.values(), *self._procs_fds]:
                os.close(fd)
            self._locks.clear()
            self._procs_fds.clear()
            if self._version == 1:  # v1 parents hold no state: drop them when empty (v2 ones keep subtree_control)
                for directory in self._dirs:
                    _rmdir_parent(os.path.dirname(directory))
            if left:
                log.warning("could not remove cgroup(s) %s; a later start sweeps them", left)
                return False
            return True

    def __enter__(self) -> RunCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<RunCgroup {self.version} {self.name} features={sorted(self._by_feature)}>"


def check_available(need: Iterable[str], *, version: str | None = None) -> str:
    """The version (``"cgroup-v1"``/``"cgroup-v2"``) that can provide ``need``; raises ``CgroupUnavailableError``.

    It really creates (and removes) an empty run cgroup, so the answer holds for
    this caller; on v2 that may move the caller into its leaf (see the module doc).
    """
    run = RunCgroup.create(Limits(), need=need, want=(), version=version, sweep=False)
    run.remove()
    return run.version


def _swap_total() -> int:
    try:
        for line in _read_text("/proc/meminfo").splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


#: The files of a cgroup that its delegatee must own to use it (cgroup v2's
#: delegation rules; v1 has ``tasks`` instead of ``cgroup.threads``).
_DELEGATED_FILES = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control", "tasks")


def _hand_over(path: str) -> None:
    """Give a cgroup that root just made inside another user's cgroup to that user.

    A root run inside a cgroup delegated to a user (systemd's Delegate=yes,
    User=) would otherwise leave root-owned ``isolate/`` directories there,
    after which the user's own runs cannot create their cgroups in them.
    """
    if os.geteuid() != 0:
        return
    try:
        owner = os.stat(os.path.dirname(path))
    except OSError:
        return
    if owner.st_uid == 0:
        return
    for name in ("", *_DELEGATED_FILES):
        try:
            os.chown(os.path.join(path, name) if name else path, owner.st_uid, owner.st_gid, follow_symlinks=False)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not hand %s over to uid %d: %s", path, owner.st_uid, exc)


def _mkdir_cgroup(path: str) -> None:
    os.mkdir(path)
    _hand_over(path)


def _ensure_dir(path: str) -> None:
    try:
        _mkdir_cgroup(path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _NotHere(_why(exc, f"create {path}")) from None


# -- cgroup v2 preparation -----------------------------------------------------------


def _v2_base(hier: Hierarchy) -> str:
    assert hier.directory is not None
    directory = hier.directory
    if os.path.basename(directory) == LEAF_NAME and hier.cgroup_path != "/":
        directory = os.path.dirname(directory)  # we moved ourselves into our leaf earlier
    return directory


def _is_v2_root(directory: str) -> bool:
    return not os.path.exists(os.path.join(directory, "cgroup.type"))


def _v2_delegated(directory: str) -> bool:
    """True when ``directory`` is ours to reorganise."""
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(directory, name) == b"1":
                return True
        except OSError:
            pass
    try:
        if os.geteuid() != 0 and os.stat(os.path.join(directory, "cgroup.procs")).st_uid == os.geteuid():
            return True
    except OSError:
        return False
    return set(_read_pids(directory)) <= {os.getpid()}


def _v2_enable(directory: str, controllers: set[str]) -> None:
    current = set(_read_text(os.path.join(directory, "cgroup.subtree_control")).split())
    todo = controllers - current
    if todo:
        _write(os.path.join(directory, "cgroup.subtree_control"), " ".join(f"+{c}" for c in sorted(todo)))


def _v2_move_to_leaf(base: str) -> None:
    leaf = os.path.join(base, LEAF_NAME)
    try:
        _mkdir_cgroup(leaf)
    except FileExistsError:
        pass
    for _ in range(20):
        pids = _read_pids(base)
        if not pids:
            return
        for pid in pids:
            try:
                _write(os.path.join(leaf, "cgroup.procs"), str(pid))
            except ProcessLookupError:
                pass


def _v2_prepare(hier: Hierarchy, required: set[str], wanted: set[str]) -> tuple[str, set[str], dict[str, str]]:
    """(parent directory, enabled controllers, skipped features) for v2 run cgroups."""
    base = _v2_base(hier)
    skipped: dict[str, str] = {}
    req_ctrl = {_V2_CONTROLLER[f] for f in required if f in _V2_CONTROLLER}
    want_ctrl = {_V2_CONTROLLER[f] for f in wanted if f in _V2_CONTROLLER}
    try:
        available = set(_read_text(os.path.join(base, "cgroup.controllers")).split())
    except OSError as exc:
        raise _NotHere(_why(exc, f"read {base}/cgroup.controllers")) from None
    missing = req_ctrl - available
    if missing:
        raise _NotHere(
            f"controller(s) {', '.join(sorted(missing))} not available to {base} "
            f"(its cgroup.controllers lists: {' '.join(sorted(available)) or 'none'})"
        )
    for c in sorted(want_ctrl - available):
        skipped[c] = f"not available in {base}"
    ctrl = (req_ctrl | want_ctrl) & available

    def enable_in_base(controllers: set[str]) -> str:
        if not controllers:
            return base
        try:
            _v2_enable(base, controllers)
            return base
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise _NotHere(_why(exc, f"enable {' '.join(sorted(controllers))} in {base}")) from None
        # "no internal processes": the own cgroup holds processes, so they go to a leaf first
        if not _is_v2_root(base) and _v2_delegated(base):
            try:
                _v2_move_to_leaf(base)
                _v2_enable(base, controllers)
                return base
            except OSError as exc:
                raise _NotHere(_why(exc, f"move the processes of {base} into {LEAF_NAME}")) from None
        top = hier.root_directory()
        if os.geteuid() == 0 and top is not None and _is_v2_root(top):
            try:
                _v2_enable(top, controllers)
            except OSError as exc:
                raise _NotHere(_why(exc, f"enable {' '.join(sorted(controllers))} in {top}")) from None
            return top
        raise _NotHere(
            f"{base} holds other processes and is not delegated to this user, so controllers cannot be enabled below it"
        )

    try:
        home = enable_in_base(ctrl)
    except _NotHere as exc:
        if req_ctrl:
            home = enable_in_base(req_ctrl)
        else:
            home = base
        for c in sorted(ctrl - req_ctrl):
            skipped[c] = str(exc)
        ctrl = set(req_ctrl)
    parent = os.path.join(home, PARENT_NAME)
    _ensure_dir(parent)
    try:
        _v2_enable(parent, ctrl)
    except OSError as exc:
        if req_ctrl:
            raise _NotHere(_why(exc, f"enable {' '.join(sorted(ctrl))} in {parent}")) from None
        for c in sorted(ctrl):
            skipped[c] = _why(exc, f"enable {c} in {parent}")
        ctrl = set()
    return parent, ctrl, skipped


# -- sweeping ---------------------------------------------------------------------


def _parent_dirs(hierarchies: Iterable[Hierarchy]) -> dict[str, int]:
    out: dict[str, int] = {}
    for hier in hierarchies:
        if hier.directory is None:
            continue
        if hier.version == 1:
            if hier.controllers & FEATURES:
                out[os.path.join(hier.directory, PARENT_NAME)] = 1
            continue
        out[os.path.join(_v2_base(hier), PARENT_NAME)] = 2
        top = hier.root_directory()
        if top is not None and os.geteuid() == 0:
            out[os.path.join(top, PARENT_NAME)] = 2
    return out


def sweep_stale(hierarchies: Iterable[Hierarchy] | None = None) -> int:
    """Remove isolate's own stale run cgroups; the number removed.

    A directory is removed only when its name is ``isolate-<pid>-<n>``, it sits
    in an ``isolate`` parent of the caller's cgroups, process ``<pid>`` no
    longer exists, no one holds its lock, and no process is in it.
    """
    removed = 0
    for parent, version in _parent_dirs(hierarchies if hierarchies is not None else discover()).items():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            match = RUN_NAME.match(name)
            if match is None or _pid_alive(int(match.group(1))):
                continue
            path = os.path.join(parent, name)
            try:
                fd = _lock_dir(path, blocking=False)
            except OSError:
                continue
            if fd is None:
                continue
            try:
                if not _read_pids(path) and _rmdir_quiet(path):
                    removed += 1
                    log.debug("removed stale cgroup %s", path)
            finally:
                os.close(fd)
        if version == 1:
            _rmdir_parent(parent)
    return removed


# -- doctor -------------------------------------------------------------------------


def _probe(parent: str) -> str | None:
    """None when a run cgroup can be created in ``parent``, else why not."""
    created_parent = False
    try:
        if not os.path.isdir(parent):
            os.mkdir(parent)
            created_parent = True
        with _counter_lock:
            path = os.path.join(parent, f"isolate-{os.getpid()}-{next(_counter)}")
        os.mkdir(path)
        os.rmdir(path)
        return None
    except OSError as exc:
        return _why(exc, f"create a cgroup in {parent}")
    finally:
        if created_parent:
            _rmdir_quiet(parent)


def doctor_info() -> dict[str, object]:
    """What this caller can get from cgroups, for ``isolate-run doctor``.

    Keys: ``versions`` (mounted), ``hierarchies`` (one dict each: version,
    name, mount, own_cgroup, directory, parent, writable, delegated, why,
    note), ``features`` (feature -> {"available", "version", "path", "why"},
    from the version ``create`` would use where possible), ``selected`` (the
    version ``RunCgroup.create`` picks for memory+pids+cpu, or None) and
    ``hint`` (how to delegate a cgroup, when a feature is missing).
    Writability is probed by creating and removing one run-named directory.
    """
    hierarchies = discover()
    versions = sorted({h.label for h in hierarchies if h.mountpoint})
    rows: list[dict[str, object]] = []
    sources: dict[str, dict[str, dict[str, object]]] = {"cgroup-v1": {}, "cgroup-v2": {}}
    for hier in hierarchies:
        if hier.version == 1 and not hier.controllers & FEATURES:
            continue
        row: dict[str, object] = {
            "version": hier.label,
            "name": hier.name,
            "mount": hier.mountpoint,
            "own_cgroup": hier.cgroup_path,
            "directory": hier.directory,
            "parent": None,
            "delegated": None,
            "note": None,
        }
        why = hier.problem
        provides: set[str] = set(hier.controllers & FEATURES) if hier.version == 1 else {"cpuacct", "freezer"}
        if hier.directory is not None and hier.version == 1:
            row["parent"] = os.path.join(hier.directory, PARENT_NAME)
            why = _probe(os.path.join(hier.directory, PARENT_NAME))
        elif hier.directory is not None:
            base = _v2_base(hier)
            try:
                available = set(_read_text(os.path.join(base, "cgroup.controllers")).split())
            except OSError as exc:
                available = set()
                why = _why(exc, f"read {base}/cgroup.controllers")
            is_root = _is_v2_root(base)
            delegated = None if is_root else _v2_delegated(base)
            row["controllers"] = sorted(available)
            row["delegated"] = delegated
            home = base
            if not is_root and not delegated and available & set(_V2_CONTROLLER.values()):
                top = hier.root_directory()
                if os.geteuid() == 0 and top is not None:
                    home = top
                    row["note"] = f"{base} is not delegated: run cgroups with controllers go under {top}"
                else:
                    row["note"] = f"{base} is not delegated: no controller can be enabled below it"
                    available = set()
            row["parent"] = os.path.join(home, PARENT_NAME)
            why = why or _probe(os.path.join(home, PARENT_NAME))
            provides |= {f for f, c in _V2_CONTROLLER.items() if c in available}
        row["writable"] = why is None
        row["why"] = why
        rows.append(row)
        for feature in sorted(provides):
            known = sources[hier.label].get(feature)
            if known is None or (not known["available"] and why is None):
                sources[hier.label][feature] = {
                    "available": why is None,
                    "version": hier.label,
                    "path": row["parent"],
                    "why": why,
                }
    has_v1 = any(r["version"] == "cgroup-v1" for r in rows)
    order = ("cgroup-v1", "cgroup-v2") if has_v1 else ("cgroup-v2",)
    selected = None
    for label in order:
        if all(sources[label].get(f, {}).get("available") for f in ("memory", "pids", "cpu")):
            selected = label
            break
    features: dict[str, dict[str, object]] = {}
    for feature in sorted(FEATURES):
        candidates = [sources[label][feature] for label in order if feature in sources[label]]
        if selected and feature in sources[selected] and sources[selected][feature]["available"]:
            features[feature] = sources[selected][feature]
        elif any(c["available"] for c in candidates):
            features[feature] = next(c for c in candidates if c["available"])
        elif candidates:
            features[feature] = candidates[0]
        else:
            features[feature] = {"available": False, "version": None, "path": None, "why": "no hierarchy provides it"}
    missing = [f for f, info in features.items() if not info["available"]]
    return {
        "versions": versions,
        "hierarchies": rows,
        "features": features,
        "selected": selected,
        "hint": delegation_hint(hierarchies, missing) if missing else None,
    }
