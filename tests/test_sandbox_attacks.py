"""isolate.Sandbox under attack: the program inside is hostile, and so is everything it can write.

Each test is a hole found by attacking the feature; it failed before its fix.
Real kernel, root and uid 65534 alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NAMESPACES_WHY, policy

import isolate
from isolate import Sandbox, Workspace
from isolate.backends.native import protocol

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")

#: The exec server, seen from inside: the only child of the sandbox's init.
SERVER = "$(cat /proc/1/task/1/children)"


@pytest.fixture
def source(workdir: str) -> str:
    root = Path(workdir) / "project"
    root.mkdir()
    (root / "a.txt").write_text("a\n")
    root.chmod(0o755)
    (root / "a.txt").chmod(0o644)
    return str(root)


@pytest.fixture
def box(source: str) -> Iterator[Sandbox]:
    with Sandbox(policy(write=()), workspace=Workspace(source)) as sandbox:
        yield sandbox


def _finishes(call: Callable[[], Any], within: float) -> tuple[bool, Any]:
    """Run call in a thread: (whether it returned or raised within the time, what it gave)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:
            out["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    return not thread.is_alive(), out.get("value")


def test_commit_refuses_links_that_leave_the_tree_through_other_links(box: Sandbox, workdir: str) -> None:
    # Each link's own text stays inside; followed as the kernel does, `out` names the target's parent.
    box.exec("mkdir a && ln -s .. a/up && ln -s a/up/.. out && ln -s a/up/a/up/../.. out2 && ln -s a/up/a.txt ok")
    target = Path(workdir) / "target"
    target.mkdir()
    changes = box.commit(target)
    assert {"out", "out2"} <= set(changes.refused), changes
    assert not (target / "out").is_symlink() and not (target / "out2").is_symlink()
    # Links that stay inside, even through another link, are still written.
    assert os.readlink(target / "a" / "up") == ".." and os.readlink(target / "ok") == "a/up/a.txt"
    for link in (p for p in target.rglob("*") if p.is_symlink()):
        real = os.path.realpath(link)
        assert real == str(target) or real.startswith(str(target) + "/"), (link, real)


def test_a_stopped_exec_server_does_not_hang_the_host(box: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    # A command may SIGSTOP the exec server (same uid, same Landlock domain): the host's next file
    # operation, or its next command (even one with a timeout), must fail, not wait for ever.
    monkeypatch.setattr(protocol, "REPLY_TIMEOUT", 2.0, raising=False)
    assert box.exec(f"kill -STOP {SERVER}").returncode == 0
    done, value = _finishes(lambda: box.read_file("a.txt"), 20)
    assert done, "read_file hung on a stopped exec server"
    assert isinstance(value, isolate.IsolationError), value
    done, value = _finishes(lambda: box.exec("echo hi", timeout=1), 20)
    assert done, "exec(timeout=1) hung on a stopped exec server"
    assert isinstance(value, isolate.IsolationError), value


def test_a_command_that_stops_its_monitor_does_not_outwait_its_timeout(box: Sandbox,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.backends.native import commands

    monkeypatch.setattr(commands, "GRACE", 1.0)
    done, value = _finishes(lambda: box.exec("kill -STOP $PPID; sleep 1000", timeout=1), 30)
    assert done, "exec(timeout=1) hung on a stopped monitor"
    assert isinstance(value, (isolate.IsolationError, commands.ExecResult)), value
    if isinstance(value, commands.ExecResult):
        assert value.timed_out, value
