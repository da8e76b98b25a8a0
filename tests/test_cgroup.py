"""Tests of isolate.kernel.cgroup against the real kernel.

The root-only tests need a writable cgroup v1 (memory, pids, cpu, cpuacct,
freezer) or the cgroup2 hierarchy; each skips with the reason when this host or
user does not have it. Every test removes what it creates, and the module ends
by checking that no cgroup of this process is left anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

import isolate
from isolate.kernel import cgroup as cg_mod
from isolate.kernel.cgroup import (
    CgroupUnavailableError,
    CgroupUsage,
    RunCgroup,
    find_hierarchies,
    parse_mountinfo,
    parse_proc_cgroup,
    required_features,
    sweep_stale,
)
from isolate.model.errors import UnsupportedError
from isolate.model.policy import Limits

IS_ROOT = os.geteuid() == 0
ALL = {"memory", "pids", "cpu", "cpuacct", "freezer"}


# -- helpers --------------------------------------------------------------------


def _own_leftovers() -> list[str]:
    """Run cgroups named after this process that still exist, in every hierarchy."""
    prefix = f"isolate-{os.getpid()}-"
    found = []
    for parent in cg_mod._parent_dirs(cg_mod.discover()):
        try:
            found += [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)]
        except OSError:
            pass
    return found


@pytest.fixture(scope="module", autouse=True)
def no_cgroup_left() -> Iterator[None]:
    yield
    assert _own_leftovers() == []


def _try_create(**kwargs: object) -> RunCgroup | None:
    try:
        return RunCgroup.create(**kwargs)  # type: ignore[arg-type]
    except UnsupportedError:
        return None


def _v1_usable() -> str | None:
    """None when this caller can create v1 run cgroups with every feature, else why not."""
    try:
        run = RunCgroup.create(Limits(), need=ALL, version="cgroup-v1")
    except UnsupportedError as exc:
        return f"needs root or a delegated cgroup v1 with {sorted(ALL)}; uid {os.geteuid()} has none: {exc}"
    run.remove()
    return None


def _v2_usable() -> str | None:
    try:
        run = RunCgroup.create(Limits(), need={"freezer"}, version="cgroup-v2")
    except UnsupportedError as exc:
        return f"needs root or a delegated cgroup2 with cgroup.freeze; uid {os.geteuid()} has none: {exc}"
    run.remove()
    return None


V1_WHY = _v1_usable()
V2_WHY = _v2_usable()
needs_v1 = pytest.mark.skipif(V1_WHY is not None, reason=V1_WHY or "")
needs_v2 = pytest.mark.skipif(V2_WHY is not None, reason=V2_WHY or "")


def _v2_controllers() -> set[str]:
    for hier in cg_mod.discover():
        if hier.version == 2 and hier.directory:
            try:
                return set(open(os.path.join(cg_mod._v2_base(hier), "cgroup.controllers")).read().split())
            except OSError:
                return set()
    return set()


def spawn_attached(run: RunCgroup, code: str, **kwargs: object) -> subprocess.Popen[str]:
    """A Python child held on a pipe until it has been attached to ``run`` (as the native spawn does)."""
    gate = "import sys\nsys.stdin.readline()\n"
    proc: subprocess.Popen[str] = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", gate + textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        text=True,
        **kwargs,  # type: ignore[call-overload]
    )
    try:
        run.attach(proc.pid)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.close()
    proc.stdin = None
    return proc


@pytest.fixture
def runs() -> Iterator[list[RunCgroup]]:
    """Collects run cgroups and removes them after the test, whatever happened."""
    made: list[RunCgroup] = []
    yield made
    for run in made:
        run.remove()
        assert not any(os.path.exists(d) for d in run.directories)


BUSY = """
import os
for _ in range({n} - 1):
    if os.fork() == 0:
        break
while True:
    pass
