"""Snapshots, forks, restore and merge of kept native sandboxes (isolate/kept/snapshots.py, merge.py).

Real kernel, as root and as uid 65534: an overlay workspace's snapshot is a layer (what changed since
the source), a copy workspace's a copy; restore and fork start sandboxes from one; merge applies the
changes of several branches against their common start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import NAMESPACES_WHY, policy

import isolate
from isolate import Sandbox, Workspace
from isolate.kernel.places import state_dir

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")

LINES = "".join(f"line {i}\n" for i in range(1, 21))


@pytest.fixture
def source(workdir: str) -> str:
    root = Path(workdir) / "project"
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('hello')\n")
    (root / "notes.txt").write_text(LINES)
    (root / "keep.txt").write_text("keep\n")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(root)


@pytest.fixture(params=["overlay", "copy"])
def box(request: pytest.FixtureRequest, source: str) -> Iterator[Sandbox]:
    with Sandbox(policy(write=()), workspace=Workspace(source, mode=request.param)) as sandbox:
        yield sandbox


@pytest.fixture(autouse=True)
def no_snapshots_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test keeps its snapshots in a state directory of its own: another process of this user (another
    run of the suite) lists and removes snapshots of the user's own state directory, and saw these."""
    import shutil
    import tempfile

    from isolate.kernel.places import runtime_dir, state_key

    private = tempfile.mkdtemp(prefix="isolate-branches-state-")
    monkeypatch.setenv("ISOLATE_STATE_DIR", private)
    before = {s.name for s in isolate.Snapshot.list()}
    try:
        yield
    finally:
        for snap in isolate.Snapshot.list():
            if snap.name not in before:
                snap.remove()
        try:
            os.rmdir(os.path.join(runtime_dir(), f"snapshots-{state_key()}"))
        except OSError:
            pass
        shutil.rmtree(private, ignore_errors=True)


def files(sb: Sandbox) -> str:
    """Everything of the workspace, /tmp and the home: names, kinds and contents."""
    return sb.exec("cd /workspace && find . /tmp ~ -mindepth 1 | sort | while read -r f; do "
                   "if [ -L \"$f\" ]; then echo \"$f -> $(readlink \"$f\")\"; elif [ -f \"$f\" ]; then "
                   "echo \"$f: $(cat \"$f\")\"; else echo \"$f/\"; fi; done").stdout


def test_snapshot_is_immune_to_later_changes_and_to_planted_links(box: Sandbox, source: str,
                                                                  workdir: str) -> None:
    secret = Path(workdir, "secret")
    secret.write_text("host secret\n")
    box.exec(f"echo mine > src/new.py && ln -s {secret} escape && ln -s /etc escape_dir && "
             "echo t > /tmp/t && mkdir ~/cfg && echo h > ~/cfg/h && "
             "head -c 100000 /dev/zero > big && for i in 1 2 3; do ln big big$i; done")
    snap = box.snapshot("branches-test-immune")
    taken = files(box)
    assert "./escape -> " in taken and "/tmp/t: t" in taken and "/cfg/h: h" in taken
    # Later changes, and links planted where the snapshot's files were, change nothing of it.
    box.exec("echo later > src/new.py && rm keep.txt && rm -r ~/cfg && ln -s /etc ~/cfg && "
             f"rm escape && ln -s {secret} src/main.py.tmp && echo x > /tmp/t")
    assert snap in isolate.Snapshot.list()
    with Sandbox(box.policy, snapshot=snap) as other:
        assert files(other) == taken
    assert secret.read_text() == "host secret\n"  # written by nothing
    kept = snap.kind
    # A copy workspace is kept as layers over its private copy, unless the overlay is refused here (it says so).
    whole = str(box.enforced.get("workspace", {}).get("snapshots", "")).startswith("whole")
    assert kept == ("tree" if whole else "layer")
    # The snapshot's files hold a link as a link, never what it points to.
    state = Path(state_dir(), "snapshots", snap.name, kept)
    assert os.path.islink(state / "escape") and os.readlink(state / "escape") == str(secret)
    # A file's several names are one copy (a program's thousand names of one file cost the host one).
    assert len({os.stat(state / name).st_ino for name in ("big", "big1", "big2", "big3")}) == 1
    snap.remove()
    assert snap not in isolate.Snapshot.list() and not state.exists()


