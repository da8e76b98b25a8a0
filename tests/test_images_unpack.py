"""A layer's unpacking, its inodes made by several threads: the same tree as tarfile's own extraction, in order."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest

import isolate
from isolate.image import Store
from isolate.image import unpack as unpacking


def _tree(root: str, named: set[str]) -> dict[str, Any]:
    """What a directory holds, as the comparison sees it (hard links: the other names of an inode; the time of a
    directory the layer does not name, made as a parent, left out)."""
    out: dict[str, Any] = {}
    inodes: dict[int, list[str]] = {}
    for path, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(path, name)
            rel = os.path.relpath(full, root)
            info = os.lstat(full)
            if stat.S_ISLNK(info.st_mode):
                out[rel] = ("link", os.readlink(full))
            elif stat.S_ISDIR(info.st_mode):
                out[rel] = ("dir", stat.S_IMODE(info.st_mode), info.st_mtime if rel in named else None)
            else:
                with open(full, "rb") as handle:
                    out[rel] = ("file", stat.S_IMODE(info.st_mode), info.st_mtime, handle.read())
                inodes.setdefault(info.st_ino, []).append(rel)
    for names in inodes.values():
        for rel in names:
            out[rel] += (sorted(names),)
    return out


def _entries() -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = [{"name": "usr", "type": "dir"}]
    for d in range(12):  # directories that hash to different threads, some never named (made as parents)
        if d % 3:
            entries.append({"name": f"usr/d{d}", "type": "dir", "mode": 0o750 if d % 2 else 0o755})
        for f in range(25):
            entries.append({"name": f"usr/d{d}/f{f}", "data": f"{d}/{f}\n".encode() * (f + 1),
                            "mode": 0o644 if f % 2 else 0o755})
        entries.append({"name": f"usr/d{d}/up", "type": "link", "target": f"../d{(d + 1) % 12}/f0"})
        # Hard links into another directory (another thread) than their target's.
        entries.append({"name": f"usr/d{d}/same", "type": "hard", "target": f"usr/d{max(d - 5, 0)}/f3"})
    entries.append({"name": "usr/big", "data": os.urandom(3 << 19)})  # past the small files: written by the reader
    entries.append({"name": "usr/deep/a/b/c", "data": b"deep"})
    # A name replaced: every task done first, and what follows unpacked serially.
    entries.append({"name": "usr/d2/f1", "data": b"again"})
    entries.append({"name": "usr/d4/f0", "type": "link", "target": "f1"})
    for f in range(10):
        entries.append({"name": f"usr/after/f{f}", "data": b"after"})
    entries.append({"name": "usr/after/same", "type": "hard", "target": "usr/d2/f1"})
    return entries


def test_a_layer_unpacks_as_tarfile_extracts_it(tmp_path: Path) -> None:
    entries = _entries()
    layer = kit.layer(entries)
    store = Store(tmp_path / "store")
    raw = kit.gz(layer)
    (tmp_path / "blob").write_bytes(raw)
    store.ensure_layer(kit.digest(raw), lambda: open(tmp_path / "blob", "rb"), diff_id=kit.digest(layer),
                       what="layer")
    reference = tmp_path / "reference"
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        # The "tar" filter where this Python has extraction filters (3.11.4); the layer is the test's own.
        options: dict[str, Any] = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
        tar.extractall(reference, **options)
    named = {e["name"] for e in entries}
    assert _tree(store.layer_root(kit.digest(raw)), named) == _tree(str(reference), named)


def test_a_directory_a_later_entry_replaced_is_left_as_it_is_and_one_listed_twice_takes_the_last(
        tmp_path: Path) -> None:
    # Its mode was given at the end through its name: the link that replaced it refused the layer ("written
    # through"), the whiteout that replaced it too. A directory listed twice took its first entry's mode (Docker
    # gives the last; tarfile the last since Python 3.11.4, the first before).
    raw = kit.gz(kit.layer([{"name": "a", "type": "dir"}, {"name": "a/f", "data": b"x"},
                            {"name": "a", "type": "link", "target": "b"}, {"name": "w", "type": "dir"},
                            {"name": ".wh.w"}, {"name": "b", "type": "dir", "mode": 0o711},
                            {"name": "c", "type": "dir", "mode": 0o750}, {"name": "c/f", "data": b"x"},
                            {"name": "c", "type": "dir", "mode": 0o705}]))
    (tmp_path / "blob").write_bytes(raw)
    store = Store(tmp_path / "store")
    store.ensure_layer(kit.digest(raw), lambda: open(tmp_path / "blob", "rb"), diff_id=None, what="layer")
    root = store.layer_root(kit.digest(raw))
    assert os.readlink(os.path.join(root, "a")) == "b"
    assert stat.S_ISCHR(os.lstat(os.path.join(root, "w")).st_mode)
    assert stat.S_IMODE(os.lstat(os.path.join(root, "b")).st_mode) == 0o711
    assert stat.S_IMODE(os.lstat(os.path.join(root, "c")).st_mode) == 0o705


def test_an_error_of_a_thread_making_files_is_raised_and_nothing_kept(tmp_path: Path) -> None:
    entries = [{"name": f"d{d}/f{f}", "data": b"x"} for d in range(8) for f in range(20)]
    entries.insert(50, {"name": "d3/" + "n" * 300, "data": b"x"})  # past NAME_MAX: the kernel refuses it
    raw = kit.gz(kit.layer(entries))
    (tmp_path / "blob").write_bytes(raw)
    store = Store(tmp_path / "store")
    with pytest.raises(isolate.IsolationError, match="File name too long"):
        store.ensure_layer(kit.digest(raw), lambda: open(tmp_path / "blob", "rb"), diff_id=None, what="layer")
    assert os.listdir(os.path.join(store.path, "layers")) == []
    assert os.listdir(os.path.join(store.path, "tmp")) == []


def test_the_threads_end_with_the_unpack(tmp_path: Path) -> None:
    import threading

    before = threading.active_count()
    raw = kit.gz(kit.layer([{"name": f"d{d}/f", "data": b"x"} for d in range(20)]
                           + [{"name": "l", "type": "link", "target": "/etc"}, {"name": "l/x", "data": b"x"}]))
    (tmp_path / "blob").write_bytes(raw)
    with pytest.raises(unpacking.BadImageError, match="written through 'l'"):
        Store(tmp_path / "store").ensure_layer(kit.digest(raw), lambda: open(tmp_path / "blob", "rb"),
                                               diff_id=None, what="layer")
    assert threading.active_count() == before


@pytest.fixture(params=["zlib", "isal"])
def gzip_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each gzip reader the unpack may use (ISA-L's where the module isal is installed, else zlib's)."""
    if request.param == "zlib":
        import gzip
        import zlib

        monkeypatch.setattr(unpacking, "_GZIP", gzip.GzipFile)
        monkeypatch.setattr(unpacking, "_DAMAGED", (zlib.error,))
    else:
        pytest.importorskip("isal")
        monkeypatch.setattr(unpacking, "_GZIP", unpacking._gzip_reader()[0])
        monkeypatch.setattr(unpacking, "_DAMAGED", unpacking._gzip_reader()[1])
    return str(request.param)


