"""A kept sandbox's bash context (``isolate-run serve --state-dir``), whose shell outlives its server: its ends
held by the sandbox's exec server (isolate.server.code.shell), attacked from the sandbox and from the API.
The server runs as in tests/test_server.py."""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import test_server as base
from test_server_restart import FLAGS, _cell, _in_session, _run, restart

pytest.importorskip("psutil")


def _call(server: base.Server, method: str, path: str, headers: dict[str, str], within: float) -> tuple[int, bytes]:
    """A request that must be answered within ``within`` seconds (TimeoutError otherwise)."""
    request = urllib.request.Request(f"http://{server.domain}{path}", method=method)
    for name, value in headers.items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=within) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _events(context: Any, code: str) -> list[tuple[str, Any]]:
    """What a code context's cell emits, in order."""
    got: list[tuple[str, Any]] = []
    context.run(code, lambda kind, payload: got.append((kind, payload)))
    return got


def _context(server: base.Server, prefix: str, headers: dict[str, str]) -> str:
    status, context = server.call("POST", prefix + "/code/context", {"language": "bash"}, key=None, headers=headers)
    assert status == 200, context
    return str(context["id"])


def test_a_paused_sandboxs_bash_context_is_deleted_once_it_runs(state_dir: str) -> None:
    # Before: the delete waited for the frozen exec server (30 s to drop the shell's ends, 30 more to take them
    # for a shell not yet adopted), and what it could not reach lived on: the shell, unknown to every server
    # from then on, and its ends, held by the exec server. A kept bash context's delete needs the sandbox
    # running; refused (409) while it is paused, it ends whole once resumed.
    server = base.Server(*FLAGS, state_dir=state_dir)
    try:
        box_id = base._create(server)["id"]
        prefix, headers = base._endpoint(server, box_id)
        context = _context(server, prefix, headers)
        shell = _cell(server, prefix, headers, context, "echo $$")["stdout"]["text"].strip()
        assert server.call("POST", f"/v1/sandboxes/{box_id}/pause")[0] == 202
        for path in (f"/code/contexts/{context}", "/code/contexts?language=bash"):
            status, body = _call(server, "DELETE", prefix + path, headers, within=20)
            assert status == 409 and b"resume" in body, (status, body)
        assert server.call("POST", f"/v1/sandboxes/{box_id}/resume")[0] == 202
        status, listed = server.call("GET", prefix + "/code/contexts", key=None, headers=headers)
        assert listed == [{"id": context, "language": "bash"}], listed
        assert _call(server, "DELETE", prefix + f"/code/contexts/{context}", headers, within=20)[0] == 200
        assert _run(server, prefix, headers, f"test -d /proc/{shell} && echo on || echo gone") == "gone"
    finally:
        server.stop()


def test_a_bash_context_past_what_the_exec_server_keeps_is_a_clear_refusal(tmp_path: Path) -> None:
    # The exec server holds at most 64 shells' ends (csrc/xs_keep.c); a server lets a sandbox have 32 contexts,
    # so only ends a server left there (one killed between a context's start and its record's write) reach
    # that. Before: the next kept bash context was refused as "400 INVALID_PATH code-ctx-...: No space left on
    # device". Now a 429 that says what is full; the shell started for it ends, and nothing is left held.
    import os

    from conftest import policy

    from isolate import Sandbox, Workspace
    from isolate.server.code import CodeContext
    from isolate.server.common import to_api_error

    (tmp_path / "w").mkdir()
    with Sandbox(policy(write=()), workspace=Workspace(str(tmp_path / "w"))) as box:
        read, write = os.pipe()
        try:
            for index in range(64):
                box._conn().keep(f"left-{index}", [read, write], note=1)
        finally:
            os.close(read)
            os.close(write)
        with pytest.raises(Exception) as raised:
            CodeContext(box, "bash", None, kept=True)
        refusal = to_api_error(raised.value)
        assert refusal.status == 429 and "64" in refusal.message, (refusal.status, refusal.code, refusal.message)
        assert box.exec("pgrep -c -x bash || true").stdout.strip() == "0"
        box._conn().keep("left-0", [])  # one let go: room for one
        context = CodeContext(box, "bash", None, kept=True)
        try:
            got = _events(context, "echo $((6 * 7))")
            assert got[0] == ("stdout", b"42\n"), got
        finally:
            context.close()