def _cmdline(process: psutil.Process) -> str:
    """A process's command line; "" for one that ended meanwhile (a command's exited shell, not yet reaped,
    is a zombie whose command line psutil refuses to read)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_fork_gives_independent_sandboxes(box: Sandbox) -> None:
    before = isolate.Snapshot.list()
    box.exec("echo base > shared.txt && echo t > /tmp/base")
    box.exec("sleep 60 >/dev/null 2>&1 &")  # processes are not carried
    forks = box.fork(3)
    try:
        assert len(forks) == 3 and all(f.workspace == box.workspace for f in forks)
        for i, fork in enumerate(forks):
            fork.exec(f"echo {i} > shared.txt && echo {i} > only{i}.txt && rm keep.txt")
        box.exec("echo source > shared.txt")
        for i, fork in enumerate(forks):
            listing = fork.exec("cat shared.txt /tmp/base; ls").stdout
            assert listing.startswith(f"{i}\nt\n")
            assert f"only{i}.txt" in listing and "keep.txt" not in listing
            assert not any(f"only{j}.txt" in listing for j in range(3) if j != i)
        assert box.read_file("shared.txt") == "source\n" and box.exists("keep.txt")
        assert any("sleep" in _cmdline(p) for p in box.processes())
        assert not any("sleep" in _cmdline(p) for f in forks for p in f.processes())
    finally:
        for fork in forks:
            fork.close()
    assert isolate.Snapshot.list() == before  # the fork point goes with the last fork
    with pytest.raises(isolate.UnsupportedError, match="processes"):
        box.fork(processes=True)


def test_restore_undoes_an_episode(box: Sandbox) -> None:
    box.exec("echo start > state.txt && echo t > /tmp/start")
    start = box.snapshot()
    before = files(box)
    for _ in range(2):  # two episodes, each restored
        box.exec("for i in $(seq 1 30); do echo $i > created$i; done; echo changed > notes.txt; "
                 "echo c > src/main.py; rm keep.txt; rm -r src; mkdir src; echo e > /tmp/episode; "
                 "echo x >> /tmp/start; mkdir -p deep/er && ln -s /etc deep/er/link; sleep 60 &")
        assert files(box) != before
        box.restore(start)
        assert files(box) == before
        assert box.read_file("notes.txt") == LINES and box.read_file("src/main.py") == "print('hello')\n"
    assert box.origin == start


def test_a_restore_started_ahead_is_the_snapshot_and_ends_with_the_sandbox(source: str) -> None:
    """restore(ahead=True) starts the next restore to that snapshot in the background: the next restore swaps it
    in (the episode's files, /tmp's included, and processes gone; the snapshot's back), a restore to another
    snapshot or the close ends the spare; a named sandbox refuses it before anything ends."""
    before = _inits()
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        box.exec("echo start > state.txt && echo t > /tmp/start")
        start = box.snapshot()
        taken = files(box)
        for _ in range(3):
            box.exec("echo changed > notes.txt; rm keep.txt; echo e > /tmp/episode; sleep 60 >/dev/null 2>&1 &")
            box.restore(start, ahead=True)
            assert files(box) == taken
            assert not any("sleep" in _cmdline(p) for p in box.processes())
        assert _new_inits(before, 2) == 2  # the sandbox, and its spare waiting
        other = box.snapshot()
        box.restore(other)  # not the spare's snapshot: it goes
        assert _new_inits(before, 1) == 1
        box.restore(start, ahead=True)
        assert files(box) == taken
    assert _new_inits(before, 0) == 0  # the sandbox and its spare
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay"), name="branches-ahead") as named:
        snap = named.snapshot()
        named.write_file("mark", "kept")
        with pytest.raises(isolate.UnsupportedError, match="ahead"):
            named.restore(snap, ahead=True)
        assert named.read_file("mark") == "kept"
        named.close()


def _inits() -> set[int]:
    """The sandboxes' inits this process started (their pids): each sandbox, and each spare, has one."""
    return {p.pid for p in psutil.Process().children() if _cmdline(p).startswith("isolate-init")}


def _new_inits(before: set[int], expect: int) -> int:
    """How many inits not in ``before`` run, once that is ``expect`` or after 60 s (sandboxes end in the
    background, after earlier tests' too: a count of all of them would take those for this test's)."""
    deadline = time.monotonic() + 60
    while (count := len(_inits() - before)) != expect and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def test_restore_ahead_refuses_a_ttl_before_anything_ends(source: str) -> None:
    """A spare's ttl runs from its own start (the init's and the exec server's clocks): swapped in, the sandbox
    would end sooner than a restored one. Refused, before anything ends."""
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay"), ttl=60) as box:
        snap = box.snapshot()
        box.write_file("mark", "kept")
        with pytest.raises(isolate.UnsupportedError, match="ttl"):
            box.restore(snap, ahead=True)
        assert box.read_file("mark") == "kept"


def test_a_restore_ahead_that_fails_after_taking_its_spare_ends_the_spare(source: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    before = _inits()
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        snap = box.snapshot()
        box.restore(snap, ahead=True)
        assert _new_inits(before, 2) == 2  # the sandbox and its spare

        def interrupted() -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(box, "_close_sessions", interrupted)
        with pytest.raises(KeyboardInterrupt):
            box.restore(snap)
        monkeypatch.undo()
        assert box.exec("echo on").stdout == "on\n"  # the sandbox as it was
    assert _new_inits(before, 0) == 0  # the spare too


def test_a_close_racing_restores_ahead_in_another_thread_ends_everything(source: str) -> None:
    """close while another thread restores (ahead) waits for that restore: it ends the sandbox started by it and
    its spare (they were started after the close ended the old one, and ran until this process's exit)."""
    import threading

    before = _inits()
    for _ in range(3):
        box = Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")).start()
        snap = box.snapshot()
        stopped: list[BaseException] = []

        def restores(box: Sandbox = box, snap: isolate.Snapshot = snap, stopped: list[BaseException] = stopped) -> None:
            try:
                while True:
                    box.restore(snap, ahead=True)
            except isolate.IsolationError as exc:
                stopped.append(exc)

        thread = threading.Thread(target=restores)
        thread.start()
        time.sleep(0.1)
        box.close()
        thread.join(60)
        assert stopped and "not running" in str(stopped[0]), stopped
        assert _new_inits(before, 0) == 0
        snap.remove()


@pytest.mark.host_independent  # the host's own threads racing (Sandbox._steady): 107 s under the VM's emulation
@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_a_commit_or_snapshot_racing_a_close_reads_every_file_or_is_refused(source: str, mode: str,
                                                                             tmp_path: Path) -> None:
    """Before: the host read the files while a close in another thread removed them: a commit wrote part of
    them to its target and raised FileNotFoundError (no IsolationError), a snapshot failed on a missing file."""
    import threading

    for delay in (0.02,):
        for what in ("commit", "snapshot"):
            box = Sandbox(policy(write=()), workspace=Workspace(source, mode=mode)).start()
            box.exec(["sh", "-c", "mkdir many && cd many && seq 1 4000 | xargs touch"])
            target = tmp_path / f"{what}-{delay}"
            target.mkdir()
            outcome: list[object] = []

            def reads(box: Sandbox = box, what: str = what, target: Path = target,
                      outcome: list[object] = outcome) -> None:
                try:
                    outcome.append(box.commit(target) if what == "commit" else box.snapshot())
                except Exception as exc:  # the test looks at which
                    outcome.append(exc)

            thread = threading.Thread(target=reads)
            thread.start()
            time.sleep(delay)
            box.close()
            thread.join(60)
            [found] = outcome
            if isinstance(found, BaseException):
                assert isinstance(found, isolate.IsolationError) and "not running" in str(found), repr(found)
                continue
            if isinstance(found, isolate.Snapshot):
                with Sandbox(policy(write=()), workspace=Workspace(source, mode=mode), snapshot=found) as again:
                    assert again.exec(["sh", "-c", "ls many | wc -l"]).stdout.strip() == "4000"
                found.remove()
            else:
                assert len(os.listdir(target / "many")) == 4000


def test_a_restore_ahead_to_a_removed_snapshot_is_refused_as_a_restore_is(source: str) -> None:
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        snap = box.snapshot()
        box.restore(snap, ahead=True)
        snap.remove()
        with pytest.raises(isolate.IsolationError, match="gone"):
            box.restore(snap)


def test_docker_and_bind_refuse(source: str) -> None:
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="bind")) as sb, \
            pytest.raises(isolate.UnsupportedError, match="bind workspace"):
        sb.snapshot()
    with pytest.raises(isolate.UnsupportedError, match="Docker backend keeps no snapshots"):
        Sandbox(policy(write=()), backend="docker", snapshot=isolate.Snapshot(
            "x", "tree", Workspace(), 0.0, "", None, (), (0, 0)))


