"""The first hour of a new user: what the CLI says when a limit ends the run, the program's home,
its PATH, --help, --chdir and --explain, and what the report says it could observe."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ISOLATE_RUN, LANDLOCK_WHY, PYTHON, skip_unless_runnable
from test_limits import cgroup_usable

CLI = [ISOLATE_RUN]


def cli(*args: str, cwd: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    skip_unless_runnable(args)
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)  # type: ignore[call-overload]


#: Only the system directories, no writable current directory.
SYSTEM = ["--no-defaults"] + [arg for p in ("/usr", "/bin", "/lib", "/lib64") if os.path.exists(p)
                              for arg in ("--ro", p)]


def isolate_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("isolate-run:")]


# -- a limit that ends the run says so on stderr ---------------------------------------------------


def test_wall_clock_kill_is_one_line(workdir: str) -> None:
    result = cli("--wall", "1", "--", "sleep", "30", cwd=workdir)
    assert result.returncode == 128 + 9
    assert isolate_lines(result.stderr) == ["isolate-run: killed: wall-clock limit 1 s"], result.stderr


def test_file_size_kill_is_one_line(workdir: str) -> None:
    result = cli("--fsize", "1M", "--", "dd", "if=/dev/zero", "of=big", "bs=1M", "count=4", cwd=workdir)
    assert result.returncode == 128 + 25  # SIGXFSZ
    assert isolate_lines(result.stderr) == ["isolate-run: killed: file size limit 1M reached (SIGXFSZ)"], \
        result.stderr


@pytest.mark.skipif(not cgroup_usable("memory"), reason="no writable memory cgroup for this caller")
def test_memory_kill_is_one_line(workdir: str) -> None:
    result = cli("--backend", "native", "--memory", "64M", "--", PYTHON, "-c", "b = bytearray(512 << 20)",
                 cwd=workdir)
    assert result.returncode != 0
    assert isolate_lines(result.stderr) == ["isolate-run: killed: memory limit 64M reached"], result.stderr


@pytest.mark.skipif(not cgroup_usable("cpuacct"), reason="no writable cpuacct cgroup for this caller")
def test_cpu_kill_is_one_line(workdir: str) -> None:
    result = cli("--backend", "native", "--cpu", "1", "--", "sh", "-c", "while :; do :; done", cwd=workdir)
    assert result.returncode != 0
    assert isolate_lines(result.stderr) == ["isolate-run: killed: CPU time limit 1 s reached"], result.stderr


def test_no_limit_no_line(workdir: str) -> None:
    result = cli("--wall", "10", "--", "sh", "-c", "exit 3", cwd=workdir)
    assert result.returncode == 3
    assert isolate_lines(result.stderr) == []


# -- the program's home ------------------------------------------------------------------------------


def test_home_exists_is_writable_and_private(workdir: str) -> None:
    script = ('echo "$HOME"; cd && touch made && ls -A; mkdir -p ~/.cache/pip ~/.config && echo ok; '
              'ls -ld ~ | cut -c1-10')
    first = cli("--", "sh", "-c", script, cwd=workdir)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["/home/sandbox", "made", "ok", "drwx------"]
    # Private to the run: the next run starts empty.
    second = cli("--", "sh", "-c", "ls -A ~ | wc -l", cwd=workdir)
    assert second.stdout.strip() == "0"


def test_home_file_is_shared_read_only(workdir: str) -> None:
    with open(os.path.join(workdir, "gitconfig"), "w") as handle:
        handle.write("[user]\n\tname = Sandbox Test\n")
    os.chmod(os.path.join(workdir, "gitconfig"), 0o644)
    env = {**os.environ, "HOME": workdir}
    result = cli("--home-file", "gitconfig", "--", "sh", "-c",
                 "cat ~/gitconfig; echo more >> ~/gitconfig || echo read-only", cwd=workdir, env=env)
    assert result.returncode == 0, result.stderr
    assert "name = Sandbox Test" in result.stdout and "read-only" in result.stdout
    assert open(os.path.join(workdir, "gitconfig")).read().count("\n") == 2
    missing = cli("--home-file", "nothing-here", "--", "true", cwd=workdir, env=env)
    assert missing.returncode == 125 and "home_files" in missing.stderr


def test_home_none_and_elsewhere(workdir: str) -> None:
    env = {**os.environ, "HOME": "/caller/home"}
    none = cli("--home", "none", "--", "sh", "-c", 'echo "$HOME"; ls /home 2>&1 || true', cwd=workdir, env=env)
    assert none.stdout.split()[0] == "/caller/home"
    elsewhere = cli("--home", "/tmp/me", "--", "sh", "-c", 'echo "$HOME"; touch ~/x && echo ok', cwd=workdir)
    assert elsewhere.stdout.split() == ["/tmp/me", "ok"], elsewhere.stderr
    inside = cli("--home", workdir + "/h", "--", "true", cwd=workdir)
    assert inside.returncode == 125 and "inside the granted" in inside.stderr


def test_home_without_namespaces(workdir: str) -> None:
    os.chmod(workdir, 0o1777)  # sticky: the state directory lies beneath (kernel/way.py)
    state = os.path.join(workdir, "state")
    env = {**os.environ, "ISOLATE_STATE_DIR": state}
    result = cli("--no-namespaces", "--", "sh", "-c", 'echo "$HOME"; echo x > ~/kept && cat ~/kept', cwd=workdir,
                 env=env)
    assert result.returncode == 0, result.stderr
    home = result.stdout.split()[0]
    assert result.stdout.split()[1] == "x"
    info = os.stat(home)
    assert info.st_uid == (65534 if os.geteuid() == 0 else os.geteuid()) and info.st_mode & 0o777 == 0o700
    refused = cli("--no-namespaces", "--home-file", "x", "--", "true", cwd=workdir, env=env)
    assert refused.returncode == 125 and "home_files" in refused.stderr


# -- PATH ----------------------------------------------------------------------------------------------


def test_path_is_reduced_and_ungranted_command_is_named(workdir: str) -> None:
    bindir = os.path.join(workdir, "tools", "bin")
    os.makedirs(bindir)
    tool = os.path.join(bindir, "mytool")
    with open(tool, "w") as handle:
        handle.write("#!/bin/sh\necho tool-ran\n")
    os.chmod(tool, 0o755)
    os.chmod(os.path.join(workdir, "tools"), 0o755)
    env = {**os.environ, "PATH": f"/nonexistent/bin:{bindir}:/usr/bin:/bin"}
    result = cli(*SYSTEM, "--chdir", "/usr", "--", "sh", "-c", 'echo "$PATH"', cwd=workdir, env=env)
    assert result.stdout.strip() == "/usr/bin:/bin", result.stderr
    # The tool lives in a directory that is not granted: say which and how to grant it.
    denied = cli(*SYSTEM, "--chdir", "/usr",
                 "--", "mytool", cwd=workdir, env=env)
    assert denied.returncode == 127
    assert isolate_lines(denied.stderr) == [
        f"isolate-run: mytool: found at {tool}, whose directory is not granted to the sandbox; "
        f"grant it with --ro {bindir} (read=)"], denied.stderr
    by_path = cli(*SYSTEM, "--chdir", "/usr",
                  "--", tool, cwd=workdir, env=env)
    assert by_path.returncode == 127 and f"its directory {bindir} is not granted" in by_path.stderr
    granted = cli("--ro", bindir, "--", "mytool", cwd=workdir, env=env)
    assert granted.stdout.strip() == "tool-ran", granted.stderr


# -- --help, --chdir, --explain ----------------------------------------------------------------------------


def test_help_has_units_examples_and_defaults(workdir: str) -> None:
    result = cli("--help", cwd=workdir, env={**os.environ, "COLUMNS": "1000"})
    assert result.returncode == 0
    from isolate.cli.flags import build_parser

    actions = [a for a in build_parser()._actions if a.option_strings and a.dest not in ("help", "version")]
    assert len(actions) >= 25
    for action in actions:
        assert action.help and "\n" not in action.help, action.option_strings
        assert action.help in " ".join(result.stdout.split()) or action.help.split(",")[0] in result.stdout
    for action in actions:
        if action.dest in ("memory", "wall", "cpu", "fsize", "pids", "nofile", "cpus", "ro", "rw", "home_file"):
            assert "e.g. " + action.option_strings[0] in action.help, action.help
    assert "no network" in result.stdout and "current\ndirectory writable" in result.stdout
    assert "examples:" in result.stdout


def test_chdir_takes_a_relative_path(workdir: str) -> None:
    os.mkdir(os.path.join(workdir, "sub"))
    result = cli("--chdir", "sub", "--", "pwd", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == os.path.join(workdir, "sub")


def test_explain_shows_resolved_paths(workdir: str) -> None:
    os.mkdir(os.path.join(workdir, "out"))
    result = cli("--explain", "--rw", "out", "--", "ls", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert f"write out = {os.path.join(workdir, 'out')}" in result.stdout
    assert f"cwd   {workdir}" in result.stdout
    assert "command ls -> /usr/bin/ls" in result.stdout or "command ls -> /bin/ls" in result.stdout
    if os.path.islink("/lib"):
        assert f"read  /lib -> {os.path.realpath('/lib')}" in result.stdout


# -- what the report can see of denials ------------------------------------------------------------------


def test_report_says_which_denials_it_observes(workdir: str) -> None:
    from conftest import policy

    import isolate
    from isolate.backends import native
    from isolate.kernel import landlock

    with_ns = isolate.run(["sh", "-c", "cat /etc/shadow /root/x 2>/dev/null; unshare -U true 2>/dev/null; true"],
                          policy=policy(write=[workdir]), cwd=workdir)
    observed = with_ns.report.denials_observed
    assert observed["seccomp"]["observed"] is True
    assert any(d["mechanism"] == "seccomp" for d in with_ns.report.denied)  # unshare, refused and seen
    assert observed["mounts"]["observed"] is False
    if landlock.abi():
        assert observed["landlock"]["observed"] is False
        state = native.audit_state()
        # The reason is measured, not assumed: audit disabled, or unreadable without root.
        assert state in ("disabled", "unreadable", "enabled")
        if os.geteuid() != 0:
            assert state == "unreadable"
            # Landlock logs denials to audit from ABI 7 (Linux 6.15); before, the detail says it cannot.
            needle = "CAP_AUDIT_READ" if landlock.abi() >= 7 else "cannot log denials"
            assert needle in observed["landlock"]["detail"]
    if LANDLOCK_WHY:
        return  # runs without namespaces are refused on this kernel
    os.chmod(workdir, 0o1777)  # sticky: a state directory may lie beneath (kernel/way.py)
    no_ns = isolate.run(["true"], policy=policy(write=[workdir], namespaces=False, tmpfs=()), cwd=workdir)
    assert no_ns.report.denials_observed["seccomp"]["observed"] is False
    assert "mounts" not in no_ns.report.denials_observed


@pytest.mark.skipif(not cgroup_usable("pids"), reason="no writable pids cgroup for this caller")
def test_pids_limit_reached_is_one_line(workdir: str) -> None:
    code = ("import os, sys, time\nfor i in range(40):\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        sys.exit(3)\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n")
    result = cli("--backend", "native", "--pids", "8", "--wall", "20", "--", PYTHON, "-c", code, cwd=workdir)
    assert result.returncode == 3, result.stderr
    assert isolate_lines(result.stderr) == [
        "isolate-run: pids limit 8 reached: a fork or thread creation failed inside the sandbox"], result.stderr
