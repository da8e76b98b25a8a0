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


def _learn_then_run(workdir: str, options: list[str], command: list[str], cwd: str | None = None,
                    product: str | None = None) -> str:
    """``isolate-run learn`` the command from an empty directory, then run it with the profile alone.

    ``product``: a path (relative to the run's directory) the command makes: learning must not have
    made it on the host (its writes land on throw-away views), the profile's run must.
    """
    cwd = cwd or os.path.join(workdir, "run")
    os.makedirs(cwd, exist_ok=True)
    os.chmod(cwd, 0o1777)  # a root caller's program (uid 65534) writes here without an idmapped mount too;
    # sticky: learn's state directory lies beneath (kernel/way.py refuses one under a directory others could swap)
    profile = os.path.join(workdir, "profile.toml")
    learned = subprocess.run([ISOLATE_RUN, "learn", "--out", profile, "--rounds", "12", *options, "--", *command],
                             cwd=cwd, capture_output=True, text=True, timeout=300)
    assert learned.returncode == 0, learned.stderr
    assert "every run is confined" in learned.stderr
    with open(profile, encoding="utf-8") as handle:
        text = handle.read()
    if product is not None:
        assert not os.path.lexists(os.path.join(cwd, product)), "learning wrote on the host"
    again = subprocess.run([ISOLATE_RUN, "--profile", profile, "--", *command], cwd=cwd, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, (again.stderr, text)
    if product is not None:
        assert os.path.lexists(os.path.join(cwd, product)), (again.stderr, text)
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
        text = _learn_then_run(workdir, ["--learn-net", "--add-host", "repo.test:127.0.0.1", "--allow-private"],
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
        text = _learn_then_run(workdir, ["--learn-net", "--add-host", "idx.test:127.0.0.1", "--allow-private"],
                               ["sh", "-c", pip])
    finally:
        server.shutdown()
    assert f'"idx.test:{server.server_address[1]}",' in text
    assert os.path.isfile(os.path.join(workdir, "run", "out", "tinypkg", "__init__.py"))


#: The system calls a hostile program under learn asks for: each stays refused, whatever it does.
DANGEROUS = ("bpf", "kexec_load", "init_module", "ptrace", "mount", "io_uring_setup", "userfaultfd",
             "perf_event_open", "keyctl", "add_key")


def test_learn_never_lets_a_dangerous_system_call_through(workdir: str) -> None:
    # Each refused call became a grant of the next run and of the profile (ptrace, bpf, kexec_load ...):
    # they are the kernel-attack surface the default filter refuses for the sandbox's safety.
    from isolate.kernel.seccomp import syscall_number

    numbers = {name: syscall_number(name) for name in DANGEROUS}
    calls = "; ".join(f"libc.syscall({n}, 0, 0, 0, 0, 0)" for n in numbers.values() if n is not None)
    code = f"import ctypes; libc = ctypes.CDLL(None, use_errno=True); {calls}"
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    text = _learn_then_run(workdir, [], [python, "-I", "-S", "-c", code])
    assert "seccomp = \"default\"" in text and not os.path.exists(os.path.join(workdir, "profile.seccomp.json"))
    for name, number in numbers.items():
        if number is not None:
            assert f"system call {name} stays refused" in text, (name, text)


def test_learn_writes_nothing_on_the_host_and_grants_no_credential(workdir: str) -> None:
    # A hostile command under learn: each write it was refused was granted for real in the next run
    # (a file in /etc/profile.d as root, ~/.ssh/authorized_keys), a key read granted all of ~/.ssh,
    # a file made in ~/.local/bin all of ~/.local writable. Now: nothing lands on the host outside the
    # given grants, whatever the rounds; credentials and start-up paths are comments, never grants.
    home, victim = os.path.join(workdir, "home"), os.path.join(workdir, "victim")
    for directory in (home, os.path.join(home, ".ssh"), os.path.join(home, ".local", "bin"), victim):
        os.makedirs(directory, exist_ok=True)
    os.chmod(victim, 0o777)
    key = os.path.join(home, ".ssh", "id_ed25519")
    with open(key, "w", encoding="utf-8") as handle:
        handle.write("secret\n")
    os.chmod(key, 0o644)
    probe = f"/etc/profile.d/isolate-learn-probe-{os.getpid()}.sh"
    script = (f"cat {key}; echo k >> {home}/.ssh/authorized_keys; echo x > {home}/.local/bin/ls; "
              f"echo y > {home}/.local/new; echo z > {probe}; mkdir {victim}/d; echo w > {victim}/pwned; "
              f"echo v > {home}/.bashrc; true")
    before = {os.path.join(d, n) for d, dirs, names in os.walk(workdir) for n in (*names, *dirs)}
    try:
        cwd = os.path.join(workdir, "run")
        os.mkdir(cwd)
        profile = os.path.join(cwd, "profile.toml")
        learned = subprocess.run([ISOLATE_RUN, "learn", "--out", profile, "--", "/bin/sh", "-c", script], cwd=cwd,
                                 capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "HOME": home, "ISOLATE_STATE_DIR": os.path.join(cwd, "state")})
        assert learned.returncode == 0, learned.stderr
        assert not os.path.exists(probe)
    finally:
        if os.path.lexists(probe):
            os.unlink(probe)
    after = {os.path.join(d, n) for d, dirs, names in os.walk(workdir) for n in (*names, *dirs)}
    made = {p for p in after - before if not p.startswith(cwd + "/")} - {cwd}
    assert not made, made
    with open(profile, encoding="utf-8") as handle:
        text = handle.read()
    granted = isolate.Policy.from_toml(text, profile)
    assert victim in granted.write, text  # learned: the profile, read by a person, grants it
    for path in (*granted.read, *granted.write):
        assert not path.startswith((os.path.join(home, ".ssh"), os.path.join(home, ".local"), "/etc/profile.d")), text
        assert path not in (home, os.path.join(home, ".bashrc")), text
    assert f"read {key}: never learned" in text and "copy-on-write view" in text


def test_learn_refuses_when_a_write_grant_has_no_copy_on_write_view(workdir: str) -> None:
    # Enforce or refuse: a learned write grant whose overlay cannot be made (here the state directory,
    # where its upper layer goes, lies inside the directory) stops learning; never the host directory.
    victim, cwd = os.path.join(workdir, "victim"), os.path.join(workdir, "run")
    for directory in (victim, cwd):
        os.mkdir(directory)
        os.chmod(directory, 0o1777)  # sticky: the state directory lies beneath (kernel/way.py)
    learned = subprocess.run([ISOLATE_RUN, "learn", "--out", os.path.join(workdir, "p.toml"), "--", "/bin/sh", "-c",
                              f"echo w > {victim}/pwned"], cwd=cwd, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ISOLATE_STATE_DIR": os.path.join(victim, "state")})
    assert learned.returncode == 125, learned.stderr
    assert "copy-on-write views" in learned.stderr and "Traceback" not in learned.stderr
    assert not os.path.lexists(os.path.join(victim, "pwned"))


def test_learn_egress_is_a_comment_without_learn_net(workdir: str) -> None:
    # Each destination the command reached for became an allowed one of the next run and of the profile.
    code = ("import socket\ntry:\n    socket.create_connection(('learn.test', 8443), timeout=5)\n"
            "except OSError:\n    pass\n")
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    text = _learn_then_run(workdir, ["--add-host", "learn.test:127.0.0.1", "--allow-private"],
                           [python, "-I", "-S", "-c", code])
    assert "learn.test:8443 was reached for" in text and "--learn-net" in text
    assert not any(line.strip().startswith('"learn.test:8443"') for line in text.splitlines()), text


def test_learn_from_nothing_a_copy(workdir: str) -> None:
    # --no-defaults stopped at run 1 ("sandbox setup failed at chdir"): nothing granted held the
    # working directory, and the executable's loader was not there either.
    cwd = os.path.join(workdir, "run")
    data, out = os.path.join(cwd, "DATA"), os.path.join(cwd, "OUT")
    for directory in (data, out):
        os.makedirs(directory)
        os.chmod(directory, 0o777)
    with open(os.path.join(data, "in.txt"), "w", encoding="utf-8") as handle:
        handle.write("hello\n")
    os.chmod(os.path.join(data, "in.txt"), 0o644)
    text = _learn_then_run(workdir, ["--no-defaults"], ["sh", "-c", "cat DATA/in.txt > OUT/copy.txt"], cwd,
                           product="OUT/copy.txt")
    granted = isolate.Policy.from_toml(text, "profile.toml")
    assert data in granted.read and out in granted.write and data not in granted.write, text
    assert cwd not in (*granted.read, *granted.write), text


def test_learn_from_nothing_a_gcc_build(workdir: str) -> None:
    gcc = shutil.which("gcc")
    if not gcc or not gcc.startswith("/usr/"):
        pytest.skip("no gcc under /usr here")
    src = os.path.join(workdir, "src")
    os.mkdir(src)
    with open(os.path.join(src, "main.c"), "w") as handle:
        handle.write('#include <stdio.h>\nint main(void) { puts("hi"); return 0; }\n')
    text = _learn_then_run(workdir, ["--no-defaults"], [gcc, "-o", "prog", os.path.join(src, "main.c")],
                           product="prog")
    granted = isolate.Policy.from_toml(text, "profile.toml")
    assert src in granted.read and os.path.join(workdir, "run") in granted.write, text
    assert "/etc" not in granted.read and "/usr" not in granted.read, text


def test_learn_from_nothing_a_git_clone(workdir: str) -> None:
    git = shutil.which("git")
    if not git or not git.startswith("/usr/"):
        pytest.skip("no git under /usr here")
    repo = os.path.join(workdir, "repo")
    quiet = {"capture_output": True, "check": True}
    subprocess.run([git, "init", "-q", repo], **quiet)  # type: ignore[call-overload]
    subprocess.run([git, "-C", repo, "-c", "user.email=a@b", "-c", "user.name=n", "commit", "-q", "--allow-empty",
                    "-m", "first"], **quiet)  # type: ignore[call-overload]
    if os.geteuid() == 0:
        # The program runs as 65534: git refuses a repository another user owns ("dubious ownership").
        for directory, dirs, names in os.walk(repo):
            for name in (directory, *(os.path.join(directory, n) for n in (*dirs, *names))):
                os.lchown(name, 65534, 65534)
    text = _learn_then_run(workdir, ["--no-defaults"], [git, "clone", "-q", repo, "out"], product="out/.git")
    granted = isolate.Policy.from_toml(text, "profile.toml")
    assert repo in granted.read and os.path.join(workdir, "run") in granted.write, text


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


def test_learn_never_grants_the_home_as_the_working_directory(workdir: str) -> None:
    # Started from the home with nothing granted there (--no-defaults), learn granted the working
    # directory itself, the home and its ~/.ssh with it, read by the profile's run.
    home = os.path.join(workdir, "home")
    os.makedirs(os.path.join(home, ".ssh"))
    key = os.path.join(home, ".ssh", "id_ed25519")
    with open(key, "w", encoding="utf-8") as handle:
        handle.write("secret\n")
    for path, mode in ((home, 0o755), (os.path.join(home, ".ssh"), 0o755), (key, 0o644)):
        os.chmod(path, mode)
    profile = os.path.join(workdir, "profile.toml")
    env = {**os.environ, "HOME": home}
    learned = subprocess.run([ISOLATE_RUN, "learn", "--no-defaults", "--rounds", "4", "--out", profile, "--",
                              "/bin/cat", ".ssh/id_ed25519"], cwd=home, capture_output=True, text=True, timeout=120,
                             env=env)
    assert learned.returncode in (0, 1), learned.stderr
    with open(profile, encoding="utf-8") as handle:
        text = handle.read()
    granted = isolate.Policy.from_toml(text, profile)
    assert not any(p == home or home.startswith(p.rstrip("/") + "/") or p.startswith(home + "/")
                   for p in (*granted.read, *granted.write)), text
    assert f"the working directory {home}: not learned" in text
    again = subprocess.run([ISOLATE_RUN, "--profile", profile, "--", "/bin/cat", ".ssh/id_ed25519"], cwd=home,
                           capture_output=True, text=True, timeout=60, env=env)
    assert "secret" not in again.stdout


def test_learn_grants_a_command_among_start_up_paths_alone(workdir: str) -> None:
    # A command in ~/.local/bin (a start-up path) learned all of ~/.local/bin: the file alone now.
    home = os.path.join(workdir, "home")
    tool = os.path.join(home, ".local", "bin", "tool")
    os.makedirs(os.path.dirname(tool))
    with open(tool, "w", encoding="utf-8") as handle:
        handle.write("#!/bin/sh\necho hi\n")
    for path in (home, os.path.join(home, ".local"), os.path.dirname(tool), tool):
        os.chmod(path, 0o755)
    cwd = os.path.join(workdir, "run")
    os.mkdir(cwd)
    os.chmod(cwd, 0o1777)  # sticky: learn's state directory may lie beneath (kernel/way.py)
    profile = os.path.join(workdir, "profile.toml")
    learned = subprocess.run([ISOLATE_RUN, "learn", "--rounds", "3", "--out", profile, "--", tool], cwd=cwd,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": home})
    assert learned.returncode == 0, learned.stderr
    with open(profile, encoding="utf-8") as handle:
        text = handle.read()
    granted = isolate.Policy.from_toml(text, profile)
    assert tool in granted.read and os.path.dirname(tool) not in granted.read, text


def test_learn_never_lets_a_call_the_default_refuses_with_some_arguments_through(workdir: str) -> None:
    # Under a profile whose default action refuses (strict, given by a profile file), unshare of a user
    # namespace was learned as an unconditional allow of unshare: every namespace, which the default filter
    # refuses with these arguments. It stays refused, named in a comment.
    given = os.path.join(workdir, "strict.toml")
    with open(given, "w", encoding="utf-8") as handle:
        handle.write('seccomp = "strict"\n')
    code = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            "print('unshared' if libc.unshare(0x10000000) == 0 else 'refused')")
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    cwd = os.path.join(workdir, "run")
    os.mkdir(cwd)
    os.chmod(cwd, 0o1777)  # sticky: learn's state directory may lie beneath (kernel/way.py)
    profile = os.path.join(workdir, "profile.toml")
    learned = subprocess.run([ISOLATE_RUN, "learn", "--profile", given, "--rounds", "3", "--out", profile, "--",
                              python, "-I", "-S", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert learned.returncode == 0, learned.stderr
    with open(profile, encoding="utf-8") as handle:
        text = handle.read()
    assert "system call unshare stays refused" in text, text
    assert not os.path.exists(os.path.join(workdir, "profile.seccomp.json")), text
    again = subprocess.run([ISOLATE_RUN, "--profile", profile, "--", python, "-I", "-S", "-c", code], cwd=cwd,
                           capture_output=True, text=True, timeout=60)
    assert again.stdout == "refused\n", (again.stdout, again.stderr)


def test_learn_keeps_its_own_directories_out_of_the_programs_reach(workdir: str) -> None:
    # Learn's state directory under a given write grant: a run swapped learn's directory for a link, and
    # the next run's copy-on-write upper layer (where its writes to a learned directory land) was made in
    # a host directory of the program's choosing. Now it is hidden under an empty tmpfs.
    granted, target, victim = (os.path.join(workdir, name) for name in ("granted", "target", "victim"))
    for directory, mode in ((granted, 0o1777), (target, 0o755), (victim, 0o777)):  # granted holds the state: sticky
        os.mkdir(directory)
        os.chmod(directory, mode)
    state, seen = os.path.join(granted, "state"), os.path.join(granted, "seen")
    script = (f"for d in {state}/learn-*; do [ -d \"$d\" ] && [ ! -L \"$d\" ] && mv \"$d\" \"$d.x\" && "
              f"ln -s {target} \"$d\"; done; echo w > {victim}/x; ls -a {target} >> {seen}; true")
    learned = subprocess.run([ISOLATE_RUN, "learn", "--rounds", "3", "--out", os.path.join(workdir, "p.toml"),
                              "--rw", granted, "--", "/bin/sh", "-c", script], cwd=granted, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "ISOLATE_STATE_DIR": state})
    assert learned.returncode == 0, learned.stderr
    with open(seen, encoding="utf-8") as handle:
        listed = handle.read()
    assert "run-" not in listed, listed
    assert os.listdir(target) == [] and not os.path.exists(os.path.join(victim, "x"))


# An --out the profile cannot go to is refused before any run, in one line: a FIFO there waited for a reader for
# ever after every run; "" and a directory were found only then, in an error naming no flag.
@pytest.mark.parametrize("out", ["", "fifo", "dir", "absent/p.toml"])
def test_an_out_it_cannot_write_is_refused_before_any_run(workdir: str, out: str) -> None:
    if out == "fifo":
        os.mkfifo(os.path.join(workdir, out))
    elif out == "dir":
        os.mkdir(os.path.join(workdir, out))
    mark = os.path.join(workdir, "ran")
    try:
        done = subprocess.run([ISOLATE_RUN, "learn", "--out", out, "--", "touch", mark], cwd=workdir,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"learn --out {out!r} hung")
    assert done.returncode == 125 and done.stderr.count("\n") == 1 and "--out" in done.stderr, done.stderr
    assert not os.path.exists(mark)
