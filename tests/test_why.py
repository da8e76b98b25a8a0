"""Denial tracing (issue 29): every file access the policy refused is named in the report.

The init looks at each path system call the program makes (csrc/why.c) and lets it continue; the
report names the path as given and as resolved, the access and the mechanism that refused it. Each
test makes the accesses a program would and checks what the report says of them, as root and as
an unprivileged caller.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ISOLATE_RUN, policy, py, python_read, write_tiny_wheel
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
    landlock = _find(denied, "/proc/self/oom_score_adj", "write")
    assert landlock["mechanism"] == "landlock" and str(landlock["resolved"]).endswith("/oom_score_adj")
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


def _learn_then_run(workdir: str, options: list[str], command: list[str]) -> str:
    """``isolate-run learn`` the command from an empty directory, then run it with the profile alone."""
    cwd = os.path.join(workdir, "run")
    os.mkdir(cwd)
    os.chmod(cwd, 0o777)  # a root caller's program (uid 65534) writes here without an idmapped mount too
    profile = os.path.join(cwd, "profile.toml")
    learned = subprocess.run([ISOLATE_RUN, "learn", "--out", profile, *options, "--", *command], cwd=cwd,
                             capture_output=True, text=True, timeout=300)
    assert learned.returncode == 0, learned.stderr
    assert "every run is confined" in learned.stderr
    with open(profile, encoding="utf-8") as handle:
        text = handle.read()
    again = subprocess.run([ISOLATE_RUN, "--profile", profile, "--", *command], cwd=cwd, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, (again.stderr, text)
    return text


def test_learn_a_gcc_build(workdir: str) -> None:
    gcc = shutil.which("gcc")
    if not gcc or not gcc.startswith("/usr/"):
        pytest.skip("no gcc under /usr here")
    src, inc = os.path.join(workdir, "src"), os.path.join(workdir, "include")
    for directory in (src, inc):
        os.mkdir(directory)
    with open(os.path.join(src, "main.c"), "w") as handle:
        handle.write('#include "twice.h"\n#include <stdio.h>\nint main(void) { printf("%d\\n", twice(21)); }\n')
    with open(os.path.join(inc, "twice.h"), "w") as handle:
        handle.write("static inline int twice(int x) { return 2 * x; }\n")
    text = _learn_then_run(workdir, [], [gcc, "-I", inc, "-o", "prog", os.path.join(src, "main.c")])
    assert f"# lookup {inc} was refused (absent)" in text or f"{inc} was refused" in text
    assert f'"{inc}"' in text and f'"{src}"' in text
    assert "[limits]" in text and "wall_seconds = " in text and "memory" in text  # written, or why not


def test_learn_a_pytest_run(workdir: str) -> None:
    pytest_dir = os.path.dirname(os.path.dirname(pytest.__file__))
    pkg = os.path.join(workdir, "pkg")
    os.mkdir(pkg)
    with open(os.path.join(pkg, "calc.py"), "w") as handle:
        handle.write("def add(a, b):\n    return a + b\n")
    with open(os.path.join(pkg, "test_calc.py"), "w") as handle:
        handle.write("from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    options = [option for path in (*python_read(), pytest_dir) for option in ("--ro", path)]
    text = _learn_then_run(workdir, options, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pkg])
    assert f'"{pkg}"' in text


def test_learn_a_git_clone_over_http(workdir: str) -> None:
    import functools
    import http.server
    import threading

    git = shutil.which("git")
    if not git or not git.startswith("/usr/"):
        pytest.skip("no git under /usr here")
    work, served = os.path.join(workdir, "work"), os.path.join(workdir, "served")
    os.mkdir(served)
    quiet = {"capture_output": True, "check": True}
    subprocess.run([git, "init", "-q", work], **quiet)  # type: ignore[call-overload]
    subprocess.run([git, "-C", work, "-c", "user.email=a@b", "-c", "user.name=n", "commit", "-q", "--allow-empty",
                    "-m", "first"], **quiet)  # type: ignore[call-overload]
    subprocess.run([git, "clone", "-q", "--bare", work, os.path.join(served, "repo.git")], **quiet)  # type: ignore[call-overload]
    subprocess.run([git, "-C", os.path.join(served, "repo.git"), "update-server-info"], **quiet)  # type: ignore[call-overload]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=served))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://repo.test:{server.server_address[1]}/repo.git"
        text = _learn_then_run(workdir, ["--add-host", "repo.test:127.0.0.1", "--allow-private"],
                               ["sh", "-c", f"rm -rf out && {git} clone -q {url} out"])
    finally:
        server.shutdown()
    assert f'"repo.test:{server.server_address[1]}",' in text and "[network]" in text


def test_learn_a_pip_install_from_a_local_index(workdir: str) -> None:
    import functools
    import http.server
    import threading

    index = os.path.join(workdir, "index")
    os.makedirs(os.path.join(index, "simple", "tinypkg"))
    write_tiny_wheel(os.path.join(index, "simple", "tinypkg", "tinypkg-1.0-py3-none-any.whl"))
    with open(os.path.join(index, "simple", "tinypkg", "index.html"), "w") as handle:
        handle.write('<a href="tinypkg-1.0-py3-none-any.whl">tinypkg-1.0-py3-none-any.whl</a>')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=index))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://idx.test:{server.server_address[1]}/simple"
    # Nothing of the interpreter is granted up front: learn finds it (through the venv's links) and pip's files.
    pip = (f"rm -rf out && {sys.executable} -m pip install -q --no-cache-dir --disable-pip-version-check "
           f"--trusted-host idx.test --index-url {url} --target out tinypkg")
    try:
        text = _learn_then_run(workdir, ["--rounds", "12", "--add-host", "idx.test:127.0.0.1", "--allow-private"],
                               ["sh", "-c", pip])
    finally:
        server.shutdown()
    assert f'"idx.test:{server.server_address[1]}",' in text
    assert os.path.isfile(os.path.join(workdir, "run", "out", "tinypkg", "__init__.py"))


def test_learn_a_system_call_outside_the_default_filter(workdir: str) -> None:
    # ptrace(PTRACE_TRACEME): refused by the default profile (seccomp), let through by the learned copy of it.
    code = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
            "sys.exit(libc.ptrace(0, 0, None, None) != 0)")
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    text = _learn_then_run(workdir, [], [python, "-I", "-S", "-c", code])
    assert "with ptrace let through" in text
    profile = os.path.join(workdir, "run", "profile.seccomp.json")
    assert f'seccomp = "{profile}"' in text and os.path.isfile(profile)


def test_explain_after_a_run(workdir: str) -> None:
    report = os.path.join(workdir, "r.json")
    run = subprocess.run([ISOLATE_RUN, "--why", "--report", report, "--", "sh", "-c", "echo x > /etc/hosts"],
                         capture_output=True, text=True)
    assert run.returncode != 0
    explained = subprocess.run([ISOLATE_RUN, "--explain", "--report", report], capture_output=True, text=True)
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout.startswith("denied: write /etc/hosts ("), explained.stdout


def test_learn_grants_a_file_of_the_home_not_the_home_and_writes_any_name(workdir: str) -> None:
    # One file read and one written in the caller's home must not learn all of the home (its keys, its
    # shell's startup files), nor a file made at / the whole filesystem (refused by the profile, which
    # failed the learning): the files alone are granted, an entry made there is left to the user.
    home = os.path.join(workdir, "home")
    os.mkdir(home)
    os.chmod(home, 0o755)
    secret, notes = os.path.join(home, "secret"), os.path.join(home, "notes")
    for path, mode in ((secret, 0o644), (notes, 0o666)):
        with open(path, "w", encoding="utf-8") as handle:
            handle.write("x\n")
        os.chmod(path, mode)
    # A name with a control character (TOML refuses it raw, in a string or a comment) made learn fail.
    data = os.path.join(workdir, "data")
    os.mkdir(data)
    os.chmod(data, 0o755)
    odd = os.path.join(data, "a\x01b")
    with open(odd, "w", encoding="utf-8") as handle:
        handle.write("x\n")
    os.chmod(odd, 0o644)
    cwd = os.path.join(workdir, "run")
    os.mkdir(cwd)
    profile = os.path.join(cwd, "profile.toml")
    script = (f"cat {secret}; echo y >> {notes}; echo z > {home}/new; echo w > /learn-probe; "
              f"cat {data}/a$(printf \\\\001)b; true")
    learned = subprocess.run([ISOLATE_RUN, "learn", "--out", profile, "--", "/bin/sh", "-c", script], cwd=cwd,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "HOME": home})
    assert learned.returncode == 0, learned.stderr
    with open(profile, encoding="utf-8") as handle:
        text = handle.read()
    granted = isolate.Policy.from_toml(text, profile)
    assert home not in granted.read and home not in granted.write, text
    assert secret in granted.read and notes in granted.write and data in granted.read, text
    assert f"create {home}/new: not learned" in text and "create /learn-probe: not learned" in text
