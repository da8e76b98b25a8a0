"""Seccomp end to end, through ``isolate.run``: what the profiles refuse, what they let work, and the report.

Every probe runs inside a real sandbox (namespaces, Landlock, the seccomp filter
with its user-notification listener in the sandbox's init). A denied call must
fail with the profile's errno *and* appear in ``report.denied``: the report is
what tells a seccomp refusal apart from the same errno coming from somewhere
else (missing capabilities, bad arguments), so every denial test checks both.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import ISOLATE_RUN, PYTHON, policy, py

from isolate.kernel import seccomp
from isolate.model.errors import PolicyError
from isolate.oneshot.runs import CompletedProcess
from isolate.oneshot.runs import (
    run as isolate_run,  # what isolate.run resolves to (mypy cannot see through its __getattr__)
)

OK, WHY = seccomp.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"seccomp unavailable here: {WHY}")
#: Denial reports need SECCOMP_RET_USER_NOTIF (Linux 5.0+); available() says whether the kernel has it.
REPORTS = "with user notification" in WHY
X86_64 = os.uname().machine == "x86_64"
x86_64_only = pytest.mark.skipif(not X86_64, reason="the probes use x86_64 system call numbers")
GCC = shutil.which("gcc")
needs_gcc = pytest.mark.skipif(GCC is None, reason="gcc is not installed: the C probe cannot be built")
GIT = shutil.which("git")

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIGCHLD = 17
AT_FDCWD = -100
ADDR_NO_RANDOMIZE = 0x0040000
AF_VSOCK = 40
SOCK_STREAM = 1
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
TIOCGWINSZ = 0x5413


def run(workdir: str, args: list[str], **changes: Any) -> CompletedProcess:
    env = changes.pop("env", {})
    return isolate_run(args, policy=policy(write=[workdir], env=env, **changes), cwd=workdir,
                       capture_output=True, text=True, timeout=60)


def denials(result: CompletedProcess, name: str) -> list[dict[str, Any]]:
    return [d for d in result.report.denied if d.get("syscall") == name]


# A raw-syscall helper for the probes: every integer goes to the kernel as an unsigned long
# (so -1 and 0xdeadbeef00005412 reach it unchanged); prints "rc errno" for each call.
PRELUDE = textwrap.dedent("""\
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def sc(nr, *args):
        ctypes.set_errno(0)
        conv = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
        rc = libc.syscall(ctypes.c_long(nr), *conv)
        err = ctypes.get_errno()
        if nr == 56 and rc == 0:  # a clone that was let through: the child leaves quietly
            os._exit(0)
        print(rc, err, flush=True)
        return rc
    """)

# (report name, x86_64 number, arguments, errno). Arguments are harmless even if a call got through:
# bad magic for reboot, NULL or nonexistent paths, queries. Each is called twice (the report counts).
DENIED: list[tuple[str, str, int, str, int]] = [
    ("init_module", "init_module", 175, "0, 0, b''", errno.EPERM),
    ("finit_module", "finit_module", 313, "-1, b'', 0", errno.EPERM),
    ("delete_module", "delete_module", 176, "b'isolate_no_such_module', 0o4000", errno.EPERM),
    ("kexec_load", "kexec_load", 246, "0, 0, 0, 0", errno.EPERM),
    ("reboot", "reboot", 169, "0, 0, 0, 0", errno.EPERM),
    ("bpf", "bpf", 321, "0, 0, 0", errno.EPERM),
    ("perf_event_open", "perf_event_open", 298, "0, 0, -1, -1, 0", errno.EPERM),
    ("userfaultfd", "userfaultfd", 323, "0", errno.EPERM),
    ("keyctl", "keyctl", 250, "0, -3, 0", errno.EPERM),
    ("add_key", "add_key", 248, "b'', b'isolate', 0, 0, -3", errno.EPERM),
    ("request_key", "request_key", 249, "b'', b'isolate', 0, 0", errno.EPERM),
    ("ptrace", "ptrace", 101, "2, 1, 0, 0", errno.EPERM),
    ("process_vm_readv", "process_vm_readv", 310, "os.getpid(), 0, 0, 0, 0, 0", errno.EPERM),
    ("process_vm_writev", "process_vm_writev", 311, "os.getpid(), 0, 0, 0, 0, 0", errno.EPERM),
    ("mount", "mount", 165, "b'none', b'/tmp', b'tmpfs', 0, 0", errno.EPERM),
    ("umount2", "umount2", 166, "b'/proc', 2", errno.EPERM),
    ("fsopen", "fsopen", 430, "b'tmpfs', 0", errno.EPERM),
    ("open_tree", "open_tree", 428, "-100, b'/tmp', 1", errno.EPERM),
    ("move_mount", "move_mount", 429, "-1, b'', -1, b'', 0", errno.EPERM),
    ("pivot_root", "pivot_root", 155, "b'/tmp', b'/tmp'", errno.EPERM),
    ("chroot", "chroot", 161, "b'/tmp'", errno.EPERM),
    ("setns", "setns", 308, "-1, 0", errno.EPERM),
    ("unshare-newuser", "unshare", 272, f"{CLONE_NEWUSER}", errno.EPERM),
    ("unshare-newns", "unshare", 272, f"{CLONE_NEWNS}", errno.EPERM),
    ("clone-newns", "clone", 56, f"{CLONE_NEWNS | SIGCHLD}, 0, 0, 0, 0", errno.EPERM),
    ("clone-newuser", "clone", 56, f"{CLONE_NEWUSER | SIGCHLD}, 0, 0, 0, 0", errno.EPERM),
    ("clone-newnet", "clone", 56, f"{CLONE_NEWNET | SIGCHLD}, 0, 0, 0, 0", errno.EPERM),
    ("open_by_handle_at", "open_by_handle_at", 304, "-1, 0, 0", errno.EPERM),
    ("name_to_handle_at", "name_to_handle_at", 303, "-100, b'/', 0, 0, 0", errno.EPERM),
    ("io_uring_setup", "io_uring_setup", 425, "1, 0", errno.EPERM),
    ("swapon", "swapon", 167, "b'/nonexistent', 0", errno.EPERM),
    ("swapoff", "swapoff", 168, "b'/nonexistent'", errno.EPERM),
    ("acct", "acct", 163, "0", errno.EPERM),
    ("quotactl", "quotactl", 179, "0, 0, 0, 0", errno.EPERM),
    ("settimeofday", "settimeofday", 164, "0, 0", errno.EPERM),
    ("clock_settime", "clock_settime", 227, "0, 0", errno.EPERM),
    ("syslog", "syslog", 103, "10, 0, 0", errno.EPERM),
    ("iopl", "iopl", 172, "0", errno.EPERM),
    ("ioperm", "ioperm", 173, "0x80, 1, 0", errno.EPERM),
    ("personality-addr-no-randomize", "personality", 135, f"{ADDR_NO_RANDOMIZE}", errno.EPERM),
    ("socket-vsock", "socket", 41, f"{AF_VSOCK}, {SOCK_STREAM}, 0", errno.EPERM),
]


@x86_64_only
@pytest.mark.parametrize(("name", "nr", "args", "err"), [d[1:] for d in DENIED], ids=[d[0] for d in DENIED])
def test_default_denies_and_reports(workdir: str, name: str, nr: int, args: str, err: int) -> None:
    code = PRELUDE + f"sc({nr}, {args})\nsc({nr}, {args})\n"
    result = run(workdir, py(code))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"-1 {err}"] * 2, result.stdout
    assert result.report.enforced["seccomp"] == "default"
    if not REPORTS:
        pytest.skip(f"no denial reports without seccomp user notification: {WHY}")
    assert denials(result, name) == [{"mechanism": "seccomp", "syscall": name, "nr": nr, "count": 2}]


@x86_64_only
def test_clone3_gets_enosys_so_libc_falls_back(workdir: str) -> None:
    # clone3 hides its flags behind a pointer: ENOSYS (not a denial) makes glibc use clone, which the filter sees.
    code = PRELUDE + (
        "sc(435, 0, 0)\n"
        "import threading\nt = threading.Thread(target=lambda: print('thread ran', flush=True)); t.start(); t.join()\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
        "print('child', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    result = run(workdir, py(code))
    assert result.stdout.splitlines() == [f"-1 {errno.ENOSYS}", "thread ran", "child 7"], result.stderr


@x86_64_only
def test_near_misses_are_allowed(workdir: str) -> None:
    # The argument-filtered rules refuse only what they name: the neighbours stay usable.
    code = PRELUDE + (
        "sc(135, 0xffffffff) >= 0 or print('personality query failed')\n"  # personality(): a query
        "sc(272, 0x400)\n"  # unshare(CLONE_FILES)
        "sc(41, 1, 1, 0) >= 0 or print('socket(AF_UNIX) failed')\n"  # socket(AF_UNIX, SOCK_STREAM)
        "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')\n"
    )
    result = run(workdir, py(code))
    lines = result.stdout.splitlines()
    assert "failed" not in result.stdout, result.stdout
    assert lines[1] == "0 0" and lines[-1] == "forked", result.stdout
    assert result.report.denied == []


TTY_PROBE = PRELUDE + textwrap.dedent("""\
    import fcntl, tty
    master, slave = os.openpty()
    tty.setraw(slave)                        # no line discipline: an injected byte would be readable at once
    os.setsid()                              # TIOCSTI wants the terminal to be the caller's controlling one,
    fcntl.ioctl(slave, 0x540E, 0)            # so make it so (TIOCSCTTY): only the filter stands in the way
    ch = ctypes.c_char_p(b"x")
    sc(16, slave, 0x5412, ch)                # TIOCSTI
    sc(16, slave, 0xdeadbeef00005412, ch)    # TIOCSTI with the high 32 bits set (the kernel ignores them)
    sub = ctypes.create_string_buffer(b"\\x06", 8)
    sc(16, slave, 0x541C, sub)               # TIOCLINUX
    print(len(fcntl.ioctl(slave, 0x5413, b"\\0" * 8)))   # TIOCGWINSZ still works
    os.set_blocking(slave, False)
    try:
        print("injected", os.read(slave, 64))
    except BlockingIOError:
        print("nothing injected")
    """)


@x86_64_only
def test_tiocsti_and_tioclinux_are_refused(workdir: str) -> None:
    result = run(workdir, py(TTY_PROBE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"-1 {errno.EPERM}"] * 3 + ["8", "nothing injected"], result.stdout
    if not REPORTS:
        pytest.skip(f"no denial reports without seccomp user notification: {WHY}")
    assert denials(result, "ioctl") == [{"mechanism": "seccomp", "syscall": "ioctl", "nr": 16, "count": 3}]


INT80 = r"""
#include <stdio.h>
int main(void) {
    long ret;
    puts("before"); fflush(stdout);
    __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(20L) : "memory", "r8", "r9", "r10", "r11");  /* i386 getpid */
    printf("%ld\n", ret); fflush(stdout);
    return 0;
}
"""


@x86_64_only
@needs_gcc
def test_i386_int80_is_refused(workdir: str) -> None:
    source, binary = os.path.join(workdir, "int80.c"), os.path.join(workdir, "int80")
    with open(source, "w") as handle:
        handle.write(INT80)
    subprocess.run([GCC or "gcc", "-O0", "-o", binary, source], check=True, capture_output=True)
    host = subprocess.run([binary], capture_output=True, text=True)
    if host.returncode != 0 or not host.stdout.split()[-1].isdigit() or int(host.stdout.split()[-1]) <= 0:
        pytest.skip(f"this kernel does not run i386 calls even without a filter (ia32 emulation off): {host!r}")
    result = run(workdir, [binary])
    assert result.stdout.splitlines() == ["before"], result.stdout  # the call never returned
    assert result.returncode == -signal.SIGSYS
    assert result.report.status == "signaled" and result.report.signal == signal.SIGSYS


# --------------------------------------------------------------------------
# real work under the default profile

SHELL_SESSION = """
set -e
n=0; for i in 1 2 3 4 5; do n=$((n + i)); done; echo "sum $n"
printf 'b\\na\\nb\\nc\\n' > words.txt
sort words.txt | uniq -c | awk '{print $2 "=" $1}' | tr '\\n' ' '; echo
x=$(cd /usr && pwd); echo "subst $x"
( echo sub > sub.txt ) && cat sub.txt
sleep 0.05 & wait $!; echo "waited $?"
cat <<EOF | wc -l
one
two
EOF
ls -l words.txt >/dev/null && echo listed
"""


def test_shell_session_works(workdir: str) -> None:
    result = run(workdir, ["sh", "-c", SHELL_SESSION])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:7] == ["sum 15", "a=1 b=2 c=1 ", "subst /usr", "sub", "waited 0", "2", "listed"]
    assert os.path.exists(os.path.join(workdir, "sub.txt"))
    assert result.report.denied == []


PYTHON_WORK = """
import concurrent.futures, subprocess, sys, threading, os
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    print(sum(pool.map(lambda n: sum(range(n)), [10**5] * 8)))
lock = threading.Lock(); hits = []
def work():
    with lock:
        hits.append(1)