"""


# -- parsers (no privilege needed) ---------------------------------------------------

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
50 23 0:40 / /mnt/with\\040space rw - ext4 /dev/sda1 rw
"""
HYBRID_CGROUP = """\
9:name=systemd:/user.slice/user-1000.slice/session-2.scope
8:pids:/user.slice/user-1000.slice/session-2.scope
4:memory:/user.slice/user-1000.slice/session-2.scope
2:cpu,cpuacct:/user.slice
0::/user.slice/user-1000.slice/session-2.scope
"""


def test_parse_mountinfo_fields_and_escapes() -> None:
    mounts = parse_mountinfo(HYBRID_MOUNTINFO + "garbage line\n")
    assert len(mounts) == 7
    cpu = mounts[1]
    assert cpu.fstype == "cgroup" and cpu.mountpoint == "/sys/fs/cgroup/cpu,cpuacct"
    assert {"cpu", "cpuacct"} <= cpu.super_options and cpu.root == "/"
    assert mounts[5].fstype == "cgroup2"
    assert mounts[6].mountpoint == "/mnt/with space"


def test_parse_proc_cgroup() -> None:
    lines = parse_proc_cgroup(HYBRID_CGROUP + "0::/odd:path\nnonsense\n")
    assert [line.hierarchy_id for line in lines] == [9, 8, 4, 2, 0, 0]
    assert lines[3].controllers == {"cpu", "cpuacct"}
    assert lines[4].controllers == frozenset() and lines[4].path.endswith("session-2.scope")
    assert lines[5].path == "/odd:path"


def test_find_hierarchies_hybrid() -> None:
    hiers = {h.name: h for h in find_hierarchies(HYBRID_CGROUP, HYBRID_MOUNTINFO)}
    assert hiers["cpu,cpuacct"].directory == "/sys/fs/cgroup/cpu,cpuacct/user.slice"
    assert hiers["cpu,cpuacct"].controllers == {"cpu", "cpuacct"}
    assert hiers["memory"].directory == "/sys/fs/cgroup/memory/user.slice/user-1000.slice/session-2.scope"
    assert hiers["unified"].version == 2
    assert hiers["unified"].directory == "/sys/fs/cgroup/unified/user.slice/user-1000.slice/session-2.scope"
    assert all(h.problem is None for h in hiers.values())


def test_find_hierarchies_pure_v2_and_container_roots() -> None:
    mountinfo = (
        "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        "60 23 0:50 /docker/abc /mnt/cg rw - cgroup cgroup rw,memory\n"
    )
    proc = "0::/system.slice/app.service\n4:memory:/other\n3:pids:/x\n"
    hiers = {h.name: h for h in find_hierarchies(proc, mountinfo)}
    assert hiers["unified"].directory == "/sys/fs/cgroup/system.slice/app.service"
    assert hiers["unified"].root_directory() == "/sys/fs/cgroup"
    # the memory mount shows another subtree: the own cgroup is not reachable through it
    assert hiers["memory"].directory is None and "outside every mount" in (hiers["memory"].problem or "")
    assert hiers["pids"].directory is None and "not mounted" in (hiers["pids"].problem or "")
    # a mount of the own subtree (cgroup namespace or bind mount) maps paths below its root
    hiers = {h.name: h for h in find_hierarchies("4:memory:/docker/abc/sub\n", mountinfo)}
    assert hiers["memory"].directory == "/mnt/cg/sub"


def test_find_hierarchies_on_this_host() -> None:
    hiers = cg_mod.discover()
    for hier in hiers:
        if hier.directory is not None:
            assert os.path.isdir(hier.directory), hier


def test_required_features_and_usage() -> None:
    assert required_features(Limits()) == set()
    assert required_features(Limits(memory="1G", pids=3, cpus=1.5, cpu_seconds=2, open_files=16)) == {
        "memory",
        "pids",
        "cpu",
        "cpuacct",
    }
    assert CgroupUsage(1.0, 0.5, None, 0, False).cpu_seconds == 1.5
    assert CgroupUsage(None, None, None, 0, False).cpu_seconds is None
    with pytest.raises(ValueError, match="unknown cgroup features"):
        RunCgroup.create(Limits(), need={"blkio"})


