"""Shared helpers: every test runs real sandboxes on the real kernel."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import isolate

ROOT = os.geteuid() == 0

#: Ray keeps its address file (ray_current_cluster) and sessions under $RAY_TMPDIR/ray, else /tmp/ray: one
#: directory for every user of the machine, and for every run. After a root run of Ray, the uid 65534 half of
#: tests/run-all.sh failed on it (PermissionError), and a plain ray.init() may find another run's cluster there.
#: Each run of the tests (and so each of the two callers run-all.sh starts side by side) has its own, private
#: and removed at the end: the Ray processes the tests start inherit it.
RAY_TMPDIR = tempfile.mkdtemp(prefix="isolate-tests-ray-")
os.mkdir(os.path.join(RAY_TMPDIR, "ray"), 0o700)  # where Ray writes the address file, without making it
os.environ["RAY_TMPDIR"] = RAY_TMPDIR

#: The interpreter probes run with: the system's (under /usr, granted by default and
#: reachable by the unprivileged uid a root caller's program gets), else the tests' own.
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else os.path.realpath(sys.executable)
PYTHON_PREFIX = os.path.dirname(os.path.dirname(PYTHON)) if PYTHON != "/usr/bin/python3" else "/usr"

#: The installed isolate-run: the native binary pip put beside this interpreter (csrc/cli.c), never a
#: Python stand-in; a missing one fails every CLI test.
ISOLATE_RUN = os.path.join(os.path.dirname(sys.executable), "isolate-run")

root_only = pytest.mark.skipif(not ROOT, reason="needs a root caller (checks how a root caller is confined)")


def python_read() -> tuple[str, ...]:
    """The default read paths plus what a probe written in Python needs."""
    extra = [p for p in {PYTHON_PREFIX, os.path.dirname(PYTHON)} if not p.startswith(("/usr", "/etc"))]
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        extra.append(os.path.realpath(venv))
    return tuple(dict.fromkeys(list(isolate.model.policy.DEFAULT_READ) + extra))


#: Top-level host directories a test may expect to be absent from the sandbox's root.
HOST_TOP = ("root", "home", "boot", "sys", "srv", "opt", "mnt", "media", "run", "data")


def not_granted_top(*granted: str, home: bool = True) -> set[str]:
    """The top-level names of ``HOST_TOP`` that no granted path (nor the private home) brings into the
    sandbox's root: these must not be visible, wherever the checkout and its venv live (``/root``,
    ``/home/USER``)."""
    tops = set()
    for path in (*python_read(), *granted):
        for form in (os.path.abspath(path), os.path.realpath(path)):
            parts = [p for p in form.split("/") if p]
            if parts:
                tops.add(parts[0])
    if home and isolate.model.policy.DEFAULT_HOME:
        tops.add(isolate.model.policy.DEFAULT_HOME.split("/")[1])
    return set(HOST_TOP) - tops


def _namespaces_problem() -> str | None:
    """Why this host cannot run a namespaced sandbox at all (asked once), or None."""
    from isolate.backends import native

    err = native.userns_error()
    if err:
        return (f"this host cannot create user namespaces ({os.strerror(err)}): every namespaced test is "
                "skipped for that one reason (the no-namespace ones still run)")
    return None


NAMESPACES_WHY = _namespaces_problem()


def _landlock_problem() -> str | None:
    """Why runs without namespaces are refused on this host (they need Landlock, ABI 6), or None."""
    from isolate.kernel import landlock

    refusal = landlock.without_namespaces_refusal(landlock.abi())
    if refusal:
        return (f"isolate refuses runs without namespaces on this kernel ({refusal.split(';')[0]}), so every "
                "no-namespace test is skipped for that one reason")
    return None


LANDLOCK_WHY = _landlock_problem()


def skip_unless_runnable(args: tuple[str, ...] | list[str]) -> None:
    """Skip a CLI test this host cannot run: namespaces missing, or --no-namespaces without Landlock."""
    if "--no-namespaces" in args:
        if LANDLOCK_WHY:
            pytest.skip(LANDLOCK_WHY)
    elif NAMESPACES_WHY and "--" in args:
        pytest.skip(NAMESPACES_WHY)


def _work_base() -> str | None:
    """Where test directories go: TMPDIR, unless a root caller cannot idmap there (tmpfs before Linux 6.3,
    overlayfs): then the first of /var/tmp and the checkout's directory that can."""
    if not ROOT or NAMESPACES_WHY:
        return None
    from isolate.backends import native

    for base in (tempfile.gettempdir(), "/var/tmp", os.path.dirname(os.path.abspath(__file__))):
        if os.path.isdir(base) and native._idmap_problem(os.stat(base).st_dev, base, 65534, 65534) is None:
            return None if base == tempfile.gettempdir() else base
    return None


