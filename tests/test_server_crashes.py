"""A crash at any step leaves nothing half made (issue 38).

SIGKILL, at random points (a fixed seed), either the server (``isolate-run serve
--state-dir``) while clients create sandboxes (each with a named volume, made
by it or shared with others; some with limits, hence cgroups), delete them,
snapshot them, create sandboxes from the snapshots, delete snapshots and take
sandboxes of the warm pool (whose refill then starts another), or one kept
sandbox's host-side process (its init or its exec server) under a running
server. After each kill (and, for the server, a start on the same state
directory) every sandbox listed is whole (it runs a command, its volume and the
files of the snapshot it came from are there) and nothing is left of any other:
no record, kept sandbox, runtime file, data directory, listening socket,
volume, cgroup, mount or process; every snapshot listed is whole and no
isolate snapshot is left without its description; ``isolate-run sandbox
prune`` has nothing of the server's to do.

``crashkit.run_kills`` (tests/crashkit.py) is the driver; ``python -m benchmarks.crashes --kills 1000`` runs
it for longer. ISOLATE_TEST_KILLS / ISOLATE_TEST_KILL_SEED change this test's
number of kills and its seed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import test_server as base
from crashkit import KILLS, SANDBOX_KILLS, SEED, _pvc, run_kills, run_sandbox_kills, world


def test_server_kills_at_random_steps_leave_nothing_half_made() -> None:
    with world() as w:
        run_kills(w, KILLS, SEED)


def test_sandbox_process_kills_end_that_sandbox_whole() -> None:
    with world(warm=False) as w:
        run_sandbox_kills(w, SANDBOX_KILLS, SEED)


def test_a_shared_volume_outlives_its_maker_and_a_restart_only_while_held() -> None:
    """A named volume made by a create that asked for its removal, shared by a second sandbox: its maker
    deleted, the server killed and started again, the second one's delete removes it (only the maker's
    record said it goes with its last holder)."""
    with world(warm=False) as w:
        server = w.start()
        try:
            maker = base._create(server, volumes=_pvc("shared-a"))["id"]
            holder = base._create(server, volumes=_pvc("shared-a"))["id"]
            assert server.call("DELETE", f"/v1/sandboxes/{maker}")[0] == 204
            assert os.listdir(w.volume_store) == ["shared-a"]
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
        finally:
            server.stop()
        server = w.start()
        try:
            assert server.call("DELETE", f"/v1/sandboxes/{holder}")[0] == 204
            assert os.listdir(w.volume_store) == []
        finally:
            server.stop()


HOLD_AND_DIE = """
import os, sys, time
from isolate.server.keep import Keeper
keeper = Keeper(sys.argv[1])
if os.fork() == 0:  # a child the server forked (its descriptors with it), still running after the server's end
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(20)
    os._exit(0)
print("locked", flush=True)
os._exit(0)  # as a server killed
"""


def test_a_killed_servers_forked_child_does_not_hold_the_state_directory(tmp_path: Any) -> None:
    import sys

    from isolate.server.keep import Keeper

    path = str(tmp_path / "state")
    done = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, path], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "locked", done.stderr
    Keeper(path).close()  # the next server starts (the child still runs)