def test_merge_of_different_hunks_is_clean_same_hunk_conflicts(box: Sandbox) -> None:
    box.exec("echo made before the fork > made.txt")
    a, b = box.fork(2)
    try:
        a.replace_text("notes.txt", "line 2\n", "line two\n")
        b.replace_text("notes.txt", "line 17\n", "line seventeen\n")
        a.write_file("from_a.txt", "a\n")
        b.remove("keep.txt")
        result = isolate.merge([a, b])
        # Against the fork point, not the source: made.txt is no change of theirs.
        assert result.clean and sorted(result.merged) == ["from_a.txt", "keep.txt", "notes.txt"]
        assert result.sandbox is not None
        with result.sandbox as merged:
            assert merged.read_file("notes.txt") == LINES.replace("line 2\n", "line two\n").replace(
                "line 17\n", "line seventeen\n")
            assert merged.exists("from_a.txt") and not merged.exists("keep.txt")
        # The same hunk, and a deletion against an edit: conflicts, reported, marked or refused.
        a.replace_text("notes.txt", "line 9\n", "nine from a\n")
        b.replace_text("notes.txt", "line 9\n", "nine from b\n")
        a.write_file("src/main.py", "edited\n")
        b.remove("src/main.py")
        with pytest.raises(isolate.MergeConflictError) as refused:
            isolate.merge([a, b], on_conflict="refuse")
        conflicts = {c.path: c for c in refused.value.result.conflicts}
        assert set(conflicts) == {"notes.txt", "src/main.py"}
        assert conflicts["src/main.py"].kind == "delete/modify"
        hunk, = conflicts["notes.txt"].hunks
        assert (hunk.base_start, hunk.base_lines, hunk.sides) == (9, 1, (("nine from a\n",), ("nine from b\n",)))
        marked = isolate.merge([a, b])
        assert not marked.clean and marked.sandbox is not None
        with marked.sandbox as merged:
            text = merged.read_file("notes.txt")
            assert "<<<<<<< " in text and "nine from a\n=======\nnine from b\n>>>>>>> " in text
            assert "line two\n" in text and merged.read_file("src/main.py") == "edited\n"
    finally:
        a.close()
        b.close()


