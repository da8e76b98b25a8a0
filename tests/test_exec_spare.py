"""The exec server's spare monitor (forked ahead of the next command): what a process of the sandbox can do
to it (kill it, stop it) costs at most the saving, never a command or the sandbox; a policy that counts
processes gets no spare."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
from conftest import NAMESPACES_WHY, policy

import isolate

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def _server_children(box: isolate.Sandbox) -> list[psutil.Process]:
    """The exec server's children while no command runs: the spare, if there is one."""
    init = box.processes()[0]
    (server,) = init.children()
    deadline = time.monotonic() + 10
    while True:
        children = server.children()
        if children or time.monotonic() > deadline:
            return children
        time.sleep(0.01)


def test_a_killed_or_stopped_spare_costs_no_command() -> None:
    with isolate.Sandbox(policy(write=())) as box:
        assert box.exec(["/bin/true"]).returncode == 0
        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGKILL):
            (spare,) = _server_children(box)
            spare.send_signal(sig)
            done = box.exec(["sh", "-c", "echo ok"])
            assert (done.returncode, done.stdout) == (0, "ok\n")
        # A stopped spare is continued by the server (as a stopped monitor is).
        (spare,) = _server_children(box)
        spare.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert spare.status() != psutil.STATUS_STOPPED
        assert box.exec(["/bin/true"]).returncode == 0


def test_no_spare_where_the_policy_counts_processes() -> None:
    limited = policy(write=(), limits=isolate.Limits(pids=50))
    with isolate.Sandbox(limited) as box:
        assert box.exec(["/bin/true"]).returncode == 0
        time.sleep(0.2)
        init = box.processes()[0]
        (server,) = init.children()
        assert server.children() == []
