"""What a sandbox says names none of the host's processes and none above its command (isolate.server.background):
the wrapper a launcher's line names is never the sandbox's init (and is in the launcher's process group), and a
command's monitor is the exec server's child, never the exec server itself nor the init's parent on the host."""

from __future__ import annotations

import time

import psutil
from conftest import policy

import isolate
from isolate.server.background import KeptCommand, host_process
from isolate.server.keep import RecordedCommand


def _posing_as(box: isolate.Sandbox, process: psutil.Process) -> KeptCommand:
    """A background command whose wrapper, as its launcher's line named it, is ``process``."""
    recorded = RecordedCommand("0123456789abcdef", "", time.time(), process.pid, process.create_time(), 0, None)
    command = KeptCommand(lambda: box, recorded, 1 << 20, lambda: None)
    command._hold()
    return command


def test_the_init_is_nobody_s_wrapper() -> None:
    """A line the launcher's pipe carries can come from any process of the sandbox (it can open the launcher's
    stdout): naming pid 1 named the init, which an interrupt then killed with all below it."""
    with isolate.Sandbox(policy(write=())) as box:
        assert host_process(box, 1) is None
        proc = box.spawn(["sleep", "30"])
        try:
            ns_pid = proc.pid
            assert host_process(box, ns_pid) is not None
            assert host_process(box, ns_pid, group=ns_pid) is not None
            assert host_process(box, ns_pid, group=ns_pid + 100000) is None  # not in the launcher's group
        finally:
            proc.kill()
            proc.close()


def test_a_monitor_is_the_exec_server_s_child() -> None:
    """A wrapper that is a monitor (its parent the exec server) made the exec server its command's monitor: all
    the sandbox's commands were listed as the command's."""
    with isolate.Sandbox(policy(write=())) as box:
        proc = box.spawn(["sleep", "30"])
        try:
            init = box.processes()[0]
            (server,) = init.children()
            (sleep,) = [p for p in server.children(recursive=True) if p.name() == "sleep"]
            command = _posing_as(box, sleep.parent())
            assert command._monitor(box) is None
            legit = _posing_as(box, sleep)._monitor(box)  # a process below a monitor: that monitor
            assert legit is not None and legit.process.pid == sleep.ppid()
            legit.close()
        finally:
            proc.kill()
            proc.close()
