"""isolate.Sandbox: a kept sandbox with a workspace, commands, files, shells.

Every test runs on the real kernel, as root and as uid 65534 (tests/run-all.sh).
The tests of the ``box`` fixture run on both backends: natively, and on Docker
where an engine and the test image answer (tests/docker_env.sh; not as 65534,
which has no access to the engine).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ISOLATE_RUN, NAMESPACES_WHY, PYTHON, WORK_BASE, policy, python_read
from test_sandbox_docker import DOCKER_WHY, IMAGE

import isolate
from isolate import Mount, Sandbox, Workspace
from isolate.kernel.places import runtime_dir

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def sandbox_policy(**changes: object) -> isolate.Policy:
    return policy(write=(), **changes)


@pytest.fixture
def source(workdir: str) -> str:
    """A small project to start a workspace from."""
    root = Path(workdir) / "project"
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('hello')\n")
    (root / "README").write_text("readme\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: main\n")
    (root / "node_modules" / "x").mkdir(parents=True)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    root.chmod(0o755)
    return str(root)


@pytest.fixture(params=["native", "docker"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "docker" and DOCKER_WHY:
        pytest.skip(f"no usable Docker engine: {DOCKER_WHY}")
    return str(request.param)


@pytest.fixture
def box(source: str, backend: str) -> Iterator[Sandbox]:
    pol = sandbox_policy() if backend == "native" else sandbox_policy(backend="docker", image=IMAGE)
    with Sandbox(pol, workspace=Workspace(source, exclude=(".git", "node_modules")), backend=backend) as sandbox:
        yield sandbox


def test_argv_and_environment_up_to_the_kernels_limit_reach_the_command(box: Sandbox) -> None:
    # One request packet holds 192 KiB: larger ones were refused ("at most 196608 go to a sandbox in one
    # request"), though the kernel runs up to ARG_MAX. They now travel in a sealed memfd.
    env = {f"BIG{i}": "v" * 100_000 for i in range(12)}  # 1.2 MB, each under MAX_ARG_STRLEN (128 KiB)
    args = ["x"] * 20_000  # more strings than one packet's table holds
    result = box.exec(["sh", "-c", 'echo "$#" "${#BIG7}"', "sh", *args], env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["20000", "100000"], result.stdout[:200]
    process = box.spawn(["sh", "-c", 'echo "${#BIG11}"'], env=env)
    assert process.stdout.read().split() == [b"100000"] and process.wait(60) == 0
    # Past the kernel's own limit: the kernel's refusal, named; past isolate's bound: one clear line.
    with pytest.raises(isolate.IsolationError, match="Argument list too long"):
        box.exec(["true", *(["y" * 1000] * 8000)])
    with pytest.raises(ValueError, match="at most 16777216 bytes"):
        box.exec(["true", *(["y" * 100_000] * 200)])
    assert box.exec("echo still").stdout == "still\n"


def test_a_file_of_many_mebibytes_is_written_and_read_whole(box: Sandbox) -> None:
    data = os.urandom(5 << 20)
    box.write_file("big.bin", data)
    assert box.read_file("big.bin", text=False) == data
    assert box.exec("wc -c < big.bin").stdout.strip() == str(5 << 20)


def terminal_shell_works(box: Sandbox) -> None:
    """Skip on the busybox test image: its ash edits lines, echoing a terminal's input (see Shell)."""
    if box.backend == "docker" and "busybox" in IMAGE:
        pytest.skip("busybox ash echoes what a terminal types (line editing): Shell(pty=True) needs a /bin/sh "
                    "without it (dash, as on Debian images)")


def test_commands_share_files_tmp_and_processes(box: Sandbox) -> None:
    first = box.exec("echo kept > /tmp/state && echo work > here.txt && pwd")
    assert first.returncode == 0 and first.stdout == "/workspace\n", first
    assert box.exec(["cat", "/tmp/state", "here.txt"]).stdout == "kept\nwork\n"
    # A background process of one command is seen, and can be signalled, by the next.
    box.exec("sleep 300 >/dev/null 2>&1 & echo $! > /tmp/pid")
    assert "sleep 300" in box.exec("cat /proc/$(cat /tmp/pid)/cmdline | tr '\\0' ' '").stdout
    assert box.exec("kill $(cat /tmp/pid)").returncode == 0


