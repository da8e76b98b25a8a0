"""isolate.Sandbox on the Docker backend: what only a container has (tests/test_sandbox.py runs the rest on both).

The engine and image come from tests/docker_env.sh; without them (or as a
user with no access to the engine, such as 65534) these tests skip saying why.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ISOLATE_RUN

import isolate
from isolate import Mount, Sandbox, Workspace
from isolate.backends.docker.served import DockerKept
from isolate.backends.native.protocol import ServerGone

IMAGE = os.environ.get("ISOLATE_TEST_IMAGE", "isolate-test:busybox")


def _docker_why() -> str:
    """Why the Docker backend cannot be tested here ("" when it can)."""
    try:
        from isolate.backends import docker as backend

        usable, why = backend.available()
        if not usable:
            return why
        backend.check_image(IMAGE)
    except Exception as exc:  # the SDK missing, no engine, no image: say so in the skip
        return f"{type(exc).__name__}: {exc} (run tests/docker_env.sh)"
    return ""


DOCKER_WHY = _docker_why()
pytestmark = pytest.mark.skipif(bool(DOCKER_WHY), reason=f"no usable Docker engine: {DOCKER_WHY}")


def docker_policy(**changes: object) -> isolate.Policy:
    return isolate.Policy(backend="docker", image=IMAGE, write=(), **changes)  # type: ignore[arg-type]


@pytest.fixture
def project(tmp_path: Path) -> str:
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('hello')\n")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    tmp_path.chmod(0o755)
    return str(root)


@pytest.fixture
def box(project: str) -> Iterator[Sandbox]:
    with Sandbox(docker_policy(), workspace=Workspace(project), backend="docker") as sandbox:
        yield sandbox


def _container(box: Sandbox) -> str:
    container_id = getattr(box._impl, "container_id", None)
    assert isinstance(container_id, str)
    return container_id


def _engine_state(container_id: str) -> str:
    from isolate.backends.docker import client

    try:
        return str(client().api.inspect_container(container_id)["State"]["Status"])
    except Exception:
        return "missing"


def _reopen_socket_directory(box: Sandbox) -> None:
    """Give the socket directory back to the container's user, as for a caller who is not root (who is that
    user): a root caller closes it once the server listens, and the host's own checks are tested behind."""
    from isolate.backends.docker.spec import program_ids

    impl = box._impl
    assert isinstance(impl, DockerKept)
    impl._run_dir_owner(*program_ids(impl.policy))


@pytest.mark.skipif(os.geteuid() != 0, reason="the container's user owns the socket directory of a non-root caller")
def test_the_program_can_write_nothing_in_the_socket_directory(box: Sandbox) -> None:
    # It lies on the host (/run/isolate/docker/NAME.d, often a small tmpfs the whole host needs): a program
    # that shares the server's uid could fill it, or replace the socket.
    run = box._impl.paths.run
    result = box.exec("dd if=/dev/zero of=/.isolate/run/fill bs=1M count=4; rm -f /.isolate/run/server.sock")
    assert result.returncode != 0
    assert os.listdir(run) == ["server.sock"]
    assert box.exec("echo still").stdout == "still\n"


def test_files_are_written_and_read_as_the_container_user(box: Sandbox) -> None:
    uid = int(box.exec("id -u").stdout)
    box.write_file("made.txt", "by the host\n")
    host = Path(box._impl.workspace_host)
    assert os.stat(host / "made.txt").st_uid == uid == box.stat("made.txt").uid
    assert box.exec("cat made.txt").stdout == "by the host\n"
    # A file the container's user may not read is refused to the host too (no docker cp as root behind it).
    secret = host / "secret"
    secret.write_text("root only\n")
    if os.geteuid() == 0 and uid != 0:
        os.chown(secret, 0, 0)
        secret.chmod(0o600)
        with pytest.raises(PermissionError):
            box.read_file("secret")
        with pytest.raises(PermissionError):
            box.write_file("secret", "x")
    # The container's own files, through its mounts: its read-only root stays so.
    assert "root:" in box.read_file("/etc/passwd")
    with pytest.raises(OSError):
        box.write_file("/etc/planted", "x")


