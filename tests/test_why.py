"""Denial tracing (issue 29): every file access the policy refused is named in the report.

The init looks at each path system call the program makes (csrc/why.c) and lets it continue; the
report names the path as given and as resolved, the access and the mechanism that refused it. Each
test makes the accesses a program would and checks what the report says of them, as root and as
an unprivileged caller.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ISOLATE_RUN, policy, py, python_read
from test_unix_sockets import Server

import isolate


def _find(denied: list[dict[str, object]], path: str, access: str) -> dict[str, object]:
    for entry in denied:
        if entry.get("path") == path and entry.get("access") == access:
            return entry
    raise AssertionError(f"no {access} of {path} in {denied}")


def test_each_refused_access_is_named(workdir: str) -> None:
    outside = os.path.join(workdir, "outside")  # a host directory the policy does not grant
    os.mkdir(outside)
    secret, tool = os.path.join(outside, "secret.txt"), os.path.join(outside, "tool.sh")
    for path, text, mode in ((secret, "x", 0o644), (tool, "#!/bin/sh\necho ran\n", 0o755)):
        with open(path, "w") as handle:
            handle.write(text)
        os.chmod(path, mode)
    ro = os.path.join(workdir, "ro")  # granted read-only
    os.mkdir(ro)
    victim = os.path.join(ro, "victim")
    with open(victim, "w") as handle:
        handle.write("keep me")
    server = Server(os.path.join(ro, "s.sock"))
    code = f"""
import os, socket
def attempt(action):
    try:
        action()
    except OSError:
        pass