def test_each_gzip_reader_unpacks_the_same_and_refuses_a_damaged_stream_in_one_line(tmp_path: Path,
                                                                                  gzip_reader: str) -> None:
    layer = kit.layer([{"name": f"d{d}/f{f}", "data": os.urandom(f * 100)} for d in range(5) for f in range(10)])
    raw = kit.gz(layer)
    (tmp_path / "good").write_bytes(raw)
    store = Store(tmp_path / "store")
    store.ensure_layer(kit.digest(raw), lambda: open(tmp_path / "good", "rb"), diff_id=kit.digest(layer),
                       what="layer")
    # The first deflate block of a reserved type: ISA-L's error is no zlib.error (which tarfile words itself).
    damaged = raw[:10] + b"\xff" + raw[11:]
    (tmp_path / "bad").write_bytes(damaged)
    with pytest.raises(unpacking.BadImageError, match=r"compressed stream is damaged|not a valid layer archive"):
        store.ensure_layer(kit.digest(damaged), lambda: open(tmp_path / "bad", "rb"), diff_id=None, what="layer")
    assert os.listdir(os.path.join(store.path, "tmp")) == []


def test_a_directory_made_for_an_opaque_marker_is_replaced_by_a_later_entry_of_its_name(tmp_path: Path) -> None:
    # Made by the marker alone (no entry named it), it was not known to the threads' record: the file of its
    # name that followed failed to be made (File exists).
    raw = kit.gz(kit.layer([{"name": "o/.wh..wh..opq"}, {"name": "o", "data": b"file"}]))
    (tmp_path / "blob").write_bytes(raw)
    store = Store(tmp_path / "store")
    store.ensure_layer(kit.digest(raw), lambda: open(tmp_path / "blob", "rb"), diff_id=None, what="layer")
    with open(os.path.join(store.layer_root(kit.digest(raw)), "o"), "rb") as handle:
        assert handle.read() == b"file"