def test_a_socket_planted_in_the_servers_place_is_refused(box: Sandbox) -> None:
    # The program shares the server's uid: it can unlink the socket and listen there itself, here with
    # the very server binary bound into the container. The host must notice the listener is not PID 1.
    _reopen_socket_directory(box)
    planted = box.spawn("rm -f /.isolate/run/server.sock; exec /.isolate/isolate-exec-server "
                        "/.isolate/run/server.sock 0 0")
    for _ in range(200):
        time.sleep(0.02)
        try:
            box._impl.connect().close()
        except ServerGone:
            continue  # between the unlink and the planted server's bind
        except isolate.IsolationError as exc:
            assert "not served by the container's main process" in str(exc)
            break
    else:
        pytest.fail("a socket planted by the program was used by the host")
    with pytest.raises(isolate.IsolationError, match="main process"):
        box.exec("true")
    planted.kill()


def test_named_sandbox_is_attached_reused_and_removed(project: str, request: pytest.FixtureRequest) -> None:
    from isolate.backends.docker.sandbox import list_sandboxes
    from isolate.cli.sandbox import sandbox_main

    name = f"t-{os.getpid()}-{request.node.name[:20]}".replace("_", "-")
    policy = docker_policy()
    first = Sandbox(policy, workspace=Workspace(project), name=name, backend="docker").start()
    try:
        first.exec("echo kept > state.txt; sleep 300 >/dev/null 2>&1 &")
        first.detach()
        again = Sandbox.attach(name)
        assert again.backend == "docker" and again.exec("cat state.txt").stdout == "kept\n"
        assert "sleep 300" in again.exec("ps").stdout
        again.detach()
        reused = Sandbox(policy, workspace=Workspace(project), name=name, backend="docker").start()
        assert getattr(reused._impl, "last_action", None) == "reused"
        assert reused.read_file("state.txt") == "kept\n"
        reused.detach()
        assert name in {entry.record.name for entry in list_sandboxes()}
        container = _container(reused)
    finally:
        assert sandbox_main(["sandbox", "rm", name]) == 0
    assert _engine_state(container) == "missing"
    with pytest.raises(isolate.IsolationError, match="no running sandbox"):
        Sandbox.attach(name)
    assert not os.path.exists(reused._impl.workspace_host)


def test_unnamed_sandbox_leaves_nothing(project: str) -> None:
    box = Sandbox(docker_policy(), workspace=Workspace(project), backend="docker").start()
    container, host = _container(box), box._impl.workspace_host
    impl = box._impl
    assert isinstance(impl, DockerKept)
    run_dir = os.path.dirname(impl.paths.socket)
    assert os.path.isdir(host) and os.path.isdir(run_dir)
    box.close()
    assert _engine_state(container) == "missing"
    assert not os.path.exists(host) and not os.path.exists(run_dir)


def test_bind_workspace_and_mounts(project: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "input").write_text("given\n")
    data.chmod(0o755)
    (data / "input").chmod(0o644)
    os.chmod(project, 0o777)  # a bind workspace is the source itself: the container's user writes it as it is
    with Sandbox(docker_policy(), workspace=Workspace(project, target="/repo", mode="bind"),
                 mounts=[Mount(str(data), "/data", "ro")], backend="docker") as sb:
        assert sb.exec("pwd; cat /data/input").stdout == "/repo\ngiven\n"
        assert sb.exec("touch /data/x").returncode != 0
        assert sb.exec("echo direct > direct.txt").returncode == 0
        assert not sb.diff()
        assert sb.enforced["binds"]["ro"] == ["/data"]
    assert Path(project, "direct.txt").read_text() == "direct\n"
    # A mount's source reached through a link that is not root's is refused, as for grants.
    link = tmp_path / "link"
    link.symlink_to(data)
    if os.geteuid() != 0:
        with pytest.raises(isolate.PolicyError):
            Sandbox(docker_policy(), mounts=[Mount(str(link), "/data")], backend="docker").start()


def test_ttl_ends_the_container(project: str) -> None:
    box = Sandbox(docker_policy(), workspace=Workspace(project), backend="docker", ttl=1.0).start()
    try:
        container = _container(box)
        assert box.exec("echo up").stdout == "up\n"
        deadline = time.monotonic() + 20
        while _engine_state(container) == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _engine_state(container) in ("exited", "missing")
    finally:
        box.close()


