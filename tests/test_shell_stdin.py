"""A persistent shell's input pipe, as a process of the sandbox can fill it: the host's writes keep the run's
deadline (isolate.kept.shell.Shell)."""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import finishes, policy

from isolate import Sandbox, Workspace
from isolate.kept.shell import Shell

#: fcntl's F_GETPIPE_SZ (Linux): a pipe's capacity.
F_GETPIPE_SZ = 1032
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


@pytest.mark.parametrize("argv", [("/bin/dash",), ("/bin/bash",), ("/bin/busybox", "ash")], ids=["dash", "bash", "ash"])
def test_a_host_killed_mid_write_leaves_the_next_host_no_part_of_a_command_to_run(tmp_path: Path,
                                                                                   argv: tuple[str, ...]) -> None:
    # A detached shell's host is killed while a long command line is half in the shell's input pipe (the shell
    # busy: here stopped, the pipe filled to leave `room`), and the next host adopts the shell from the ends the
    # exec server kept. Before: the pipe held a line's first part, the rest died with the host, and the next
    # host's line completed it: the truncated command ran (`ran` made), its quote swallowing the next host's
    # text. Every write is whole lines within PIPE_BUF now, which a pipe takes all or nothing.
    from isolate.server.code.shell import _adopt

    (tmp_path / "w").mkdir()
    command = "echo x > ran; : " + "y'" * 4500
    with Sandbox(policy(write=()), workspace=Workspace(str(tmp_path / "w"))) as box:
        def ran() -> bool:
            return box.exec("test -e /workspace/ran && echo yes || echo no").stdout == "yes\n"

        def stopped(pid: int) -> None:
            while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.01)

        sh: Any = Shell(box, "cut", False, argv, detached=True)
        ends, peer = sh.ends()
        box._conn().keep("cut", ends, note=peer)
        try:
            assert sh.run("v=kept; cd /workspace", timeout=30) == ("", 0)
            for room in (1, 60, 2000, 4100, 6000, 12000):
                sh._process.signal(signal.SIGSTOP)
                assert finishes(functools.partial(stopped, sh.ends()[1]), within=10)[0]  # sent through its monitor
                fd = sh._process.stdin_fd
                os.write(fd, b"\n" * (fcntl.fcntl(fd, F_GETPIPE_SZ) - room))
                with pytest.raises(TimeoutError):
                    sh.run(command, timeout=0.3)
                sh.release()  # as a kill leaves it: what this host did not write is gone with it
                sh = _adopt(box, "cut")
                sh._process.signal(signal.SIGCONT)
                assert sh.run("echo $v", timeout=30) == ("kept\n", 0), room
                assert not ran(), f"a truncated command ran ({room} bytes of room)"
            assert sh.run(command, timeout=30) == ("", 0) and ran()  # whole, it runs
        finally:
            sh.close()
            box._conn().keep("cut", [])