def test_the_tasks_waiting_for_the_threads_are_bounded_not_only_their_bytes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Each task holds a descriptor (two for a hard link) until its thread runs it, and a symbolic link or an
    # empty file has no bytes: a layer of many of them in one directory (one thread) piled up tasks while the
    # archive was read faster than the inodes were made, until the unpack failed (Too many open files: 50,000
    # links at the usual limit of 1024, 200,000 at 20,000). Here the thread is slowed, the limit the usual one.
    import resource
    import time

    made = unpacking._Unpacker.symlink

    def slow(self: Any, dir_fd: int, name: str, member: tarfile.TarInfo) -> None:
        time.sleep(0.0005)
        made(self, dir_fd, name, member)

    monkeypatch.setattr(unpacking._Unpacker, "symlink", slow)
    raw = kit.gz(kit.layer([{"name": f"d/l{i}", "type": "link", "target": "x"} for i in range(1500)]))
    (tmp_path / "blob").write_bytes(raw)
    store = Store(tmp_path / "store")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, soft), hard))
    try:
        store.ensure_layer(kit.digest(raw), lambda: open(tmp_path / "blob", "rb"), diff_id=None, what="layer")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(os.listdir(os.path.join(store.layer_root(kit.digest(raw)), "d"))) == 1500


def test_a_name_too_deep_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    # One entry 2,000 directories deep: the walk held a descriptor per directory (Too many open files at the
    # usual limit), and throwing the layer away recursed once per directory: RecursionError (a traceback), the
    # partial tree left in the store's tmp. Where the descriptors sufficed, the layer was kept, and its removal
    # (prune) failed the same way.
    raw = kit.gz(kit.layer([{"name": "a/" * 2000 + "f", "data": b"x"}]))
    (tmp_path / "blob").write_bytes(raw)
    store = Store(tmp_path / "store")
    with pytest.raises(unpacking.BadImageError, match=r"^layer: entry 'a/a/.* is \d+ names deep"):
        store.ensure_layer(kit.digest(raw), lambda: open(tmp_path / "blob", "rb"), diff_id=None, what="layer")
    assert os.listdir(os.path.join(store.path, "tmp")) == []


def test_a_layers_owners_other_than_root_are_counted_by_id_and_bounded(tmp_path: Path) -> None:
    # An archive may give each entry another owner: the index names OWNERS of them, and counts the rest together.
    many = unpacking.OWNERS + 4
    layer = kit.layer([{"name": "root-owned"}, {"name": "group-only", "pax": {"gid": "7"}},
                       *({"name": f"f{n}", "pax": {"uid": str(1000 + n), "gid": "1000"}} for n in range(many))])
    store = Store(tmp_path / "store")
    (tmp_path / "blob").write_bytes(layer)
    index = store.ensure_layer(kit.digest(layer), lambda: open(tmp_path / "blob", "rb"), diff_id=None, what="layer")
    assert index.owners is not None and len(index.owners) == unpacking.OWNERS + 1
    assert index.owners["0:7"] == 1 and index.owners["other"] == many + 1 - unpacking.OWNERS
    assert store.layer_owners(kit.digest(layer)) == index.owners
    assert store.layer_index(kit.digest(layer)).owners == index.owners


def test_a_layer_whose_names_together_pass_their_bound_is_refused(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Each name is held in memory while the layer unpacks (its index): deep names compress well, and a 100 MB blob
    # held 16 GB of them. The bound lowered here so that a small layer passes it.
    monkeypatch.setattr(unpacking, "MAX_NAME_BYTES", 64 << 10, raising=False)
    deep = "/".join(["d" * 200] * 4)
    raw = kit.layer([{"name": f"{deep}/{i:04d}" + "x" * 200, "data": b""} for i in range(100)])
    kit.oci_layout(str(tmp_path / "oci"), [raw])
    with pytest.raises(unpacking.BadImageError, match="names past 65536 characters"):
        isolate.image.Image.load(tmp_path / "oci", store=Store(tmp_path / "store"))
    assert not os.listdir(tmp_path / "store" / "layers")
