"""A kept sandbox's code contexts whose processes outlive the server (Python, Node.js and Java drivers, bash shells):
a server killed at any step of their making or ending leaves none that no record names, a resume after a restart
ends those named as ones to end, and a language's default context is made once however many ask at once.
The server runs as in tests/test_server.py, killed as in tests/test_server_bash_kept.py."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import test_server as base
from test_server_restart import FLAGS, _cell, _run, killed_after

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
    killed_after(tmp_path, monkeypatch, f"isolate.server.code.{'node' if language == 'javascript' else language}"
                 ":start_kept" if step == "start" else "isolate.server.code:KeptInterpreter.close")
    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first)["id"]
        prefix, headers = base._endpoint(first, box_id)
        if step == "start":
            with pytest.raises(OSError):  # the server dies mid-request
                _context(first, prefix, headers, language)
        else:
            context = _context(first, prefix, headers, language)
            with pytest.raises(OSError):
                first.call("DELETE", prefix + f"/code/contexts/{context}", key=None, headers=headers)
        assert first.proc.wait(60) == -9
    finally:
        first.stop()
    killed_after(tmp_path, monkeypatch, "")
    second = base.Server(*FLAGS, state_dir=state_dir)
    try:
        assert _run(second, prefix, headers, _DRIVERS).strip() == "0"
        assert second.call("GET", prefix + "/code/contexts", key=None, headers=headers) == (200, [])
    finally:
        second.stop()


@pytest.mark.parametrize("language", ["python", "bash"])
def test_a_resume_after_a_restart_ends_what_the_record_names_as_ones_to_end(
        state_dir: str, tmp_path: Path, monkeypatch: Any, language: str) -> None:
    # A sandbox paused while a kept context was made, its server killed before the record named the context: the
    # record names the driver (or shell) as one to end, which a restarted server cannot do while the sandbox is
    # paused (its exec server is frozen). Before: its resume did not either, and the process lived on. It ends it.
    _language(language if language != "bash" else "python")
    killed_after(tmp_path, monkeypatch, "isolate.server.code.python:start_kept" if language == "python" else
                 "isolate.backends.native.protocol:Connection.keep", pause=3)
    first = base.Server(*FLAGS, state_dir=state_dir, end_on_exit=False)
    try:
        box_id = base._create(first)["id"]
        prefix, headers = base._endpoint(first, box_id)
        def make() -> None:
            with contextlib.suppress(OSError):  # the server dies mid-request
                _context(first, prefix, headers, language)

        threading.Thread(target=make, daemon=True).start()
        time.sleep(1.5)  # the driver started (or the shell kept), the server not yet killed
        assert first.call("POST", f"/v1/sandboxes/{box_id}/pause")[0] == 202
        assert first.proc.wait(60) == -9
    finally:
        first.stop()
    killed_after(tmp_path, monkeypatch, "")
    second = base.Server(*FLAGS, state_dir=state_dir)
    try:
        assert second.call("GET", f"/v1/sandboxes/{box_id}")[1]["status"]["state"] == "Paused"
        assert second.call("POST", f"/v1/sandboxes/{box_id}/resume")[0] == 202
        count = "pgrep -c -f '^/bin/bash$' || true" if language == "bash" else _DRIVERS
        assert _run(second, prefix, headers, count).strip() == "0"
        assert second.call("GET", prefix + "/code/contexts", key=None, headers=headers) == (200, [])
    finally:
        second.stop()


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