def test_merge3_as_git_merge_file() -> None:
    from isolate.kept.merge import merge3

    base = [b"a\n", b"b\n", b"c\n", b"d\n", b"e\n"]
    assert merge3(base, [b"A\n", *base[1:]], [*base[:4], b"E\n"])[0] == [b"A\n", b"b\n", b"c\n", b"d\n", b"E\n"]
    # Touching lines conflict, as in git; the same change on both sides does not.
    assert merge3(base, [b"a\n", b"B\n", *base[2:]], [*base[:2], b"C\n", *base[3:]])[1]
    assert not merge3(base, [b"a\n", b"B\n", *base[2:]], [b"a\n", b"B\n", *base[2:]])[1]
    assert merge3(base, [*base, b"f\n"], base[:-1])[1]  # an append against the last line's deletion


def test_verification_branches_flow(source: str) -> None:
    from isolate.agents import NativeBranches

    with NativeBranches(policy(write=())) as strategy:
        ids = [strategy.setup_branch(source) for _ in range(3)]
        strategy.execute_command(ids[0], "sed -i 's/^line 3$/three/' notes.txt")
        strategy.execute_command(ids[1], "sed -i 's/^line 18$/eighteen/' notes.txt && echo n > new.txt")
        strategy.execute_command(ids[2], "echo discarded > gone.txt")
        verification = strategy.setup_verification_branches({"v0": [ids[0], ids[1]], "v1": [ids[1]]})
        assert verification["v1"] == ids[1]  # one source: reused as it is
        merged = verification["v0"]
        assert merged not in ids and strategy.merges[merged].clean
        out = strategy.execute_command(merged, "cat notes.txt new.txt; ls").stdout
        assert "three\n" in out and "eighteen\n" in out and "n\n" in out and "gone.txt" not in out
        with pytest.raises(isolate.IsolationError, match="no branch"):
            strategy.execute_command(ids[2], "true")  # used by no group: discarded
        target = Path(source).parent / "result"
        target.mkdir()
        strategy.commit_to_host(merged, target)
        assert (target / "new.txt").read_text() == "n\n"