def test_kept_shells_leave_the_exec_server_room_under_a_low_open_files_limit(tmp_path: Path) -> None:
    # The exec server runs under the sandbox's open-files limit, and each kept bash context's shell costs it three
    # descriptors for as long as the context lives. Before: under a limit of 32 the seventh context failed as
    # "starting /bin/bash failed at exec-server: Protocol error" (its request's descriptors found no room), and
    # the host ended the sandbox (a command's monitor went away). The exec server keeps descriptors only below
    # half its limit: past that, a 429 that says why, and the sandbox runs on.
    import dataclasses

    from conftest import policy

    from isolate import Sandbox, Workspace
    from isolate.server.code import CodeContext
    from isolate.server.common import to_api_error

    (tmp_path / "w").mkdir()
    base_policy = policy(write=())
    low = dataclasses.replace(base_policy, limits=dataclasses.replace(base_policy.limits, open_files=32))
    with Sandbox(low, workspace=Workspace(str(tmp_path / "w"))) as box:
        contexts: list[CodeContext] = []
        try:
            with pytest.raises(Exception) as raised:
                for _ in range(12):
                    contexts.append(CodeContext(box, "bash", None, kept=True))
            refusal = to_api_error(raised.value)
            assert refusal.status == 429 and "open-files" in refusal.message, (refusal.status, refusal.message)
            assert contexts, "not one kept bash context under a limit of 32"
            assert box.exec("echo runs").stdout == "runs\n"
            for context in contexts:
                got = _events(context, "echo $((6 * 7))")
                assert got[0] == ("stdout", b"42\n"), got
        finally:
            for context in contexts:
                context.close()
        assert box.exec("echo after").stdout == "after\n"


def test_a_bash_context_deleted_as_its_first_cell_adopts_the_shell_leaks_nothing(tmp_path: Path,
                                                                                  monkeypatch: Any) -> None:
    # A context served again (its shell left by the last server) adopts its shell at its first use, and its
    # delete adopts it too (to learn what to end) without the cell's lock (a cell may run for ever). Before: the
    # two adopted it each, and the cell's adoption, made last, stayed the context's after the delete, its
    # descriptors (the shell's pipes, channel and pidfds) held by the server for good. The adoption is the
    # context's alone now, and after its end none is made.
    import os
    import threading

    from conftest import policy

    from isolate import Sandbox, Workspace
    from isolate.server.code import CodeContext
    from isolate.server.code import shell as bash

    (tmp_path / "w").mkdir()
    with Sandbox(policy(write=()), workspace=Workspace(str(tmp_path / "w"))) as box:
        first = CodeContext(box, "bash", None, kept=True)
        assert _events(first, "x=3")[-1][1]["error"] is None
        first.detach()  # as a server's stop leaves it
        held = len(os.listdir("/proc/self/fd"))
        adopt = bash._adopt

        def slow_adopt(*args: Any) -> Any:
            time.sleep(0.5)  # both adoptions under way at once
            return adopt(*args)

        monkeypatch.setattr(bash, "_adopt", slow_adopt)
        again = CodeContext(box, "bash", first.id, kept=True, fresh=False)
        cell = threading.Thread(target=_events, args=(again, "echo $x"))
        cell.start()
        time.sleep(0.1)
        again.close()
        cell.join(30)
        assert not cell.is_alive()
        assert len(os.listdir("/proc/self/fd")) <= held, os.listdir("/proc/self/fd")
        assert box.exec("pgrep -c -x bash || true").stdout.strip() == "0"