def test_exec_result_fields(box: Sandbox) -> None:
    result = box.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], env={"X": "1"})
    assert (result.returncode, result.stdout, result.stderr, result.truncated) == (3, "out\n", "err\n", False)
    assert result.report.status == "exited" and result.report.exit_code == 3
    assert result.report.backend == box.backend and result.report.wall_seconds > 0
    assert box.exec("echo $X", env={"X": "given"}).stdout == "given\n"
    assert box.exec(["cat"], input="fed\n").stdout == "fed\n"
    assert box.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    big = box.exec("head -c 300000 /dev/zero | tr '\\0' a; echo END", output_limit=1000)
    assert big.truncated and len(big.stdout) == 1000 and big.stdout.endswith("aEND\n")
    with pytest.raises(isolate.CommandNotFoundError):
        box.exec(["no-such-command-here"])
    with pytest.raises(isolate.SetupError):
        box.exec(["true"], cwd="/no/such/dir")
    for bad in (0, -1, float("nan")):
        with pytest.raises(isolate.PolicyError):
            box.exec(["true"], timeout=bad)


def test_timeout_ends_the_whole_tree_and_nothing_else(box: Sandbox) -> None:
    # Another command's background process, started before, must survive.
    box.exec("setsid sh -c 'exec sleep 301' >/dev/null 2>&1 < /dev/null &")
    started = time.monotonic()
    result = box.exec("setsid sh -c 'exec sleep 302' >/dev/null 2>&1 < /dev/null & sleep 303 & sleep 60",
                      timeout=0.5)
    assert time.monotonic() - started < 10
    assert result.timed_out and result.report.status == "timeout" and result.returncode == 137
    time.sleep(0.2)
    cmdlines = box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
    assert "sleep 301" in cmdlines
    assert "sleep 302" not in cmdlines and "sleep 303" not in cmdlines


def test_spawn_streams_and_kill_ends_the_tree(box: Sandbox) -> None:
    proc = box.spawn(["sh", "-c", "read line; echo got $line; echo second"])
    proc.write("hello\n")
    assert list(proc) == [b"got hello\n", b"second\n"]
    assert proc.wait(10) == 0 and proc.report.status == "ok"
    proc.close()

    daemon = box.spawn("setsid sh -c 'exec sleep 304' </dev/null >/dev/null 2>&1 & echo started; sleep 100")
    assert next(iter(daemon)) == b"started\n"
    daemon.kill()
    assert daemon.wait(10) == 137
    daemon.close()
    assert "sleep 304" not in box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout


def test_spawn_reads_a_descriptor_of_the_callers_as_its_stdin(box: Sandbox) -> None:
    fd = os.memfd_create("input", os.MFD_CLOEXEC)  # as a code context hands the JVM its driver's source
    try:
        os.write(fd, b"line one\nline two\n")
        os.lseek(fd, 0, os.SEEK_SET)
        proc = box.spawn(["sh", "-c", "wc -l; head -1 /proc/self/fd/0"], stdin=fd)
    finally:
        os.close(fd)  # the command has its own
    assert list(proc) == [b"2\n", b"line one\n"]  # a new open of a memfd reads from its start
    with pytest.raises(ValueError, match="not a pipe"):
        proc.write("more")
    assert proc.wait(10) == 0
    proc.close()
    with pytest.raises(isolate.PolicyError, match="terminal"):
        box.spawn("cat", stdin=0, pty=True)


def test_spawns_flags_are_true_or_false_and_a_detached_one_has_no_terminal(box: Sandbox) -> None:
    for flag in ("pty", "stderr_to_stdout", "detached"):
        with pytest.raises(isolate.PolicyError, match=f"{flag}: expected True or False"):
            box.spawn("true", **{flag: "no"})  # a string is true: it would have been taken as True
    with pytest.raises(isolate.PolicyError, match="detached: a command with a terminal"):
        box.spawn("sleep 300", detached=True, pty=True)


def test_dropping_a_command_ends_it(box: Sandbox) -> None:
    proc = box.spawn("sleep 305")
    proc.close()  # the conversation ends: so does the command
    for _ in range(100):
        if "sleep 305" not in box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the command outlived its conversation")