threads = [threading.Thread(target=work) for _ in range(16)]
[t.start() for t in threads]; [t.join() for t in threads]
print(len(hits))
print(subprocess.run(["sh", "-c", "echo from-sh"], capture_output=True, text=True, check=True).stdout.strip())
print(subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True).stdout.strip())
with open("out.txt", "w") as f:
    f.write("written")
print(open("out.txt").read())
"""


def test_python_threads_and_subprocess_work(workdir: str) -> None:
    result = run(workdir, py(PYTHON_WORK))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(8 * sum(range(10**5))), "16", "from-sh", "42", "written"]
    assert result.report.denied == []


C_PROGRAM = r"""
#include <math.h>
#include <pthread.h>
#include <stdio.h>
static void *work(void *arg) { *(double *)arg = sqrt(*(double *)arg); return NULL; }
int main(void) {
    double x = 1764.0; pthread_t t;
    if (pthread_create(&t, NULL, work, &x) != 0) return 1;
    pthread_join(t, NULL);
    printf("root %.0f\n", x);
    return 0;
}
"""


@needs_gcc
def test_gcc_compiles_and_runs_under_default(workdir: str) -> None:
    with open(os.path.join(workdir, "prog.c"), "w") as handle:
        handle.write(C_PROGRAM)
    # Only the system's own tree: /lib and /lib64 are symlinks into /usr on this host, but the ELF interpreter
    # (/lib64/ld-linux-x86-64.so.2 -> /lib/x86_64-linux-gnu/...) is reached through them.
    result = run(workdir, ["sh", "-c", "gcc -O2 -pthread -o prog prog.c -lm && ./prog"],
                 read=["/usr", "/lib", "/lib64"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "root 42"
    assert os.path.exists(os.path.join(workdir, "prog"))
    assert result.report.enforced["seccomp"] == "default"
    assert result.report.denied == []


GIT_SESSION = """
set -e
git init -q repo && cd repo
git config user.name "Isolate Test" && git config user.email test@example.invalid
echo hello > file.txt && git add file.txt && git commit -q -m first
echo more >> file.txt && git commit -q -am second
git log --format=%s | tr '\\n' ' '
"""


@pytest.mark.skipif(GIT is None, reason="git is not installed")
def test_git_works_under_default(workdir: str) -> None:
    result = run(workdir, ["sh", "-c", GIT_SESSION], env={"HOME": workdir})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["second", "first"]
    assert result.report.denied == []
    # The commits are really there, seen from outside.
    outside = subprocess.run([GIT or "git", "-c", "safe.directory=*", "-C", os.path.join(workdir, "repo"), "log",
                              "--format=%s"], capture_output=True, text=True, check=True)
    assert outside.stdout.split() == ["second", "first"]


# --------------------------------------------------------------------------
# strict, a JSON profile, and the kernel's own view

STRICT_JOB = """
import os, socket, threading
print(sum(i * i for i in range(1000)))
with open("data.txt", "w") as f:
    f.write("x" * 100)
