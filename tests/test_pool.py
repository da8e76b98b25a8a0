"""Many sandboxes on one machine: ``Sandbox.create_many`` and the warm ``SandboxPool``.

Real sandboxes on the real kernel, as root and as uid 65534. The pool's promise
is that no sandbox reaches a second user: the tests leave files, a background
process and a shell behind and look for them in every later sandbox.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import NAMESPACES_WHY, policy, python_read, running

import isolate
from isolate.kept.pool import PoolClosedError, PoolExhaustedError

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def box_policy() -> isolate.Policy:
    return policy(write=())


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return list(process.cmdline())
    except psutil.Error:  # ended meanwhile (a command's short-lived helper)
        return []


def test_create_many_starts_distinct_running_sandboxes() -> None:
    boxes = isolate.Sandbox.create_many(6, box_policy())
    try:
        inits = {box.processes()[0].pid for box in boxes}
        assert len(inits) == 6
        for i, box in enumerate(boxes):
            box.write_file("mine", str(i))
        assert [box.exec(["cat", "mine"]).stdout for box in boxes] == [str(i) for i in range(6)]
    finally:
        for box in boxes:
            box.close()
    assert not any(psutil.pid_exists(pid) for pid in inits)


def test_create_many_refuses_bad_input_before_starting_any() -> None:
    with pytest.raises(isolate.PolicyError, match="n: expected an integer"):
        isolate.Sandbox.create_many(-1, box_policy())
    with pytest.raises(isolate.PolicyError, match="cannot share one name"):
        isolate.Sandbox.create_many(2, box_policy(), name="same")
    with pytest.raises(isolate.PolicyError):
        isolate.Sandbox.create_many(2, box_policy(), ttl=float("nan"))
    assert isolate.Sandbox.create_many(0, box_policy()) == []


def test_a_released_sandbox_leaves_nothing_to_the_next_user() -> None:
    marker = f"left-{uuid.uuid4().hex[:8]}"
    with isolate.SandboxPool(box_policy(), size=2) as pool:
        first = pool.acquire()
        # Everything a user could leave: files in the workspace, /tmp, /var/tmp and the home; a
        # process that left its session; a persistent shell's variable.
        first.exec(f"echo x > {marker}; echo x > /tmp/{marker}; echo x > /var/tmp/{marker}; "
                   f"echo x > ~/{marker}")
        first.exec(f"setsid sh -c 'sleep 300; :' {marker} >/dev/null 2>&1 &")
        first.shell().run(f"export LEFT={marker}")
        leftover = [p.pid for p in first.processes() if marker in " ".join(_cmdline(p))]
        assert leftover, "the background process did not start"
        with first:
            pass  # the end of its with block releases it
        assert not any(psutil.pid_exists(pid) for pid in leftover)
        with pytest.raises(isolate.IsolationError, match="not running"):
            first.exec(["true"])
        # Every sandbox the pool hands out from now on, warm or started for the call, is clean.
        later = pool.acquire_many(3)
        try:
            for box in later:
                assert box is not first
                found = box.exec(f"ls -a . /tmp /var/tmp ~ | grep -c {marker}; echo ${{LEFT:-none}}")
                assert found.stdout.split() == ["0", "none"], found
                assert not [p for p in box.processes() if marker in " ".join(_cmdline(p))]
                assert box.shell().run("echo ${LEFT:-none}")[0].strip() == "none"
        finally:
            for box in later:
                box.close()


def test_acquire_past_max_size_waits_for_a_release() -> None:
    pool = isolate.SandboxPool(box_policy(), size=1, max_size=2)
    try:
        a, b = pool.acquire(), pool.acquire()
        t0 = time.monotonic()
        with pytest.raises(PoolExhaustedError, match="max_size"):
            pool.acquire(timeout=0.3)
        assert time.monotonic() - t0 >= 0.3
        got: list[isolate.Sandbox] = []
        waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=60)))
        waiter.start()
        time.sleep(0.2)
        assert not got  # still waiting: the pool is full
        a.close()
        waiter.join(60)
        assert got and got[0].exec(["true"]).returncode == 0
        assert pool.stats["in_use"] == 2
        got[0].close()
        b.close()
    finally:
        pool.close()


def test_the_pool_refills_and_close_ends_its_warm_sandboxes() -> None:
    pool = isolate.SandboxPool(box_policy(), size=2)
    for box in pool.acquire_many(2):
        box.close()
    deadline = time.monotonic() + 30
    while pool.stats["warm"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats == {"warm": 2, "in_use": 0, "starting": 0}
    warm_inits = [box.processes()[0].pid for box in list(pool._warm)]
    pool.close()
    assert not any(psutil.pid_exists(pid) for pid in warm_inits)
    with pytest.raises(PoolClosedError):
        pool.acquire()
    pool.close()  # idempotent


def test_a_pool_refuses_bad_sizes_and_names() -> None:
    for kwargs, match in (({"size": -1}, "size"), ({"size": 2, "max_size": 1}, "below size"),
                          ({"size": True}, "size"), ({"size": 1, "name": "x"}, "unnamed")):
        with pytest.raises(isolate.PolicyError, match=match):
            isolate.SandboxPool(box_policy(), **kwargs)  # type: ignore[arg-type]
    with isolate.SandboxPool(box_policy(), size=0, max_size=1) as pool:
        for timeout in (-1, float("nan"), "1"):
            with pytest.raises(isolate.PolicyError, match="timeout"):
                pool.acquire(timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(isolate.PolicyError, match="max_size"):
            pool.acquire_many(2)


def test_a_caller_with_umask_077_gets_a_working_root() -> None:
    """The root's directories take the plan's modes whatever the caller's umask (with 077, /var was
    made 0700 and every run failed at Landlock's /var/tmp); the program still gets the caller's umask."""
    code = ("import os, isolate; os.umask(0o077); "
            f"r = isolate.run(['sh', '-c', 'ls -d /var/tmp && umask'], policy=isolate.Policy(read={python_read()!r}),"
            " capture_output=True); print(r.returncode, r.stdout.decode().split())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0 ['/var/tmp', '0077']", out.stderr


def test_a_sandbox_outlives_the_thread_that_started_it_not_its_process() -> None:
    """create_many and the pool start sandboxes from worker threads that end: the sandbox's init watches
    the caller's process (a pidfd), not the parent-death signal, which follows the starting thread."""
    script = (
        "import threading, time, isolate, sys\n"
        f"box = isolate.Sandbox(isolate.Policy(write=(), read={python_read()!r}))\n"
        "t = threading.Thread(target=box.start); t.start(); t.join()\n"
        "time.sleep(0.3)\n"
        "print(box.exec(['echo', 'alive']).stdout.strip(), box._impl.process.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    creator = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    assert creator.stdout is not None
    said, init = creator.stdout.readline().split()
    assert said == "alive"
    creator.kill()
    creator.wait()
    deadline = time.monotonic() + 5
    while running(int(init)):
        assert time.monotonic() < deadline, "the sandbox outlived its creator"
        time.sleep(0.05)




def test_a_sandbox_starts_when_its_program_descriptor_is_not_the_cached_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that started a process's first sandboxes together could each open the init binary (the cache
    was not locked); a child kept only the descriptor its static plan named and its exec server failed with
    "cannot execute: Bad file descriptor". The child now keeps the program's own descriptor too: here the
    sandbox's program descriptor is made a second one, as the race made it."""
    from isolate._core import INIT_PATH
    from isolate.backends.native import kept

    second = os.open(INIT_PATH, os.O_PATH | os.O_CLOEXEC)
    monkeypatch.setattr(kept, "init_fd", lambda: second)
    try:
        with isolate.Sandbox(box_policy()) as box:
            assert box.exec(["echo", "up"]).stdout == "up\n"
    finally:
        os.close(second)