def test_files_as_the_program_sees_them(box: Sandbox) -> None:
    box.write_file("notes/today.txt", "one\n")
    box.write_file("notes/today.txt", "two\n", append=True)
    assert box.read_file("notes/today.txt") == "one\ntwo\n"
    assert box.exec("cat notes/today.txt").stdout == "one\ntwo\n"
    info = box.stat("notes/today.txt")
    assert info.is_file and info.size == 8
    # Written as the program: its uid inside.
    uid = int(box.exec("id -u").stdout)
    assert info.uid == uid
    assert box.replace_text("notes/today.txt", "two", "2") == 1
    with pytest.raises(ValueError):
        box.replace_text("notes/today.txt", "absent", "x")
    box.write_file("notes/b.txt", "x x x")
    with pytest.raises(ValueError):
        box.replace_text("notes/b.txt", "x", "y", count=2)
    assert box.replace_text("notes/b.txt", "x", "y", count=3) == 3
    names = [e.path for e in box.list_dir(depth=2)]
    assert "notes" in names and "notes/today.txt" in names and "src/main.py" in names
    assert ".git" not in names and "node_modules" not in names  # excluded from the copy
    assert box.glob("**/*.txt") == ["notes/b.txt", "notes/today.txt"]
    assert [(m.path, m.line_number) for m in box.grep(r"^print", glob="*.py")] == [("src/main.py", 1)]
    box.mkdir("deep/er/still")
    box.move("notes/b.txt", "deep/er/b.txt")
    assert box.exists("deep/er/b.txt") and not box.exists("notes/b.txt")
    box.remove("deep", recursive=True)
    assert not box.exists("deep")
    with pytest.raises(FileNotFoundError):
        box.read_file("missing.txt")
    with pytest.raises(IsADirectoryError):
        box.read_file("notes")
    with pytest.raises(OSError):
        box.read_file("notes/today.txt", limit=3)


def test_file_methods_cannot_leave_the_sandbox(box: Sandbox, workdir: str) -> None:
    secret = Path(workdir) / "host-secret"
    secret.write_text("host only\n")
    secret.chmod(0o644)
    # Links the program plants resolve inside its own view, never the host's.
    box.exec(f"ln -s {secret} planted; ln -s /etc/shadow shadow; ln -s ../../../../{secret} dots; mkfifo fifo")
    for path in ("planted", "dots", str(secret), f"../../../..{secret}"):
        with pytest.raises(FileNotFoundError):
            box.read_file(path)
    with pytest.raises((PermissionError, FileNotFoundError)):
        box.read_file("shadow")
    with pytest.raises(OSError):
        box.read_file("fifo")  # not a regular file: refused at once, never blocks
    with pytest.raises((PermissionError, OSError)):
        box.write_file("/usr/bin/planted", "x")
    assert not os.path.exists("/usr/bin/planted")
    # The host's path names the sandbox's own file there (its /tmp is private): the host file is untouched.
    box.write_file(str(secret), "overwritten")
    assert box.read_file(str(secret)) == "overwritten"
    assert secret.read_text() == "host only\n"