def test_merge_of_deleted_directories_and_an_edit_kept_over_a_deletion(source: str) -> None:
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        box.exec("mkdir -p lib/sub && echo 1 > lib/one && echo 2 > lib/sub/two && echo o > src/other.py")
        a, b = box.fork(2)
        try:
            a.exec("rm -r lib src && printf 'a\\0' > bin.dat && ln -s notes.txt to && "
                   "sed -i 's/^line 3$/three/' notes.txt")  # a deletes two directories
            b.exec("echo edited > src/main.py && printf 'b\\0' > bin.dat && ln -s keep.txt to && "
                   "chmod 755 notes.txt")                      # b edits inside one of them
            result = isolate.merge([a, b])
            assert [(c.path, c.kind) for c in result.conflicts] == [
                ("bin.dat", "binary"), ("src/main.py", "delete/modify"), ("to", "link")]
            assert result.sandbox is not None
            with result.sandbox as merged:
                # lib is gone whole; src holds only the kept edit (nothing else of the source shows through).
                assert merged.exec("ls; ls src; cat src/main.py").stdout == \
                    "bin.dat\nkeep.txt\nnotes.txt\nsrc\nto\nmain.py\nedited\n"
                # One side's text change and the other's mode change, together.
                assert merged.read_file("notes.txt") == LINES.replace("line 3\n", "three\n")
                assert merged.stat("notes.txt").mode & 0o777 == 0o755
        finally:
            a.close()
            b.close()


def test_merge_of_snapshots_of_forks_gone_since(source: str) -> None:
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        box.write_file("made.txt", "a\nb\nc\nd\ne\nf\n")
        a, b = box.fork(2)
        a.replace_text("made.txt", "b\n", "B\n")
        b.replace_text("made.txt", "e\n", "E\n")
        snaps = [a.snapshot(), b.snapshot()]
        a.close()
        b.close()
        # Their common start is kept with each layer snapshot: the forks and the fork point are gone.
        result = isolate.merge(snaps, start=False)
        assert result.clean and result.merged == ["made.txt"] and result.sandbox is None
        assert result.snapshot is not None
        with Sandbox(box.policy, snapshot=result.snapshot) as merged:
            assert merged.read_file("made.txt") == "a\nB\nc\nd\nE\nf\n"


