"""``python -m benchmarks.soak`` for two minutes (4 clients): mixed work against one ``isolate-run serve`` (commands,
files, sessions, code contexts, snapshots and forks, the warm pool, egress), then no error, no descriptor, mount,
process, run cgroup, state directory entry or kept sandbox left and memory within its bound (the script's exit
status; its docstring states the bounds). ``ISOLATE_SOAK_SECONDS`` changes the duration."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("uvicorn", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("psutil")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_soak_two_minutes(tmp_path: Path) -> None:
    seconds = os.environ.get("ISOLATE_SOAK_SECONDS", "120")
    # The harness from the checkout, isolate as installed: run from the checkout, its source tree (without the
    # C core a checkout does not build in place) would come first on the path.
    start = (f"import runpy, sys; sys.path.append({REPO!r}); sys.argv[0] = 'soak'; "
             "runpy.run_module('benchmarks.soak', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", start, "--seconds", seconds, "--clients", "4"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=float(seconds) + 600)
    assert done.returncode == 0, _why(done)
    results = json.loads(done.stdout)
    assert results["requests"] > 0 and results["errors"] == 0 and not results["problems"], _why(done)
    assert {"create", "command", "download", "delete", "session-run", "code-run", "snapshot", "pool-command",
            "egress-command"} <= set(results["operations"]), results["operations"]


def _why(done: subprocess.CompletedProcess[str]) -> str:
    """What a failed soak said: its exit status, its problems (from its JSON on standard output: a bound passed,
    the failed requests, the server's log last, as the longest) and the ends of both streams; the problems come
    first, so that a log cut short still shows them."""
    parts = [f"exit status {done.returncode}"]
    try:
        results = json.loads(done.stdout)
    except ValueError:
        parts.append("standard output (not JSON) ends: " + done.stdout[-2000:])
    else:
        parts.append(f"{results.get('requests')} requests, {results.get('errors')} errors; first sample "
                     f"{results.get('first')}, final {results.get('final')}")
        parts += [f"problem: {problem}" for problem in results.get("problems", [])]
    parts.append("standard error ends: " + done.stderr[-3000:])
    return "\n".join(parts)


def test_run_cgroups_are_counted_by_live_creator(tmp_path: Path) -> None:
    """The soak's cgroup count takes the run cgroups of the pids given (the server and its live descendants):
    another's run cgroup, made by a pid a descendant that ended once had, is not the server's (the hour's run
    counted 9 such once pids had wrapped)."""
    sys.path.insert(0, REPO)
    try:
        from benchmarks.soak import _run_cgroups
    finally:
        sys.path.pop(0)
    for hierarchy in ("memory", "freezer"):
        for name in ("isolate-100-0", "isolate-100-1", "isolate-200-0", "isolate-caller", "other"):
            (tmp_path / hierarchy / "parent" / "isolate" / name).mkdir(parents=True)
    assert _run_cgroups({100}, str(tmp_path)) == 4
    assert _run_cgroups({100, 200}, str(tmp_path)) == 6
    assert _run_cgroups({300}, str(tmp_path)) == 0


def test_host_mounts_are_bounded_only_where_the_server_may_mount() -> None:
    """The host's mounts are the whole machine's: as uid 65534 the server and its sandboxes cannot add one (their
    mount namespaces are of user namespaces of their own and never propagate back), so mounts another made meanwhile
    (CI's root suite beside the unprivileged one: Docker containers, overlay mounts) are not the server's leak; as
    root they are bounded, and the problem names the new mount points. ``_may_mount`` is the kernel's answer:
    CAP_SYS_ADMIN, which root has and uid 65534 has not."""
    sys.path.insert(0, REPO)
    try:
        from benchmarks.soak import _counts_passed, _may_mount
    finally:
        sys.path.pop(0)
    first = {"fds": 30, "mounts": 23, "processes": 6, "cgroups": 0, "state_entries": 15}
    others = {**first, "mounts": 40}
    points = [f"/var/lib/docker/overlay2/{i}/merged" for i in range(17)]
    assert _counts_passed(first, others, points, may_mount=False) == []
    passed = _counts_passed(first, others, points, may_mount=True)
    assert passed and passed[0].startswith("mounts: 23 at start, 40 at the end") and points[0] in passed[0]
    leaked = {**first, "processes": 11, "state_entries": 32}
    assert len(_counts_passed(first, leaked, [], may_mount=False)) == 2  # the others stay bounded
    assert _may_mount() is (os.geteuid() == 0)


def test_server_started_again_when_its_port_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness picks a free port and releases it for the server to bind: another's listener may take it
    meanwhile (the longer the server takes to start, as on a loaded host). A connection to that port reached the
    other listener and was taken for the server started, while the server ended on "address already in use": the
    server is started once it listens there itself, and again on another port when it could not bind."""
    sys.path.insert(0, REPO)
    try:
        from benchmarks import opensandbox
    finally:
        sys.path.pop(0)
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    picks = iter([port])
    free = opensandbox._free_port
    monkeypatch.setattr(opensandbox, "_free_port", lambda: next(picks, None) or free())
    try:
        proc, domain = opensandbox._server(True)
        try:
            assert domain != f"127.0.0.1:{port}" and proc.poll() is None
            request = urllib.request.Request(f"http://{domain}/v1/sandboxes",
                                             headers={"OPEN-SANDBOX-API-KEY": opensandbox.KEY})
            with urllib.request.urlopen(request, timeout=30) as answer:
                assert answer.status == 200
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        taken.close()
