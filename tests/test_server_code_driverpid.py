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

from isolate.server import code


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
        box: Any = object()
        context = code.KeptInterpreter(box, "javascript", "ctx-0123456789abcdef", fresh=False)
        context.close()
        assert host.poll() is None, "the host's process that took the driver's number was killed"
    finally:
        host.kill()
        host.wait()
