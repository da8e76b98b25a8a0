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


def _server_children(box: isolate.Sandbox, want: int) -> list[psutil.Process]:
    """The exec server's children once the last command's monitor has gone (it sends EXITED, then
    exits): the spare, if there is one; waits up to 10 s for ``want`` of them."""
    init = box.processes()[0]
    (server,) = init.children()
    deadline = time.monotonic() + 10
    while True:
        children = [c for c in server.children() if c.status() != psutil.STATUS_ZOMBIE]
        if len(children) == want or time.monotonic() > deadline:
            return children
        time.sleep(0.01)


def test_a_killed_or_stopped_spare_costs_no_command() -> None:
    with isolate.Sandbox(policy(write=())) as box:
        assert box.exec(["/bin/true"]).returncode == 0
        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGKILL):
            (spare,) = _server_children(box, 1)
            spare.send_signal(sig)
            done = box.exec(["sh", "-c", "echo ok"])
            assert (done.returncode, done.stdout) == (0, "ok\n")
        # A stopped spare is continued by the server (as a stopped monitor is).
        (spare,) = _server_children(box, 1)
        spare.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert spare.status() != psutil.STATUS_STOPPED
        assert box.exec(["/bin/true"]).returncode == 0


def test_no_spare_where_the_policy_counts_processes() -> None:
    try:
        box = isolate.Sandbox(policy(write=(), limits=isolate.Limits(pids=50))).start()
    except isolate.UnsupportedError as exc:  # no cgroup this user may write (a pids limit is refused then)
        pytest.skip(str(exc)[:120])
    with box:
        assert box.exec(["/bin/true"]).returncode == 0
        assert _server_children(box, 0) == []
