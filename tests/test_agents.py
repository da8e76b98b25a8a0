"""isolate.agents: per-agent sandboxes, path-guarded file tools, branches, wrap. Real sandboxes, real kernel.

Runs as root and as uid 65534 (tests/run-all.sh).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ISOLATE_RUN, NAMESPACES_WHY, PYTHON, policy, python_read

import isolate
from isolate import Sandbox, Workspace, agents
from isolate.agents import AgentSandboxes, SandboxConfig, ToolError
from isolate.cli.flags import build_parser, policy_from_args
from isolate.kernel.places import runtime_dir

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


@pytest.fixture
def state(workdir: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private state directory (sandbox copies, the agents table) for the test."""
    path = os.path.join(workdir, "state")
    monkeypatch.setenv("ISOLATE_STATE_DIR", path)
    return path


@pytest.fixture
def source(workdir: str) -> str:
    root = Path(workdir) / "project"
    root.mkdir()
    (root / "main.py").write_text("print('hello')\n")
    (root / "main.py").chmod(0o644)
    root.chmod(0o755)
    return str(root)


@pytest.fixture
def manager(state: str) -> Iterator[AgentSandboxes]:
    made: list[AgentSandboxes] = []

    def make(**kwargs: Any) -> AgentSandboxes:
        m = AgentSandboxes(f"t{os.getpid()}", **kwargs)
        made.append(m)
        return m

    yield make  # type: ignore[misc]
    for m in made:
        for rec in m.list():
            m.rm(rec.agent_id)
        m.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(runtime_dir(), f"t{os.getpid()}.agents.lock"))


def _gone(name: str) -> bool:
    try:
        Sandbox.attach(name).detach()
    except isolate.IsolationError:
        return True
    return False


# -- the per-agent manager -------------------------------------------------------------------------------


def test_manager_reuses_while_the_config_holds_and_recreates_when_it_changes(manager: Any, source: str) -> None:
    m = manager()
    config = SandboxConfig(policy(write=()), Workspace(source))
    box = m.get("agent-1", config)
    assert m.last_action == "created"
    box.write_file("state.txt", "kept")
    assert m.get("agent-1", config) is box and m.last_action == "reused"
    # Another process (another manager) finds it by its name and checks the config the sandbox reports.
    other = manager()
    again = other.get("agent-1", SandboxConfig(policy(write=()), Workspace(source)))
    assert other.last_action == "reused" and again.read_file("state.txt") == "kept"
    assert again.name == box.name
    # The policy changes: a new sandbox, the old state gone.
    changed = other.get("agent-1", SandboxConfig(policy(write=(), network="loopback"), Workspace(source)))
    assert other.last_action == "recreated (configuration changed)"
    assert not changed.exists("state.txt") and changed.exec("python3 main.py").stdout == "hello\n"
    changed.write_file("state.txt", "second")
    # The workspace is part of the configuration too (its exclude list here; mounts alike).
    config2 = SandboxConfig(policy(write=(), network="loopback"), Workspace(source, exclude=("*.pyc",)))
    assert config2.config_hash() != SandboxConfig(changed.policy, Workspace(source)).config_hash()
    third = other.get("agent-1", config2)
    assert other.last_action == "recreated (configuration changed)" and not third.exists("state.txt")
    mounted = SandboxConfig(config2.policy, config2.workspace, (isolate.Mount(source, "/src", "ro"),))
    assert mounted.config_hash() != config2.config_hash()
    # A second agent has its own sandbox; list and rm.
    other.get("agent-2", config2)
    assert [r.agent_id for r in other.list()] == ["agent-1", "agent-2"]
    assert other.rm("agent-1") and _gone(box.name)
    assert [r.agent_id for r in other.list()] == ["agent-2"]
    assert not other.rm("agent-1")


def test_manager_names_never_come_from_the_id(manager: Any) -> None:
    m = manager()
    ids = ["../../etc/passwd", "/abs", "a/b", "", "x" * 5000, "ümlaut 💥", "agent-1", "AGENT-1", "..", "\n"]
    names = [m.name_of(i) for i in ids]
    assert len(set(names)) == len(ids)
    for name in names:
        assert re.fullmatch(rf"t{os.getpid()}-[0-9a-f]{{32}}", name), name
    box = m.get("../../escape", policy(write=()))
    assert box.name == m.name_of("../../escape") and box.exec("true").returncode == 0
    with pytest.raises(isolate.PolicyError):
        AgentSandboxes("../x")
    with pytest.raises(isolate.PolicyError):
        m.name_of("\udc80")