def test_cli_lists_and_prunes_docker_sandboxes(project: str) -> None:
    name = f"cli-{os.getpid()}"
    box = Sandbox(docker_policy(), workspace=Workspace(project), name=name, backend="docker").start()
    box.detach()
    try:
        listed = subprocess.run([ISOLATE_RUN, "sandbox", "list"], capture_output=True,
                                text=True, timeout=60)
        assert any(line.split()[:2] == [name, "docker"] for line in listed.stdout.splitlines()), listed
    finally:
        box.close()
    assert not os.path.exists(box._impl.workspace_host)


def test_orphans_reaped_by_the_server_do_not_count_as_commands(project: str) -> None:
    # The server is the container's PID 1: what a command leaves behind comes to it when it dies. Reaping
    # such an orphan must not count as a command's end, or the idle timeout would end a running command.
    with Sandbox(docker_policy(), workspace=Workspace(project), backend="docker", idle_timeout=0.5) as box:
        long = box.spawn("sleep 3; echo done")
        for _ in range(3):
            box.exec("sleep 0.2 >/dev/null 2>&1 &")  # orphaned at once, reaped by PID 1 0.2 s later
        box._impl.detach()  # no file conversation open: only the running command keeps the sandbox up
        assert long.wait(20) == 0 and list(long) == [b"done\n"]
        long.close()
        assert "Z" not in box.exec("ps -o stat | tail -n +2").stdout  # no zombie left


def test_a_link_planted_in_the_socket_directory_is_not_followed(box: Sandbox, tmp_path: Path) -> None:
    # A link in the server's place would make the host connect wherever it leads, on the host's side.
    trap = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    trap.bind(str(tmp_path / "trap.sock"))
    trap.listen(4)
    trap.setblocking(False)
    _reopen_socket_directory(box)
    box.exec(f"rm -f /.isolate/run/server.sock; ln -s {tmp_path / 'trap.sock'} /.isolate/run/server.sock")
    with pytest.raises(isolate.IsolationError, match="not a socket"):
        box._impl.connect()
    with pytest.raises(BlockingIOError):
        trap.accept()  # nobody came
    trap.close()


def test_unnamed_sandbox_dies_with_its_creator(project: str) -> None:
    script = ("import isolate, os, sys, time\n"
              f"box = isolate.Sandbox(isolate.Policy(backend='docker', image={IMAGE!r}, write=()),\n"
              f"                      workspace=isolate.Workspace({project!r}), backend='docker').start()\n"
              "print(box._impl.container_id, box._impl.box_name, box._impl.workspace_host, flush=True)\n"
              "time.sleep(300)\n")
    creator = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert creator.stdout is not None
    container, name, host = creator.stdout.readline().split()
    assert _engine_state(container) == "running"
    creator.kill()  # no close(), no atexit: only the watchdog is left to remove it
    creator.wait()
    deadline = time.monotonic() + 30
    while _engine_state(container) != "missing" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_state(container) == "missing"
    # What it left on the host goes with rm (or prune, which finds its record without a container).
    from isolate.backends.docker.sandbox import remove_sandbox

    assert os.path.isdir(host) and remove_sandbox(name) and not os.path.exists(host)


def test_strict_seccomp_is_refused_with_the_reason() -> None:
    # The strict profile refuses the server's socket calls: said at once, not after a start that fails.
    with pytest.raises(isolate.UnsupportedError, match="strict"):
        Sandbox(docker_policy(seccomp="strict"), backend="docker")


def test_a_grant_that_holds_the_runtime_directory_is_refused(tmp_path: Path) -> None:
    # As natively (tests/test_sandbox_attacks.py): a container whose user may write the runtime directory
    # (a caller who is not root, granting /tmp where that directory is /tmp/isolate-UID) could rewrite
    # the kept sandboxes' descriptions there.
    from isolate.backends.docker import prepare
    from isolate.kernel.places import runtime_dir

    parent = os.path.dirname(runtime_dir())
    writes = isolate.Policy(backend="docker", image=IMAGE, write=(parent,), cwd=parent)
    os.makedirs(os.path.join(runtime_dir(), "docker"), 0o700, exist_ok=True)
    inside = docker_policy(binds=(Mount(os.path.join(runtime_dir(), "docker"), "/x", "rw"),))
    for pol in (writes, docker_policy(binds=(Mount(parent, "/x", "rw"),)), inside):
        with pytest.raises(isolate.PolicyError, match="runtime directory"):
            prepare(pol)
    prepare(docker_policy(binds=(Mount(parent, "/x", "ro"),)))  # seeing it is not writing it