def test_delegation_hint_names_the_way_out() -> None:
    v2 = find_hierarchies("0::/user.slice/x.scope\n", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    assert "systemd-run --user --scope -p Delegate=yes" in cg_mod.delegation_hint(v2)
    v1 = find_hierarchies(HYBRID_CGROUP, HYBRID_MOUNTINFO)
    hint = cg_mod.delegation_hint(v1, {"memory"})
    assert "chown" in hint and "/sys/fs/cgroup/memory/user.slice/user-1000.slice/session-2.scope/isolate" in hint


def test_doctor_info_shape() -> None:
    info = cg_mod.doctor_info()
    assert set(info) == {"versions", "hierarchies", "features", "selected", "hint"}
    features = info["features"]
    assert isinstance(features, dict) and set(features) == ALL
    for entry in features.values():
        assert entry["available"] or entry["why"]
    if V1_WHY is None:
        assert info["selected"] == "cgroup-v1"
    assert _own_leftovers() == []


# -- unprivileged -----------------------------------------------------------------------


@pytest.mark.skipif(IS_ROOT, reason="root may write every cgroup here; this checks the unprivileged refusal")
def test_unprivileged_create_refuses_with_delegation_hint() -> None:
    if cg_mod.doctor_info()["features"]["memory"]["available"]:  # type: ignore[index]
        pytest.skip("this user has a delegated cgroup with the memory controller")
    with pytest.raises(CgroupUnavailableError):
        cg_mod.check_available({"memory"})
    with pytest.raises(CgroupUnavailableError) as info:
        RunCgroup.create(Limits(memory="64M"))
    message = str(info.value)
    assert isinstance(info.value, UnsupportedError)
    assert "memory" in message and "way out" in message
    assert "systemd-run --user --scope -p Delegate=yes" in message or "chown" in message
    assert info.value.reasons and info.value.hint in message


# -- cgroup v1, real kernel -------------------------------------------------------------------


@needs_v1
def test_v1_create_attach_and_remove(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(memory="64M", pids=16, cpus=1.5, cpu_seconds=3), version="cgroup-v1")
    runs.append(run)
    assert run.version == "cgroup-v1"
    assert run.enforced() == {
        "memory": "cgroup-v1",
        "pids": "cgroup-v1",
        "cpus": "cgroup-v1",
        "cpu_seconds": "cgroup-v1",
    }
    assert run.features == ALL and run.dir_fd is None
    for directory in run.directories:
        assert os.path.basename(directory) == run.name and os.path.basename(os.path.dirname(directory)) == "isolate"
    by = run._by_feature
    assert open(os.path.join(by["memory"], "memory.limit_in_bytes")).read().strip() == str(64 << 20)
    memsw = os.path.join(by["memory"], "memory.memsw.limit_in_bytes")
    if os.path.exists(memsw):
        assert open(memsw).read().strip() == str(64 << 20)
    assert open(os.path.join(by["pids"], "pids.max")).read().strip() == "16"
    assert open(os.path.join(by["cpu"], "cpu.cfs_quota_us")).read().strip() == "150000"
    assert open(os.path.join(by["cpu"], "cpu.cfs_period_us")).read().strip() == "100000"

    proc = spawn_attached(run, "import time\ntime.sleep(30)\n")
    try:
        assert run.pids() == [proc.pid]
        own = open(f"/proc/{proc.pid}/cgroup").read()
        assert own.count(f"/isolate/{run.name}\n") == len(run.directories)
    finally:
        assert run.kill()
        assert proc.wait(timeout=10) == -9
    assert run.remove()
    assert not any(os.path.exists(d) for d in run.directories)
    assert run.remove()  # idempotent


@needs_v1
def test_v1_procs_fds_attach_and_check_available(runs: list[RunCgroup]) -> None:
    assert cg_mod.check_available({"memory", "pids", "cpu"}) == "cgroup-v1"
    run = RunCgroup.create(Limits(pids=8), version="cgroup-v1")
    runs.append(run)
    fds = run.procs_fds()
    assert len(fds) == len(run.directories) and run.procs_fds() == fds
    proc = subprocess.Popen(["sleep", "30"])
    try:
        for fd in fds:  # what the C spawner does with them
            os.write(fd, str(proc.pid).encode())
        assert run.pids() == [proc.pid]
    finally:
        assert run.remove()
    assert proc.wait(timeout=10) == -9
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


@needs_v1
def test_v1_memory_limit_oom_kills_the_tree(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(memory="64M"), version="cgroup-v1")
    runs.append(run)
    # the allocation happens in a grandchild: the limit covers the tree
    proc = spawn_attached(
        run,
        """
        import os, subprocess, sys
        child = subprocess.run([sys.executable, "-I", "-S", "-c", "b = bytearray(512 << 20); print('survived')"])
        sys.exit(0 if child.returncode == -9 else 3)
        """,
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=60)
    assert "survived" not in out
    assert proc.returncode == 0, "the 512 MiB grandchild should have died of SIGKILL"
    usage = run.usage()
    assert usage.oom_kills >= 1
    assert usage.peak_memory_bytes is not None and usage.peak_memory_bytes <= (64 << 20) + (1 << 20)
    assert usage.peak_memory_bytes > 32 << 20
    assert run.remove()
    assert run.usage() == usage  # kept from just before removal


@needs_v1
def test_v1_pids_limit_contains_a_fork_loop(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(pids=16), version="cgroup-v1")
    runs.append(run)
    # at most 100 forks; the children sleep 20 s at most, and are killed long before
    proc = spawn_attached(
        run,
        """
        import os, time
        made = failed = 0
        for _ in range(100):
            try:
                pid = os.fork()
            except OSError:
                failed += 1
                continue
            if pid == 0:
                os.close(1)
                time.sleep(20)
                os._exit(0)
            made += 1
        print(made, failed, flush=True)
        """,
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=60)
    made, failed = map(int, out.split())
    assert made <= 15 and failed >= 85, (made, failed)
    assert run.usage().pids_max_hit
    assert len(run.pids()) == made  # the orphans are still in the cgroup
    assert run.kill()
    assert run.pids() == []


def _cpu_reaches(run: RunCgroup, seconds: float, deadline: float = 60.0) -> float:
    """Wait until the tree has used ``seconds`` more CPU than now (the kernel's accounting, whatever the
    load); the amount used. Fails after ``deadline`` s of wall clock, which only a stopped tree reaches."""
    start = run.cpu_seconds()
    assert start is not None
    until = time.monotonic() + deadline
    while (used := run.cpu_seconds() - start) < seconds:  # type: ignore[operator]
        assert time.monotonic() < until, f"the tree used {used:.3f} s of CPU in {deadline} s"
        time.sleep(0.01)
    return used


@needs_v1
def test_v1_cpus_quota_holds(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(cpus=0.5), version="cgroup-v1")
    runs.append(run)
    assert run.features >= {"cpu", "cpuacct"}
    cpu_dir = next(d for d in run.directories if os.path.exists(os.path.join(d, "cpu.cfs_quota_us")))
    quota_us = int(open(os.path.join(cpu_dir, "cpu.cfs_quota_us")).read())
    period_us = int(open(os.path.join(cpu_dir, "cpu.cfs_period_us")).read())
    assert quota_us == period_us // 2
    proc = spawn_attached(run, BUSY.format(n=2))
    try:
        _cpu_reaches(run, 0.3)
        # Throttled once the tree wanted more than its quota in some period, and run for ten periods so
        # that the bound below is about the quota, not the edges; on a host so loaded that two busy
        # processes get less than half a CPU between them, that takes longer (never past 60 s).
        until = time.monotonic() + 60
        while True:
            # Usage first, then the periods: the periods read cover at least the usage read.
            used_us = run.cpu_seconds() * 1e6  # type: ignore[operator]
            stat = cg_mod._parse_keyed(open(os.path.join(cpu_dir, "cpu.stat")).read())
            if (stat["nr_throttled"] > 0 and stat["nr_periods"] >= 10) or time.monotonic() > until:
                break
            time.sleep(0.05)
    finally:
        run.kill()
        proc.wait(timeout=10)
    # The kernel's own accounting: two busy processes would use two CPUs (four quotas a period); the
    # quota throttled them and over the periods they ran they had about one quota each. The slack is
    # the usage from before the first counted period (the tree ran 0.3 s before this loop, some of it
    # before the quota's timer first armed) and the per-CPU runtime slices the scheduler hands out
    # ahead of the accounting: CI measured 305 ms in 5 periods of a 50 ms quota.
    assert stat["nr_throttled"] > 0, stat
    assert used_us <= (stat["nr_periods"] + 2) * quota_us * 1.25, (used_us, stat)


def _watchdog_case(run: RunCgroup, limit: float) -> None:
    fired: list[str] = []
    done = threading.Event()

    def on_limit(which: str) -> None:
        fired.append(which)
        done.set()

    # How late a thread of this process wakes up from a 25 ms wait while the tree burns CPU: the
    # watchdog polls the same way, so its overshoot margin is derived from this run, not guessed.
    lateness: list[float] = [0.0]

    def sample() -> None:
        while not done.is_set():
            asked = time.monotonic()
            done.wait(0.025)
            lateness[0] = max(lateness[0], time.monotonic() - asked - 0.025)

    proc = spawn_attached(run, BUSY.format(n=4))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    run.start_watchdog(limit, on_limit)
    try:
        assert proc.wait(timeout=60) == -9
        assert done.wait(10)
    finally:
        run.kill()
        done.set()
        sampler.join(5)
    assert fired == ["cpu"] and run.limit_hit == "cpu"
    assert run.pids() == []
    used = run.cpu_seconds()
    # Killed at the limit (never before it), and no later than the tree's CPUs could burn in one poll
    # interval plus the worst wake-up delay this run saw.
    margin = (os.cpu_count() or 1) * (0.025 + lateness[0]) + 0.1
    assert used is not None and limit <= used < limit + margin, (used, margin)


@needs_v1
def test_v1_watchdog_kills_tree_at_cpu_seconds(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(cpu_seconds=1), version="cgroup-v1")
    runs.append(run)
    _watchdog_case(run, 1.0)


@needs_v1
def test_v1_freeze_stops_cpu_and_thaw_resumes(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(), need={"freezer", "cpuacct"}, version="cgroup-v1")
    runs.append(run)
    proc = spawn_attached(run, BUSY.format(n=2))
    try:
        _cpu_reaches(run, 0.05)
        run.freeze()
        frozen_at = run.cpu_seconds()
        time.sleep(0.5)
        assert run.cpu_seconds() - frozen_at < 0.02  # type: ignore[operator]
        assert proc.poll() is None
        run.thaw()
        _cpu_reaches(run, 0.05)
        # kill works on a frozen tree too
        run.freeze()
        assert run.kill()
    finally:
        run.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -9 and run.pids() == []


@needs_v1
def test_v1_kill_empties_a_forking_tree(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(pids=200), version="cgroup-v1")
    runs.append(run)
    # a tree that keeps forking short-lived children while we kill it
    proc = spawn_attached(
        run,
        """
        import os, time
        deadline = time.monotonic() + 20
        for _ in range(8):
            if os.fork() == 0:
                break
        while time.monotonic() < deadline:
            try:
                pid = os.fork()
            except OSError:
                time.sleep(0.01)
                continue
            if pid == 0:
                time.sleep(0.05)
                os._exit(0)
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pass
        """,
    )
    deadline = time.monotonic() + 30
    while len(run.pids()) < 9:  # the first nine are up, whatever the load
        assert time.monotonic() < deadline, run.pids()
        time.sleep(0.01)
    assert run.kill()
    assert run.pids() == []
    assert proc.wait(timeout=10) == -9
    assert run.remove()


@needs_v1
def test_sweep_removes_only_stale_isolate_cgroups(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(pids=8), version="cgroup-v1", sweep=False)
    runs.append(run)
    parent = os.path.dirname(run._by_feature["pids"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    dead_pid = dead.pid
    live = subprocess.Popen(["sleep", "30"])
    stale = os.path.join(parent, f"isolate-{dead_pid}-7")
    busy = os.path.join(parent, f"isolate-{dead_pid}-8")
    locked = os.path.join(parent, f"isolate-{dead_pid}-9")
    alive_owner = os.path.join(parent, f"isolate-{live.pid}-0")
    foreign = os.path.join(parent, f"someone-else-{os.getpid()}")
    foreign2 = os.path.join(parent, f"isolate-{dead_pid}")
    made = [stale, busy, locked, alive_owner, foreign, foreign2]
    for path in made:
        os.mkdir(path)
    lock_fd = cg_mod._lock_dir(locked, blocking=True)
    occupant = subprocess.Popen(["sleep", "30"])
    try:
        with open(os.path.join(busy, "cgroup.procs"), "w") as handle:
            handle.write(str(occupant.pid))
        sweep_stale()  # (a concurrent test run's sweep may have taken the stale one first)
        assert not os.path.exists(stale)
        for path in (busy, locked, alive_owner, foreign, foreign2, run._by_feature["pids"]):
            assert os.path.isdir(path), path
    finally:
        occupant.kill()
        occupant.wait()
        live.kill()
        live.wait()
        if lock_fd is not None:
            os.close(lock_fd)
        for path in made:
            deadline = time.monotonic() + 5
            while os.path.exists(path) and time.monotonic() < deadline:
                cg_mod._rmdir_quiet(path)
                time.sleep(0.01)
    assert not any(os.path.exists(p) for p in made)


@needs_v1
def test_sweep_counts_exactly_in_a_private_parent(runs: list[RunCgroup]) -> None:
    """Sweeping a private parent (nested inside a run cgroup of ours) removes exactly the stale entries."""
    run = RunCgroup.create(Limits(pids=8), version="cgroup-v1", sweep=False)
    runs.append(run)
    own = run._by_feature["pids"]
    private = cg_mod.Hierarchy(1, "pids", frozenset({"pids"}), "/", "/", "/", own)
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent = os.path.join(own, "isolate")
    os.mkdir(parent)
    stale = [os.path.join(parent, f"isolate-{dead.pid}-{n}") for n in range(3)]
    keep = os.path.join(parent, f"isolate-{os.getpid()}-999999")
    for path in [*stale, keep]:
        os.mkdir(path)
    try:
        assert sweep_stale([private]) == 3
        assert [os.path.exists(p) for p in stale] == [False] * 3 and os.path.isdir(keep)
        assert sweep_stale([private]) == 0
    finally:
        for path in [*stale, keep, parent]:
            cg_mod._rmdir_quiet(path)
    assert not os.path.exists(parent)


@needs_v1
def test_sweep_after_owner_sigkill() -> None:
    """An owner killed by SIGKILL leaves its run cgroups; the next start removes them."""
    script = textwrap.dedent(
        """
        import os, sys
        sys.path.insert(0, sys.argv[1])
        from isolate.kernel.cgroup import RunCgroup
        from isolate.model.policy import Limits
        run = RunCgroup.create(Limits(memory="64M", pids=8), version="cgroup-v1")
        print("\\n".join(run.directories), flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(isolate.__file__)))
    proc = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    left = proc.stdout.split()
    assert left and all(os.path.isdir(d) for d in left)
    sweep_stale()
    assert not any(os.path.exists(d) for d in left)


# -- cgroup v2 (grouping, cgroup.kill, cgroup.freeze, cpu.stat) ---------------------------


@needs_v2
def test_v2_group_kill_and_dir_fd(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(cpu_seconds=30), version="cgroup-v2")
    runs.append(run)
    assert run.version == "cgroup-v2" and run.enforced() == {"cpu_seconds": "cgroup-v2"}
    (directory,) = run.directories
    assert os.path.basename(directory) == run.name
    fd = run.dir_fd
    assert fd is not None and os.path.samestat(os.fstat(fd), os.stat(directory))
    proc = spawn_attached(
        run, "import os, time\nfor _ in range(3):\n    os.fork()\ntime.sleep(30)\n", stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 20  # forks are slow under emulation (the VM)
        while len(run.pids()) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(run.pids()) == 8
        hierarchy = next(h for h in cg_mod.discover() if h.version == 2)
        assert hierarchy.mountpoint is not None  # /sys/fs/cgroup/unified here, /sys/fs/cgroup on v2-only hosts
        inside = "/" + os.path.relpath(directory, hierarchy.mountpoint)
        assert f"0::{inside}" in open(f"/proc/{proc.pid}/cgroup").read()
        assert os.path.exists(os.path.join(directory, "cgroup.kill"))
        assert run.kill()
        assert run.pids() == []
    finally:
        run.kill()
    assert proc.wait(timeout=10) == -9
    assert run.remove() and not os.path.exists(directory) and run.dir_fd is None


@needs_v2
def test_v2_freeze_thaw_and_cpu_stat(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(), need={"freezer", "cpuacct"}, version="cgroup-v2")
    runs.append(run)
    proc = spawn_attached(run, BUSY.format(n=2))
    try:
        _cpu_reaches(run, 0.1)
        usage = run.usage()
        assert usage.cpu_user_seconds is not None and usage.cpu_user_seconds > 0
        run.freeze()
        frozen_at = run.cpu_seconds()
        time.sleep(0.5)
        assert run.cpu_seconds() - frozen_at < 0.02  # type: ignore[operator]
        run.thaw()
        _cpu_reaches(run, 0.05)
    finally:
        run.kill()
    assert proc.wait(timeout=10) == -9


@needs_v2
def test_v2_watchdog_kills_tree_at_cpu_seconds(runs: list[RunCgroup]) -> None:
    run = RunCgroup.create(Limits(cpu_seconds=0.5), version="cgroup-v2")
    runs.append(run)
    _watchdog_case(run, 0.5)


@needs_v2
def test_v2_memory_pids_cpu_limits_or_refusal(runs: list[RunCgroup]) -> None:
    available = _v2_controllers()
    limits = Limits(memory="64M", pids=16, cpus=1.5)
    if not {"memory", "pids", "cpu"} <= available:
        with pytest.raises(CgroupUnavailableError, match="not available"):
            RunCgroup.create(limits, version="cgroup-v2")
        return
    run = RunCgroup.create(limits, version="cgroup-v2")
    runs.append(run)
    (directory,) = run.directories
    assert open(os.path.join(directory, "memory.max")).read().strip() == str(64 << 20)
    assert open(os.path.join(directory, "pids.max")).read().strip() == "16"
    assert open(os.path.join(directory, "cpu.max")).read().split() == ["150000", "100000"]
    proc = spawn_attached(run, "b = bytearray(512 << 20)\n")
    assert proc.wait(timeout=60) == -9
    assert run.usage().oom_kills >= 1


def test_v2_memory_refused_where_controller_missing() -> None:
    if "memory" in _v2_controllers() or not any(h.version == 2 for h in cg_mod.discover()):
        pytest.skip("this host's cgroup2 offers the memory controller (or has no cgroup2)")
    with pytest.raises(UnsupportedError) as info:
        RunCgroup.create(Limits(memory="64M"), version="cgroup-v2")
    assert "memory" in str(info.value) and "way out" in str(info.value)


@needs_v2
def test_v2_run_cgroups_go_under_the_callers_own_cgroup() -> None:
    """A caller in a non-root cgroup gets its run cgroups below that cgroup, not at the top."""
    top = next(h for h in cg_mod.discover() if h.version == 2).directory
    assert top is not None
    own = os.path.join(top, f"isolate-test-{os.getpid()}")  # not a run-cgroup name: sweeps leave it alone
    os.mkdir(own)
    script = textwrap.dedent(
        """
        import os, sys
        sys.stdin.readline()
        sys.path.insert(0, sys.argv[1])
        from isolate.kernel import cgroup
        from isolate.model.policy import Limits
        own = sys.argv[2]
        assert cgroup._v2_delegated(own)  # only this process is in it
        run = cgroup.RunCgroup.create(Limits(cpu_seconds=5), version="cgroup-v2")
        print(run.directories[0], flush=True)
        assert run.remove()
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(isolate.__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, root, own], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        with open(os.path.join(own, "cgroup.procs"), "w") as handle:
            handle.write(str(proc.pid))
        out, _ = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 0
        assert os.path.dirname(out.strip()) == os.path.join(own, "isolate")
        assert not os.path.exists(out.strip())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # An exited process leaves its cgroup a moment after it is reaped (rmdir: EBUSY until then).
        for _ in range(100):
            cg_mod._rmdir_quiet(os.path.join(own, "isolate"))
            cg_mod._rmdir_quiet(own)
            if not os.path.exists(own):
                break
            time.sleep(0.02)
    assert not os.path.exists(own)


@pytest.mark.skipif(not IS_ROOT, reason="checks what a root caller leaves in another user's cgroup")
def test_root_hands_its_cgroups_over_inside_another_users_cgroup() -> None:
    # A root run inside a cgroup delegated to a user must not leave root-owned
    # isolate/ directories there: the user's own runs could not use them.
    top = next((h.directory for h in cg_mod.discover() if h.directory and os.access(h.directory, os.W_OK)), None)
    if top is None:
        pytest.skip("no writable cgroup here")
    delegated = os.path.join(top, f"isolate-test-delegated-{os.getpid()}")
    made = os.path.join(delegated, "isolate")
    own = os.path.join(top, f"isolate-test-own-{os.getpid()}")
    os.mkdir(delegated)
    try:
        os.chown(delegated, 65534, 65534)
        cg_mod._ensure_dir(made)
        assert os.stat(made).st_uid == 65534
        assert os.stat(os.path.join(made, "cgroup.procs")).st_uid == 65534
        cg_mod._ensure_dir(own)  # beside it, in the caller's own cgroup: its owner's (root's unless delegated)
        assert os.stat(own).st_uid == os.stat(top).st_uid
    finally:
        for path in (own, made, delegated):
            if os.path.isdir(path):
                os.rmdir(path)



@needs_v1
def test_v1_a_value_the_kernel_refuses_is_named_not_blamed_on_the_cgroups() -> None:
    # Limits refuses both values itself now (PID_MAX_LIMIT, 8192 CPUs): set past its check, the kernel's
    # EINVAL must still name the field and the value, and leave no cgroup behind (the module checks).
    for field, value, need, needle in (("pids", 2**31 - 1, "pids", "pids.max"),
                                       ("cpus", 1e9, "cpu", "cpu.cfs_quota_us")):
        limits = Limits()
        object.__setattr__(limits, field, value)
        with pytest.raises(UnsupportedError) as info:
            RunCgroup.create(limits, need={need}, version="cgroup-v1")
        message = str(info.value)
        assert not isinstance(info.value, CgroupUnavailableError), message
        assert f"limits.{field}: the kernel refused {value}" in message and needle in message, message
