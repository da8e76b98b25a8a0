"""A persistent shell's input pipe, as a process of the sandbox can fill it: the host's writes keep the run's
deadline (isolate.kept.shell.Shell)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from conftest import finishes, policy

from isolate import Sandbox, Workspace
from isolate.kept.shell import Shell

#: A command of the shell's that stops the shell (any process of the sandbox with its uid can): it reads no more of
#: its input pipe, and a command line longer than the pipe holds finds no room.
STOP = "( sleep 0.3; kill -STOP $$ ) >/dev/null 2>&1 &"


def test_a_full_input_pipe_keeps_the_runs_timeout(tmp_path: Path) -> None:
    # Before: the command line was written to the pipe with a blocking write before the run's deadline was
    # counted: a stopped shell behind a full pipe held the host's thread for good (a server's request handler;
    # a restarted server's first run of an adopted shell, whose last server's cell filled the pipe).
    (tmp_path / "w").mkdir()
    with Sandbox(policy(write=()), workspace=Workspace(str(tmp_path / "w"))) as box:
        sh = Shell(box, "stuffed", False, ("/bin/bash",))
        try:
            assert sh.run(STOP, timeout=30) == ("", 0)
            time.sleep(1.5)
            done, value = finishes(lambda: sh.run("echo " + "x" * 70_000, timeout=1), within=15)
            assert done, "the run's write waited past its timeout"
            assert isinstance(value, TimeoutError), value
            # The rest of that line waits for room, then goes before the next's: the shell reads whole lines.
            sh._process.signal(signal.SIGCONT)
            assert sh.run("echo back; (exit 4)", timeout=30) == ("back\n", 4)
        finally:
            sh.close()
