"""Every program in examples/ runs as a user runs it: its own process, this interpreter, a new user's
PATH, a fresh working directory; it must exit 0 and print a line that starts as expected.

The examples import the isolate this test imported (the checkout under test, or the installed
package), whatever their working directory. An example is skipped, with the reason, only where this
host cannot do what it shows. They are started all at once and each test waits for its own: most of
their time is spent importing frameworks and waiting on servers and sandboxes, so the file takes
about as long as the slowest (inspect_task.py, which imports inspect_ai).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import pytest
from conftest import NAMESPACES_WHY

import isolate

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(HERE, "examples")
#: What a new user's shell would have: the system's python3 first, no venv or pyenv shims.
USER_PATH = "/usr/local/bin:/usr/bin:/bin"
TIMEOUT = 150


def missing(*modules: str) -> str | None:
    """Why an example cannot run here: the first of ``modules`` (its extra's packages) not installed."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'isolate[...]' with the example's extra)"
    return None


#: name: (the start of a line it prints when it worked, why it cannot run here or None).
CASES: dict[str, tuple[str, str | None]] = {
    "agent_loop.py": ("committed: ['NOTES.md', 'calc.py', 'test_calc.py'] fixed", NAMESPACES_WHY),
    "egress_index.py": ("refused: pypi.org:443", NAMESPACES_WHY),
    "grader.py": ("all verdicts as expected", NAMESPACES_WHY),
    "inspect_task.py": ("score: 1.0 (C)", missing("inspect_ai") or NAMESPACES_WHY),
    "mcp_client.py": ("killed; sandboxes left: 0", missing("mcp") or NAMESPACES_WHY),
    "opensandbox_client.py": ("killed: the server holds no sandbox",
                              missing("starlette", "uvicorn", "multipart", "opensandbox") or NAMESPACES_WHY),
}


def example_env() -> dict[str, str]:
    # The package under test first on sys.path, and its commands: isolate-run from a checkout's in-place
    # build (setup.py build_ext --inplace) when there is one, else the examples find the ones beside
    # this interpreter.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(isolate.__file__)))
    in_place = os.path.join(package_parent, "build", "isolate-run-bin")
    path = f"{in_place}:{USER_PATH}" if os.access(os.path.join(in_place, "isolate-run"), os.X_OK) else USER_PATH
    env = {**os.environ, "PATH": path,
           "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
    env.pop("VIRTUAL_ENV", None)
    return env


@dataclass
class Started:
    process: subprocess.Popen[bytes]
    output: IO[bytes]  # stdout and stderr, in a file: nothing blocks on a pipe nobody reads yet


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest) -> Iterator[dict[str, Started]]:
    """The selected examples that can run here, each started in a fresh working directory."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    env = example_env()
    running: dict[str, Started] = {}
    with tempfile.TemporaryDirectory(prefix="isolate-examples-") as base:
        os.chmod(base, 0o755)
        try:
            for name in sorted(selected):
                if CASES[name][1]:
                    continue
                cwd = os.path.join(base, name.removesuffix(".py"))
                os.mkdir(cwd, 0o755)
                output = tempfile.TemporaryFile(dir=base)
                process = subprocess.Popen([sys.executable, os.path.join(EXAMPLES, name)], cwd=cwd, env=env,
                                           stdin=subprocess.DEVNULL, stdout=output, stderr=output)
                running[name] = Started(process, output)
            yield running
        finally:
            for run in running.values():
                if run.process.poll() is None:
                    run.process.kill()
                    run.process.wait()
                run.output.close()


def test_every_example_is_run_here() -> None:
    assert sorted(CASES) == sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".py"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name: str, started: dict[str, Started]) -> None:
    expected, why = CASES[name]
    if why:
        pytest.skip(why)
    run = started[name]
    try:
        returncode = run.process.wait(timeout=TIMEOUT)
    finally:
        run.output.seek(0)
        output = run.output.read().decode(errors="replace")
    assert returncode == 0, output
    assert any(line.startswith(expected) for line in output.splitlines()), output
