"""Pathname unix sockets under network none/loopback (issue 11, finding 4).

A read grant must not hand the program the host's daemons: their sockets
are not scoped by the network namespace, and connect() works through a
read-only bind. The servers here are started by the test, on the host, with
mode 0777 sockets, so that only isolate's own rule can refuse the program.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import ISOLATE_RUN, policy, py, python_read

import isolate
from isolate.backends import native
from isolate.kernel import landlock


class Server:
    """A unix socket server on the host, counting what reaches it."""

    def __init__(self, path: str, kind: int = socket.SOCK_STREAM) -> None:
        self.path = path
        self.accepted = 0
        self.sock = socket.socket(socket.AF_UNIX, kind)
        self.sock.bind(path)
        os.chmod(path, 0o777)
        self.kind = kind
        if kind == socket.SOCK_STREAM:
            self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            try:
                if self.kind == socket.SOCK_STREAM:
                    conn, _ = self.sock.accept()
                    conn.sendall(b"hello")
                    conn.close()
                else:
                    self.sock.recv(100)
                self.accepted += 1
            except (TimeoutError, OSError):
                continue

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close()


@pytest.fixture
def granted(workdir: str) -> Iterator[tuple[str, Server]]:
    """(a directory granted read-only, a stream server listening in it)."""
    ro = os.path.join(workdir, "ro")
    os.mkdir(ro)
    os.chmod(workdir, 0o777)
    os.chmod(ro, 0o755)
    server = Server(os.path.join(ro, "s.sock"))
    try:
        yield ro, server
    finally:
        server.close()


def run(code: str, workdir: str, ro: str, *args: str, **changes: object) -> isolate.CompletedProcess:
    fields: dict[str, object] = {"read": (*policy().read, ro), "write": (workdir,)}
    fields.update(changes)
    return isolate.run([*py(code), *args], policy=policy(**fields), cwd=workdir, capture_output=True, text=True)


CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
    print("connected", s.recv(5).decode())
except OSError as e:
    print("refused", e.errno)
"""


def test_a_read_grant_does_not_reach_a_host_socket(granted: tuple[str, Server], workdir: str) -> None:
    ro, server = granted
    result = run(CONNECT, workdir, ro, server.path)
    assert result.stdout.split() == ["refused", "13"], result.stderr
    assert server.accepted == 0
    report = result.report
    assert report.enforced["unix_sockets"] in ("supervisor", "landlock")
    if report.enforced["unix_sockets"] == "supervisor":
        assert {"mechanism": "unix-socket", "path": server.path, "count": 1} in report.denied


def test_host_network_keeps_host_sockets(granted: tuple[str, Server], workdir: str) -> None:
    """network=host grants the host's sockets with the host's network (said in the report)."""
    ro, server = granted
    result = run(CONNECT, workdir, ro, server.path, network="host")
    assert result.stdout.split() == ["connected", "hello"], result.stderr
    assert result.report.enforced["unix_sockets"] == "host"


def test_relative_path_and_planted_symlink_are_refused(granted: tuple[str, Server], workdir: str) -> None:
    ro, server = granted
    code = CONNECT.replace("s.connect(sys.argv[1])", "import os; os.chdir(sys.argv[2]); s.connect(sys.argv[1])")
    result = run(code, workdir, ro, "s.sock", ro)
    assert result.stdout.split() == ["refused", "13"], result.stderr
    link = os.path.join(workdir, "link.sock")
    code = CONNECT.replace("s.connect(sys.argv[1])", "import os; os.symlink(sys.argv[2], sys.argv[1]); "
                           "s.connect(sys.argv[1])")
    result = run(code, workdir, ro, link, server.path)
    assert result.stdout.split() == ["refused", "13"], result.stderr
    # A link to a directory of the read grant, then a relative path through it.
    code = CONNECT.replace("s.connect(sys.argv[1])", "import os; os.symlink(sys.argv[2], 'dirlink'); "
                           "s.connect(sys.argv[1])")
    result = run(code, workdir, ro, "dirlink/s.sock", ro)
    assert result.stdout.split() == ["refused", "13"], result.stderr
    assert server.accepted == 0


