"""Workspace(mode="copy") kept as layers: the private copy, made once, is an overlay's read-only lower layer.

After the first copy, a snapshot, a fork and a restore cost what changed since the copy: shown here by
what they hold (the snapshot's layer has the changed files and nothing else; every sandbox and snapshot
shares the one copy), never by a time. A copy's semantics stay: the source may change afterwards, unseen;
``exclude`` leaves names out; diff and commit compare with the source.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import policy

import isolate
from isolate import Sandbox, Workspace

FILES = 50


@pytest.fixture
def state(workdir: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state directory of the test's own: its copies and snapshots are all this test made."""
    from isolate.kernel.places import runtime_dir, state_key

    path = Path(workdir) / "state"
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(path))
    yield path
    for snap in isolate.Snapshot.list():
        snap.remove()
    try:
        os.rmdir(os.path.join(runtime_dir(), f"snapshots-{state_key()}"))
    except OSError:
        pass


@pytest.fixture
def source(workdir: str) -> str:
    root = Path(workdir) / "project"
    for i in range(FILES):
        (root / f"d{i % 10}").mkdir(parents=True, exist_ok=True)
        (root / f"d{i % 10}" / f"f{i:03d}").write_text(f"file {i}\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(root)


def layered(sb: Sandbox) -> None:
    """The copy is kept as layers here, or the test is skipped with the reason the sandbox reports."""
    report = sb.enforced.get("workspace") or {}
    snapshots = str(report.get("snapshots", ""))
    if snapshots.startswith("whole copies"):
        pytest.skip(f"the copy is kept whole here, as its report says: {snapshots}")
    assert report.get("mode") == "copy" and snapshots.startswith("layers"), report


def nodes(root: Path) -> dict[str, str]:
    """Every non-directory node under root: "file", "link" or "whiteout"."""
    out = {}
    for path in root.rglob("*"):
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode):
            continue
        kind = "whiteout" if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0 else \
            "link" if stat.S_ISLNK(info.st_mode) else "file"
        out[str(path.relative_to(root))] = kind
    return out


def test_a_snapshot_after_the_copy_holds_only_what_changed(source: str, state: Path) -> None:
    with Sandbox(policy(write=()), workspace=Workspace(source, exclude=(".git",))) as sb:
        layered(sb)
        sb.exec("echo changed > d1/f001 && echo new > d2/added && rm d3/f003")
        first = sb.snapshot()
        assert first.kind == "layer" and first.lower is not None
        layer = state / "snapshots" / first.name / "layer"
        # What changed since the copy, and not one of the other files.
        assert nodes(layer) == {"d1/f001": "file", "d2/added": "file", "d3/f003": "whiteout"}
        assert (layer / "d1" / "f001").read_text() == "changed\n"
        # Forks and a restore start from the snapshot's layer over the same copy: none copies it again.
        fork, = sb.fork(1)
        try:
            assert fork._impl.copy == sb._impl.copy == first.lower
            assert fork.read_file("d1/f001") == "changed\n" and not fork.exists("d3/f003")
            assert fork.read_file("d5/f005") == "file 5\n"
            assert nodes(Path(fork._impl.data_dir) / "overlay" / "base") == nodes(layer)
        finally:
            fork.close()
        sb.exec("echo again > d4/f004")
        second = sb.snapshot()
        assert nodes(state / "snapshots" / second.name / "layer") == {
            "d1/f001": "file", "d2/added": "file", "d3/f003": "whiteout", "d4/f004": "file"}
        sb.restore(first)
        assert sb.read_file("d4/f004") == "file 4\n" and sb.read_file("d1/f001") == "changed\n"
        assert sb._impl.copy == first.lower
        assert os.listdir(state / "copies") == [first.lower]  # one copy, made once
        # diff and commit see the restored files (the snapshot's layer under the upper one).
        changes = sb.diff()
        assert (changes.added, changes.modified, changes.deleted) == (["d2/added"], ["d1/f001"], ["d3/f003"])
        target = Path(state.parent / "target")
        target.mkdir()
        sb.commit(target)
        assert sorted(p.name for p in target.iterdir()) == [f"d{i}" for i in range(10)]  # no .git
        assert (target / "d1" / "f001").read_text() == "changed\n" and not (target / "d3" / "f003").exists()
    # The copy stays while a snapshot lies over it, and goes with the last.
    assert os.listdir(state / "copies") == [first.lower]
    first.remove()
    assert os.listdir(state / "copies") == [first.lower]
    second.remove()
    assert os.listdir(state / "copies") == []


