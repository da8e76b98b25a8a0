"""A kept context's driver is named by its pid in the sandbox (the relay's hello), looked up among the sandbox's
processes; the server then holds it by a pidfd, which its delete signals. The number looked up is freed and given
again when its process ends: a pidfd opened after the lookup may name another process, the host's included, which
the delete would kill. The pidfd is checked to be the looked-up process's (its start time) after it is opened."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import psutil
import pytest

from isolate.server import background, code


class _Box:
    """A sandbox with no process of its own (the host's process stands for a number given again)."""

    def processes(self) -> list[Any]:
        return []


class _Relay:
    """What the server keeps of a relay: its hello's pid, its count, its close."""

    said_pid = 7
    count = 0
    peer = None

    def close(self) -> None:
        pass


def test_a_driver_pid_given_again_since_its_lookup_is_not_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        looked_up = psutil.Process(host.pid)
        # The process the lookup found held this number before the host's process took it (an earlier start).
        looked_up._create_time = looked_up.create_time() - 100.0
        looked_up._ident = (host.pid, looked_up._create_time)
        monkeypatch.setattr(code, "host_process", lambda box, pid: looked_up)
        monkeypatch.setattr(code.node, "connect", lambda box, language, context_id: _Relay())
        box: Any = _Box()
        context = code.KeptInterpreter(box, "javascript", "ctx-0123456789abcdef", fresh=False)
        context.close()
        with pytest.raises(subprocess.TimeoutExpired):  # a SIGKILL sent has ended it by then
            host.wait(timeout=0.5)
    finally:
        host.kill()
        host.wait()


class _PythonDriver(_Relay):
    """A Python driver's hello names no pid: its writer's (the kernel's word) is the peer."""

    said_pid = None


def test_a_python_hello_writer_gone_since_is_not_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    # The hello's writer (a process of the sandbox, a squatter of the driver's socket) ended at once and the host
    # gave its number to a process of its own: the sandbox has no process of that number any more.
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        relay = _PythonDriver()
        relay.peer = host.pid  # type: ignore[assignment]
        monkeypatch.setattr(code, "host_process", lambda box, pid: None)
        monkeypatch.setattr(background, "host_process", lambda box, pid: None)
        monkeypatch.setattr(code.python, "connect", lambda box, context_id: relay)
        box: Any = _Box()
        context = code.KeptInterpreter(box, "python", "ctx-0123456789abcdef", fresh=False)
        context.close()
        with pytest.raises(subprocess.TimeoutExpired):  # a SIGKILL sent has ended it by then
            host.wait(timeout=0.5)
    finally:
        host.kill()
        host.wait()