def test_a_bash_context_of_a_sandbox_paused_across_a_restart_runs_once_resumed(state_dir: str) -> None:
    # A sandbox paused when its server was killed is served again paused, and its resume attaches it again (a
    # new handle). Before: its code contexts kept the handle they were made with, of a sandbox not attached: each
    # cell failed ("the sandbox is not running; start() it first"), and a bash context's delete could reach
    # neither its shell nor what the exec server holds for it, answered 200 and left the shell running. Its
    # contexts follow the sandbox's handle now.
    with restart(state_dir) as r:
        prefix, headers = r.prefix, r.headers
        context = _context(r.first, prefix, headers)
        shell = _cell(r.first, prefix, headers, context, "y=5; echo $$")["stdout"]["text"].strip()
        status, python = r.first.call("POST", prefix + "/code/context", {"language": "python"}, key=None,
                                      headers=headers)
        assert status == 200, python
        assert "error" not in _cell(r.first, prefix, headers, python["id"], "w = 6")
        assert r.first.call("POST", f"/v1/sandboxes/{r.box_id}/pause")[0] == 202
        second = r.next()
        assert second.call("POST", f"/v1/sandboxes/{r.box_id}/resume")[0] == 202
        got = _cell(second, prefix, headers, context, "echo $y $$")
        assert "error" not in got and got["stdout"]["text"].split() == ["5", shell], got
        got = _cell(second, prefix, headers, python["id"], "print(w + 1)")  # a Python context's handle too
        assert "error" not in got and got["stdout"]["text"].strip() == "7", got
        assert second.call("DELETE", prefix + f"/code/contexts/{context}", key=None, headers=headers)[0] == 200
        assert _run(second, prefix, headers, f"test -d /proc/{shell} && echo on || echo gone") == "gone"


def test_a_shells_pid_taken_by_another_process_is_not_adopted(tmp_path: Path) -> None:
    # What the exec server holds names the shell by its pid, a number the kernel gives again once the shell is
    # reaped (a cell's `exit`, then the numbers cycled). Before: the next server adopted whatever process of the
    # sandbox held the number then (a user's background command, say) and the context's delete killed it and
    # what its monitor held. Only the process that reads the kept input pipe is adopted: here the note names
    # another process of the sandbox, as a reused number would.
    import os

    from conftest import policy

    from isolate import Sandbox, Workspace
    from isolate.server.background import host_process
    from isolate.server.code import CodeContext

    (tmp_path / "w").mkdir()
    with Sandbox(policy(write=()), workspace=Workspace(str(tmp_path / "w"))) as box:
        first = CodeContext(box, "bash", None, kept=True)
        other = box.spawn(["sleep", "1000"], detached=True)
        try:
            inner = box.exec("pgrep -x sleep").stdout.split()
            assert len(inner) == 1, inner
            host = host_process(box, int(inner[0]))
            assert host is not None
            conn = box._conn()
            ends = [conn.take(f"code-{first.id}", index)[0] for index in range(3)]
            try:
                conn.keep(f"code-{first.id}", ends, note=host.pid)  # the shell's ends, another's pid
            finally:
                for fd in ends:
                    os.close(fd)
            first.detach()
            again = CodeContext(box, "bash", first.id, kept=True, fresh=False)
            got = _events(again, "echo hi")
            assert got[-1][1]["error"] is not None and "did not survive" in got[-1][1]["error"]["evalue"], got
            again.close()
            assert box.exec("pgrep -x sleep || true").stdout.split() == inner, "the other process was ended"
        finally:
            other.kill()
            other.close()