def test_merge_of_huge_sparse_files_reads_none_whole(source: str) -> None:
    # A sparse file costs the program's disk nothing: merge compared two by reading both whole into the
    # caller's memory, and read a text candidate whole. Equal ones are compared by their data, holes
    # skipped; different ones past the text merge's size are a binary conflict, unread.
    def status_kib(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        a, b = box.fork(2)
        try:
            for side in (a, b):
                side.exec("truncate -s 2G same && truncate -s 2G differs")
            b.exec("printf x | dd of=differs bs=1 seek=1000000 conv=notrunc 2>/dev/null")
            # The peak from here (not ru_maxrss: an earlier, higher peak of the test process would hide any growth).
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # VmHWM reset to the resident size now
            before = status_kib("VmRSS")
            result = isolate.merge([a, b], start=False)
            grown_mib = (status_kib("VmHWM") - before) // 1024
        finally:
            a.close()
            b.close()
    assert "same" in result.merged and [(c.path, c.kind) for c in result.conflicts] == [("differs", "binary")]
    assert grown_mib < 512, f"merge grew the caller by {grown_mib} MiB"
    assert result.snapshot is not None
    result.snapshot.remove()


@pytest.fixture
def host_dir(workdir: str) -> str:
    """A host directory the program may write (a root caller's program is nobody)."""
    path = os.path.join(workdir, "host")
    os.mkdir(path)
    os.chmod(path, 0o777)
    return path


@pytest.mark.parametrize("way", ["snapshot=", "restore", "write grant"])
def test_a_snapshot_restores_nothing_into_the_host_directories_of_the_next_sandbox(source: str, host_dir: str,
                                                                                   way: str) -> None:
    import tempfile
    import warnings

    grant = tempfile.mkdtemp(dir="/var/tmp", prefix="isolate-test-grant-") if way == "write grant" else ""
    try:
        if grant:
            os.chmod(grant, 0o777)
        shared = {"snapshot=": "/tmp/shared", "restore": "/home/sandbox/shared", "write grant": grant}[way]
        ws = Workspace(source, mode="copy")
        with Sandbox(policy(write=()), workspace=ws) as a:
            a.exec(f"mkdir -p {shared} && echo planted > {shared}/planted && echo mine > /tmp/mine")
            snap = a.snapshot()
        mounts = [] if grant else [isolate.Mount(host_dir, shared, "rw")]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if way == "restore":
                with Sandbox(policy(write=()), workspace=ws, mounts=mounts) as b:
                    assert b.exec("echo fresh > /tmp/fresh").returncode == 0
                    b.restore(snap)
                    mine, skipped = b.read_file("/tmp/mine"), getattr(b, "restore_skipped", ())
            else:
                with Sandbox(policy(write=(grant,) if grant else ()), mounts=mounts, snapshot=snap) as b:
                    mine, skipped = b.read_file("/tmp/mine"), getattr(b, "restore_skipped", ())
        assert os.listdir(grant or host_dir) == []
        assert mine == "mine\n"  # the sandbox's own areas are restored
        assert any(f"{shared}/planted" in s for s in skipped), skipped
        assert any(issubclass(w.category, isolate.kept.snapshots.SnapshotSkipWarning) for w in caught)
    finally:
        if grant:
            import shutil

            shutil.rmtree(grant, ignore_errors=True)


def test_a_snapshots_archive_is_the_programs_word_and_its_tar_is_not_run(source: str, host_dir: str) -> None:
    """The archive a planted tar hands over, with links, .. and absolute names into a host mount, lands only
    in the sandbox's own tmpfs mounts; no tar of the sandbox's runs to unpack it."""
    import io
    import tarfile
    import warnings

    Path(host_dir, "existing").write_text("host\n")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        def add(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"x\n") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = kind, link, 0o644
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("tmp/lnk", tarfile.SYMTYPE, "/tmp/shared")
        add("tmp/lnk/through-link")
        add("tmp/shared/direct")
        add("tmp/shared/existing", data=b"overwritten\n")
        add("tmp/../tmp/shared/dotdot")
        add("/tmp/shared/absolute")
        add("etc/outside")
        add("tmp/hard", tarfile.LNKTYPE, "tmp/shared/existing")
        add("tmp/kept", data=b"kept\n")
    env = {"PATH": "/tmp/bin:/usr/bin:/bin"}
    with Sandbox(policy(write=(), env=env), workspace=Workspace(source, mode="copy")) as a:
        a.write_file("/tmp/bin/payload.tar", buffer.getvalue())
        a.write_file("/tmp/bin/tar", "#!/bin/sh\ncat /tmp/bin/payload.tar\n", mode=0o755)
        snap = a.snapshot()
    with warnings.catch_warnings(record=True) as caught, \
            Sandbox(policy(write=(), env=env), mounts=[isolate.Mount(host_dir, "/tmp/shared", "rw")],
                    snapshot=snap) as b:
        warnings.simplefilter("always")
        assert b.read_file("/tmp/kept") == "kept\n"
        assert b.exec("readlink /tmp/lnk").stdout == "/tmp/shared\n"  # stored as a link, never followed
        skipped = "\n".join(getattr(b, "restore_skipped", ()))
    assert sorted(os.listdir(host_dir)) == ["existing"]
    assert Path(host_dir, "existing").read_text() == "host\n"
    assert any(issubclass(w.category, isolate.kept.snapshots.SnapshotSkipWarning) for w in caught)
    for name in ("through-link", "direct", "existing", "dotdot", "absolute", "etc/outside", "/tmp/hard"):
        assert name in skipped, skipped


def test_a_sparse_file_of_tmp_is_restored_sparse(source: str) -> None:
    """4 GiB apparent in a 1 GiB /tmp: its holes stay holes through the snapshot's archive and back."""
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="copy")) as a:
        a.exec("truncate -s 4G /tmp/sparse && printf abc | dd of=/tmp/sparse bs=1 seek=3000000000 conv=notrunc")
        snap = a.snapshot()
    with Sandbox(policy(write=()), snapshot=snap) as b:
        out = b.exec("stat -c '%s %b' /tmp/sparse && dd if=/tmp/sparse bs=1 skip=3000000000 count=3 2>/dev/null")
    size, blocks = out.stdout.splitlines()[0].split()
    assert int(size) == 4 << 30 and int(blocks) < 1024 and out.stdout.endswith("abc"), out


