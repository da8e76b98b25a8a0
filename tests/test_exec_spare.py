"""The exec server's spare monitor (forked ahead of the next command): what a process of the sandbox can do
to it (kill it, stop it) costs at most the saving, never a command or the sandbox; a policy that counts
processes gets no spare. A monitor whose command exited leaving nothing serves the next command (no fork):
its report counts that command alone, and one that left processes behind is not reused."""

from __future__ import annotations

import errno
import os
import signal
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from conftest import NAMESPACES_WHY, policy, running

import isolate
from isolate._core import lib
from isolate.backends.native import protocol

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def _server_children(box: isolate.Sandbox, want: int) -> list[psutil.Process]:
    """The exec server's children once the last command's monitor has gone (it sends EXITED, then
    exits): the spare, if there is one; waits up to 10 s for ``want`` of them."""
    init = box.processes()[0]
    (server,) = init.children()
    deadline = time.monotonic() + 10
    while True:
        children = [c for c in server.children() if running(c)]
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


def test_a_monitor_serves_the_next_command_with_its_own_usage() -> None:
    with isolate.Sandbox(policy(write=())) as box:
        assert box.exec(["/bin/true"]).returncode == 0
        (first,) = _server_children(box, 1)
        busy = box.exec(["sh", "-c", "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done"])
        assert busy.returncode == 0 and busy.report.cpu_seconds > 0.02
        quick = box.exec(["/bin/true"])
        assert quick.returncode == 0
        # The same monitor ran all three (none forked for them) ...
        assert [c.pid for c in _server_children(box, 1)] == [first.pid]
        # ... and each report counts its own command (not the monitor's earlier ones).
        assert quick.report.cpu_seconds < busy.report.cpu_seconds / 2


def test_a_command_that_leaves_processes_gets_a_monitor_of_its_own() -> None:
    with isolate.Sandbox(policy(write=())) as box:
        assert box.exec(["/bin/true"]).returncode == 0
        (first,) = _server_children(box, 1)
        assert box.exec("sleep 30 >/dev/null 2>&1 &").returncode == 0
        # Its monitor ended (the sleep went to the sandbox's init); a new one waits for the next command.
        deadline = time.monotonic() + 10
        while running(first) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not running(first)
        # A later command's timeout ends its own tree, not what an earlier command left.
        timed = box.exec(["sleep", "10"], timeout=0.3)
        assert timed.timed_out
        assert box.exec(["sh", "-c", "pgrep -x sleep || ps -o comm | grep -qx sleep"]).returncode == 0


def test_a_command_longer_than_the_started_delay() -> None:
    # The host does not wait for STARTED (exec); a command outlasting ISO_XS_STARTED_AFTER_MS gets it late.
    with isolate.Sandbox(policy(write=())) as box:
        done = box.exec(["sh", "-c", "sleep 1.3; echo done"])
        assert (done.returncode, done.stdout) == (0, "done\n")


def test_execs_beside_file_calls_from_threads() -> None:
    # exec()'s request shares the file connection (its answers come on its own socketpair): threads mixing
    # both each get their own answers.
    with isolate.Sandbox(policy(write=())) as box:
        def work(i: int) -> tuple[str, str]:
            box.write_file(f"f{i}", str(i))
            done = box.exec(["cat", f"f{i}"])
            return done.stdout, box.read_file(f"f{i}")

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(work, range(16)))
        assert results == [(str(i), str(i)) for i in range(16)]


def test_a_conversation_that_is_not_a_socket_is_refused() -> None:
    with isolate.Sandbox(policy(write=())) as box:
        conn = box._impl.connect()
        r, w = os.pipe()
        try:
            packet, _ = protocol.encode_exec(["", "/bin/true"], 1, 0, int(lib.ISO_XS_F_CONVERSATION))
            conn.send(packet, [r, r, w, w])
            reply = conn.answer()
        finally:
            os.close(r)
            os.close(w)
            conn.close()
        assert (reply.kind, reply.err) == (lib.ISO_XS_ERROR, errno.EPROTO)


def test_a_waiting_monitor_holds_no_descriptor_of_another_command() -> None:
    # A monitor forked while the server held a request's descriptors (none waiting: a command already runs)
    # kept a copy of them, and serves on once its command ends by itself: a socket passed to a command (fd3)
    # never saw its end when the command was killed from inside (the server's port connector hung).
    with isolate.Sandbox(policy()) as box:
        busy = box.spawn(["sleep", "1001"])  # takes the waiting monitor: the next request forks one
        try:
            for _ in range(2):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    # Killed from inside (by itself): an end of its own, after which its monitor serves on.
                    proc = box.spawn(["sh", "-c", "printf up >&3; kill -9 $$"], fd3=theirs.fileno())
                    theirs.close()
                    ours.settimeout(10)
                    assert ours.recv(16) == b"up"
                    assert ours.recv(16) == b"", "a copy of the command's socket outlived it"
                    proc.wait(timeout=30)
                finally:
                    ours.close()
                    theirs.close()
        finally:
            busy.kill()