def test_manager_prunes_by_max_age(manager: Any) -> None:
    m = manager(max_age=1.0, idle=None)
    first = m.get("old", policy(write=()))
    time.sleep(1.3)
    assert m.prune() == [("old", "older than max_age 1 s")]
    assert m.list() == [] and _gone(first.name)
    # get() replaces an expired sandbox by itself, too.
    box = m.get("again", policy(write=()))
    box.write_file("x", "1")
    time.sleep(1.3)
    fresh = m.get("again", policy(write=()))
    assert m.last_action == "recreated (older than max_age 1 s)" and not fresh.exists("x")


def test_manager_prunes_the_idle_only(manager: Any) -> None:
    # "idle" was last used before "busy" was touched, midway through the limit; prune then looks once
    # "idle" is past the limit. That only shows something if "busy" was still younger than the limit
    # when prune looked, which a loaded machine (an emulated VM) can spoil: the test checks that from
    # its own clock and tries again with a doubled limit instead of asserting on a spoiled round.
    limit = 1.0
    for _ in range(5):
        m = manager(idle=limit, max_age=None)
        m.get("busy", policy(write=()))
        idle = m.get("idle", policy(write=()))
        idle_used = time.monotonic()
        time.sleep(0.5 * limit)
        busy_touched = time.monotonic()
        busy = m.get("busy", policy(write=()))
        time.sleep(max(0.0, idle_used + limit + 0.05 - time.monotonic()))
        pruned = m.prune()
        if time.monotonic() - busy_touched < limit:
            break
        for rec in m.list():
            m.rm(rec.agent_id)
        limit *= 2
    else:
        pytest.fail(f"this machine never ran a reuse and a prune within {limit / 2:g} s")
    assert pruned == [("idle", f"idle longer than {limit:g} s")]
    assert _gone(idle.name) and busy.exec("true").returncode == 0
    assert [r.agent_id for r in m.list()] == ["busy"]


def test_manager_replaces_an_ended_sandbox(manager: Any) -> None:
    m = manager()
    box = m.get("a", policy(write=()))
    Sandbox.attach(box.name).close()  # ended from elsewhere (rm, its ttl, a reboot)
    fresh = m.get("a", policy(write=()))
    assert m.last_action == "recreated (ended)" and fresh.exec("echo up").stdout == "up\n"
    # A paused sandbox is not taken for an ended one: prune leaves it (it only looks at its processes).
    assert fresh.pause() in ("cgroup-freezer", "sigstop")
    assert manager().prune() == []
    assert fresh.resume() and fresh.exec("echo back").stdout == "back\n"
    Sandbox.attach(fresh.name).close()
    assert manager().prune() == [("a", "ended")]


# -- file tools ------------------------------------------------------------------------------------------


@pytest.fixture
def planted(workdir: str) -> tuple[str, str]:
    """A root with a file, a directory and links planted to an outside secret (file and directory)."""
    root = Path(workdir) / "root"
    outside = Path(workdir) / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("secret\n")
    (root / "a.txt").write_text("alpha beta beta\n")
    (root / "link_file").symlink_to(outside / "secret")
    (root / "link_dir").symlink_to(outside)
    (root / "sub" / "up").symlink_to("../..")
    os.mkfifo(root / "fifo")
    return str(root), str(outside)


