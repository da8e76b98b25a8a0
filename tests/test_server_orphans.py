"""A kept sandbox's code contexts whose processes outlive the server (Python, Node.js and Java drivers, bash shells):
a server killed at any step of their making or ending leaves none that no record names, a resume after a restart
ends those named as ones to end, and a language's default context is made once however many ask at once.
The server runs as in tests/test_server.py, killed as in tests/test_server_bash_kept.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import test_server as base
from test_server_restart import FLAGS, _cell, _run, _until, restart

pytest.importorskip("psutil")

#: The kept drivers in the sandbox, counted (not their relays: "--kept" is in a driver's arguments alone).
_DRIVERS = "grep -lae '[-]-kept' /proc/[0-9]*/cmdline 2>/dev/null | wc -l"
_TOOLS = {"python": "python3", "javascript": "node", "java": "java"}


def _language(language: str) -> None:
    if shutil.which(_TOOLS[language]) is None:
        pytest.skip(f"no {_TOOLS[language]} on this machine")


def _context(server: base.Server, prefix: str, headers: dict[str, str], language: str) -> str:
    status, made = server.call("POST", prefix + "/code/context", {"language": language}, key=None, headers=headers)
    assert status == 200, made
    return str(made["id"])


@pytest.mark.parametrize("language, step", [("python", "start"), ("javascript", "start"), ("java", "start"),
                                            ("python", "delete")])
def test_a_server_killed_as_it_starts_or_ends_a_kept_interpreter_leaves_neither_it_nor_its_name(
        state_dir: str, tmp_path: Path, monkeypatch: Any, language: str, step: str) -> None:
    # A server killed after a kept context's driver started (a process of the sandbox, which outlives it), before
    # its record named the context. Before: no server knew of the driver, which lived on for good. Or killed
    # after a delete ended the driver, before its record stopped naming the context: the next served a context
    # the client had deleted, its interpreter gone. The record names the context as one the next server ends
    # while it is made or deleted (endingContexts): the next ends it, and serves no such context.
    _language(language)
    where = f"isolate.server.code.{'node' if language == 'javascript' else language}:start_kept" \
        if step == "start" else "isolate.server.code:KeptInterpreter.close"
    with restart(state_dir, tmp_path=tmp_path, monkeypatch=monkeypatch, killed_at=where) as r:
        if step == "start":
            with pytest.raises(OSError):  # the server dies mid-request
                _context(r.first, r.prefix, r.headers, language)
        else:
            context = _context(r.first, r.prefix, r.headers, language)
            with pytest.raises(OSError):
                r.first.call("DELETE", r.prefix + f"/code/contexts/{context}", key=None, headers=r.headers)
        second = r.next()
        assert _run(second, r.prefix, r.headers, _DRIVERS).strip() == "0"
        assert second.call("GET", r.prefix + "/code/contexts", key=None, headers=r.headers) == (200, [])


@pytest.mark.parametrize("language", ["python", "bash"])
def test_a_resume_after_a_restart_ends_what_the_record_names_as_ones_to_end(
        state_dir: str, tmp_path: Path, monkeypatch: Any, language: str) -> None:
    # A sandbox paused while a kept context was made, its server killed before the record named the context: the
    # record names the driver (or shell) as one to end, which a restarted server cannot do while the sandbox is
    # paused (its exec server is frozen). Before: its resume did not either, and the process lived on. It ends it.
    _language(language if language != "bash" else "python")
    where = "isolate.server.code.python:start_kept" if language == "python" else \
        "isolate.backends.native.protocol:Connection.keep"
    with restart(state_dir, tmp_path=tmp_path, monkeypatch=monkeypatch, killed_at=where, pause=3) as r:
        def make() -> None:
            with contextlib.suppress(OSError):  # the server dies mid-request
                _context(r.first, r.prefix, r.headers, language)

        threading.Thread(target=make, daemon=True).start()
        time.sleep(1.5)  # the driver started (or the shell kept), the server not yet killed
        assert r.first.call("POST", f"/v1/sandboxes/{r.box_id}/pause")[0] == 202
        second = r.next()
        assert second.call("GET", f"/v1/sandboxes/{r.box_id}")[1]["status"]["state"] == "Paused"
        assert second.call("POST", f"/v1/sandboxes/{r.box_id}/resume")[0] == 202
        count = "pgrep -c -f '^/bin/bash$' || true" if language == "bash" else _DRIVERS
        assert _run(second, r.prefix, r.headers, count).strip() == "0"
        assert second.call("GET", r.prefix + "/code/contexts", key=None, headers=r.headers) == (200, [])


@pytest.mark.parametrize("language", ["bash", "python"])
def test_a_default_context_asked_for_at_once_is_made_once(state_dir: str, language: str) -> None:
    # Four first cells of a language's default context at once. Before: each made default-LANGUAGE, its cell
    # ran in its own shell or driver, and the last replaced the others (the exec server's ends of a shell, the
    # record's name of a driver, which ran on named by nothing). One is made, and runs all four.
    _language("python")
    server = base.Server(*FLAGS, state_dir=state_dir)
    try:
        box_id = base._create(server)["id"]
        prefix, headers = base._endpoint(server, box_id)
        code = "echo $$" if language == "bash" else "import os; print(os.getpid())"
        pids: list[str] = []

        def first_cell() -> None:
            pids.append(_cell(server, prefix, headers, "", code, {"language": language})["stdout"]["text"])

        threads = [threading.Thread(target=first_cell) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(pids) == 4 and len(set(pids)) == 1, pids
        count = "pgrep -c -f '^/bin/bash$'" if language == "bash" else _DRIVERS
        assert _run(server, prefix, headers, count).strip() == "1"
    finally:
        server.stop()


def _prune_leaves(box_id: str) -> None:
    """``isolate-run sandbox prune`` has nothing of the sandbox's to do."""
    done = subprocess.run([os.path.join(os.path.dirname(base.ISOLATE_RUN), "isolate-run"), "sandbox", "prune"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert box_id not in done.stdout, done.stdout


@pytest.mark.parametrize("step", ["start", "delete"])
def test_a_kept_driver_whose_socket_is_gone_is_ended(state_dir: str, tmp_path: Path, monkeypatch: Any,
                                                    step: str) -> None:
    # A kept driver is reached through its socket in the sandbox's /tmp, which any process of the sandbox can
    # remove (a `rm -rf /tmp/*`). A server killed right after start_kept (the record names the context as one to
    # end), its socket removed meanwhile; or a context deleted after a restart, its socket removed. Before: the
    # restore (or the delete) reached no driver and named the context no longer; the driver ran on, named by
    # nothing, for good. It is found by its arguments and ended.
    _language("python")
    hook = {"tmp_path": tmp_path, "monkeypatch": monkeypatch, "killed_at": "isolate.server.code.python:start_kept",
            "pause": 3} if step == "start" else {}
    with restart(state_dir, **hook) as r:
        gone = "rm -f /tmp/.isolate-code-*; echo gone"
        if step == "start":
            def make() -> None:
                with contextlib.suppress(OSError):  # the server dies mid-request
                    _context(r.first, r.prefix, r.headers, "python")

            threading.Thread(target=make, daemon=True).start()
            _until(lambda: _run(r.first, r.prefix, r.headers, "ls /tmp/.isolate-code-*.sock 2>/dev/null || true"))
            assert _run(r.first, r.prefix, r.headers, gone) == "gone"  # before the server kills itself
            second = r.next()
        else:
            context = _context(r.first, r.prefix, r.headers, "python")
            assert "error" not in _cell(r.first, r.prefix, r.headers, context, "x = 1")
            second = r.next()
            assert _run(second, r.prefix, r.headers, gone) == "gone"
            assert second.call("DELETE", r.prefix + f"/code/contexts/{context}", key=None,
                               headers=r.headers)[0] == 200
        assert _run(second, r.prefix, r.headers, _DRIVERS).strip() == "0"
        assert second.call("GET", r.prefix + "/code/contexts", key=None, headers=r.headers) == (200, [])
        _prune_leaves(r.box_id)
