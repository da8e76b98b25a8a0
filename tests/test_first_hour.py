"""The first hour of a new user: what the CLI says when a limit ends the run, the program's home,
its PATH, --help, --chdir and --explain, and what the report says it could observe."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import PYTHON
from test_limits import cgroup_usable

CLI = [sys.executable, "-m", "isolate.cli"]


def cli(*args: str, cwd: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)  # type: ignore[call-overload]


def isolate_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("isolate-run:")]


# -- a limit that ends the run says so on stderr ---------------------------------------------------


def test_wall_clock_kill_is_one_line(workdir: str) -> None:
    result = cli("--wall", "1", "--", "sleep", "30", cwd=workdir)
    assert result.returncode == 128 + 9
    assert isolate_lines(result.stderr) == ["isolate-run: killed: wall-clock limit 1 s"], result.stderr


def test_file_size_kill_is_one_line(workdir: str) -> None:
    result = cli("--fsize", "1M", "--", "dd", "if=/dev/zero", "of=big", "bs=1M", "count=4", cwd=workdir)
    assert result.returncode == 128 + 25  # SIGXFSZ
    assert isolate_lines(result.stderr) == ["isolate-run: killed: file size limit 1M reached (SIGXFSZ)"], \
        result.stderr


@pytest.mark.skipif(not cgroup_usable("memory"), reason="no writable memory cgroup for this caller")
def test_memory_kill_is_one_line(workdir: str) -> None:
    result = cli("--backend", "native", "--memory", "64M", "--", PYTHON, "-c", "b = bytearray(512 << 20)",
                 cwd=workdir)
    assert result.returncode != 0
    assert isolate_lines(result.stderr) == ["isolate-run: killed: memory limit 64M reached"], result.stderr


@pytest.mark.skipif(not cgroup_usable("cpuacct"), reason="no writable cpuacct cgroup for this caller")
def test_cpu_kill_is_one_line(workdir: str) -> None:
    result = cli("--backend", "native", "--cpu", "1", "--", "sh", "-c", "while :; do :; done", cwd=workdir)
    assert result.returncode != 0
    assert isolate_lines(result.stderr) == ["isolate-run: killed: CPU time limit 1 s reached"], result.stderr


def test_no_limit_no_line(workdir: str) -> None:
    result = cli("--wall", "10", "--", "sh", "-c", "exit 3", cwd=workdir)
    assert result.returncode == 3
    assert isolate_lines(result.stderr) == []