def test_upload_copies_a_tree_without_its_links(box: Sandbox, workdir: str) -> None:
    tree = Path(workdir) / "up"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "b.sh").write_text("echo b")
    (tree / "sub" / "b.sh").chmod(0o755)
    (tree / "leak").symlink_to("/etc/hostname")
    (tree / "sub" / "dir-leak").symlink_to("/etc")
    box.upload(tree, "up")
    assert box.read_file("up/a.txt") == "a"
    assert box.exec("up/sub/b.sh").stdout == "b\n"
    assert sorted(e.path for e in box.list_dir("up", depth=2)) == ["a.txt", "sub", "sub/b.sh"]
    os.mkfifo(tree / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        box.upload(tree, "up2")  # a FIFO is refused, never waited on


def test_diff_and_commit(box: Sandbox, source: str) -> None:
    box.write_file("src/main.py", "print('changed')\n")
    box.write_file("src/new.py", "x = 1\n")
    box.remove("README")
    changes = box.diff()
    assert changes.added == ["src/new.py"] and changes.modified == ["src/main.py"] and changes.deleted == ["README"]
    assert Path(source, "src", "main.py").read_text() == "print('hello')\n"  # nothing before commit
    box.commit()
    assert Path(source, "src", "main.py").read_text() == "print('changed')\n"
    assert Path(source, "src", "new.py").read_text() == "x = 1\n"
    assert not Path(source, "README").exists()
    assert Path(source, ".git", "HEAD").exists()  # excluded names are left alone
    assert not box.diff()


def test_commit_refuses_planted_links_and_strips_setid(box: Sandbox, source: str, workdir: str) -> None:
    secret = Path(workdir) / "host-secret"
    secret.write_text("host only\n")
    box.exec(f"ln -s {secret} abs-link; ln -s ../../outside rel-out; ln -s src/main.py inside-link; "
             "mkfifo pipe; echo x > tool; chmod 4755 tool || chmod 755 tool")
    # The program replaces a directory of the workspace by a link to the host's secret place.
    box.exec(f"rm -rf src && ln -s {workdir} src")
    changes = box.commit()
    assert set(changes.refused) == {"abs-link", "rel-out", "pipe", "src"}
    assert not Path(source, "abs-link").exists() and not Path(source, "rel-out").is_symlink()
    assert not Path(source, "pipe").exists()
    assert Path(source, "src").is_dir() and not Path(source, "src").is_symlink()  # left as it was
    assert os.readlink(Path(source, "inside-link")) == "src/main.py"
    mode = os.stat(Path(source, "tool")).st_mode
    assert stat.S_IMODE(mode) & 0o7000 == 0 and stat.S_IMODE(mode) & 0o111
    assert secret.read_text() == "host only\n"


def test_commit_through_a_planted_target_link_is_refused(box: Sandbox, workdir: str) -> None:
    target = Path(workdir) / "out"
    target.mkdir()
    elsewhere = Path(workdir) / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, target / "src")  # a link where the workspace has a directory
    box.commit(target)
    assert (target / "src").is_dir() and not (target / "src").is_symlink()
    assert list(elsewhere.iterdir()) == []


def test_persistent_shell(box: Sandbox) -> None:
    terminal_shell_works(box)
    shell = box.shell()
    assert shell.run("cd src && X=5 && f() { echo fn$1; }") == ("", 0)
    assert shell.run("pwd; echo $X; f 1") == ("/workspace/src\n5\nfn1\n", 0)
    assert shell.run("false")[1] == 1
    with pytest.raises(TimeoutError):
        shell.run("sleep 30", timeout=0.5)
    assert shell.run("echo still here") == ("still here\n", 0)
    # The terminal is the sandbox's own (its devpts): it has a name inside.
    out, status = shell.run('t=$(tty) && test -c "$t" && echo "$t"')
    assert status == 0 and out.startswith("/dev/pts/"), out
    other = box.shell("second", pty=False)
    assert other.run("pwd; echo err >&2") == ("/workspace\nerr\n", 0)
    assert box.shell() is shell


def test_pause_stops_cpu_use(box: Sandbox) -> None:
    spinner = box.spawn("while :; do :; done")
    time.sleep(0.3)
    mechanism = box.pause()
    assert mechanism in ("cgroup-freezer", "sigstop")

    def cpu() -> float:
        return sum(p.cpu_times().user + p.cpu_times().system for p in box.processes() if p.is_running())

    before = cpu()
    time.sleep(0.5)
    assert cpu() - before < 0.05
    box.resume()
    # It runs again: the kernel accounts its CPU (however long a loaded host takes to give it some).
    until = time.monotonic() + 30
    while cpu() - before <= 0.05:
        assert time.monotonic() < until, "the spinner did not run again after resume()"
        time.sleep(0.02)
    spinner.kill()
    spinner.close()


def test_bind_workspace_and_mounts(source: str, workdir: str) -> None:
    data = Path(workdir) / "data"
    data.mkdir()
    (data / "input").write_text("given\n")
    data.chmod(0o755)
    (data / "input").chmod(0o644)
    with Sandbox(sandbox_policy(), workspace=Workspace(source, target="/repo", mode="bind"),
                 mounts=[Mount(str(data), "/data", "ro")]) as sb:
        assert sb.exec("pwd; cat /data/input").stdout == "/repo\ngiven\n"
        assert sb.exec("touch /data/x").returncode != 0
        assert sb.exec("echo direct > direct.txt").returncode == 0
        assert not sb.diff()
    assert Path(source, "direct.txt").read_text() == "direct\n"


