"""policy.preexec_fn with plain subprocess: the same confinement, no report."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ROOT, not_granted_top, policy

import isolate


def test_preexec_confines_like_run(workdir: str) -> None:
    hook = policy(write=[workdir]).preexec_fn
    result = subprocess.run(
        ["sh", "-c", "id -u; hostname; cat /proc/self/status | grep -E 'NoNewPrivs|CapEff|Seccomp:'; "
         "echo x > made.txt; ls /; cat /etc/shadow 2>/dev/null || echo shadow-denied; exit 4"],
        preexec_fn=hook, cwd=workdir, capture_output=True, text=True,
    )
    lines = result.stdout.split("\n")
    assert result.returncode == 4, result.stderr
    assert int(lines[0]) == (65534 if ROOT else os.geteuid())
    assert lines[1] == "isolate"
    assert "NoNewPrivs:\t1" in result.stdout and "CapEff:\t0000000000000000" in result.stdout
    assert "Seccomp:\t2" in result.stdout
    assert "shadow-denied" in result.stdout
    assert not set(result.stdout.split()) & not_granted_top(workdir)
    info = os.stat(os.path.join(workdir, "made.txt"))
    assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid())


def test_preexec_hook_can_be_reused(workdir: str) -> None:
    hook = policy(write=[workdir]).preexec_fn
    for _ in range(3):
        assert subprocess.run(["true"], preexec_fn=hook, cwd=workdir).returncode == 0


def test_preexec_without_namespaces(workdir: str) -> None:
    os.chmod(workdir, 0o777)
    hook = policy(write=[workdir], namespaces=False, tmpfs=()).preexec_fn
    result = subprocess.run(["sh", "-c", "cat /proc/self/status | grep NoNewPrivs; ls /root 2>&1 | head -1"],
                            preexec_fn=hook, cwd=workdir, capture_output=True, text=True)
    assert "NoNewPrivs:\t1" in result.stdout
    assert "Permission denied" in result.stdout


def test_preexec_setup_failure_is_one_line_and_125(tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = str(tmp_path_factory.mktemp("not-granted"))
    hook = policy(write=()).preexec_fn
    result = subprocess.run(["touch", "/tmp/should-not-exist-isolate"], preexec_fn=hook, cwd=outside,
                            capture_output=True, text=True)
    assert result.returncode == 125
    assert result.stderr.startswith("isolate: sandbox setup failed at chdir")
    assert len(result.stderr.strip().splitlines()) == 1


def test_preexec_command_not_found(workdir: str) -> None:
    hook = policy(write=[workdir]).preexec_fn
    try:
        subprocess.run(["no-such-command-xyz"], preexec_fn=hook, cwd=workdir)
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("expected FileNotFoundError")


def test_preexec_wall_limit(workdir: str) -> None:
    hook = policy(write=[workdir], limits=isolate.Limits(wall_seconds=0.5)).preexec_fn
    result = subprocess.run(["sleep", "20"], preexec_fn=hook, cwd=workdir, timeout=15)
    assert result.returncode == 128 + 9


def test_subprocess_timeout_leaves_nothing_behind(workdir: str) -> None:
    import time

    hook = policy(write=[workdir]).preexec_fn
    try:
        subprocess.run(["sleep", "77.25"], preexec_fn=hook, cwd=workdir, timeout=1)
    except subprocess.TimeoutExpired:
        pass
    # The program dies with the relay subprocess killed, but not at once on a slow host (the VM's
    # emulation): a leak outlives any wait here (77 s).
    deadline = time.monotonic() + 10
    while True:
        leftovers = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if b"77.25" in handle.read():
                        leftovers.append(pid)
            except OSError:
                pass
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert leftovers == []


@pytest.mark.parametrize("namespaces", [True, False])
def test_preexec_gives_the_policy_environment_not_the_parents(
    workdir: str, monkeypatch: pytest.MonkeyPatch, namespaces: bool
) -> None:
    # subprocess with env=None execs with the child's environ: the hook must
    # replace it, or every secret of the parent reaches the program.
    monkeypatch.setenv("ISOLATE_TEST_SECRET", "sk-do-not-leak")
    os.chmod(workdir, 0o777)
    hook = policy(write=[workdir], namespaces=namespaces, env={"GIVEN": "yes"}).preexec_fn
    result = subprocess.run(["env"], preexec_fn=hook, cwd=workdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    names = {line.split("=", 1)[0] for line in result.stdout.splitlines()}
    assert "ISOLATE_TEST_SECRET" not in names
    assert "GIVEN=yes" in result.stdout.splitlines()
    assert names <= {"PATH", "HOME", "LANG", "TERM", "GIVEN", "PWD", "SHLVL", "_", "TMPDIR"}
    # An explicit env= is the program's environment as given.
    explicit = subprocess.run(["env"], preexec_fn=hook, cwd=workdir, capture_output=True, text=True,
                              env={"ONLY": "this"})
    assert explicit.stdout.splitlines() == ["ONLY=this"]