def test_host_files_stay_beneath_the_root_and_follow_no_link(planted: tuple[str, str]) -> None:
    root, outside = planted
    files = agents.agent_files(root)
    assert isinstance(files, agents.HostFiles) and isinstance(files, agents.AgentFiles)
    assert files.read("a.txt") == "alpha beta beta\n"
    assert files.read("sub/../a.txt") == files.read(os.path.join(root, "a.txt")) == "alpha beta beta\n"
    refusals = {
        "../outside/secret": "out of the workspace",
        "sub/../../outside/secret": "out of the workspace",
        os.path.join(outside, "secret"): "outside the workspace",
        "/etc/passwd": "outside the workspace",
        "link_file": "symbolic link",
        "link_dir/secret": "symbolic link",
        "sub/up/outside/secret": "symbolic link",
    }
    for path, why in refusals.items():
        for call in (lambda p: files.read(p), lambda p: files.write(p, "pwned"),
                     lambda p: files.edit(p, "secret", "pwned")):
            with pytest.raises(ToolError, match=why) as info:
                call(path)
            assert info.value.path == path
    for path in ("link_dir", "sub/up", "..", "/"):
        with pytest.raises(ToolError):
            files.ls(path)
    with pytest.raises(ToolError, match="symbolic link"):
        files.write("link_dir/new.txt", "x")
    assert (Path(outside) / "secret").read_text() == "secret\n" and os.listdir(outside) == ["secret"]
    assert os.readlink(os.path.join(root, "link_file")) == os.path.join(outside, "secret")
    # A FIFO is refused at once, not waited on; a directory is named as one.
    with pytest.raises(ToolError, match="not a regular file"):
        files.read("fifo")
    with pytest.raises(ToolError, match="is a directory"):
        files.read("sub")
    with pytest.raises(ToolError, match="no such file"):
        files.read("missing.txt")
    # What the tools are for.
    assert files.write("new/deep/f.txt", "one\n") == "wrote 4 bytes to new/deep/f.txt"
    assert (Path(root) / "new" / "deep" / "f.txt").read_text() == "one\n"
    with pytest.raises(ToolError, match="occurs 2 times"):
        files.edit("a.txt", "beta", "gamma")
    with pytest.raises(ToolError, match="does not occur"):
        files.edit("a.txt", "delta", "gamma")
    assert files.edit("a.txt", "alpha", "ALPHA") == "replaced 1 occurrence in a.txt"
    assert files.edit("a.txt", "beta", "b", replace_all=True) == "replaced 2 occurrences in a.txt"
    assert files.read("a.txt") == "ALPHA b b\n"
    assert files.ls() == ["a.txt", "fifo", "link_dir@", "link_file@", "new/", "sub/"]
    assert files.ls("sub") == ["up@"]
    files.close()


def test_host_files_hold_the_root_they_opened(planted: tuple[str, str], workdir: str) -> None:
    # The root's path is swapped for a link to the outside after the tools opened it: they stay in the
    # directory they opened (a descriptor), as openat2 on a held dirfd would.
    root, outside = planted
    files = agents.HostFiles(root)
    os.rename(root, os.path.join(workdir, "moved"))
    os.symlink(outside, root)
    assert files.read("a.txt") == "alpha beta beta\n"
    with pytest.raises(ToolError):
        files.read("secret")


@pytest.fixture
def box(source: str) -> Iterator[Sandbox]:
    with Sandbox(policy(write=()), workspace=Workspace(source)) as sandbox:
        yield sandbox


def test_sandbox_files_stay_in_the_workspace_and_follow_no_link(box: Sandbox) -> None:
    assert box.exec("ln -s /etc/passwd link_file && ln -s /etc link_dir && mkdir d && ln -s .. d/up").returncode == 0
    files = agents.agent_files(box)
    assert isinstance(files, agents.SandboxFiles) and files.root == "/workspace"
    # The sandbox alone lets the program's own view through the link; the tools do not.
    assert "root:" in box.read_file("link_file")
    refusals = {
        "link_file": "symbolic link",
        "link_dir/passwd": "symbolic link",
        "d/up/main.py": "symbolic link",
        "../etc/passwd": "out of the workspace",
        "/etc/passwd": "outside the workspace",
        "/workspace/../etc/passwd": "outside the workspace",
    }
    for path, why in refusals.items():
        for call in (lambda p: files.read(p), lambda p: files.write(p, "x"), lambda p: files.edit(p, "root", "x")):
            with pytest.raises(ToolError, match=why):
                call(path)
    with pytest.raises(ToolError, match="symbolic link"):
        files.ls("link_dir")
    assert files.read("main.py") == files.read("/workspace/main.py") == "print('hello')\n"
    assert files.write("notes/todo.txt", "a a\n") == "wrote 4 bytes to notes/todo.txt"
    with pytest.raises(ToolError, match="occurs 2 times"):
        files.edit("notes/todo.txt", "a", "b")
    files.edit("notes/todo.txt", "a a", "done")
    assert box.exec("cat notes/todo.txt").stdout == "done\n"
    assert files.ls() == ["d/", "link_dir@", "link_file@", "main.py", "notes/"]
    with pytest.raises(ToolError, match="no such file"):
        files.read("nothing")
    with pytest.raises(ToolError, match="read-only here"):
        agents.SandboxFiles(box, "/etc").write("passwd", "x")  # a root the program may not write


# -- branches --------------------------------------------------------------------------------------------


