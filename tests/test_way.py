"""One rule for who could change the way to a directory isolate uses by path (isolate/kernel/way.py): the
state directory and the image store both ask it, and say the same."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import isolate
from isolate.image import Image
from isolate.image.store import Store
from isolate.kernel import way
from isolate.kernel.places import open_state_dir

STORE_WAY_OUT = "choose another with --image-store or ISOLATE_IMAGE_STORE"
STATE_WAY_OUT = "set ISOLATE_STATE_DIR to a directory on a way only you and root can change"


def _shared(tmp_path: Path, mode: int) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    return shared


def _refusal(what: str, path: Path, unsafe: str, way_out: str) -> str:
    return f"{what} {path}: {unsafe}: another user could rename it and put their own in its place; {way_out}"


@pytest.mark.parametrize("mode, whom", [(0o777, "others"), (0o775, "its group")])
def test_a_state_directory_under_a_directory_others_could_write_is_refused_as_the_store_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, whom: str) -> None:
    # Before, the state directory's own walk asked only who owned each directory: one under Ray's 0777
    # temporary directory was taken while the store beside it was refused.
    shared = _shared(tmp_path, mode)
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(shared / "state"))
    unsafe = f"{shared} is writable by {whom} (mode {mode:o}, not sticky)"
    with pytest.raises(isolate.IsolationError) as caught:
        os.close(open_state_dir("sandboxes"))
    assert str(caught.value) == _refusal("state directory", shared / "state" / "sandboxes", unsafe, STATE_WAY_OUT)
    with pytest.raises(isolate.IsolationError) as caught:
        Image.list(Store(shared / "images"))
    assert str(caught.value) == _refusal("image store", shared / "images", unsafe, STORE_WAY_OUT)


def test_a_state_directory_under_a_sticky_directory_of_everyones_is_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As /tmp: only an entry's owner (or the directory's) may rename it there.
    shared = _shared(tmp_path, 0o1777)
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(shared / "state"))
    fd = open_state_dir("sandboxes")
    try:
        assert os.fstat(fd).st_ino == os.stat(shared / "state" / "sandboxes").st_ino
    finally:
        os.close(fd)
    assert Image.list(Store(shared / "images")) == []


def test_a_state_directory_others_could_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The directory itself is a step of the way: a 0777 ISOLATE_STATE_DIR let anyone swap its `sandboxes`.
    state = _shared(tmp_path, 0o777)
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(state))
    with pytest.raises(isolate.IsolationError, match=f"{state} is writable by others"):
        os.close(open_state_dir("sandboxes"))


def test_a_link_of_the_callers_in_a_directory_others_could_write_is_refused(tmp_path: Path) -> None:
    # Before, the path as given was asked only whether its links were root's or the caller's, and the way as
    # resolved whether its directories were: a link of the caller's in a 0777 directory, leading to a safe
    # directory, passed, though anyone could put their own link in its place.
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o755)
    shared = _shared(tmp_path, 0o777)
    (shared / "link").symlink_to(safe)
    with pytest.raises(isolate.IsolationError, match=f"{shared} is writable by others"):
        Image.list(Store(shared / "link" / "store"))
    assert Image.list(Store(safe / "store")) == []


def test_a_verdict_kept_is_asked_again_when_a_link_on_the_way_is_pointed_elsewhere(tmp_path: Path) -> None:
    # The verdict is kept with each step as it was: a link of the caller's re-pointed (a new inode, or the
    # same number used again) through a directory others could write walks the way again.
    safe = tmp_path / "safe"
    (safe / "store").mkdir(parents=True, mode=0o700)
    shared = _shared(tmp_path, 0o777)
    os.rename(safe / "store", shared / "store")
    (safe / "store").mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(safe)
    store = Store(link / "store")
    assert Image.list(store) == []
    assert way.unsafe_way(str(link / "store")) is None
    link.unlink()
    link.symlink_to(shared)
    with pytest.raises(isolate.IsolationError, match=f"{shared} is writable by others"):
        Image.list(store)


def test_a_group_writable_directory_is_refused_even_one_of_the_callers_own_group(tmp_path: Path) -> None:
    # A 0775 home of the caller's own group: the kernel lets every process holding the group write it, and who
    # holds it is not the caller's to know (way.py's docstring).
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, 0o775)
    assert home.stat().st_gid == os.getegid()
    assert way.unsafe_way(str(home / "state")) == f"{home} is writable by its group (mode 775, not sticky)"
    os.chmod(home, 0o755)
    os.mkdir(home / "state", 0o700)
    assert way.unsafe_way(str(home / "state")) is None


def test_a_link_of_another_users_on_the_way_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a link of another uid")
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    os.lchown(link, 65534, 65534)
    assert way.unsafe_way(str(link / "x")) == f"{link} is a symbolic link of uid 65534"


def test_the_directory_judged_is_the_one_the_path_names(tmp_path: Path) -> None:
    # check_way gives the (device, inode) the caller compares with the descriptor it opened.
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to("a/b")
    for path, named in (("a/b", "a/b"), ("a/b/..", "a"), ("link", "a/b"), ("link/..", "a")):
        info = os.stat(tmp_path / named)
        assert way.check_way("test", str(tmp_path / path), "none") == (info.st_dev, info.st_ino), path
        assert way.check_way("test", str(tmp_path / path), "none") == (info.st_dev, info.st_ino), path  # kept