def test_the_source_changed_after_the_copy_is_not_seen(source: str, state: Path) -> None:
    with Sandbox(policy(write=()), workspace=Workspace(source, exclude=(".git",))) as sb:
        layered(sb)
        assert not sb.exists(".git")
        copy = state / "copies" / str(sb._impl.copy) / "tree"
        assert not (copy / ".git").exists() and (copy / "d0" / "f000").read_text() == "file 0\n"
        Path(source, "d0", "f000").write_text("host changed\n")
        Path(source, "d0", "host-new").write_text("host new\n")
        os.unlink(os.path.join(source, "d1", "f001"))
        assert sb.read_file("d0/f000") == "file 0\n"
        assert not sb.exists("d0/host-new") and sb.read_file("d1/f001") == "file 1\n"
        snap = sb.snapshot()
        assert nodes(state / "snapshots" / snap.name / "layer") == {}  # the program changed nothing
        with Sandbox(policy(write=()), snapshot=snap) as other:
            assert other.read_file("d0/f000") == "file 0\n" and not other.exists("d0/host-new")
        # Against the source, the workspace is what it was when copied: diff says what commit would undo.
        changes = sb.diff()
        assert (changes.added, changes.modified, changes.deleted) == (["d1/f001"], ["d0/f000"], ["d0/host-new"])
        assert (copy / "d0" / "f000").read_text() == "file 0\n"  # nothing wrote the copy
        snap.remove()


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_diff_and_commit_after_a_restore_see_the_snapshots_files(source: str, state: Path, workdir: str,
                                                                 mode: str) -> None:
    # A sandbox restored to (or started from) a snapshot has the snapshot's layer under its upper layer: diff
    # and commit read the upper layer over the source only, and a restored sandbox's diff came back empty.
    with Sandbox(policy(write=()), workspace=Workspace(source, mode=mode)) as sb:
        sb.exec("echo new > d2/added && echo changed > d1/f001")
        snap = sb.snapshot()
        sb.restore(snap)
        sb.exec("echo later > d3/later")
        changes = sb.diff()
        assert (changes.added, changes.modified) == (["d2/added", "d3/later"], ["d1/f001"])
        target = Path(workdir) / "target"
        target.mkdir()
        sb.commit(target)
        assert (target / "d2" / "added").read_text() == "new\n"
        assert (target / "d1" / "f001").read_text() == "changed\n"
        snap.remove()


def test_a_layer_snapshot_started_where_the_overlay_is_refused_is_one_whole_copy(
        source: str, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.backends.native import datadir
    from isolate.kernel.places import state_dir

    with Sandbox(policy(write=()), workspace=Workspace(source)) as sb:
        layered(sb)
        sb.exec("echo changed > d1/f001 && rm -r d2 && mkdir d3/new && echo n > d3/new/n && chmod 555 d3")
        snap = sb.snapshot()
    # As if the kernel had refused the overlay in this process (a refusal is remembered per state directory).
    monkeypatch.setitem(datadir.COPY_LAYERS_REFUSED, state_dir(), "refused (test)")
    with Sandbox(policy(write=()), snapshot=snap) as other:
        assert other.enforced["workspace"]["snapshots"] == "whole copies: the copy cannot be an overlay's lower " \
                                                          "layer here (refused (test))"
        assert other._impl.copy is None
        assert other.read_file("d1/f001") == "changed\n" and not other.exists("d2")
        assert other.read_file("d3/new/n") == "n\n" and other.read_file("d0/f000") == "file 0\n"
        assert other.stat("d3").mode & 0o777 == 0o555
        assert other.diff().deleted[:1] == ["d2"]
    snap.remove()


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_a_read_only_directory_with_new_files_is_snapshotted_and_forked(source: str, state: Path, mode: str) -> None:
    # The snapshot's copy of a directory got its mode (0555) before its files: a caller who is not root could
    # not write them into it, and the snapshot failed with EACCES.
    with Sandbox(policy(write=()), workspace=Workspace(source, mode=mode)) as sb:
        sb.exec("mkdir -p d3/new && echo n > d3/new/n && chmod 555 d3/new d3")
        snap = sb.snapshot()
        fork, = sb.fork(1)
        try:
            assert fork.read_file("d3/new/n") == "n\n" and fork.stat("d3").mode & 0o777 == 0o555
        finally:
            fork.close()
        assert (state / "snapshots" / snap.name / snap.kind / "d3").stat().st_mode & 0o777 == 0o555
        snap.remove()