RACE = r"""
import ctypes, os, socket, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
good, bad = sys.argv[1].encode(), sys.argv[2].encode()
own = socket.socket(socket.AF_UNIX); own.bind(good.decode()); own.listen(1000)
class sockaddr_un(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("path", ctypes.c_char * 108)]
addr = sockaddr_un(socket.AF_UNIX, good)
stop = False
def flip():
    a, b = ctypes.create_string_buffer(good, 108), ctypes.create_string_buffer(bad, 108)
    off = sockaddr_un.path.offset
    while not stop:
        ctypes.memmove(ctypes.addressof(addr) + off, b, 108)
        ctypes.memmove(ctypes.addressof(addr) + off, a, 108)
t = threading.Thread(target=flip); t.start()
ok = refused = 0
for i in range(300):
    s = socket.socket(socket.AF_UNIX)
    if libc.connect(s.fileno(), ctypes.byref(addr), ctypes.sizeof(addr)) == 0:
        ok += 1
        if s.getpeername() != good.decode():
            print("ESCAPED", s.getpeername())
    else:
        refused += 1
    s.close()
    try:
        own.settimeout(0); own.accept()[0].close()
    except OSError:
        pass
stop = True; t.join()
print(ok, refused)
"""


def test_a_racing_thread_cannot_swap_the_address(granted: tuple[str, Server], workdir: str) -> None:
    """The address is read once and the path opened once: what is checked is what is connected."""
    ro, server = granted
    result = run(RACE, workdir, ro, "/tmp/own.sock", server.path)
    assert "ESCAPED" not in result.stdout, result.stdout
    ok, refused = (int(n) for n in result.stdout.split())
    assert ok + refused == 300, result.stderr
    assert server.accepted == 0


def test_datagram_sockets_cannot_reach_a_host_socket(granted: tuple[str, Server], workdir: str) -> None:
    ro, _ = granted
    server = Server(os.path.join(ro, "d.sock"), socket.SOCK_DGRAM)
    try:
        code = (
            "import socket, sys\n"
            "for kind in (socket.SOCK_DGRAM, 3):  # SOCK_RAW is a datagram socket for AF_UNIX\n"
            "    try:\n"
            "        s = socket.socket(socket.AF_UNIX, kind)\n"
            "        s.sendto(b'x', sys.argv[1]); print('sent')\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n"
            "try:\n"
            "    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "    a.sendto(b'x', sys.argv[1]); print('sent')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "a, b = socket.socketpair(); a.send(b'y'); print(b.recv(1).decode())\n"
        )
        result = run(code, workdir, ro, server.path)
        time.sleep(0.3)
        assert server.accepted == 0
        if result.report.enforced["unix_sockets"] == "supervisor":
            assert result.stdout.split() == ["refused", "13"] * 3 + ["y"], result.stderr
            assert any(d.get("type") == "datagram" for d in result.report.denied)
        else:
            assert "sent" not in result.stdout
    finally:
        server.close()


OWN = """
import os, socket, sys, threading
path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX); srv.bind(path); srv.listen(1)
def serve():
    c, _ = srv.accept(); c.sendall(b"own"); c.close()
threading.Thread(target=serve).start()
c = socket.socket(socket.AF_UNIX); c.connect(path); print(c.recv(3).decode())
a = socket.socket(socket.AF_UNIX); a.bind("\\0isolate-test-abstract"); a.listen(1)
b = socket.socket(socket.AF_UNIX); b.connect("\\0isolate-test-abstract"); print("abstract")
"""


@pytest.mark.parametrize("where", ["tmp", "write"])
def test_sockets_the_program_creates_work(granted: tuple[str, Server], workdir: str, where: str) -> None:
    ro, _ = granted
    path = "/tmp/own.sock" if where == "tmp" else os.path.join(workdir, "own.sock")
    result = run(OWN, workdir, ro, path)
    assert result.stdout.split() == ["own", "abstract"], result.stderr
    assert result.report.denied == []