def test_native_branches_end_to_end(source: str, workdir: str, state: str) -> None:
    with agents.branches(policy(write=()), prefer=("native",)) as strategy:
        assert isinstance(strategy, agents.BranchStrategy)
        assert strategy.name == "native" and strategy.reason == "first choice"
        one, two = strategy.setup_branch(source), strategy.setup_branch(source)
        assert one != two
        assert strategy.execute_command(one, "echo one > result.txt").returncode == 0
        ran = strategy.execute_python(two, "open('result.txt', 'w').write('two\\n')\nprint(6 * 7)")
        assert (ran.returncode, ran.stdout) == (0, "42\n"), ran.stderr
        # Neither sees the other's change, and the source saw none.
        assert strategy.execute_command(one, "cat result.txt").stdout == "one\n"
        assert strategy.execute_python(two, "print(open('result.txt').read(), end='')").stdout == "two\n"
        assert not os.path.exists(os.path.join(source, "result.txt"))
        failed = strategy.execute_python(one, "raise SystemExit(3)")
        assert failed.returncode == 3
        # Commit writes a branch back: to another directory, then to the source itself.
        target = os.path.join(workdir, "target")
        os.mkdir(target)
        changes = strategy.commit_to_host(one, target)
        assert sorted(changes.added) == ["main.py", "result.txt"]
        assert Path(target, "result.txt").read_text() == "one\n"
        assert strategy.commit_to_host(two, source).added == ["result.txt"]
        assert Path(source, "result.txt").read_text() == "two\n"
        strategy.clean_up(one)
        with pytest.raises(isolate.IsolationError, match="no branch"):
            strategy.execute_command(one, "true")
    with pytest.raises(isolate.IsolationError, match="no branch"):
        strategy.execute_command(two, "true")  # clean_up_all on leaving the with block


