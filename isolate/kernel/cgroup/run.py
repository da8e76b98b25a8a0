"""A run's own cgroup (v1 or v2): made per run below the caller's, its limits written, its usage read,
its tree frozen and killed, removed at the end; and sweeping what killed owners left.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...model.errors import SetupError, UnsupportedError
from ...model.forks import fork_safe
from ...model.policy import Limits
from .fs import (
    CgroupUnavailableError,
    _ensure_dir,
    _lock_dir,
    _mkdir_cgroup,
    _NotHere,
    _pid_alive,
    _read_pids,
    _read_text,
    _rmdir_parent,
    _rmdir_quiet,
    _swap_total,
    _why,
    _write,
    log,
)
from .hierarchy import (
    _V2_CONTROLLER,
    DEFAULT_WANT,
    FEATURES,
    PARENT_NAME,
    RUN_NAME,
    Hierarchy,
    _parse_keyed,
    delegation_hint,
    discover,
    required_features,
)
from .v2 import _v2_base, _v2_prepare

_CFS_PERIOD_US = 100_000


_counter = itertools.count()


_counter_lock = fork_safe(threading.Lock())


_swept = False


def _write_limit(path: str, value: object, field: str, asked: object = None) -> None:
    """Write a limit; a value the kernel refuses (EINVAL, ERANGE) is named, with the policy's field,
    instead of being told as a cgroup this process cannot use (which it can: the value is at fault)."""
    try:
        _write(path, str(value))
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ERANGE, errno.EOVERFLOW):
            raise
        shown = asked if asked is not None else value
        raise UnsupportedError(f"limits.{field}: the kernel refused {shown} ({os.path.basename(path)} = {value}: "
                               f"{exc.strerror})") from None


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
                # Another run's cleanup removes the parent once it is empty: one gone between its making and
                # the check is made again (access() says no for a directory that is not there).
                for _attempt in range(10):
                    _ensure_dir(parent)
                    usable = os.access(parent, os.W_OK | os.X_OK,
                                       effective_ids=os.access in os.supports_effective_ids)
                    if usable or os.path.isdir(parent):
                        break
                if not usable:
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
            except (_NotHere, UnsupportedError):
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
                _write_limit(os.path.join(directory, "memory.limit_in_bytes"), memory, "memory")
                memsw = os.path.join(directory, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write_limit(memsw, memory, "memory")
                elif _swap_total() > 0:
                    _write(os.path.join(directory, "memory.swappiness"), "0")
                    self.warnings.append(
                        "swap is not accounted (no memory.memsw.*): swappiness 0 keeps the tree out of swap, "
                        "boot with swapaccount=1 to make the memory limit cover swap"
                    )
            else:
                _write_limit(os.path.join(directory, "memory.max"), memory, "memory")
                swap = os.path.join(directory, "memory.swap.max")
                if os.path.exists(swap):
                    _write(swap, "0")
                elif _swap_total() > 0:
                    self.warnings.append("memory.swap.max is missing: the tree may use swap beyond the memory limit")
        pids = limits.pids
        if pids is not None:
            _write_limit(os.path.join(self._by_feature["pids"], "pids.max"), pids, "pids")
        cpus = limits.cpus
        if cpus is not None:
            assert isinstance(cpus, float)
            quota = max(1000, round(cpus * _CFS_PERIOD_US))
            directory = self._by_feature["cpu"]
            if self._version == 1:
                _write(os.path.join(directory, "cpu.cfs_period_us"), str(_CFS_PERIOD_US))
                _write_limit(os.path.join(directory, "cpu.cfs_quota_us"), quota, "cpus", cpus)
            else:
                _write_limit(os.path.join(directory, "cpu.max"), f"{quota} {_CFS_PERIOD_US}", "cpus", cpus)

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
            match = RUN_NAME.fullmatch(name)
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
