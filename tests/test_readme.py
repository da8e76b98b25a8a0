"""Every code block of the README runs as written: the Python blocks in a directory holding the
files they name, the quick start's sandboxed command, and the test command is the one CI runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile

import pytest
from conftest import ISOLATE_RUN

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
#: What a new user's shell would have: the system's python3 first, no venv or pyenv shims.
USER_PATH = "/usr/local/bin:/usr/bin:/bin"


def quick_start() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_readme_has_python_blocks() -> None:
    assert PYTHON_BLOCKS


@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="the README's examples run python3")
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_readme_python_block_runs(block: str) -> None:
    with tempfile.TemporaryDirectory(prefix="isolate-readme-") as directory:
        os.chmod(directory, 0o755)
        with open(os.path.join(directory, "job.py"), "w") as handle:
            handle.write("print('job ran')\n")
        os.chmod(os.path.join(directory, "job.py"), 0o644)
        os.mkdir(os.path.join(directory, "work"), 0o755)
        env = {**os.environ, "PATH": USER_PATH}
        env.pop("VIRTUAL_ENV", None)
        result = subprocess.run([sys.executable, "-c", block], cwd=directory, capture_output=True, text=True,
                                timeout=180, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        assert "job ran" in result.stdout


def test_quick_start_is_two_commands_and_ci_runs_the_second() -> None:
    commands = quick_start()
    assert len(commands) == 2, commands
    install, test = commands
    assert "python3 -m venv .venv" in install and "python3 -m venv .venv" in test
    assert "pip install ." not in README.replace(".venv/bin/pip install", "")  # never outside a venv
    ci = open(os.path.join(HERE, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert test in ci, "the README's test command and .ci/run differ"


def test_quick_start_sandboxed_command_runs(workdir: str) -> None:
    install = quick_start()[0]
    marker = ".venv/bin/isolate-run "
    assert marker in install
    args = shlex.split(install.split(marker, 1)[1])
    env = {**os.environ, "PATH": USER_PATH}
    result = subprocess.run([ISOLATE_RUN, *args], cwd=workdir, capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert "denied" in lines and "usr" in lines and "uid=" in result.stdout
    assert "root" not in lines and "boot" not in lines