def test_fallback_from_docker_is_warned_and_recorded(source: str, state: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent")
    with pytest.warns(agents.StrategyFallbackWarning, match="native strategy, because docker: .*nonexistent"):
        strategy = agents.branches(policy(write=()), prefer=("docker", "native"))
    try:
        assert strategy.name == "native"
        assert strategy.reason.startswith("fallback: docker: ") and "unix:///nonexistent" in strategy.reason
        branch = strategy.setup_branch(source)
        assert strategy.execute_command(branch, "python3 main.py && echo ran > out").stdout == "hello\n"
        assert strategy.execute_command(branch, "cat out").stdout == "ran\n"
    finally:
        strategy.clean_up_all()


def test_no_strategy_raises_with_every_reason(state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent")
    with pytest.raises(isolate.UnsupportedError) as info:
        agents.branches(policy(write=(), namespaces=False), prefer=("native", "docker"))
    message = str(info.value)
    assert "native: a kept native sandbox needs namespaces" in message
    assert "docker: " in message and "unix:///nonexistent" in message


# -- wrap ------------------------------------------------------------------------------------------------

#: A non-default value for every Policy field isolate-run has a flag for.
def _samples(workdir: str) -> dict[str, Any]:
    return {
        "read": ("/usr", "/etc", "/var"),
        "write": (workdir,),
        "tmpfs": ("/tmp", "/var/tmp", "/scratch"),
        "network": "loopback",
        "limits": isolate.Limits(memory="256M", cpu_seconds=30, wall_seconds=12.5, pids=64, open_files=128,
                                 file_size="8M", cpus=1.5, tmpfs_size="32M"),
        "seccomp": "strict",
        "env": {"A": "1", "B": "x=y -z"},
        "keep_env": (*isolate.model.policy.DEFAULT_KEEP_ENV, "CI"),
        "home": "/home/agent",
        "home_files": (".gitconfig",),
        "cwd": "/tmp",
        "uid": 1234,
        "gid": 2345,
        "namespaces": False,
        "best_effort": True,
        "trace_denials": True,
        "backend": "native",
        "image": "debian:stable-slim",
        "unix_sockets": (workdir,),
        "binds": (isolate.Mount(workdir, "/out", "rw"), isolate.Mount(workdir, "/data", "ro")),
    }


#: Fields isolate-run has no flag for (wrap refuses a policy that changes them), with a non-default value.
NO_FLAG = {"new_session": False, "die_with_parent": False}


def _parsed_back(argv: list[str]) -> isolate.Policy:
    flags = argv[1:argv.index("--")]
    return policy_from_args(build_parser().parse_args([*flags, "--", "true"]))


def test_wrap_round_trips_every_field(workdir: str) -> None:
    samples = _samples(workdir)
    fields = {f.name for f in dataclasses.fields(isolate.Policy)}
    # Every field is either mapped or refused: a new Policy field must be added to one of the two.
    assert set(samples) | set(NO_FLAG) == fields
    for name, value in samples.items():
        changes = {name: value}
        if name == "namespaces":
            changes["tmpfs"] = ()
        if name == "binds" or name == "tmpfs":
            changes["namespaces"] = True
        given = isolate.Policy(**changes)
        argv = isolate.wrap(["echo", "hi"], given)
        assert argv[0] == "isolate-run" and argv[-3:] == ["--", "echo", "hi"]
        assert len(argv) > 4, f"{name} gave no flag"
        assert _parsed_back(argv) == given, name
    everything = isolate.Policy(**{k: v for k, v in samples.items() if k not in ("namespaces",)})
    assert _parsed_back(isolate.wrap(["-x"], everything)) == everything
    assert isolate.wrap(["true"]) == ["isolate-run", "--", "true"]
    for name, value in NO_FLAG.items():
        with pytest.raises(isolate.PolicyError) as info:
            isolate.wrap(["true"], isolate.Policy(**{name: value}))
        assert info.value.field == name
    # Values no flag can give are refused, naming the field, never dropped.
    # isolate-run mounts --bind before --ro-bind: a read-only /data over a writable /data/out cannot be said.
    colon = os.path.join(workdir, "a:b")
    os.mkdir(colon)
    nested = (isolate.Mount(workdir, "/data", "ro"), isolate.Mount(workdir, "/data/out", "rw"))
    side_by_side = (isolate.Mount(workdir, "/data", "ro"), isolate.Mount(workdir, "/out", "rw"))
    assert "--ro-bind=" + workdir + ":/data" in isolate.wrap(["true"], isolate.Policy(binds=side_by_side))
    for changes, name in (({"tmpfs": ()}, "tmpfs"), ({"keep_env": ("CI",)}, "keep_env"),
                          ({"network": isolate.Egress(())}, "network"), ({"binds": nested}, "binds"),
                          ({"binds": (isolate.Mount(colon, "/data", "ro"),)}, "binds")):
        with pytest.raises(isolate.PolicyError) as info:
            isolate.wrap(["true"], isolate.Policy(**changes))
        assert info.value.field == name, changes


def _isolate_run() -> list[str]:
    return [ISOLATE_RUN]


PROBE = """
import socket
open('ok/written', 'w').write('yes')
try:
    open('denied/written', 'w').write('no')
    print('outside-write: allowed')
except OSError as exc:
    print('outside-write: refused', exc.errno)
try:
    socket.create_connection(('127.0.0.1', 9), timeout=2)
    print('network: connected')
except OSError as exc:
    print('network: refused', exc.errno)
print('env', __import__('os').environ.get('AGENT_RUN'))
"""


def test_wrapped_command_runs_under_the_policy(workdir: str) -> None:
    for name in ("ok", "denied"):
        os.mkdir(os.path.join(workdir, name))
        os.chmod(os.path.join(workdir, name), 0o777)  # only the policy stands in the way
    given = policy(write=(os.path.join(workdir, "ok"),), read=(*python_read(), workdir), env={"AGENT_RUN": "1"})
    argv = agents.wrap([PYTHON, "-c", PROBE], given, program=_isolate_run())
    result = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("outside-write: refused"), lines
    assert lines[1].startswith("network: refused"), lines
    assert lines[2] == "env 1"
    assert Path(workdir, "ok", "written").read_text() == "yes"
    assert not os.path.exists(os.path.join(workdir, "denied", "written"))
    # The same line with a wall-clock limit: it holds too.
    slow = agents.wrap(["sleep", "30"], given.replace(limits=isolate.Limits(wall_seconds=1)), program=_isolate_run())
    started = time.monotonic()
    ended = subprocess.run(slow, cwd=workdir, capture_output=True, text=True, timeout=60)
    assert ended.returncode == 128 + 9 and time.monotonic() - started < 20, ended.stderr
    assert "wall-clock limit" in ended.stderr


def test_manager_get_at_once_from_threads_and_managers(manager: Any) -> None:
    # Two managers (as two processes would) and two threads each ask for the same new agent at once:
    # one sandbox is made, none is removed from under another, and every caller gets the running one.
    managers = [manager(), manager()]
    boxes: list[Sandbox] = []
    errors: list[BaseException] = []

    def get(m: AgentSandboxes) -> None:
        try:
            boxes.append(m.get("shared", policy(write=())))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=get, args=(m,)) for m in managers * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({id(b) for b in boxes}) == 2 and len({b.name for b in boxes}) == 1
    for b in boxes:
        assert b.exec("echo alive").stdout == "alive\n"