FORKING = r'''
import sys
import isolate
box = isolate.Sandbox(isolate.Policy(write=()), workspace=isolate.Workspace(sys.argv[1], mode=sys.argv[2])).start()
box.exec(["sh", "-c", "for i in $(seq 30); do echo $i > f$i; done"])
print("ready", flush=True)
while True:
    for fork in box.fork(2):
        fork.close()
'''


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_a_process_killed_while_forking_leaves_nothing_after_a_prune(source: str, mode: str) -> None:
    # Before: the snapshot fork() takes for itself stayed in the state directory (and its description in the
    # runtime directory) whenever the forking process was killed: SIGKILLs at random points of a fork loop
    # left one each, which nothing ever removed.
    import random
    import signal
    import subprocess
    import sys
    import time

    from conftest import ISOLATE_RUN

    from isolate.kernel.places import runtime_dir, state_key

    rng = random.Random(38)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", FORKING, source, mode], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    pruned = subprocess.run([ISOLATE_RUN, "sandbox", "prune"], capture_output=True, text=True, timeout=120)
    assert pruned.returncode == 0, pruned.stderr
    assert os.listdir(os.path.join(state_dir(), "snapshots")) == []
    meta = os.path.join(runtime_dir(), f"snapshots-{state_key()}")
    assert not [e for e in (os.listdir(meta) if os.path.isdir(meta) else []) if "tmp-" in e]
    assert [e for e in os.listdir(os.path.join(state_dir(), "sandboxes")) if not e.startswith(".")] == []


