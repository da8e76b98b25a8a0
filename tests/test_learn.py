"""Learn mode (issue 29): `isolate-run learn` on real programs, then the learned profile alone runs them.

Each test lets learn observe a real program (gcc, pytest, git over HTTP, pip from a local index, a
system call outside the default filter) under confinement, then runs the program again with the
profile and no other flag. The denial tracer that learn stands on is tested on every kernel by
test_why.py; this file runs on the host only (learn reruns each program until nothing is refused,
minutes of emulation in the VM for no other kernel feature).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ISOLATE_RUN, python_read, write_tiny_wheel

import isolate


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
