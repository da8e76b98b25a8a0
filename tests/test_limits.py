"""Limits on the real kernel: rlimits per process, cgroups for the tree, the init's wall clock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import PYTHON, ROOT, policy, py, python_read

import isolate
from isolate import Limits


def cgroup_usable(*needs: str) -> bool:
    from isolate.kernel import cgroup

    try:
        cgroup.check_available(set(needs))
    except isolate.UnsupportedError:
        return False
    return True


needs_cgroup = pytest.mark.skipif(
    not cgroup_usable("memory", "pids"), reason="no writable memory/pids cgroup for this caller (unprivileged, no "
    "delegation): the refusal is tested instead"
)


def test_cpu_rlimit_stops_a_busy_loop(workdir: str) -> None:
    pol = policy(write=[workdir], limits=Limits(cpu_seconds=1))
    result = isolate.run(py("while True: pass"), policy=pol, cwd=workdir)
    assert result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    assert result.report.status == "cpu"
    # The kernel's accounting, not the wall clock (a loaded machine stretches the latter): stopped near
    # its one CPU second, not far past it. The report's figure is the program's rusage, which a loaded
    # host's tick sampling puts below the limit's own count (CI measured 0.876 s): the lower bound only
    # says the limit did not fire at start.
    assert result.report.cpu_seconds is not None and 0.5 <= result.report.cpu_seconds < 3, result.report


def test_file_size_limit(workdir: str) -> None:
    code = (
        "import os\nf = open('big', 'wb')\ntry:\n    f.write(b'x' * 4096)\n    f.flush()\n"
        "except OSError as e:\n    print('EFBIG', e.errno)\n"
    )
    pol = policy(write=[workdir], limits=Limits(file_size="1K"))
    result = isolate.run([*py("import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n" + code)],
                         policy=pol, cwd=workdir, capture_output=True, text=True)
    assert "EFBIG" in result.stdout
    assert os.path.getsize(os.path.join(workdir, "big")) <= 1024
    # A program that keeps SIGXFSZ's default action is ended by it, and the status names the limit.
    result = isolate.run(["sh", "-c", "exec head -c 4096 /dev/zero > big2"], policy=pol, cwd=workdir)
    assert result.returncode == -signal.SIGXFSZ
    assert result.report.status == "file-size"


def test_open_files_limit(workdir: str) -> None:
    code = (
        "import os\nfds = []\ntry:\n    while True: fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError as e:\n    print(len(fds), e.errno)\n"
    )
    result = isolate.run(py(code), policy=policy(write=[workdir], limits=Limits(open_files=32)), cwd=workdir,
                         capture_output=True, text=True)
    count, err = result.stdout.split()
    assert int(count) <= 32 and int(err) == 24  # EMFILE


def test_no_core_dumps(workdir: str) -> None:
    result = isolate.run(["sh", "-c", "ulimit -c"], policy=policy(write=[workdir]), cwd=workdir,
                         capture_output=True, text=True)
    assert result.stdout.strip() == "0"


def test_wall_clock_ends_the_run(workdir: str) -> None:
    started = time.monotonic()
    result = isolate.run(["sleep", "30"], policy=policy(write=[workdir], limits=Limits(wall_seconds=1)), cwd=workdir)
    assert time.monotonic() - started < 10
    assert result.report.status == "timeout"
    assert result.returncode == -signal.SIGKILL



@pytest.mark.parametrize("namespaces", [True, False])
def test_the_wall_limit_holds_whatever_the_program_kills(workdir: str, namespaces: bool) -> None:
    # The program kills or stops every process it can see (its parent, PID 1, the init) and sleeps on:
    # the wall limit still ends it, and nothing it printed after the attempt comes out.
    from isolate.kernel import landlock

    if not namespaces and landlock.abi() < 6:
        # Without a PID namespace only Landlock's scoping (ABI 6) keeps the program's signals in its own
        # domain: here it would kill every process of its uid, this test's runner included (open).
        pytest.skip(f"Landlock ABI {landlock.abi()}: no signal scoping without namespaces")
    if not namespaces and os.geteuid() == 0:
        os.chown(workdir, 65534, 65534)  # without idmapped mounts a root caller's program writes as 65534
    script = ("for p in /proc/[0-9]*; do n=${p#/proc/}; [ \"$n\" = $$ ] || kill -STOP \"$n\" 2>/dev/null; "
              "[ \"$n\" = $$ ] || kill -9 \"$n\" 2>/dev/null; done; sleep 5; echo survived")
    started = time.monotonic()
    result = isolate.run(["sh", "-c", script], policy=policy(write=[workdir], namespaces=namespaces,
                                                             limits=Limits(wall_seconds=1)),
                         cwd=workdir, capture_output=True, text=True)
    assert time.monotonic() - started < 4.5, result.report
    assert "survived" not in result.stdout, (result.stdout, result.report)
    assert result.returncode == -signal.SIGKILL and (result.report.wall_seconds or 0) < 4.5, result.report


@pytest.mark.parametrize("wall", [0.0004, 1e-9])
def test_a_wall_clock_under_the_floor_is_refused_and_the_floor_is_a_limit(workdir: str, wall: float) -> None:
    # A sub-millisecond wall clock was truncated to 0 ms, which the init reads as "no limit", while the
    # report said it was enforced; it is now refused as input (below 0.01 s nothing can start), and
    # the floor itself ends the run at once.
    with pytest.raises(isolate.PolicyError, match="wall_seconds"):
        Limits(wall_seconds=wall)
    started = time.monotonic()
    result = isolate.run(["sleep", "5"], policy=policy(write=[workdir], limits=Limits(wall_seconds=0.01)), cwd=workdir)
    assert time.monotonic() - started < 4
    assert result.report.status == "timeout"
    assert result.report.enforced["wall_seconds"] == "init"


@needs_cgroup
def test_memory_limit_kills_any_process_of_the_tree(workdir: str) -> None:
    pol = policy(write=[workdir], limits=Limits(memory="64M"))
    result = isolate.run(["sh", "-c", f"{PYTHON} -c 'b = bytearray(512 << 20)'"], policy=pol, cwd=workdir)
    assert result.returncode != 0
    assert result.report.status == "memory"
    assert result.report.oom_kills >= 1
    assert result.report.max_rss_bytes <= 64 << 20


@needs_cgroup
def test_fork_bomb_is_contained(workdir: str) -> None:
    pol = policy(write=[workdir], limits=Limits(pids=16, wall_seconds=20))
    started = time.monotonic()
    # Bounded: 200 forks whose children each live two seconds, far beyond 16 at once.
    code = ("import os, time\nmade = failed = 0\nfor i in range(200):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        failed += 1\n        continue\n    if pid == 0:\n        time.sleep(2)\n"
            "        os._exit(0)\n    made += 1\nprint(made, failed)\n")
    result = isolate.run(py(code), policy=pol, cwd=workdir, capture_output=True, text=True)
    assert time.monotonic() - started < 20
    made, failed = map(int, result.stdout.split())
    assert made < 16 and failed > 0


@pytest.mark.skipif(not cgroup_usable("cpuacct"), reason="no writable cpuacct cgroup for this caller")
def test_cpu_limit_covers_the_whole_tree(workdir: str) -> None:
    pol = policy(write=[workdir], limits=Limits(cpu_seconds=1))
    result = isolate.run(["sh", "-c", "for i in 1 2 3 4; do (while :; do :; done) & done; wait"], policy=pol,
                         cwd=workdir)
    assert result.report.status == "cpu"
    # Four busy processes under a per-process limit of 1 s would use at least 4 CPU seconds; the
    # tree's limit stopped them all at 1 s of the whole tree (the kernel's accounting, whatever the load).
    # The watchdog reads the tree's total (cpuacct.usage); the report gives user + system, which cgroup v1
    # splits from tick counts: the two may differ by a few ticks either way (0.98 s seen at a 1 s limit).
    assert result.report.cpu_seconds is not None and 0.9 <= result.report.cpu_seconds < 3.5, result.report
    assert result.report.enforced["cpu_seconds"].startswith("cgroup")


@pytest.mark.skipif(cgroup_usable("memory"), reason="this caller has a writable memory cgroup")
def test_memory_limit_without_cgroup_is_refused(workdir: str) -> None:
    marker = os.path.join(workdir, "ran")
    with pytest.raises(isolate.UnsupportedError) as info:
        isolate.run(["touch", marker], policy=policy(write=[workdir], limits=Limits(memory="64M")), cwd=workdir)
    assert "cgroup" in str(info.value)
    assert not os.path.exists(marker)


@pytest.mark.skipif(cgroup_usable("memory"), reason="this caller has a writable memory cgroup")
def test_best_effort_memory_falls_back_to_rlimit_as(workdir: str) -> None:
    pol = policy(write=[workdir], limits=Limits(memory="256M"), best_effort=True)
    result = isolate.run(["true"], policy=pol, cwd=workdir)
    assert result.returncode == 0
    assert result.report.enforced["memory"].startswith("rlimit-as")
    assert any("not enforced" in w for w in result.report.warnings)


def _grows(path: str, past: int, deadline: float = 30.0) -> None:
    """Wait until the file at ``path`` is larger than ``past`` bytes (a running writer), or fail."""
    until = time.monotonic() + deadline
    while not os.path.exists(path) or os.path.getsize(path) <= past:
        assert time.monotonic() < until, f"{path} did not grow past {past} bytes in {deadline} s"
        time.sleep(0.01)


@needs_cgroup
def test_pause_and_resume(workdir: str) -> None:
    pol = policy(write=[workdir], limits=Limits(pids=64))
    with isolate.Popen(py("import time\nwhile True: time.sleep(0.01); print(time.monotonic(), flush=True)"),
                       policy=pol, cwd=workdir, stdout=open(os.path.join(workdir, "out"), "w")) as proc:
        out = os.path.join(workdir, "out")
        _grows(out, 0)
        proc.pause()  # returns once the tree is frozen
        size = os.path.getsize(out)
        time.sleep(0.3)
        assert os.path.getsize(out) == size
        proc.resume()
        _grows(out, size)
        proc.kill()


def test_no_cgroup_left_behind() -> None:
    found = []
    for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        for dirpath, dirnames, _ in os.walk(base):
            found += [os.path.join(dirpath, d) for d in dirnames if d.startswith(f"isolate-{os.getpid()}-")]
    assert found == []


_ = ROOT


@needs_cgroup
def test_a_memory_limit_the_setup_cannot_meet_never_kills_the_caller(workdir: str) -> None:
    # The OOM killer kills every process that shares its victim's memory. The sandbox's first child
    # shares the caller's (it is cloned with CLONE_VM, for speed) until it execs the init: were it in
    # the run's memory cgroup, a limit reached before that exec took the caller down with it, a Python
    # process or a server holding other sandboxes. Only the program child (a vfork child, which the OOM
    # killer never picks, then a process with its own memory) joins the run's cgroups. In a child
    # process, so that the old behaviour fails the test instead of killing pytest.
    code = (
        "import isolate\n"
        # Below the floor a Limits refuses (1 MiB): as a limit the setup cannot meet, whatever the cause.
        "limits = isolate.Limits(memory='1M')\n"
        "object.__setattr__(limits, 'memory', 64 * 1024)\n"
        f"pol = isolate.Policy(read={python_read()!r}, limits=limits, backend='native')\n"
        "r = isolate.run(['true'], policy=pol)\n"
        "print('caller alive', r.returncode, r.report.status)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["caller", "alive", str(-signal.SIGKILL), "memory"], done.stdout