WORK_BASE = _work_base()


@pytest.fixture
def workdir() -> Iterator[str]:
    """A fresh directory, writable by the test's user and by a root caller's program."""
    with tempfile.TemporaryDirectory(prefix="isolate-test-", dir=WORK_BASE) as path:
        os.chmod(path, 0o755)
        yield path


def policy(**changes: object) -> isolate.Policy:
    """A test policy; a namespaced one skips the test where this host has no namespaces (one reason)."""
    if NAMESPACES_WHY and changes.get("namespaces", True):
        pytest.skip(NAMESPACES_WHY)
    if LANDLOCK_WHY and changes.get("namespaces", True) is False:
        pytest.skip(LANDLOCK_WHY)
    fields: dict[str, object] = {"read": python_read(), "backend": "native"}
    fields.update(changes)
    return isolate.Policy(**fields)  # type: ignore[arg-type]


def processes_with(marker: str) -> list[int]:
    """Pids of the processes whose command line contains ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if marker.encode() in handle.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def py(code: str) -> list[str]:
    return [PYTHON, "-I", "-S", "-c", code]


@contextlib.contextmanager
def descriptors_past_fd_setsize() -> Iterator[None]:
    """Hold descriptors until the next one opened is numbered past 1024, where select() fails
    (an agent's host process that holds many sandboxes and commands gets there)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit here is {hard}")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1050:
            held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def write_tiny_wheel(path: str | os.PathLike[str]) -> None:
    """A valid pure-Python wheel ``tinypkg-1.0-py3-none-any.whl`` at ``path``: what a pip index serves in tests."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tinypkg/__init__.py", "VALUE = 42\n")
        z.writestr("tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        z.writestr("tinypkg-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tinypkg-1.0.dist-info/RECORD", "")


#: Test modules whose outcome does not depend on the kernel, its cgroup layout or its Landlock ABI:
#: protocol and framework adapters (the integrations run the same native sandboxes the host-marked
#: modules prove), the Docker backend (no engine in the VM), the policy grammar and the benchmark
#: harness, learn mode on real programs (test_learn.py: it reruns each program until nothing is refused;
#: the denial tracer it stands on runs in the VM with test_why.py), and the Ray cluster layer
#: (test_ray.py: placement, transport and failures around the
#: same native sandboxes, test_ray_nodes.py: snapshots between nodes; a Ray cluster under the VM's emulation
#: would take most of CI's budget).
#: Every other module is marked ``host`` and runs again in the VM (Linux 6.1, cgroup v2,
#: Landlock ABI 2) as root and as uid 65534: a new module is host-sensitive unless it is named here.
HOST_INDEPENDENT = frozenset({
    "test_benchmarks_quick.py",
    "test_containers.py",
    "test_csrc_layers.py",
    "test_docker.py",
    "test_examples.py",
    "test_exec_keep.py",
    "test_images_memory.py",
    "test_images_push.py",
    "test_images_subids.py",
    "test_images_trust.py",
    "test_images_unpack.py",
    "test_inspect.py",
    "test_kubernetes.py",
    "test_layers.py",
    "test_learn.py",
    "test_llm_sandbox.py",
    "test_mcp.py",
    "test_policy.py",
    "test_ray_transfer.py",
    "test_sandbox_docker.py",
    "test_ray.py",
    "test_ray_direct.py",
    "test_ray_nodes.py",
    "test_ray_ports.py",
    "test_ray_tls.py",
    "test_server.py",
    "test_server_bash_kept.py",
    "test_server_bg_lookup.py",
    "test_server_code_driverpid.py",
    "test_server_crashes.py",
    "test_server_keepall.py",
    "test_server_pool.py",
    "test_server_reboot.py",
    "test_server_restart.py",
    "test_server_spec.py",
    "test_shell_stdin.py",
    "test_smolagents.py",
    "test_soak.py",
})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "host: depends on the kernel, cgroups or Landlock; also run in the VM")
    config.addinivalue_line("markers", "host_independent: a test of a host-marked module whose outcome does not "
                            "depend on the kernel (the host's own Python racing itself, say), too slow to repeat "
                            "under the VM's emulation")


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    shutil.rmtree(RAY_TMPDIR, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name not in HOST_INDEPENDENT and item.get_closest_marker("host_independent") is None:
            item.add_marker(pytest.mark.host)


@pytest.fixture
def upstream() -> Iterator[int]:
    """A loopback server that answers every connection "hi\\n" and keeps it open: the port the names of an
    egress allow-list map to (``egress_profile``)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"hi\n")
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in held:
            conn.close()