def test_a_running_named_sandbox_is_not_replaced_by_another_of_its_name(project: str) -> None:
    # isolate-mcp's sandbox_create(name=...) lets an agent pick the name: another configuration (here only
    # a ttl) must not remove the running sandbox of that name, and its workspace with it (as natively).
    name = f"dk{os.getpid()}x"
    first = Sandbox(docker_policy(), workspace=Workspace(project), name=name, backend="docker").start()
    try:
        first.write_file("work.txt", "uncommitted\n")
        with pytest.raises(isolate.IsolationError, match="exists already"):
            Sandbox(docker_policy(), workspace=Workspace(project), name=name, backend="docker", ttl=600).start()
        assert first.read_file("work.txt") == "uncommitted\n"
        same = Sandbox(docker_policy(), workspace=Workspace(project), name=name, backend="docker").start()
        assert same._impl.last_action == "reused"  # the same configuration is still reached by its name
        same.detach()
    finally:
        first.close()


def test_prune_uses_no_name_that_isolate_did_not_give(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The registry lies in the state directory, which a sandbox granted it can write: a record named with
    # '..' made prune unlink "<runtime>/docker/NAME.json", i.e. any .json file on the host.
    import sqlite3

    from isolate.backends.docker import engine_address
    from isolate.backends.docker.sandbox import prune
    from isolate.backends.registry import Registry
    from isolate.kernel.places import runtime_dir

    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "state"))
    victim = tmp_path / "victim.json"
    victim.write_text("{}\n")
    name = "../" * (runtime_dir().count("/") + 1) + str(victim)[1:-len(".json")]
    assert os.path.normpath(os.path.join(runtime_dir(), "docker", name + ".json")) == str(victim)
    Registry().touch(engine_address(), "x", 0.0)  # makes the file and its table
    with sqlite3.connect(Registry().path) as db:
        db.execute("INSERT INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (engine_address(), name, "0" * 64, "", "", "", 0.0, 0.0))
    prune(idle=0.0, age=0.0)
    assert victim.read_text() == "{}\n"
    assert all(rec.name != name for rec in Registry().all())


def test_tmp_var_tmp_and_home_are_the_programs_whatever_the_images_modes(project: str) -> None:
    """An image whose /tmp is 0755, /var/tmp 0700 and home 0750 (root's): the engine's runc gives each tmpfs
    mounted there that mode; the program still writes them, by a command and by write_file, as natively."""
    import io
    import shutil
    import tarfile

    from isolate.backends import docker as backend

    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("no busybox binary on the host to build the image from")
    blob = io.BytesIO()
    with tarfile.open(fileobj=blob, mode="w") as tar:
        for name, mode in [("bin", 0o755), ("tmp", 0o755), ("var", 0o755), ("var/tmp", 0o700), ("home", 0o755),
                           ("home/sandbox", 0o750), ("workspace", 0o755)]:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for applet in subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split():
            if applet != "busybox":
                link = tarfile.TarInfo(f"bin/{applet}")
                link.type, link.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(link)
    repository, tag = "isolate-test", f"modes-{os.getpid()}"
    api = backend.client().api
    api.import_image_from_data(blob.getvalue(), repository=repository, tag=tag)
    try:
        policy = isolate.Policy(backend="docker", image=f"{repository}:{tag}", write=())
        with Sandbox(policy, workspace=Workspace(project), backend="docker") as box:
            done = box.exec("echo x > /tmp/y && echo x > /var/tmp/y && echo x > ~/y && echo written")
            assert done.stdout == "written\n", (done.stdout, done.stderr)
            box.write_file("/tmp/t.txt", "t")
            box.write_file("/var/tmp/t.txt", "t")
            assert box.read_file("/tmp/t.txt") == "t"
    finally:
        api.remove_image(f"{repository}:{tag}", force=True)