def _name(process: psutil.Process) -> str:
    try:
        return str(process.name())
    except psutil.NoSuchProcess:  # ended meanwhile (setsid -f's parent)
        return ""


def test_a_detached_command_keeps_what_it_left_below_its_monitor() -> None:
    """A detached command's monitor outlives the command and its host hanging up: what the command left (a
    double fork into a session of its own included) stays below it, not the sandbox's init, until it has ended;
    the monitor, which will not wait for another command, lets the server fork the next one's ahead."""
    with isolate.Sandbox(policy(write=())) as box:
        assert box.exec(["/bin/true"]).returncode == 0
        (spare,) = _server_children(box, 1)
        proc = box.spawn(["sh", "-c", "setsid -f sleep 30 >/dev/null 2>&1"], detached=True)
        proc.close_stdin()
        assert proc.wait(10) == 0
        proc.close()  # the host hangs up: nothing ends
        init = box.processes()[0]
        (server,) = init.children()
        # setsid -f's child may not have exec'd sleep yet when the command (its parent) has ended.
        deadline = time.monotonic() + 10
        while not (sleeps := [p for p in server.children(recursive=True) if _name(p) == "sleep"]):
            assert time.monotonic() < deadline, "the command's double fork never ran sleep"
            time.sleep(0.01)
        (sleep,) = sleeps
        assert sleep.parent() == spare  # the monitor that ran the command, detached, its subreaper
        # The server forked the next command's monitor ahead: two children (the detached one and the spare).
        assert len(_server_children(box, 2)) == 2
        sleep.kill()
        deadline = time.monotonic() + 10
        while running(spare) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not running(spare)  # nothing left below it: it ended
        assert box.exec(["/bin/true"]).returncode == 0


def test_output_ends_close_when_the_command_ends_on_a_monitor_that_serves_on() -> None:
    # The monitor holds the command's stdout and stderr until its EXITED is sent (their hang-up then
    # wakes the host no more), and must let go of them before it serves the next command: else a
    # reader of a spawned command's output would wait for its end for ever.
    import select

    with isolate.Sandbox(policy(write=())) as box:
        for round in range(3):
            proc = box.spawn(["sh", "-c", f"printf out{round}; printf err{round} >&2"])
            try:
                assert proc.wait(timeout=30) == 0
                for stream, want in ((proc.stdout, f"out{round}"), (proc.stderr, f"err{round}")):
                    assert stream is not None
                    got = b""
                    while True:
                        ready, _, _ = select.select([stream], [], [], 10)
                        assert ready, f"round {round}: the command's output never reached its end"
                        chunk = os.read(stream.fileno(), 4096)
                        if not chunk:
                            break
                        got += chunk
                    assert got == want.encode()
            finally:
                proc.close()
            done = box.exec(["sh", "-c", f"head -c 300000 /dev/zero; echo tail{round} >&2"])
            assert (done.returncode, len(done.stdout), done.stderr) == (0, 300000, f"tail{round}\n")


@pytest.mark.parametrize("spare", [True, False])
def test_strings_in_a_memfd_that_did_not_come_are_refused(spare: bool) -> None:
    # An EXEC whose strings are in a memfd (ISO_XS_F_STRINGS_FD) with its own conversation, and no descriptor
    # but the conversation: the server's check (one descriptor at least) counted the conversation, which it
    # then takes off; a monitor forked for the command (no spare: a pids limit) then moved -1 descriptors
    # and crashed (a hang-up, not an answer). A spare refused it already (it parses the request again).
    try:
        box = isolate.Sandbox(policy(write=(), **({} if spare else {"limits": isolate.Limits(pids=50)}))).start()
    except isolate.UnsupportedError as exc:  # no cgroup this user may write (a pids limit is refused then)
        pytest.skip(str(exc)[:120])
    with box:
        conn = box._impl.connect()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            flags = int(lib.ISO_XS_F_CONVERSATION | lib.ISO_XS_F_STRINGS_FD)
            conn.send(protocol._header(int(lib.ISO_XS_EXEC), flags, 0, 0, 2, 1), [theirs.fileno()])
            theirs.close()
            ours.settimeout(30)
            reply = ours.recv(4096)
        finally:
            ours.close()
            theirs.close()
            conn.close()
        assert len(reply) >= protocol.REPLY_SIZE, "the monitor hung up instead of answering"
        kind, err = struct.unpack_from("=Ii", reply, 4)
        assert (kind, err) == (lib.ISO_XS_ERROR, errno.EPROTO)
        assert box.exec(["/bin/true"]).returncode == 0