def test_unix_socket_option_reaches_exactly_that_socket(granted: tuple[str, Server], workdir: str) -> None:
    ro, server = granted
    other = Server(os.path.join(ro, "other.sock"))
    try:
        code = ("import socket, sys\nfor p in sys.argv[1:]:\n    s = socket.socket(socket.AF_UNIX)\n"
                "    try:\n        s.connect(p); print('connected', s.recv(5).decode())\n"
                "    except OSError as e:\n        print('refused', e.errno)\n")
        result = run(code, workdir, ro, server.path, other.path, unix_sockets=(server.path,))
        assert result.stdout.split() == ["connected", "hello", "refused", "13"], result.stderr
        assert result.report.enforced["unix_sockets_allowed"] == [server.path]
        assert other.accepted == 0
        # The CLI's flag, and without --ro: the socket alone is bound in.
        cli = subprocess.run(
            [ISOLATE_RUN, "--backend", "native", "--unix-socket", server.path,
             *(arg for path in policy().read for arg in ("--ro", path)), "--",
             *py(CONNECT), server.path],
            cwd=workdir, capture_output=True, text=True, timeout=60,
        )
        assert cli.stdout.split() == ["connected", "hello"], cli.stderr
    finally:
        other.close()


def test_unix_socket_must_be_a_socket(workdir: str) -> None:
    path = os.path.join(workdir, "plain")
    open(path, "w").close()
    with pytest.raises(isolate.PolicyError, match="not a unix socket"):
        isolate.run(["true"], policy=policy(unix_sockets=(path,)), cwd=workdir)