print(os.path.getsize("data.txt"))
out = []
t = threading.Thread(target=lambda: out.append(2 ** 64)); t.start(); t.join()
print(out[0])
r, w = os.pipe(); os.write(w, b"piped"); print(os.read(r, 5).decode())
a, b = socket.socketpair(socket.AF_UNIX); a.sendall(b"pair"); print(b.recv(4).decode())
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    print("inet allowed")
except OSError as e:
    print("inet", e.errno)
"""


def test_strict_runs_a_compute_job_and_refuses_inet(workdir: str) -> None:
    result = run(workdir, py(STRICT_JOB), seccomp="strict")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:6] == [str(sum(i * i for i in range(1000))), "100", str(2**64), "piped",
                                             "pair", f"inet {errno.EPERM}"]
    assert result.report.enforced["seccomp"] == "strict"
    if not REPORTS:
        pytest.skip(f"no denial reports without seccomp user notification: {WHY}")
    assert [d["count"] for d in denials(result, "socket")] == [1]


def test_json_profile_is_obeyed(workdir: str) -> None:
    profile = os.path.join(workdir, "profile.json")
    with open(profile, "w") as handle:
        json.dump({
            "defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [
                {"names": ["getcwd"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
                {"names": ["getpriority"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EACCES},
            ],
        }, handle)
    code = (
        "import os\n"
        "for call in (os.getcwd, lambda: os.getpriority(os.PRIO_PROCESS, 0), os.getpid):\n"
        "    try:\n        call(); print('ok')\n    except OSError as e:\n        print(e.errno)\n"
    )
    result = run(workdir, py(code), seccomp=profile)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(errno.EPERM), str(errno.EACCES), "ok"]
    assert profile in str(result.report.enforced["seccomp"])
    if not REPORTS:
        pytest.skip(f"no denial reports without seccomp user notification: {WHY}")
    assert [d["count"] for d in denials(result, "getcwd")] == [1]
    assert [d["count"] for d in denials(result, "getpriority")] == [1]
    # Under the default profile the same calls work and nothing is reported.
    plain = run(workdir, py(code))
    assert plain.stdout.split() == ["ok", "ok", "ok"] and plain.report.denied == []


def test_a_profile_file_changed_between_two_runs_of_one_policy_applies_to_the_second(workdir: str) -> None:
    # The plan of a policy is cached by the policy, which names the file: a profile tightened (or loosened)
    # meanwhile kept the filter compiled from what it held first, for every later run of the process.
    profile = os.path.join(workdir, "changing.json")
    code = "import os\ntry:\n    os.getcwd(); print('ok')\nexcept OSError as e:\n    print(e.errno)\n"
    checked = None
    for refused in (False, True, False):
        with open(profile, "w") as handle:
            json.dump({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
                {"names": ["getcwd"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}] if refused else []},
                handle)
        checked = checked or policy(seccomp=profile)  # one policy for the three runs
        result = isolate_run(py(code), policy=checked, cwd=workdir, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [str(errno.EPERM) if refused else "ok"], refused


BAD_PROFILES: list[tuple[str, str, list[str]]] = [
    ("invalid-json", '{"defaultAction": "SCMP_ACT_ALLOW",\n "syscalls": [\n  {"names": ["read"],, }]}',
     ["line 3", "column"]),
    ("unknown-syscall",
     json.dumps({"defaultAction": "SCMP_ACT_ALLOW",
                 "syscalls": [{"names": ["read", "no_such_call_xyz"], "action": "SCMP_ACT_ERRNO"}]}),
     ["syscalls[0].names[1]", "no_such_call_xyz"]),
    ("unknown-action",
     json.dumps({"defaultAction": "SCMP_ACT_ALLOW",
                 "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO"},
                              {"names": ["getcwd"], "action": "SCMP_ACT_EXPLODE"}]}),
     ["syscalls[1].action", "SCMP_ACT_EXPLODE"]),
    ("unknown-op",
     json.dumps({"defaultAction": "SCMP_ACT_ALLOW",
                 "syscalls": [{"names": ["personality"], "action": "SCMP_ACT_ERRNO",
                               "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_SOMETIMES"}]}]}),
     ["syscalls[0].args[0].op", "SCMP_CMP_SOMETIMES"]),
]


def cli(workdir: str, profile: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ISOLATE_RUN, "--seccomp", profile, "--", "touch", "MARKER"],
                          cwd=workdir, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("content", "expected"), [b[1:] for b in BAD_PROFILES], ids=[b[0] for b in BAD_PROFILES])
def test_malformed_profile_fails_cleanly_in_the_cli(workdir: str, content: str, expected: list[str]) -> None:
    profile = os.path.join(workdir, "bad.json")
    with open(profile, "w") as handle:
        handle.write(content)
    result = cli(workdir, profile)
    assert result.returncode == 125, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "bad.json" in lines[0] and "Traceback" not in lines[0]
    for part in expected:
        assert part in lines[0], lines[0]
    assert not os.path.exists(os.path.join(workdir, "MARKER"))


def test_valid_profile_runs_in_the_cli(workdir: str) -> None:
    # The control for the test above: the same command with a sound profile does create MARKER.
    profile = os.path.join(workdir, "good.json")
    with open(profile, "w") as handle:
        json.dump({"defaultAction": "SCMP_ACT_ALLOW",
                   "syscalls": [{"names": ["reboot"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}, handle)
    result = cli(workdir, profile)
    assert result.returncode == 0, result.stderr
    assert os.path.exists(os.path.join(workdir, "MARKER"))


@pytest.mark.parametrize(("mode", "value"), [("none", "0"), ("default", "2"), ("strict", "2")])
def test_proc_status_shows_the_filter(workdir: str, mode: str, value: str) -> None:
    result = run(workdir, [PYTHON, "-I", "-S", "-c", "print(open('/proc/self/status').read())"], seccomp=mode)
    assert result.returncode == 0, result.stderr
    if mode == "none":
        # Writable paths (the working directory) keep the set-ID guard even without a profile, for
        # every caller, and network none keeps the connect() supervisor (issue 11).
        assert "Seccomp:\t2\n" in result.stdout
        assert result.report.enforced["seccomp"] == "none"
        assert result.report.enforced["setid_files"] == "refused (seccomp)"
        return
    assert f"Seccomp:\t{value}\n" in result.stdout
    assert result.report.enforced["seccomp"] == (None if mode == "none" else mode)


@pytest.mark.parametrize("namespaces", [True, False])
def test_no_setuid_file_reaches_the_host(workdir: str, namespaces: bool) -> None:
    # A root caller's program owns root's files through the idmapped mount, and a user's program that
    # user's files: neither may leave a set-user-ID (or set-group-ID) binary behind, which would lend
    # its owner's rights to whoever runs it later (another account, a service). Before, only a root
    # caller's namespaced runs had the guard.
    script = ("cp /bin/true t; chmod 4755 t; chmod 2755 t; chmod u+s t; "
              "python3 -c \"import os; os.close(os.open('u', os.O_CREAT | os.O_WRONLY, 0o6755))\"; true")
    if not namespaces and os.geteuid() == 0:
        os.chown(workdir, 65534, 65534)  # without idmapped mounts a root caller's program writes as 65534
    for mode in ("default", "none"):
        done = run(workdir, ["sh", "-c", script], seccomp=mode, namespaces=namespaces)
        assert done.report.enforced["setid_files"] == "refused (seccomp)", done.report.enforced
        for name in ("t", "u"):
            path = os.path.join(workdir, name)
            if os.path.exists(path):
                assert os.stat(path).st_mode & 0o6000 == 0, (mode, name, oct(os.stat(path).st_mode))
                os.unlink(path)


def test_no_filter_is_ever_read_from_the_callers_files(workdir: str) -> None:
    # A sandbox granted the caller's home could write ~/.cache: a compiled
    # filter cached there would be loaded by every later run, so none is.
    # (workdir, not tmp_path: the run's cwd is written, and TMPDIR may not be idmappable.)
    cache = Path(workdir) / "cache"
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    result = subprocess.run([ISOLATE_RUN, "--", "true"], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not (cache / "isolate").exists()



# A profile that refuses the calls the program child makes before the init runs (its exec, the report of a
# failed exec, its exit): each such denial used to be a notification no one could answer yet, and the run
# waited for ever (the C isolate-run's musl _exit spun when exit itself was refused).
_STARTLESS = {
    "only-read": {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]},
    "no-execveat": {"defaultAction": "SCMP_ACT_ALLOW",
                    "syscalls": [{"names": ["execveat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 13}]},
}


@pytest.mark.parametrize("profile", sorted(_STARTLESS))
@pytest.mark.parametrize("entry", ["api", "cli"])
def test_a_profile_refusing_the_start_fails_at_once(workdir: str, profile: str, entry: str) -> None:
    path = os.path.join(workdir, "profile.json")
    Path(path).write_text(json.dumps(_STARTLESS[profile]))
    mark = os.path.join(workdir, "ran")
    if entry == "cli":
        argv = [ISOLATE_RUN, "--seccomp", path, "--", "touch", mark]
    else:
        code = (f"import isolate\np = isolate.Policy(seccomp={path!r})\ntry:\n"
                f"    print(isolate.run(['touch', {mark!r}], policy=p).returncode)\n"
                "except isolate.IsolationError as e:\n    print(type(e).__name__)")
        argv = [sys.executable, "-c", code]
    try:
        done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{entry} with a profile refusing the program's start hung")
    assert not os.path.exists(mark)
    # Refused before the run, the call named (it was 126, or 127 with no line when write was refused too).
    if entry == "cli":
        assert done.returncode == 125 and len(done.stderr.splitlines()) == 1, done.stderr
        assert "execveat" in done.stderr
    else:
        assert done.stdout.strip() == "PolicyError", done.stderr


def _profile(tmp: Path, name: str, rules: list[dict[str, Any]]) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}))
    return str(path)


@pytest.mark.parametrize("rules", [
    [{"names": ["execveat"], "action": "SCMP_ACT_ERRNO"}],
    [{"names": ["execveat"], "action": "SCMP_ACT_KILL"}],
    [{"names": ["write", "execveat"], "action": "SCMP_ACT_ERRNO"}],
], ids=["errno", "kill", "with-write"])
def test_a_profile_that_refuses_the_start_is_refused_with_the_call_named(rules: list[dict[str, Any]], workdir: str,
                                                                        tmp_path: Path) -> None:
    # The start execs the program with execveat under the profile: one that refuses it made every run end 126
    # ("cannot execute"), 159 (SIGSYS) or, when write was refused too, 127 with nothing said. The refusal is
    # enforced, never dropped: the profile is refused, with one line naming the call.
    profile = _profile(tmp_path, "start", rules)
    result = subprocess.run([ISOLATE_RUN, "--seccomp", profile, "--", "/bin/echo", "ran"], cwd=workdir,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 125, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "execveat" in lines[0] and profile in lines[0], result.stderr
    with pytest.raises(PolicyError, match="execveat"):
        isolate_run(["/bin/echo", "ran"], policy=policy(seccomp=profile), cwd=workdir)


def test_a_start_refused_by_an_argument_rule_is_said_even_when_write_is_refused(workdir: str,
                                                                               tmp_path: Path) -> None:
    # A rule on execveat's arguments is met by the run. Its failure was reported by the program child's own
    # write, under the profile: refused (here killed), the run ended 127 with nothing on stderr. Now the
    # sandbox's first process, which the profile does not confine, reports it.
    profile = _profile(tmp_path, "argument", [
        {"names": ["write"], "action": "SCMP_ACT_KILL"},
        {"names": ["execveat"], "action": "SCMP_ACT_ERRNO", "args": [{"index": 4, "value": 0, "op": "SCMP_CMP_EQ"}]},
    ])
    result = subprocess.run([ISOLATE_RUN, "--seccomp", profile, "--", "/bin/echo", "ran"], cwd=workdir,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 125, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "refused execveat" in lines[0], result.stderr


def test_a_profile_that_refuses_write_lets_the_program_start_and_meet_it(workdir: str, tmp_path: Path) -> None:
    # write is not a call the start needs: the program runs and meets the refusal itself (its echo fails).
    profile = _profile(tmp_path, "write", [{"names": ["write"], "action": "SCMP_ACT_ERRNO"}])
    result = subprocess.run([ISOLATE_RUN, "--seccomp", profile, "--", "sh", "-c", "echo ran || exit 9"],
                            cwd=workdir, capture_output=True, text=True, timeout=60)
    assert result.returncode == 9 and result.stdout == "" and result.stderr == "", result
