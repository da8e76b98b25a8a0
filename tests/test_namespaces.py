"""The sandbox's own view of the system: PID, mount, UTS, IPC, network namespaces and the init."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import ISOLATE_RUN, PYTHON, not_granted_top, policy, processes_with, py

import isolate


def run_out(workdir: str, args: list[str], **changes: object) -> subprocess.CompletedProcess[str]:
    return isolate.run(args, policy=policy(write=[workdir], **changes), cwd=workdir, capture_output=True, text=True)


def test_only_own_processes_in_proc(workdir: str) -> None:
    result = run_out(workdir, ["sh", "-c", "ls /proc | grep -E '^[0-9]+$'"])
    pids = {int(p) for p in result.stdout.split()}
    assert 1 in pids and max(pids) < 10


def test_cannot_signal_the_caller(workdir: str) -> None:
    result = run_out(workdir, py(f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    print('reached')\n"
                                 "except OSError as e:\n    print(e.errno)\n"))
    assert result.stdout.strip() in ("3", "1")  # ESRCH (not visible) or EPERM (Landlock scope)


def test_proc_root_and_dotdot_lead_nowhere(workdir: str) -> None:
    result = run_out(workdir, ["sh", "-c", "ls /proc/1/root/; echo ---; cd /../../..; pwd; ls"])
    inside, after = result.stdout.split("---")
    hidden = not_granted_top(workdir)
    assert {"root", "boot"} <= hidden or len(hidden) >= 5
    assert not set(inside.split()) & hidden and not set(after.split()) & hidden, (inside, after, hidden)
    assert "usr" in after.split()


def test_mount_and_pivot_root_refused(workdir: str) -> None:
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "print(libc.umount2(b'/proc', 2), ctypes.get_errno())\n"
        "print(libc.syscall(155, b'/tmp', b'/tmp'), ctypes.get_errno())\n"
        "print(libc.unshare(0x00020000), ctypes.get_errno())\n"
    )
    result = run_out(workdir, py(code), seccomp="none")
    for line in result.stdout.splitlines():
        rc, err = line.split()
        assert rc == "-1" and int(err) in (1, 13), line  # EPERM / EACCES


def test_hostname_is_private(workdir: str) -> None:
    before = socket.gethostname()
    result = run_out(workdir, ["sh", "-c", "hostname; hostname changed 2>/dev/null; cat /proc/sys/kernel/hostname"])
    assert result.stdout.split()[0] == "isolate"
    assert socket.gethostname() == before


@pytest.fixture
def host_server() -> tuple[int, str]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"isolate-test-{os.getpid()}"
    abstract.bind("\0" + name)
    abstract.listen(8)
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1], name
    stop.set()
    thread.join()
    listener.close()
    abstract.close()


CONNECT = """
import socket, sys
port, name = int(sys.argv[1]), sys.argv[2]
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", port)); print("tcp reached")
except OSError as e:
    print("tcp", e.errno)
u = socket.socket(socket.AF_UNIX)
try:
    u.connect("\\0" + name); print("abstract reached")
except OSError as e:
    print("abstract", e.errno)
