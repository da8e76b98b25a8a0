"""Without namespaces the program cannot reach what they would have isolated (issue 11, finding 6)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import time

import pytest
from conftest import ROOT, policy, py

import isolate
from isolate.kernel import landlock, seccomp

IPC_CREAT, O_CREAT, O_RDWR = 0o1000, 0o100, 0o2
LIBC = ctypes.CDLL(None, use_errno=True)

#: Each probe prints {name: errno or 0}. argv: shm key, msg key, sem key, mq name, target pid, keyctl nr.
PROBE = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
shm, msg, sem, mq, target, keyctl = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].encode(), \\
    int(sys.argv[5]), int(sys.argv[6])
out = {}
def check(name, rc):
    out[name] = ctypes.get_errno() if rc == -1 else 0
    ctypes.set_errno(0)
check("shmget", libc.shmget(shm, 0, 0))
check("shmget_private", libc.shmget(0, 4096, 0o1600))
check("msgget", libc.msgget(msg, 0))
check("semget", libc.semget(sem, 0, 0))
check("mq_open", libc.mq_open(mq, 2))
check("keyctl", libc.syscall(keyctl, 0, -4, 0))  # KEYCTL_GET_KEYRING_ID of the user keyring
old = (ctypes.c_ulonglong * 2)()
check("prlimit_other", libc.prlimit(target, 7, None, old))
check("prlimit_self", libc.prlimit(0, 7, None, old))
check("setpriority_other", libc.setpriority(0, target, 19))
check("setpriority_self", libc.setpriority(0, 0, 1))
check("kill_other", libc.kill(target, 0))
print(json.dumps(out))
"""


@pytest.fixture
def host_objects(workdir: str):  # type: ignore[no-untyped-def]
    base = (os.getpid() << 8) & 0x7FFFFF00
    shm_key, msg_key, sem_key = base | 1, base | 2, base | 3
    mq_name = f"/isolate-test-{os.getpid()}-{time.monotonic_ns()}"
    LIBC.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    shm = LIBC.shmget(shm_key, 4096, IPC_CREAT | 0o666)
    msg = LIBC.msgget(msg_key, IPC_CREAT | 0o666)
    sem = LIBC.semget(sem_key, 1, IPC_CREAT | 0o666)
    mqd = LIBC.mq_open(mq_name.encode(), O_CREAT | O_RDWR, 0o666, None)
    assert min(shm, msg, sem, mqd) >= 0, ctypes.get_errno()
    os.fchmod(mqd, 0o666)  # past the umask
    # A host process of the uid the program runs as (a root caller's program runs as 65534).
    runas = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if ROOT else []
    target = subprocess.Popen([*runas, "sleep", "60"])
    try:
        yield [str(shm_key), str(msg_key), str(sem_key), mq_name, str(target.pid),
               str(seccomp.syscall_number("keyctl"))]
    finally:
        target.kill()
        target.wait()
        LIBC.shmctl(shm, 0, None)  # IPC_RMID
        LIBC.msgctl(msg, 0, None)
        LIBC.semctl(sem, 0, 0)
        os.close(mqd)
        LIBC.mq_unlink(mq_name.encode())


@pytest.mark.parametrize("profile", ["none", "default"])
def test_without_namespaces_the_host_is_out_of_reach(workdir: str, host_objects: list[str], profile: str) -> None:
    os.chmod(workdir, 0o777)
    pol = policy(write=[workdir], namespaces=False, tmpfs=(), seccomp=profile)
    result = isolate.run([*py(PROBE), *host_objects], policy=pol, cwd=workdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    denied = ["shmget", "shmget_private", "msgget", "semget", "mq_open", "keyctl", "prlimit_other",
              "setpriority_other"]
    assert {k: seen[k] for k in denied} == dict.fromkeys(denied, 1)  # EPERM
    assert (seen["prlimit_self"], seen["setpriority_self"]) == (0, 0)
    if landlock.abi() >= 6:
        assert seen["kill_other"] == 1


def test_the_report_says_how_the_host_is_kept_out(workdir: str) -> None:
    os.chmod(workdir, 0o777)  # without an idmapped mount, a root caller's program (65534) must be able to write it
    prepared = isolate.backends.native.prepare(policy(write=[workdir], namespaces=False, tmpfs=(), seccomp="none"),
                                               ["true"])
    try:
        assert prepared.enforced["host_ipc"].startswith("refused (seccomp)")
        assert prepared.enforced["seccomp"] == "none"
        assert prepared.enforced["signals"] == ("landlock-scope" if landlock.abi() >= 6 else
                                                "host processes of the same uid (no PID namespace, Landlock "
                                                "below ABI 6)")
    finally:
        prepared.close_child_side()


@pytest.mark.skipif(landlock.abi() < 6, reason="abstract sockets are scoped from Landlock ABI 6")
def test_without_namespaces_host_abstract_sockets_are_scoped(workdir: str) -> None:
    import socket

    os.chmod(workdir, 0o777)
    name = f"\0isolate-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen(1)
        code = ("import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n"
                f"    s.connect({name!r})\n    print('connected')\nexcept OSError as e:\n    print(e.errno)\n")
        pol = policy(write=[workdir], namespaces=False, tmpfs=(), network="host", seccomp="none")
        result = isolate.run(py(code), policy=pol, cwd=workdir, capture_output=True, text=True)
        assert result.stdout.strip() == "1", result.stderr
        prepared = isolate.backends.native.prepare(pol, ["true"])
        assert prepared.enforced["abstract_unix_sockets"] == "landlock-scope"
        prepared.close_child_side()
