"""A signal ignored when isolate-run starts stays ignored: neither caught nor forwarded, and the program starts
with it ignored (as exec keeps SIG_IGN). ``nohup isolate-run ...`` and a non-interactive shell's background job
(SIGINT and SIGQUIT ignored) rely on it.

Every path is tried: the native binary replaying a cached plan, the binary handing over to the Python side that
plans and execs it back, the Python side running the command itself (``--why``, which the binary leaves to
isolate.cli), and the Python CLI started directly (``python -m isolate.cli``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from typing import Any

import pytest
from conftest import ISOLATE_RUN, skip_unless_runnable

PATHS = ["replayed", "planned", "python", "module"]
REPLAYED = "trace: replaying the cached plan"


def _command(path: str, workdir: str, program: list[str]) -> tuple[list[str], dict[str, str]]:
    """isolate-run's command line and environment for the path."""
    env = dict(os.environ, ISOLATE_RUN_TRACE="1")
    args = ["--", *program]
    if path == "replayed":
        warm = subprocess.run([*_ignoring(), ISOLATE_RUN, *args], cwd=workdir, env=env, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert warm.returncode == 0, warm.stderr  # the plan of exactly this command line is cached now
    elif path == "planned":
        env["SIGIGN_FRESH"] = uuid.uuid4().hex  # a key never planned: the Python side plans, execs the binary back
    elif path == "python":
        args = ["--why", *args]
    if path == "module":
        return [sys.executable, "-m", "isolate.cli", *args], env
    return [ISOLATE_RUN, *args], env


def _ignoring(*names: str) -> list[str]:
    """A shell that ignores the signals, then execs the rest of the command line: SIG_IGN survives the exec."""
    trap = f"trap '' {' '.join(names)}; " if names else ""
    return ["sh", "-c", trap + 'exec "$@"', "sh"]


def _ignored(status_line: str) -> set[int]:
    """The signals of a /proc/PID/status SigIgn line."""
    name, value = status_line.split(":")
    assert name == "SigIgn", status_line
    mask = int(value, 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


@pytest.mark.parametrize("path", PATHS)
def test_a_signal_ignored_at_start_is_not_forwarded_and_stays_ignored(path: str, workdir: str) -> None:
    # Before: isolate-run caught SIGHUP and SIGINT whatever their disposition and forwarded them, and the sandbox
    # reset the program's dispositions: nohup's SIGHUP and a background job's SIGINT killed the program (129, 130).
    skip_unless_runnable(["--", "sh"])
    program = ["sh", "-c", "grep ^SigIgn: /proc/self/status; echo ready; read line || exit 0; echo survived; "
               "while :; do sleep 0.05; done"]
    command, env = _command(path, workdir, program)
    process = subprocess.Popen([*_ignoring("HUP", "INT"), *command], cwd=workdir, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdin is not None and process.stdout is not None
    try:
        ignored = _ignored(process.stdout.readline().strip())
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGHUP)
        process.send_signal(signal.SIGINT)
        process.stdin.write("go\n")  # the program goes on once both signals are sent (and not forwarded)
        process.stdin.flush()
        assert process.stdout.readline() == "survived\n", process.stderr.read() if process.stderr else ""
        # A signal that was default at the start is forwarded as before: the program dies of it.
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert (REPLAYED in (err.splitlines() or [""])[0]) == (path == "replayed"), err
    assert {signal.SIGHUP, signal.SIGINT} <= ignored
    # SIGPIPE (which isolate-run and Python ignore for themselves) is the program's default, as with subprocess.
    assert signal.SIGPIPE not in ignored and signal.SIGXFSZ not in ignored


def _ignored_and_pending(signum: int) -> Any:
    """A preexec_fn: signum ignored, blocked and pending when isolate-run starts (a blocked signal is queued
    even when ignored)."""

    def pending() -> None:
        signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
        os.kill(os.getpid(), signum)
    return pending


@pytest.mark.parametrize("path", PATHS)
def test_an_ignored_signal_during_the_start_does_not_stop_the_run(path: str, workdir: str) -> None:
    # Before: the start caught it as any other and ended the run unstarted, 129 and "SIGHUP before the program
    # started: nothing was run".
    skip_unless_runnable(["--", "sh"])
    token = uuid.uuid4().hex
    command, env = _command(path, workdir, ["sh", "-c", f"echo ran {token}"])
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=60,
                            preexec_fn=_ignored_and_pending(signal.SIGHUP))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ran {token}\n"
    assert "before the program started" not in result.stderr


def test_sandbox_exec_forwards_no_signal_ignored_at_its_start(workdir: str) -> None:
    # isolate-run sandbox exec forwarded SIGINT, SIGTERM and SIGHUP whatever their disposition: nohup's SIGHUP
    # ended the command in the kept sandbox (129).
    skip_unless_runnable(["--", "sh"])
    name = f"sigign{os.getpid()}"
    created = subprocess.run([ISOLATE_RUN, "sandbox", "create", name], cwd=workdir, capture_output=True,
                             text=True, timeout=60)
    assert created.returncode == 0, created.stderr
    try:
        command = [ISOLATE_RUN, "sandbox", "exec", name, "--", "sh", "-c",
                   "echo ready; read line || exit 0; echo survived; while :; do sleep 0.05; done"]
        process = subprocess.Popen([*_ignoring("HUP"), *command], cwd=workdir, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdin is not None and process.stdout is not None
        try:
            assert process.stdout.readline() == "ready\n"
            process.send_signal(signal.SIGHUP)
            process.stdin.write("go\n")
            process.stdin.flush()
            assert process.stdout.readline() == "survived\n"
            process.send_signal(signal.SIGTERM)  # default at the start: forwarded, the command dies of it
            _, err = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 128 + signal.SIGTERM, err
    finally:
        subprocess.run([ISOLATE_RUN, "sandbox", "rm", name], capture_output=True, timeout=60)