def test_a_warm_sandbox_its_ttl_ended_is_not_handed_out() -> None:
    # ttl counts from a sandbox's start: one that waited warm past it had ended, and acquire handed it out.
    with isolate.SandboxPool(box_policy(), size=1, ttl=2) as pool:
        time.sleep(3)
        with pool.acquire() as box:
            assert box.exec(["/bin/true"]).returncode == 0


def test_a_warm_sandbox_past_half_its_ttl_is_not_handed_out() -> None:
    # Handed out with a moment to live, it ended under its first command ("its monitor went away": ci5's VM).
    with isolate.SandboxPool(box_policy(), size=1, ttl=4) as pool:
        old = pool._warm[0]
        time.sleep(2.5)
        with pool.acquire() as box:
            assert box is not old and box.exec(["/bin/true"]).returncode == 0
        assert not old._started


def test_a_forked_child_is_never_handed_its_parents_warm_sandboxes() -> None:
    # A process forked after the pool warmed up (a pre-forking server's workers, multiprocessing's fork) held
    # the same warm sandboxes: the child and the parent were each handed the first of them, one sandbox for two
    # users, each seeing the other's files.
    marker = f"child-{uuid.uuid4().hex[:8]}"
    with isolate.SandboxPool(box_policy(), size=1) as pool:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read)
                with pool.acquire(timeout=60) as box:
                    box.exec(f"echo x > /tmp/{marker}; echo x > {marker}")
                    os.write(write, f"{box._impl.process.pid}\n".encode())
            except BaseException as exc:
                os.write(write, f"error {exc!r}\n".encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as answer:
            said = answer.read().strip()
        os.waitpid(pid, 0)
        assert said.isdigit(), said
        with pool.acquire(timeout=60) as box:
            assert box._impl.process.pid != int(said)
            assert box.exec(f"ls -a /tmp . | grep -c {marker}").stdout.split() == ["0"]


def test_a_forked_childs_exit_leaves_its_parents_sandbox_whole(tmp_path: object) -> None:
    # A child forked from a process holding a sandbox runs, at its (normal) exit, the finalizers it inherited:
    # they removed the parent's sandbox's files, its workspace among them (the parent's diff then failed).
    script = (
        "import os, sys, isolate\n"
        "from isolate.model.policy import Policy\n"
        f"box = isolate.Sandbox(Policy(read={python_read()!r}, write=()))\n"
        "box.start()\n"
        "box.write_file('kept', 'the parent\\'s')\n"
        "if os.fork() == 0:\n"
        "    sys.exit(0)\n"
        "os.wait()\n"
        "print(box.diff().added, box.read_file('kept'))\n"
        "box.close()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['kept'] the parent's", result.stdout


def test_a_child_forked_while_other_threads_plan_runs_its_own_sandboxes(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A module-level lock held by another thread at the fork (the plan cache's, while that thread planned) was
    # held for good in the child: its first run waited for ever (135 children of 200 here, before).
    from isolate.backends.native import plan

    checked = policy(write=[str(tmp_path)])
    monkeypatch.chdir(tmp_path)  # the runs' working directory (pytest's own: a directory the policy may not grant)
    # Once first, in this thread: the threads below then import nothing (a module being imported by another
    # thread at the fork is Python's own lock, held for good in the child, whatever isolate does).
    assert isolate.run(["true"], policy=checked, timeout=30).returncode == 0
    stop = threading.Event()

    def planning() -> None:
        while not stop.is_set():
            plan._static_for(checked, os.getcwd(), False)

    threads = [threading.Thread(target=planning, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = isolate.run(["true"], policy=checked, timeout=30).returncode
                finally:
                    os._exit(0 if code == 0 else 1)
            deadline = time.monotonic() + 15
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if done[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the forked child's run hung or failed"
    finally:
        stop.set()
        for thread in threads:
            thread.join()