def egress_profile(directory: Path, port: int) -> str:
    """A profile (``directory/egress.toml``, readable by a server of another user) whose allow-list holds
    ``web.test`` and ``late.test`` on ``port`` of the loopback."""
    profile = directory / "egress.toml"
    profile.write_text(f'[network]\negress = ["web.test:{port}", "late.test:{port}"]\n'
                       'add_hosts = {"web.test" = "127.0.0.1", "late.test" = "127.0.0.1"}\n')
    profile.chmod(0o644)
    directory.chmod(0o755)
    return str(profile)


@pytest.fixture
def state_dir() -> Iterator[str]:
    """A state directory for an ``isolate-run serve`` (``--state-dir``) of the server tests, removed after."""
    path = tempfile.mkdtemp(prefix="isolate-serve-state-")
    try:
        yield path
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def volume_store() -> Iterator[str]:
    """A ``--volume-store`` for the server tests (named volumes), removed after."""
    path = tempfile.mkdtemp(prefix="isolate-serve-volumes-")
    os.chmod(path, 0o755)  # the sandbox's user (65534 under a root server) reaches its volumes
    try:
        yield path
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def running(process: int | Any) -> bool:
    """Whether a process (a pid, or a psutil.Process) runs: not ended, not a zombie; one that ends while it is
    looked at has ended (psutil raises NoSuchProcess then, between any two of its reads)."""
    import psutil

    try:
        proc = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def recv_exact(sock: Any, size: int) -> bytes:
    """Exactly ``size`` bytes from a socket (a test's peer); an assertion when it closes first."""
    got = b""
    while len(got) < size:
        chunk = sock.recv(size - len(got))
        assert chunk, "the peer closed the connection early"
        got += chunk
    return got


def in_threads(work: Any, count: int) -> list[BaseException]:
    """``work(n)`` in ``count`` threads at once (n = 0 .. count-1), joined; what each raised, if anything."""
    import threading

    failures: list[BaseException] = []

    def run(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:  # reported to the test's thread
            failures.append(exc)

    workers = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return failures


def finishes(call: Any, within: float) -> tuple[bool, Any]:
    """Run call in a thread: (whether it returned or raised within the time, what it gave)."""
    import threading

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:
            out["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    return not thread.is_alive(), out.get("value")


def ray_cluster(head: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    """A local Ray cluster (``ray.cluster_utils.Cluster``): its head started with ``head``'s arguments, then a
    node for each of ``nodes``; returns (cluster, those nodes). Started again once where Ray gave up on a
    node: it waits a fixed 30 s for a raylet to register, which a loaded host can pass (ci5: as two suites and
    the VM ran, "The current node timed out during startup")."""
    from ray import cluster_utils

    for attempt in range(2):
        cluster = None
        try:
            cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=head)
            return cluster, [cluster.add_node(**node) for node in nodes]
        except Exception as exc:
            if cluster is not None:
                cluster.shutdown()
            if attempt or "timed out during startup" not in str(exc):
                raise
    raise AssertionError("unreachable")