"""


@pytest.mark.parametrize("network", ["none", "loopback"])
def test_no_way_to_the_hosts_services(workdir: str, host_server: tuple[int, str], network: str) -> None:
    port, name = host_server
    result = run_out(workdir, [*py(CONNECT), str(port), name], network=network)
    assert "reached" not in result.stdout, result.stdout


def test_network_none_has_nothing(workdir: str) -> None:
    result = run_out(workdir, ["cat", "/proc/net/dev"], network="none")
    devices = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:]]
    assert devices == ["lo"]
    # "none" promises that nothing can be reached, not even the program itself:
    # a listening socket may be made where Landlock has no TCP rules (ABI < 4,
    # Linux 6.1), but no connection to it can be.
    code = (
        "import socket\ns = socket.socket()\ntry:\n    s.bind(('127.0.0.1', 0)); s.listen()\n"
        "except OSError as e:\n    print('bind', e.errno); raise SystemExit\n"
        "try:\n    socket.create_connection(s.getsockname(), timeout=5); print('connected')\n"
        "except OSError as e:\n    print('connect', e.errno)\n"
    )
    out = run_out(workdir, py(code), network="none").stdout
    assert "connected" not in out and ("bind" in out or "connect" in out), out


NETNS_VIEW = (
    "import fcntl, os, socket, struct\n"
    "fd = os.open('/proc/self/ns/net', os.O_RDONLY)\n"
    "try:\n    os.close(fcntl.ioctl(fd, 0xb701)); owner = 'own'\n"  # NS_GET_USERNS
    "except OSError as e:\n    owner = e.errno\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "flags = struct.unpack_from('H', fcntl.ioctl(s, 0x8913, struct.pack('16s16x', b'lo')), 16)[0]\n"  # SIOCGIFFLAGS
    "print(os.readlink('/proc/self/ns/net'), owner, flags & 1, [n for _, n in socket.if_nameindex()])\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root caller makes network namespaces ahead (kernel/netns.py)")
def test_network_none_namespace_made_ahead_serves_one_sandbox(workdir: str) -> None:
    """A root caller's runs with network "none" are born in namespaces its own thread made ahead: a new one
    for each run, empty (only lo, down), owned by the caller's user namespace (NS_GET_USERNS: EPERM inside,
    where a namespace the clone made would be the sandbox's own), and the caller's threads stay in theirs."""
    from isolate.kernel import netns

    host = os.readlink("/proc/self/ns/net")
    run_out(workdir, ["true"], network="none")  # the pool fills meanwhile
    # All alive at once (a namespace's number is reused once it is gone): each its own.
    stay = NETNS_VIEW + "import sys\nsys.stdout.flush()\nsys.stdin.read()\n"
    seen, running = [], []
    try:
        for _ in range(5):
            deadline = time.monotonic() + 10
            while not netns._POOL._ready and time.monotonic() < deadline:
                time.sleep(0.01)
            proc = isolate.Popen(py(stay), policy=policy(write=[workdir], network="none"), cwd=workdir,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            running.append(proc)
            assert proc.stdout is not None
            name, owner, up, names = proc.stdout.readline().split(maxsplit=3)
            assert owner == "1" and up == "0" and names.strip() == "['lo']", (owner, up, names)  # EPERM, down
            seen.append(name)
    finally:
        for proc in running:
            proc.communicate()
    assert all(proc.returncode == 0 for proc in running)
    assert len(set(seen)) == len(seen) and host not in seen, seen
    for task in os.listdir("/proc/self/task"):
        assert os.readlink(f"/proc/self/task/{task}/ns/net") == host
    # loopback and egress make their own (the child brings lo up): owned by the sandbox, lo up
    name, owner, up, _ = run_out(workdir, py(NETNS_VIEW), network="loopback").stdout.split(maxsplit=3)
    assert owner == "own" and up == "1" and name != host


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root caller makes network namespaces ahead (kernel/netns.py)")
def test_the_namespace_maker_ends_when_idle_and_comes_back_with_the_next_run(workdir: str) -> None:
    """A process that stopped running sandboxes holds no thread of ours (Python 3.12+ warns at its os.fork());
    the namespaces already made stay ready, and the next run starts the maker again to refill the pool."""
    import threading

    from isolate.kernel import netns

    def makers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "isolate-netns"]

    for _ in range(2):
        run_out(workdir, ["true"], network="none")
        deadline = time.monotonic() + 10 + netns.IDLE_SECONDS
        while makers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not makers()
        assert len(netns._POOL._ready) == netns.POOL_SIZE


def test_a_namespace_that_cannot_be_joined_is_made_by_the_clone(workdir: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Handed something that is no network namespace, the run still gets an empty one of its own."""
    from isolate.kernel import netns

    null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        monkeypatch.setattr(netns, "take", lambda: os.dup(null))
        result = run_out(workdir, py(NETNS_VIEW), network="none")
    finally:
        os.close(null)
    assert result.returncode == 0, result.stderr
    name, owner, up, names = result.stdout.split(maxsplit=3)
    assert (owner, up, names.strip()) == ("own", "0", "['lo']") and name != os.readlink("/proc/self/ns/net")


def test_namespaces_made_ahead_are_not_a_forked_childs() -> None:
    """A forked child never hands out its parent's namespaces: its pool starts empty."""
    from isolate.kernel import netns

    pid = os.fork()
    if pid == 0:
        os._exit(0 if not netns._POOL._ready and netns._POOL._pid == os.getpid() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root caller's runs take namespaces made ahead")
def test_a_child_forked_while_a_thread_holds_the_pool_takes_from_its_own() -> None:
    """The pool's lock, held by another thread at the fork, is free in the child (model/forks.py frees it)."""
    from isolate.kernel import netns

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with netns._POOL._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:
            fd = netns.take()  # waited for ever on the lock a thread the child does not have held
            os._exit(0 if fd == -1 and netns._POOL._pid == os.getpid() else 1)
    finally:
        release.set()
        holder.join()
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waited on the pool's lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_loopback_talks_to_itself(workdir: str) -> None:
    code = (
        "import socket\nsrv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()\n"
        "c = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()\n"
        "c.sendall(b'ping'); print(conn.recv(4).decode())\n"
    )
    result = run_out(workdir, py(code), network="loopback")
    assert result.stdout.strip() == "ping", result.stderr


def test_init_reaps_and_forwards(workdir: str) -> None:
    # An orphaned zombie is reaped by the init; the program's exit status passes through.
    script = ("for i in 1 2 3; do (sh -c 'exit 0' &); done; sleep 0.3; "
              "for f in /proc/[0-9]*/stat; do cut -d' ' -f3 $f; done | grep -c Z; exit 5")
    result = run_out(workdir, ["sh", "-c", script])
    assert result.returncode == 5
    assert result.stdout.strip() == "0", result.stdout


def test_signal_death_is_reported(workdir: str) -> None:
    result = run_out(workdir, ["sh", "-c", "kill -TERM $$"])
    assert result.returncode == -signal.SIGTERM
    assert result.report.status == "signaled" and result.report.signal == signal.SIGTERM


DAEMON = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
    "        open(sys.argv[1], 'w').write('up')\n        time.sleep(60)\n    os._exit(0)\n"
    # The program ends once its daemon is up (a fixed 0.3 s was not always enough on a loaded host).
    "deadline = time.monotonic() + 30\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n    time.sleep(0.02)\n"
    "time.sleep(0.3)\n"
)