def test_a_snapshot_named_as_a_temporary_one_is_refused(source: str) -> None:
    # Before: a snapshot the user named tmp-PID-START-HEX (a name of the form isolate gives the snapshots it takes
    # for itself) was taken, and the next fork anywhere (or a prune) removed it as one whose maker was killed.
    from isolate.kept.snapshots import sweep_temporary_snapshots

    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        try:
            snap = box.snapshot("tmp-1-0-0123abcd")
        except isolate.PolicyError:
            return
        try:
            sweep_temporary_snapshots()
            assert "tmp-1-0-0123abcd" in {s.name for s in isolate.Snapshot.list()}, \
                "the user's snapshot was swept as a temporary one"
        finally:
            snap.remove()


def test_a_temporary_snapshot_between_its_making_and_its_lock_is_not_swept() -> None:
    # Before: a maker in another PID namespace (its pid means nothing here) that had made its temporary snapshot's
    # directory but not yet locked it had the directory swept from under it by a sweep running just then. The
    # maker holds the snapshots directory's making lock through that window; a sweep waits for it.
    import subprocess
    import sys
    import threading

    from isolate.kept.snapshots import sweep_temporary_snapshots

    parent = os.path.join(state_dir(), "snapshots")
    os.makedirs(parent, exist_ok=True)
    name = "tmp-1-0-0badc0de"  # PID 1 here is another process than its maker (start time 0)
    maker = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys\n"
                              "from isolate.kernel.places import making_in\n"
                              "parent = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                              "with making_in(parent):\n"
                              "    os.mkdir(sys.argv[2], dir_fd=parent)\n"
                              "    print('made', flush=True)\n"
                              "    sys.stdin.readline()\n"
                              "    fd = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)\n"
                              "    fcntl.flock(fd, fcntl.LOCK_EX)\n"
                              "print('locked', flush=True)\nsys.stdin.readline()\n", parent, name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert maker.stdin is not None and maker.stdout is not None
    try:
        assert maker.stdout.readline() == "made\n"
        sweep = threading.Thread(target=sweep_temporary_snapshots)
        sweep.start()
        sweep.join(0.5)  # it waits for the window to close (before the fix it swept the directory at once)
        assert os.path.isdir(os.path.join(parent, name)), "a directory just made was swept before its lock"
        maker.stdin.write("\n")
        maker.stdin.flush()
        assert maker.stdout.readline() == "locked\n"
        sweep.join(30)
        assert not sweep.is_alive()
        assert os.path.isdir(os.path.join(parent, name)), "a locked temporary snapshot was swept"
    finally:
        maker.communicate("\n")
    assert sweep_temporary_snapshots() == [name]  # its maker ended: swept now
    assert not os.path.exists(os.path.join(parent, name))


def test_a_forked_child_leaves_its_parents_spare_alone(source: str) -> None:
    """A child forked while a restore's spare is starting neither waits for that start (it has no thread to see
    it end: its restore would hang for good) nor ends the spare (the parent's); the parent then swaps it in."""
    with Sandbox(policy(write=()), workspace=Workspace(source, mode="overlay")) as box:
        start = box.snapshot()
        box.restore(start, ahead=True)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: what its restore and close would ask of the spare
            try:
                os.close(read)
                spare = box._ahead
                assert spare is not None
                taken = spare.take(start)
                spare.discard()
                os.write(write, b"ok" if taken is None and not spare._discarded else b"spare touched")
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            said = answer.read()
        os.waitpid(pid, 0)
        assert said == b"ok"
        spare = box._ahead
        assert spare is not None and not spare._discarded
        box.exec("echo x > episode")
        box.restore(start)
        assert box._impl is spare.impl and not box.exists("episode")
