"""Every code block of the README and of the documentation (docs/) runs as written: the Python blocks
in a directory holding the files they name, the quick start's sandboxed command, and the test command is
the one CI runs.

The convention: a block fenced ```python is run, in a directory holding job.py (it prints "job ran",
which the block must print too) and an empty work/. Every other block is shown, not run: commands are
fenced ```sh, Python that cannot run here (it needs a server, a framework or a placeholder) ```text,
and indented blocks (the quick start's commands) are never run as Python. Another name for Python
(```py, ```python3 ...) is refused, so that no block that looks run is skipped.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

import pytest
from conftest import ISOLATE_RUN

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The README and every page of the documentation, by path relative to the checkout.
PAGES = {rel: open(os.path.join(HERE, rel), encoding="utf-8").read()
         for rel in ["README.md", *sorted(os.path.relpath(p, HERE)
                                          for p in glob.glob(os.path.join(HERE, "docs", "**", "*.md"),
                                                             recursive=True))]}
README = PAGES["README.md"]
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```", re.S | re.M)
PYTHON_BLOCKS = [(f"{rel}-{i}", m.group("body"))
                 for rel, text in PAGES.items()
                 for i, m in enumerate(m for m in FENCE.finditer(text) if m.group("info").strip() == "python")]
#: Names Pygments reads as Python: a block fenced so would look run and be skipped.
OTHER_PYTHON_NAMES = {"py", "py3", "python3", "pycon"}
#: What a new user's shell would have: the system's python3 first, no venv or pyenv shims.
USER_PATH = "/usr/local/bin:/usr/bin:/bin"


def quick_start() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [line[4:] for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_readme_and_docs_have_python_blocks() -> None:
    pages = {name.rsplit("-", 1)[0] for name, _ in PYTHON_BLOCKS}
    assert "README.md" in pages and any(page.startswith("docs/") for page in pages), pages


def test_python_is_fenced_python_or_text() -> None:
    others = [(rel, m.group("info")) for rel, text in PAGES.items() for m in FENCE.finditer(text)
              if m.group("info").strip().lower() in OTHER_PYTHON_NAMES]
    assert not others, f"fence Python ```python (run) or ```text (shown only): {others}"


@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="the README's examples run python3")
@pytest.mark.parametrize("block", [b for _, b in PYTHON_BLOCKS], ids=[name for name, _ in PYTHON_BLOCKS])
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
    for rel, text in PAGES.items():  # never outside a venv
        assert "pip install ." not in text.replace(".venv/bin/pip install", ""), rel
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


@pytest.mark.parametrize("rel", sorted(PAGES))
def test_no_page_keeps_a_merge_conflict(rel: str) -> None:
    # Before: docs/threat-model.md kept a merge's conflict markers (and both sides) for a whole stop.
    markers = [line for line in PAGES[rel].splitlines() if re.fullmatch(r"(<{7}|>{7})( .*)?|={7}", line)]
    assert not markers, f"{rel}: merge conflict markers {markers[:3]}"