@pytest.mark.parametrize("kind, step", [("session", "keep"), ("context", "keep"), ("session", "letgo")])
def test_a_server_killed_as_it_keeps_or_lets_go_of_a_shell_leaves_neither_shell_nor_name(
        state_dir: str, tmp_path: Path, monkeypatch: Any, kind: str, step: str) -> None:
    # A server killed after the exec server kept a new bash session's (or bash context's) shell ends, before its
    # record named the shell. Before: the next server knew no key of it, and the shell lived on in the exec
    # server's table for good (one of its 64 keys). Or killed as it deleted a session, after the exec server let go
    # of the ends: the next served a session the client had deleted (its shell gone). The record names the shell
    # as one the next server ends from before its ends are kept until it is a session's (or context's), and from
    # before a delete until they are let go: the next server ends it, and serves no such session.
    where = "isolate.backends.native.protocol:Connection.keep" if step == "keep" else \
        "isolate.server.code.shell:BashShell.close"
    with restart(state_dir, tmp_path=tmp_path, monkeypatch=monkeypatch, killed_at=where) as r:
        prefix, headers = r.prefix, r.headers
        path, body = ("/session", None) if kind == "session" else ("/code/context", {"language": "bash"})
        session = ""
        with contextlib.ExitStack() as stack:
            if step == "keep":
                stack.enter_context(pytest.raises(OSError))  # the server dies mid-request
            status, made = r.first.call("POST", prefix + path, body, key=None, headers=headers)
        if step == "letgo":
            assert status == 200, made
            session = made["session_id"]
            with pytest.raises(OSError):
                r.first.call("DELETE", prefix + f"/session/{session}", key=None, headers=headers)
        second = r.next()
        assert _run(second, prefix, headers, "pgrep -c -f '^/bin/bash$' || true").strip() == "0"
        assert second.call("GET", prefix + "/code/contexts?language=bash", key=None, headers=headers) == (200, [])
        if session:
            status, body = second.call("POST", prefix + f"/session/{session}/run", {"command": "true"}, key=None,
                                       headers=headers)
            assert status == 404, (status, body)


@pytest.mark.parametrize("cut", ["deadline", "kill"])
def test_a_long_command_cut_short_leaves_none_of_its_chunks_in_the_shell(state_dir: str, cut: str) -> None:
    # A command longer than a pipe's atomic write goes to the shell in chunks, each line an assignment to a
    # variable of a random name that only the command's last line evaluates and unsets. Before: a run cut between
    # its chunks (its deadline came while the shell read them, a byte at a time; or its server was killed, here
    # while the shell was stopped and the pipe full) left them set in the shell for good (megabytes, listed by
    # every `set`). The first run after an unfinished one unsets them (the next server's, in the shell it adopts).
    import http.client
    import threading

    with restart(state_dir) as r:
        status, made = r.first.call("POST", r.prefix + "/session", None, key=None, headers=r.headers)
        assert status == 200, made
        session = made["session_id"]
        long = {"command": "echo never #" + "x" * (3 << 20), "timeout": 300 if cut == "deadline" else 0}
        if cut == "deadline":  # the shell reads 3 MiB in seconds
            status, body = r.first.call("POST", r.prefix + f"/session/{session}/run", long, key=None,
                                        headers=r.headers)
            assert status == 200 and b"did not finish" in body and b"exit status 124" in body, (status, body[-300:])
            server = r.first
        else:
            shell = _in_session(r.first, r.prefix, r.headers, session, "echo $$").strip()
            _run(r.first, r.prefix, r.headers, f"kill -STOP {shell}")

            def cut_short() -> None:
                with contextlib.suppress(OSError, http.client.HTTPException):  # the server dies mid-request
                    r.first.call("POST", r.prefix + f"/session/{session}/run", long, key=None, headers=r.headers)

            threading.Thread(target=cut_short, daemon=True).start()
            time.sleep(2)  # the pipe full of its first chunks, the rest waiting
            server = r.next()
            _run(server, r.prefix, r.headers, f"kill -CONT {shell}")
        chunks = "set | grep -cE '^__isolate_[0-9a-f]{12}_[0-9]+='; echo works"
        assert _in_session(server, r.prefix, r.headers, session, chunks).split() == ["0", "works"]