def test_mount_in_isolate_run_and_cli(workdir: str) -> None:
    shown = Path(workdir) / "shown"
    shown.mkdir()
    (shown / "f").write_text("content\n")
    shown.chmod(0o755)
    (shown / "f").chmod(0o644)
    result = isolate.run(["sh", "-c", "cat /elsewhere/f; echo new > /elsewhere/g"], capture_output=True, text=True,
                         policy=policy(write=(), binds=[Mount(str(shown), "/elsewhere", "rw")], cwd="/elsewhere"))
    assert result.stdout == "content\n" and result.returncode == 0, result.stderr
    assert (shown / "g").read_text() == "new\n"
    cli = subprocess.run([ISOLATE_RUN, "--ro-bind", f"{shown}:/ro", "--", "sh", "-c",
                          "cat /ro/f; touch /ro/x"], capture_output=True, text=True, cwd=workdir, timeout=60)
    assert cli.stdout == "content\n" and cli.returncode != 0
    with pytest.raises(isolate.PolicyError):
        Mount(str(shown), "relative")
    with pytest.raises(isolate.PolicyError):
        Mount(str(shown), "/proc/x")
    assert Mount.parse("a:/b:rw") == Mount("a", "/b", "rw")


def test_peer_credentials_refuse_the_program(source: str) -> None:
    # Even shown the host's socket, a process inside the sandbox is refused. The runtime directory
    # itself cannot be granted (or bound) any more: the socket is shown through a hard link of it.
    run_dir = runtime_dir()
    with pytest.raises(isolate.PolicyError, match="runtime directory"):
        Sandbox(sandbox_policy(binds=[Mount(run_dir, "/run-isolate", "ro")]), workspace=Workspace(source)).start()
    shown = tempfile.mkdtemp(dir=os.path.dirname(run_dir))  # the same file system: a link can be made
    try:
        os.chmod(shown, 0o755)
        with Sandbox(sandbox_policy(read=python_read(), binds=[Mount(shown, "/run-isolate", "ro")]),
                     workspace=Workspace(source)) as sb:
            assert sb._impl is not None
            name = os.path.basename(sb._impl.paths.socket)
            os.link(sb._impl.paths.socket, os.path.join(shown, name))
            probe = ("import socket, struct\n"
                     f"s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect('/run-isolate/{name}')\n"
                     "s.send(struct.pack('=IIiiqII', 0x15a7e5e1, 11, 0, 0, 0, 0, 0))\n"
                     "print('answered' if s.recv(4096) else 'refused')\n")
            result = sb.exec([PYTHON, "-c", probe])
            assert "answered" not in result.stdout, result
            # The host, of course, is still served.
            assert sb.exec("echo ok").stdout == "ok\n"
    finally:
        shutil.rmtree(shown, ignore_errors=True)