attempt(lambda: open({secret!r}).read())
attempt(lambda: os.waitpid(os.posix_spawn({tool!r}, [{tool!r}], {{}}), 0))
attempt(lambda: open({ro!r} + "/new", "w"))
attempt(lambda: os.unlink({victim!r}))
attempt(lambda: open("/proc/self/oom_score_adj", "w").write("0"))
attempt(lambda: socket.socket(socket.AF_UNIX).connect({server.path!r}))
print("done")
"""
    try:
        # Nothing writable but the private /tmp: the caller's cwd may hold workdir.
        result = isolate.run(py(code), policy=policy(read=(*python_read(), ro), write=(), cwd="/tmp",
                                                     trace_denials=True), capture_output=True)
    finally:
        server.close()
    assert result.stdout == b"done\n", result.stderr
    assert os.path.exists(victim) and server.accepted == 0
    denied = result.report.denied
    read = _find(denied, secret, "read")
    assert (read["mechanism"], read["resolved"], read["count"]) == ("absent", secret, 1)
    assert _find(denied, tool, "execute")["mechanism"] == "absent"
    created = _find(denied, ro + "/new", "create")
    assert (created["mechanism"], created["resolved"]) == ("read-only", ro + "/new")
    assert _find(denied, victim, "remove")["mechanism"] == "read-only"
    # /proc is mounted read-only (a rule on an image's / reaches it): its files are refused by the mount, as
    # Landlock refuses them too where the kernel checks Landlock first.
    proc = _find(denied, "/proc/self/oom_score_adj", "write")
    assert proc["mechanism"] in ("read-only", "landlock") and str(proc["resolved"]).endswith("/oom_score_adj")
    connect = _find(denied, server.path, "connect")
    assert connect["mechanism"] == "unix-socket"
    assert result.report.denials_observed["landlock"]["observed"] is True


def test_a_clean_run_reports_nothing() -> None:
    # Python probes dozens of missing files at start: none of them is a denial.
    result = isolate.run(py("import json, os; print(os.getcwd() != '')"), policy=policy(trace_denials=True),
                         capture_output=True)
    assert result.returncode == 0, result.stderr
    assert result.report.denied == []
    assert result.report.denials_observed["landlock"]["calls_looked_at"] > 0


def test_cli_hint_names_the_flag() -> None:
    if not os.path.exists("/etc/hosts"):
        pytest.skip("no /etc/hosts on this host")
    run = subprocess.run([ISOLATE_RUN, "--why", "--", "sh", "-c", "echo x > /etc/hosts"], capture_output=True,
                         text=True)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.startswith("isolate-run: denied:")]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("isolate-run: denied: write /etc/hosts (")
    assert lines[0].endswith("grant it with --rw /etc/hosts") or "file modes" in lines[0]


def test_refused_where_no_init_can_look() -> None:
    with pytest.raises(isolate.UnsupportedError, match="trace_denials"):
        isolate.run(["true"], policy=isolate.Policy(trace_denials=True, namespaces=False, write=(), backend="native"))
    with pytest.raises(isolate.UnsupportedError, match="trace_denials"):
        subprocess.run(["true"], preexec_fn=isolate.Policy(trace_denials=True).preexec_fn)


def test_profile_field_round_trips() -> None:
    text = isolate.Policy(trace_denials=True).to_toml()
    assert "trace_denials = true" in text
    assert isolate.Policy.from_toml(text).trace_denials is True
    assert "trace_denials" not in isolate.Policy().to_toml()
    with pytest.raises(isolate.PolicyError, match="trace_denials"):
        isolate.Policy(trace_denials=1)  # type: ignore[arg-type]


def test_a_kept_sandbox_reports_each_commands_own(workdir: str) -> None:
    ro = os.path.join(workdir, "ro")
    os.mkdir(ro)
    with open(os.path.join(ro, "keep"), "w") as handle:
        handle.write("x")
    sandbox = isolate.Sandbox(policy(read=(*python_read(), ro), write=(), cwd="/tmp", trace_denials=True))
    with sandbox:
        first = sandbox.exec(["sh", "-c", f"touch {ro}/new; echo ok > /tmp/fine"])
        second = sandbox.exec(["sh", "-c", f"rm {ro}/keep; cat /tmp/fine"])
        third = sandbox.exec(["true"])
    assert [(e["access"], e["path"], e["mechanism"]) for e in first.report.denied] == [
        ("create", f"{ro}/new", "read-only")]
    assert [(e["access"], e["path"], e["mechanism"]) for e in second.report.denied] == [
        ("remove", f"{ro}/keep", "read-only")]
    assert second.stdout == "ok\n" and third.report.denied == []


def test_explain_after_a_run(workdir: str) -> None:
    report = os.path.join(workdir, "r.json")
    run = subprocess.run([ISOLATE_RUN, "--why", "--report", report, "--", "sh", "-c", "echo x > /etc/hosts"],
                         capture_output=True, text=True)
    assert run.returncode != 0
    explained = subprocess.run([ISOLATE_RUN, "--explain", "--report", report], capture_output=True, text=True)
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout.startswith("denied: write /etc/hosts ("), explained.stdout


def test_a_path_longer_than_the_tracer_keeps_is_named_cut(workdir: str) -> None:
    # The report keeps a path's first 255 bytes: a longer one names another file (or none), so the entry
    # says it is cut, and neither the hint nor learn offers to grant the cut name.
    outside = os.path.join(workdir, "outside")  # not granted
    deep = os.path.join(outside, *(["d" * 60] * 5))  # > 255 bytes
    os.makedirs(deep)
    target = os.path.join(deep, "secret.txt")
    with open(target, "w") as handle:
        handle.write("x")
    code = f"""
try:
    open({target!r}).read()
except OSError:
    pass
print("done")
"""
    result = isolate.run(py(code), policy=policy(read=python_read(), write=(), cwd="/tmp", trace_denials=True),
                         capture_output=True)
    assert result.stdout == b"done\n", result.stderr
    cut = [e for e in result.report.denied if e.get("cut")]
    assert len(cut) == 1 and cut[0]["access"] == "read", result.report.denied
    assert target.startswith(str(cut[0]["path"])) and len(str(cut[0]["path"])) == 255
    from isolate.cli.learn import Learned
    from isolate.cli.why import file_hint, grant_flag

    assert grant_flag(cut[0]) is None
    assert "longer than the tracer keeps" in file_hint(cut[0], isolate.Policy())
    learned = Learned()
    assert learned.add(cut) == 0 and not learned.read and not learned.write
    assert any("longer than the tracer keeps" in why for why in learned.unfixable.values())