def test_daemon_does_not_outlive_the_run(workdir: str) -> None:
    marker = os.path.join(workdir, f"daemon-{time.monotonic_ns()}")
    result = run_out(workdir, [*py(DAEMON), marker])
    assert result.returncode == 0
    assert os.path.exists(marker)
    time.sleep(0.2)
    assert processes_with(marker) == []


def mountinfo() -> list[str]:
    """The caller's mounts (a Docker engine's own come and go: they are not ours to judge)."""
    with open("/proc/self/mountinfo") as handle:
        lines = [line.split(" ", 4)[4] for line in handle]
    return sorted(line for line in lines if "docker" not in line)


def test_nothing_left_behind_after_cli_sigterm_and_parent_sigkill(workdir: str) -> None:
    before = mountinfo()
    marker = os.path.join(workdir, f"left-{time.monotonic_ns()}")
    # SIGTERM to isolate-run: the program (ignoring SIGTERM) and its daemon still go.
    cli = subprocess.Popen([ISOLATE_RUN, "--ro", os.path.dirname(PYTHON), "--",
                            *py(DAEMON.replace("time.sleep(0.3)", "time.sleep(60)")), marker], cwd=workdir)
    deadline = time.monotonic() + 60  # a wait, not a bound: a Python start in the VM under emulation is slow
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker)
    cli.terminate()
    cli.wait(timeout=10)
    cli.wait()
    time.sleep(0.3)
    assert processes_with(marker) == []
    # SIGKILL of a Python parent holding an isolate.Popen: the sandbox dies with it.
    marker2 = marker + "-2"
    parent_code = (
        "import isolate, sys, time\n"
        f"p = isolate.Popen({py(DAEMON.replace('time.sleep(0.3)', 'time.sleep(60)'))!r} + [{marker2!r}], "
        f"policy=isolate.Policy(read={list(policy().read)!r}, write=[{workdir!r}]), cwd={workdir!r})\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    deadline = time.monotonic() + 60
    while not os.path.exists(marker2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker2)
    parent.kill()
    parent.wait()
    time.sleep(0.5)
    assert processes_with(marker2) == []
    assert mountinfo() == before


def test_without_namespaces_a_daemon_is_still_ended(workdir: str) -> None:
    os.chmod(workdir, 0o777)
    marker = os.path.join(workdir, f"nons-{time.monotonic_ns()}")
    result = isolate.run([*py(DAEMON), marker], policy=policy(write=[workdir], namespaces=False, tmpfs=()),
                         cwd=workdir)
    assert result.returncode == 0
    time.sleep(0.3)
    assert processes_with(marker) == []


def test_without_namespaces_unix_sockets_by_path_are_refused(workdir: str) -> None:
    os.chmod(workdir, 0o777)
    code = ("import socket\ntry:\n    socket.socket(socket.AF_UNIX)\n    print('socket')\nexcept OSError as e:\n"
            "    print(e.errno)\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1).decode())\n")
    result = isolate.run(py(code), policy=policy(write=[workdir], namespaces=False, tmpfs=()), cwd=workdir,
                         capture_output=True, text=True)
    assert result.stdout.split() == ["1", "x"], result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the init is not dumpable: only root may list its descriptors")
def test_init_holds_no_passed_descriptor(workdir: str) -> None:
    r, w = os.pipe()
    try:
        with isolate.Popen(["sleep", "5"], policy=policy(write=[workdir]), cwd=workdir, pass_fds=[r]) as proc:
            time.sleep(0.3)
            passed = os.fstat(r).st_ino
            held = [os.stat(f"/proc/{proc.pid}/fd/{fd}").st_ino for fd in os.listdir(f"/proc/{proc.pid}/fd")]
            assert passed not in held
            assert len(held) <= 4, held  # its signalfd, the status pipe, the seccomp listener, the pidfd of its caller
            proc.kill()
    finally:
        os.close(r)
        os.close(w)