def test_a_profile_that_denies_connect_stays_in_force(granted: tuple[str, Server], workdir: str) -> None:
    """connect() goes to the init only when the profile allows it: a denial is never performed."""
    ro, _ = granted
    profile = os.path.join(workdir, "profile.json")
    with open(profile, "w") as handle:
        json.dump({"defaultAction": "SCMP_ACT_ALLOW",
                   "syscalls": [{"names": ["connect"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}, handle)
    code = ("import socket\nsrv = socket.socket(socket.AF_UNIX); srv.bind('/tmp/x.sock'); srv.listen(1)\n"
            "c = socket.socket(socket.AF_UNIX)\ntry:\n    c.connect('/tmp/x.sock'); print('connected')\n"
            "except OSError as e:\n    print('refused', e.errno)\n")
    result = run(code, workdir, ro, seccomp=profile)
    assert result.stdout.split() == ["refused", "1"], result.stderr


def test_io_uring_is_refused_under_the_supervisor(granted: tuple[str, Server], workdir: str) -> None:
    """A ring's IORING_OP_CONNECT would never pass through seccomp."""
    ro, _ = granted
    if landlock.abi() >= 9:
        pytest.skip("Landlock governs unix sockets here; io_uring needs no refusal")
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(120)\n"
            "print(libc.syscall(425, 4, buf), ctypes.get_errno())\n")
    result = run(code, workdir, ro, seccomp="none")
    assert result.stdout.split() == ["-1", "1"], result.stderr


def test_a_program_that_hides_from_the_init_is_refused(workdir: str) -> None:
    """Not dumpable: the init cannot take its socket, and says no (fail closed)."""
    if landlock.abi() >= 9:
        pytest.skip("Landlock governs unix sockets here")
    code = ("import ctypes, socket\nsrv = socket.socket(socket.AF_UNIX); srv.bind('/tmp/x.sock'); srv.listen(1)\n"
            "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\n"
            "c = socket.socket(socket.AF_UNIX)\ntry:\n    c.connect('/tmp/x.sock'); print('connected')\n"
            "except OSError as e:\n    print('refused', e.errno)\n")
    result = isolate.run(py(code), policy=policy(write=(workdir,)), cwd=workdir, capture_output=True, text=True)
    assert result.stdout.split() == ["refused", "13"], result.stderr


TCP = """
import errno, select, socket, sys
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)
port = srv.getsockname()[1]
a = socket.socket(); a.connect(("127.0.0.1", port)); print("blocking")
b = socket.socket(); b.setblocking(False)
rc = b.connect_ex(("127.0.0.1", port))
if rc == errno.EINPROGRESS:
    select.select([], [b], [], 5)
    rc = b.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
print("nonblocking", rc)
c = socket.socket()
print("outside", c.connect_ex(("1.1.1.1", 53)))
"""


def test_loopback_tcp_connects_work(workdir: str) -> None:
    result = isolate.run(py(TCP), policy=policy(network="loopback"), cwd=workdir, capture_output=True, text=True)
    assert result.stdout.split() == ["blocking", "nonblocking", "0", "outside", "101"], result.stderr
    if result.report.enforced["unix_sockets"] == "supervisor":
        assert {"mechanism": "network", "address": "1.1.1.1", "port": 53, "count": 1} in result.report.denied


BLOCKED = """
import socket, sys
srv = socket.socket(socket.AF_UNIX); srv.bind("/tmp/full.sock"); srv.listen(0)
n = 0
while True:  # fill the backlog with non-blocking connects
    s = socket.socket(socket.AF_UNIX); s.setblocking(False)
    try:
        s.connect("/tmp/full.sock"); n += 1
    except BlockingIOError:
        break
print("full", n, flush=True)
socket.socket(socket.AF_UNIX).connect("/tmp/full.sock")  # blocks: nobody accepts
print("never")
"""


def test_a_blocked_connect_does_not_stop_the_wall_clock(workdir: str) -> None:
    started = time.monotonic()
    result = isolate.run(py(BLOCKED), policy=policy(limits=isolate.Limits(wall_seconds=1.5)), cwd=workdir,
                         capture_output=True, text=True)
    assert time.monotonic() - started < 15
    assert "full" in result.stdout and "never" not in result.stdout, result.stderr
    assert result.report.status == "timeout"


def test_none_fails_fast_and_says_so(workdir: str) -> None:
    code = ("import socket, sys\nfor i in range(2):\n    c = socket.socket()\n"
            "    print(c.connect_ex(('1.1.1.1', 53)))\nsys.exit(1)\n")
    started = time.monotonic()
    result = isolate.run(py(code), policy=policy(), cwd=workdir, capture_output=True, text=True)
    assert time.monotonic() - started < 10
    assert result.stdout.split() == ["101", "101"], result.stderr
    if result.report.enforced["unix_sockets"] == "supervisor":
        assert {"mechanism": "network", "address": "1.1.1.1", "port": 53, "count": 2} in result.report.denied
        cli = subprocess.run(
            [ISOLATE_RUN, "--backend", "native",
             *(arg for path in policy().read for arg in ("--ro", path)), "--", *py(code)],
            cwd=workdir, capture_output=True, text=True, timeout=60,
        )
        assert cli.returncode == 1
        assert ("isolate-run: the network is off (--net none): connect to 1.1.1.1:53 was refused; "
                "allow it with --net host") in cli.stderr


def test_the_mechanism_is_chosen_by_abi(workdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ABI 9 and later: Landlock's own right, granted on write grants and tmpfs, never on read grants."""
    assert landlock.unix_socket_mechanism(9, "none", True, True) == "landlock"
    assert landlock.unix_socket_mechanism(8, "loopback", True, True) == "supervisor"
    assert landlock.unix_socket_mechanism(0, "none", True, True) == "supervisor"
    assert landlock.unix_socket_mechanism(7, "none", True, False) == "seccomp-no-unix-sockets"
    assert landlock.unix_socket_mechanism(9, "host", True, True) == "host"
    assert landlock.unix_socket_mechanism(9, "none", False, True) == "seccomp-no-sockets"
    bit = landlock.LANDLOCK_ACCESS_FS_RESOLVE_UNIX
    assert bit == 1 << 16
    assert landlock.handled_fs(9, resolve_unix=True) & bit
    assert not landlock.handled_fs(9) & bit
    assert not landlock.handled_fs(8, resolve_unix=True) & bit
    # The plan the native backend makes for an ABI 9 kernel (not run: this kernel may be older).
    ro = os.path.join(workdir, "ro")
    os.mkdir(ro)
    monkeypatch.setattr(landlock, "abi", lambda: 9)
    native._STATIC_CACHE.clear()
    try:
        prepared = native.prepare(policy(read=(*policy().read, ro), write=(workdir,)), ["true"], cwd=workdir)
        try:
            plan = prepared.plan
            assert prepared.enforced["unix_sockets"] == "landlock"
            assert plan.supervise == native.ffi.NULL
            assert plan.landlock_handled_fs & bit
            rules = {native.ffi.string(plan.landlock_rules[i].path).decode(): int(plan.landlock_rules[i].access)
                     for i in range(plan.n_landlock_rules)}
            assert rules[os.path.realpath(workdir)] & bit
            assert rules["/tmp"] & bit
            assert not rules[os.path.realpath(ro)] & bit
        finally:
            prepared.close_child_side()
            os.close(prepared.status_fd)
    finally:
        native._STATIC_CACHE.clear()


def test_docker_refuses_unix_sockets_under_read_only_binds(workdir: str) -> None:
    """A container has no supervisor: with a host directory bound read-only, AF_UNIX sockets are refused."""
    from isolate.backends import docker as backend

    ro = os.path.join(workdir, "ro")
    os.mkdir(ro)
    spec = backend.build_spec(isolate.Policy(read=(ro,), write=(), network="loopback"), cwd=workdir)
    assert spec.enforced["unix_sockets"] == "seccomp-no-unix-sockets"
    (option,) = [o for o in spec.security_opt if o.startswith("seccomp=")]
    profile = json.loads(option[len("seccomp="):])
    guards = [r for r in profile["syscalls"] if r["names"] in (["socket"], ["socketpair"]) and r.get("errnoRet") == 13]
    assert len(guards) == 3
    # seccomp none still gets the guard (an allow-all profile with it), never "unconfined".
    spec = backend.build_spec(isolate.Policy(read=(ro,), write=(), network="loopback", seccomp="none"),
                              cwd=workdir)
    assert not any(o == "seccomp=unconfined" for o in spec.security_opt)
    # Nothing bound read-only, or the host's network: no guard, and the report says why.
    spec = backend.build_spec(isolate.Policy(read=(), write=(), network="loopback"), cwd=workdir)
    assert spec.enforced["unix_sockets"] == "no host directory bound read-only"
    spec = backend.build_spec(isolate.Policy(read=(ro,), write=(), network="host"), cwd=workdir)
    assert spec.enforced["unix_sockets"] == "host"
    with pytest.raises(isolate.UnsupportedError, match="unix_sockets"):
        backend.build_spec(_with_socket(workdir), cwd=workdir)


def _with_socket(workdir: str) -> isolate.Policy:
    path = os.path.join(workdir, "named.sock")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.close()
    return isolate.Policy(read=(), write=(), network="loopback", unix_sockets=(path,))


def test_docker_runs_with_the_unix_guard(workdir: str) -> None:
    """The engine accepts the guarded profile, and a plain command still runs under it."""
    from test_docker import ENGINE_OK, ENGINE_WHY, pol, sh

    if not ENGINE_OK:
        pytest.skip(f"no usable Docker engine: {ENGINE_WHY}")
    ro = os.path.join(workdir, "ro")
    os.mkdir(ro)
    os.chmod(ro, 0o755)
    result = sh("echo ok", pol(read=[ro]))
    assert result.stdout.strip() == "ok", result.stderr
    assert result.report.enforced["unix_sockets"] == "seccomp-no-unix-sockets"


def test_preexec_fn_without_a_supervisor_refuses_unix_sockets(granted: tuple[str, Server], workdir: str) -> None:
    """The pre-exec hook has no init to perform connect(): AF_UNIX sockets are refused (fail closed)."""
    ro, server = granted
    if landlock.abi() >= 9:
        pytest.skip("Landlock governs unix sockets here")
    pol = policy(read=(*policy().read, ro), write=(workdir,))
    code = ("import socket, sys\ntry:\n    s = socket.socket(socket.AF_UNIX)\n"
            "    s.connect(sys.argv[1]); print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\n"
            "a, b = socket.socketpair(); a.send(b'y'); print(b.recv(1).decode())\n")
    result = subprocess.run([*py(code), server.path], preexec_fn=pol.preexec_fn, cwd=workdir, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.split() == ["refused", "13", "y"], result.stderr
    assert server.accepted == 0
    # write=: not the default grant of the cwd, which as 65534 is /tmp, refused for holding its runtime directory.
    with pytest.raises(isolate.UnsupportedError, match="unix_sockets"):
        policy(unix_sockets=(server.path,), write=(workdir,)).preexec_fn()


def test_the_hint_line_escapes_the_programs_path() -> None:
    from isolate.cli.main import denial_hints

    report = isolate.Report(denied=[{"mechanism": "unix-socket", "path": "/tmp/\x1b[2Jx", "count": 1}])
    (line,) = denial_hints(report, isolate.Policy())
    assert "\x1b" not in line and "\\x1b[2Jx" in line


def test_a_thread_that_is_not_the_leader_is_supervised(granted: tuple[str, Server], workdir: str) -> None:
    """The init takes the socket from the calling thread itself (pidfd of the thread)."""
    ro, server = granted
    code = ("import socket, sys, threading\nsrv = socket.socket(socket.AF_UNIX); srv.bind('/tmp/t.sock'); "
            "srv.listen(1)\ndef go():\n    for p in ('/tmp/t.sock', sys.argv[1]):\n"
            "        c = socket.socket(socket.AF_UNIX)\n        try:\n            c.connect(p); print('connected')\n"
            "        except OSError as e:\n            print('refused', e.errno)\n"
            "t = threading.Thread(target=go); t.start(); t.join()\n")
    result = run(code, workdir, ro, server.path)
    assert result.stdout.split() == ["connected", "refused", "13"], result.stderr
    assert server.accepted == 0


def test_seccomp_none_on_the_host_network_installs_no_filter(workdir: str) -> None:
    """The supervisor's filter is there only where it is needed (network none/loopback); with no writable
    path there is no set-ID guard either."""
    code = "print(open('/proc/self/status').read())"
    result = isolate.run(py(code), policy=policy(seccomp="none", network="host", write=(),
                                                 read=(*python_read(), workdir)), cwd=workdir,
                         capture_output=True, text=True)
    assert "Seccomp:\t0\n" in result.stdout, result.stderr
    assert result.report.enforced["seccomp"] is None


@pytest.mark.parametrize("mode", ["default", "strict", "none"])
def test_every_allow_of_the_profile_goes_through_the_epilogue(mode: str) -> None:
    """No path of the compiled profile returns ALLOW (or USER_NOTIF) without the supervisor's epilogue."""
    import struct

    from isolate.kernel import seccomp

    reference = seccomp.compile_filter("default", notify=True)
    with_epilogue = seccomp.compile_filter("default", notify=True, unix_sockets="supervise")
    assert reference is not None and with_epilogue is not None
    epilogue = (len(with_epilogue.bpf) - len(reference.bpf)) // 8  # the same for every profile
    supervised = seccomp.compile_filter(mode, notify=True, unix_sockets="supervise")
    assert supervised is not None
    body = len(supervised.bpf) // 8 - epilogue
    returns = [struct.unpack_from("=HBBI", supervised.bpf, 8 * i) for i in range(len(supervised.bpf) // 8)]
    for index, (code, _jt, _jf, k) in enumerate(returns[:body]):
        if code == 0x06:
            assert k not in (seccomp.RET_ALLOW, seccomp.RET_LOG, seccomp.RET_USER_NOTIF), (index, hex(k))
    assert any(code == 0x06 and k == seccomp.RET_USER_NOTIF for code, _, _, k in returns[body:])