def test_named_sandbox_outlives_its_creator_and_is_pruned(source: str, workdir: str) -> None:
    name = f"t{os.getpid()}-{time.monotonic_ns() % 100000}"
    script = (
        "import isolate, sys\n"
        f"sb = isolate.Sandbox(isolate.Policy(write=()), workspace=isolate.Workspace({source!r}), name={name!r})\n"
        "sb.start(); sb.exec('echo from-creator > mark')\n"
    )
    created = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert created.returncode == 0, created.stderr
    try:
        again = Sandbox.attach(name)
        assert again.exec("cat mark").stdout == "from-creator\n"
        again.detach()
        listed = subprocess.run([ISOLATE_RUN, "sandbox", "list"], capture_output=True,
                                text=True, timeout=60)
        assert name in listed.stdout and "running" in listed.stdout
        out = subprocess.run([ISOLATE_RUN, "sandbox", "exec", name, "--", "cat", "mark"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout == "from-creator\n" and out.returncode == 0
        # Killed from outside (as a reboot or an OOM kill would): prune removes what is left.
        box = Sandbox.attach(name)
        assert box._impl is not None
        init = box._impl._init_pid()
        assert init is not None
        box.detach()
        os.kill(init, 9)
        time.sleep(0.3)
        pruned = subprocess.run([ISOLATE_RUN, "sandbox", "prune"], capture_output=True,
                                text=True, timeout=60)
        assert f"removed {name}" in pruned.stdout, pruned
        assert not os.path.exists(os.path.join(runtime_dir(), f"{name}.json"))
    finally:
        subprocess.run([ISOLATE_RUN, "sandbox", "rm", name], capture_output=True, timeout=60)


def test_prune_leaves_a_starting_sandbox_and_removes_one_never_described() -> None:
    # Its maker has bound and is holding the socket but has not described it yet (copying a large
    # workspace, or a loaded machine): prune must not take it for ended.
    import socket

    from isolate.backends.native.kept import Paths

    name = f"starting-{os.getpid()}"
    path = Paths.of(name).socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(4)
    prune = [ISOLATE_RUN, "sandbox", "prune"]
    try:
        pruned = subprocess.run(prune, capture_output=True, text=True, timeout=60)
        assert name not in pruned.stdout and os.path.exists(path), pruned
    finally:
        listener.close()
    pruned = subprocess.run(prune, capture_output=True, text=True, timeout=60)
    assert f"removed {name}" in pruned.stdout and not os.path.exists(path), pruned


def test_prune_sweeps_only_names_an_unnamed_sandbox_has(workdir: str) -> None:
    # The state directory may be writable by a sandbox granted the home: a planted anon- name whose pid
    # is past a C long ended every prune (and every Ray host's start) with an OverflowError.
    state = os.path.join(workdir, "state")
    ended = subprocess.Popen(["/bin/true"])
    ended.wait()  # its pid names no process now (reused only after the pids wrap)
    orphan = f"anon-{ended.pid}-0123456789ab"
    planted = ["anon-99999999999999999999-0123456789ab", "anon-4194305-0123456789ab", "anon-1-x"]
    for name in [orphan, *planted]:
        os.makedirs(os.path.join(state, "sandboxes", name))
    pruned = subprocess.run([ISOLATE_RUN, "sandbox", "prune"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "ISOLATE_STATE_DIR": state})
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(os.listdir(os.path.join(state, "sandboxes"))) == sorted(planted), pruned.stdout


def test_unnamed_sandbox_dies_with_its_creator(source: str) -> None:
    script = (
        "import isolate, os, sys\n"
        f"sb = isolate.Sandbox(isolate.Policy(write=()), workspace=isolate.Workspace({source!r}))\n"
        "sb.start(); print(sb._impl.process.pid, flush=True); sys.stdin.read()\n"
    )
    creator = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    assert creator.stdout is not None
    init = int(creator.stdout.readline())
    creator.kill()
    creator.wait()
    for _ in range(100):
        try:
            os.kill(init, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the sandbox outlived its creator")


def test_idle_timeout_ends_the_sandbox(source: str) -> None:
    sb = Sandbox(sandbox_policy(), workspace=Workspace(source), idle_timeout=0.5).start()
    try:
        assert sb._impl is not None and sb._impl.process is not None
        sb.detach()  # no connection left: the server counts idle time from now
        sb._impl.process.wait(timeout=10)
    finally:
        sb.close()


def test_cli_create_exec_diff_commit_rm(source: str) -> None:
    name = f"c{os.getpid()}-{time.monotonic_ns() % 100000}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ISOLATE_RUN, "sandbox", *args], capture_output=True,
                              text=True, timeout=60)

    created = cli("create", name, "--workspace", source, "--exclude", ".git", "--memory", "256M")
    if created.returncode and "memory" in created.stderr:
        created = cli("create", name, "--workspace", source, "--exclude", ".git")
    assert created.returncode == 0, created.stderr
    try:
        first = cli("exec", name, "--", "sh", "-c", "echo more >> README; exit 4")
        assert first.returncode == 4, first.stderr
        assert cli("exec", name, "--", "no-such-cmd").returncode == 127
        assert cli("diff", name).stdout == "M README\n"
        assert "1 modified" in cli("commit", name).stdout
        assert Path(source, "README").read_text() == "readme\nmore\n"
        host_copy = Path(WORK_BASE or "/tmp") / f"{name}-copy"
        assert cli("cp", f"{name}:README", str(host_copy)).returncode == 0
        assert host_copy.read_text() == "readme\nmore\n"
        host_copy.unlink()
        assert cli("pause", name).returncode == 0 and cli("resume", name).returncode == 0
        bad = cli("exec", "no-such-sandbox", "--", "true")
        assert bad.returncode == 125 and len(bad.stderr.splitlines()) == 1
    finally:
        assert cli("rm", name).returncode == 0
    assert cli("rm", name).returncode == 125


def test_cli_refuses_an_empty_value_and_never_commits_into_the_current_directory(
        source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `sandbox commit NAME --to ""` (a script's unset variable) made the current directory equal to the workspace:
    # its files that the workspace lacks were deleted, in silence. Every empty value is refused in one line now.
    name = f"e{os.getpid()}-{time.monotonic_ns() % 100000}"
    here = tmp_path / "here"
    here.mkdir()
    (here / "precious").write_text("keep\n")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ISOLATE_RUN, "sandbox", *args], capture_output=True, text=True, timeout=60, cwd=here)

    assert cli("create", name, "--workspace", source, "--exclude", ".git").returncode == 0
    try:
        for args in (["commit", name, "--to", ""], ["exec", "--cwd", "", name, "--", "true"],
                     ["create", f"{name}x", "--workspace", ""], ["create", ""]):
            refused = cli(*args)
            assert refused.returncode == 125 and len(refused.stderr.splitlines()) == 1, (args, refused)
            assert "an empty value" in refused.stderr, refused.stderr
        assert sorted(os.listdir(here)) == ["precious"]
        monkeypatch.chdir(here)
        with Sandbox.attach(name) as box, pytest.raises(isolate.IsolationError, match="empty target"):
            box.commit("")  # the API too (realpath("") is the working directory)
        assert sorted(os.listdir(here)) == ["precious"]
        # An empty argument of the command itself is the command's.
        assert cli("exec", name, "--", "sh", "-c", 'printf "[%s]" "$1"', "sh", "").stdout == "[]"
    finally:
        assert cli("rm", name).returncode == 0


def test_a_glob_never_backtracks_for_ever_over_the_programs_names(source: str) -> None:
    # Each "*" was "[^/]*" of one regular expression: "*a*a*a*a*a*a*a*a*b" over a name of 120 a's (the program names
    # its files) backtracked for hours, in the caller's thread (a server's request).
    from conftest import finishes

    with Sandbox(sandbox_policy(), workspace=Workspace(source, exclude=(".git",))) as box:
        box.write_file("a" * 120, "x")
        box.write_file("deep/" * 20 + "a" * 100 + "b", "y")
        done, found = finishes(lambda: box.glob("*a" * 12 + "*b"), 30)
        assert done, "the glob did not end"
        assert found == []
        done, found = finishes(lambda: box.glob("**/" * 12 + "*a" * 12 + "*"), 30)
        assert done and found == ["a" * 120, "deep/" * 20 + "a" * 100 + "b"], found
        assert box.glob("**/" + "a" * 100 + "b") == ["deep/" * 20 + "a" * 100 + "b"]


def test_async_sandbox(source: str) -> None:
    async def main() -> tuple[str, str]:
        async with isolate.AsyncSandbox(sandbox_policy(), workspace=Workspace(source)) as sb:
            await sb.write_file("a.txt", "async\n")
            result = await sb.exec("cat a.txt")
            return result.stdout, await sb.read_file("a.txt")

    assert asyncio.run(main()) == ("async\n", "async\n")


def test_many_sandboxes_at_once(source: str) -> None:
    boxes = [Sandbox(sandbox_policy(), workspace=Workspace()).start() for _ in range(12)]
    try:
        for i, sb in enumerate(boxes):
            sb.write_file("id", str(i))
        assert [sb.exec("cat id").stdout for sb in boxes] == [str(i) for i in range(12)]
        # One policy, one prepared plan; each sandbox binds (and reports) its own workspace in it.
        shown = [next(b for b in sb.enforced["binds"] if b.endswith(":/workspace:rw")) for sb in boxes]
        assert len(set(shown)) == 12 and not any(".workspace-stand-in" in b for b in shown)
    finally:
        for sb in boxes:
            sb.close()


def test_workspace_and_sandbox_arguments_are_checked(workdir: str) -> None:
    with pytest.raises(isolate.PolicyError):
        Workspace(mode="overlay")
    with pytest.raises(isolate.PolicyError):
        Workspace(mode="bind")
    with pytest.raises(isolate.PolicyError):
        Workspace(os.path.join(workdir, "missing"))
    with pytest.raises(isolate.PolicyError):
        Workspace(target="relative")
    for mode in ("copy", "bind", "overlay"):  # "" was the working directory (abspath), a variable left empty
        with pytest.raises(isolate.PolicyError, match="empty source"):
            Workspace("", mode=mode)
    for bad in (0, -5, float("nan")):
        with pytest.raises(isolate.PolicyError):
            Sandbox(sandbox_policy(), ttl=bad)
    with pytest.raises(isolate.PolicyError):
        Sandbox(sandbox_policy(), name="../escape")
    # The strict seccomp profile refuses the exec server's accept4: said at once, not after a silent wait.
    started = time.monotonic()
    with pytest.raises(isolate.UnsupportedError, match="strict"):
        Sandbox(sandbox_policy(seccomp="strict")).start()
    assert time.monotonic() - started < 5


def test_the_socket_directory_is_private_and_checked(monkeypatch: pytest.MonkeyPatch, workdir: str) -> None:
    path = runtime_dir()
    info = os.lstat(path)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and info.st_mode & 0o077 == 0
    if os.geteuid() != 0:
        # A directory someone else could enter or swap is refused, not used.
        shared = Path(workdir) / "xdg"
        (shared / "isolate").mkdir(parents=True)
        shared.chmod(0o700)
        (shared / "isolate").chmod(0o755)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
        with pytest.raises(isolate.IsolationError):
            runtime_dir()


def test_host_waits_take_any_number(box: Sandbox) -> None:
    # A timeout too large for the host's own waits is no timeout; NaN and negatives are refused.
    terminal_shell_works(box)
    assert box.shell().run("echo x", timeout=1e18) == ("x\n", 0)
    proc = box.spawn("true")
    assert proc.wait(1e20) == 0
    proc.close()
    for bad in (float("nan"), -1):
        with pytest.raises(ValueError):
            box.shell().run("echo", timeout=bad)


def test_file_methods_racing_a_close_in_another_thread_raise_isolation_errors_only(workdir: str) -> None:
    """Before: a file method whose socket another thread's close had just ended raised OSError (EBADF) from
    resetting that socket's timeout, past the exception model (IsolationError)."""
    import threading

    strays: list[BaseException] = []
    for _ in range(4):
        box = Sandbox(policy(write=()), workspace=Workspace(workdir, mode="overlay")).start()
        box.write_file("a.txt", "x")
        done = threading.Event()

        def calls(box: Sandbox = box, done: threading.Event = done) -> None:
            while not done.is_set():
                try:
                    box.read_file("a.txt")
                    box.list_dir(".")
                    box.write_file("b.txt", "y")
                except isolate.IsolationError:
                    pass
                except Exception as exc:  # what the test looks for
                    strays.append(exc)

        thread = threading.Thread(target=calls)
        thread.start()
        time.sleep(0.1)
        box.close()
        time.sleep(0.05)
        done.set()
        thread.join(30)
    assert not strays, strays


# A string with a NUL byte, or an unusable variable, is bad input: a PolicyError (an IsolationError, and a
# ValueError as before) naming it, raised before anything reaches the sandbox, which goes on working.
@pytest.mark.parametrize("call", [
    lambda b: b.exec(["echo", "a\0b"]),
    lambda b: b.exec(["true"], cwd="a\0b"),
    lambda b: b.exec(["true"], env={"A": "a\0b"}),
    lambda b: b.exec(["true"], env={"A=B": "x"}),
    lambda b: b.spawn(["true"], env={"": "x"}),
    lambda b: b.read_file("a\0b"),
    lambda b: b.write_file("a\0b", "x"),
    lambda b: b.list_dir("a\0b"),
    lambda b: b.list_dir(".", 0),
    lambda b: b.glob("*", "a\0b"),
    lambda b: b.exec(["true", *(["y" * 100_000] * 200)]),  # past isolate's bound on one command's strings
])
def test_bad_strings_are_policy_errors(workdir: str, call: Any) -> None:
    with Sandbox(sandbox_policy(), workspace=Workspace(workdir)) as sb:
        with pytest.raises(isolate.PolicyError):
            call(sb)
        assert sb.exec("echo still").stdout == "still\n"
