"""Snapshots, forks and restores of a sandbox of an image hold its root's changes (one layer over the image);
``Snapshot.to_image`` makes an image of them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY

import isolate
from isolate.image import Image, Store
from isolate.kept import bundles

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")

INSTALL = ("printf '#!/bin/sh\\necho installed\\n' > /usr/local/bin/tool && chmod 755 /usr/local/bin/tool && "
           "rm /data/gone && echo mine > /workspace/mine")


def _disk_upper_why() -> str | None:
    from isolate.kernel.overlay import xattr_problem
    from isolate.kernel.places import state_dir

    os.makedirs(state_dir(), exist_ok=True)
    return xattr_problem(state_dir(), state_dir())


@pytest.fixture()
def images(tmp_path: Path) -> Iterator[tuple[Image, Image]]:
    if _disk_upper_why():
        pytest.skip(f"image_upper='disk' is refused here: {_disk_upper_why()}")
    saved = os.environ.get("ISOLATE_IMAGE_STORE")
    os.environ["ISOLATE_IMAGE_STORE"] = str(tmp_path / "store")
    extra = [{"name": "usr", "type": "dir"}, {"name": "usr/local", "type": "dir"},
             {"name": "usr/local/bin", "type": "dir", "mode": 0o777},
             {"name": "data", "type": "dir", "mode": 0o777},
             {"name": "data/gone", "data": b"base's\n", "mode": 0o666},
             {"name": "data/piped", "data": b"base's\n", "mode": 0o666}]
    kit.oci_layout(str(tmp_path / "base"), [kit.busybox_layer(extra)], ref="snapbase:1",
                   Env=["PATH=/usr/local/bin:/bin"])
    kit.oci_layout(str(tmp_path / "other"), [kit.busybox_layer(extra), kit.layer([{"name": "other", "data": b"x"}])],
                   ref="snapother:1", Env=["PATH=/usr/local/bin:/bin"])
    store = Store(tmp_path / "store")
    try:
        yield Image.load(tmp_path / "base", store=store), Image.load(tmp_path / "other", store=store)
    finally:
        if saved is None:
            os.environ.pop("ISOLATE_IMAGE_STORE", None)
        else:
            os.environ["ISOLATE_IMAGE_STORE"] = saved


def _state(box: isolate.Sandbox) -> str:
    """What the root and workspace hold: the tool's output, whether /data/gone is there, the workspace file."""
    result = box.exec(["sh", "-c", "tool; test -e /data/gone && echo gone-is-back; cat /workspace/mine; "
                                   "cat /data/later 2>/dev/null; true"])
    return result.stdout


def test_snapshot_restore_and_fork_keep_the_image_roots_changes(images: tuple[Image, Image], tmp_path: Path) -> None:
    base, _ = images
    policy = isolate.Policy(image=base.reference)
    source = tmp_path / "source"
    source.mkdir()
    source.chmod(0o755)
    workspace = isolate.Workspace(str(source), mode="overlay")
    with isolate.Sandbox(policy, workspace=workspace, image_upper="disk") as box:
        assert box.exec(["sh", "-c", INSTALL]).returncode == 0
        snap = box.snapshot()
        try:
            assert snap.image == base.id
            # Changed after the snapshot: undone by the restore.
            assert box.exec(["sh", "-c", "rm /usr/local/bin/tool; echo later > /data/later"]).returncode == 0
            box.restore(snap)
            assert _state(box) == "installed\nmine\n"
            # Again, from the snapshot it now started from (its root layer moved over, not cloned again).
            assert box.exec(["sh", "-c", "echo again > /data/later; echo 1 > /usr/local/bin/tool"]).returncode == 0
            box.restore(snap)
            assert _state(box) == "installed\nmine\n"
            a, b = box.fork(2)
            with a, b:
                assert _state(a) == _state(b) == "installed\nmine\n"
                # Each fork's root is its own.
                assert a.exec(["sh", "-c", "echo a > /data/later"]).returncode == 0
                assert _state(b) == "installed\nmine\n"
                assert _state(a) == "installed\nmine\na\n"
                # A fork of a fork: its root's layer is the one it started from with its changes over it.
                (c,) = a.fork(1)
                with c:
                    assert _state(c) == "installed\nmine\na\n"
                merged = isolate.merge([a, b])
                assert merged.sandbox is not None and merged.merged == ["/data/later"] and not merged.conflicts
                with merged.sandbox:
                    # The roots are merged too: the fork point's changes, and a's since.
                    assert _state(merged.sandbox) == "installed\nmine\na\n"
            assert _state(box) == "installed\nmine\n"
        finally:
            snap.remove()


def test_to_image_makes_an_image_of_the_root_and_another_image_is_refused(images: tuple[Image, Image],
                                                                         tmp_path: Path) -> None:
    base, other = images
    name = f"imgsnap-{os.getpid()}"
    with isolate.Sandbox(isolate.Policy(image=base.reference, env={"ADDED": "yes"}), image_upper="disk", name=name):
        # Attached (as another process would): its upper layer on disk is still known.
        box = isolate.Sandbox.attach(name)
        assert box.exec(["sh", "-c", INSTALL]).returncode == 0
        snap = box.snapshot()
        assert box.exec(["rm", "/usr/local/bin/tool"]).returncode == 0
        box.restore(snap)
        try:
            assert _state(box) == "installed\nmine\n"
        finally:
            box.close()  # the sandbox the restore started is this handle's: the creator's close ends its own
    try:
        made = snap.to_image("snapmade:1")
        assert made.layers[:-1] == base.layers and len(made.layers) == len(base.layers) + 1
        assert "ADDED=yes" in made.config.env
        with isolate.Sandbox(isolate.Policy(image=made.reference)) as again:
            # The root's changes are the image's; the workspace is the sandbox's own, not in it.
            assert again.exec(["sh", "-c", "tool; test -e /data/gone || echo deleted; ls -A /workspace"]
                              ).stdout == "installed\ndeleted\n"
        # Shipped as a bundle (as to another node of a Ray cluster: another state directory, the same image in
        # its store), with its root layer: a sandbox started from it there has the root's changes.
        data, digest = bundles.export(snap)
        there = tmp_path / "elsewhere"
        saved = os.environ["ISOLATE_STATE_DIR"] if "ISOLATE_STATE_DIR" in os.environ else None
        os.environ["ISOLATE_STATE_DIR"] = str(there)
        try:
            shipped = bundles.load(data, digest)
            assert shipped.image == base.id and shipped.image_ref == snap.image_ref
            with isolate.Sandbox(isolate.Policy(image=base.reference), snapshot=shipped) as arrived:
                assert _state(arrived) == "installed\nmine\n"  # its root, and its workspace
            assert shipped.to_image("snapshipped:1").layers[:-1] == base.layers
            shipped.remove()
            # A bundle whose description names no image but carries a root layer (or the reverse): refused.
            forged = bundles._image_meta({"id": base.id, "reference": None, "config": {}, "leave_out": [],
                                          "root": [0o755, 0, 0]})
            assert forged is not None and forged["root"] == (0o755, 0, 0)
            for bad in ({"id": "sha256:../x", "reference": None, "config": {}, "leave_out": [], "root": [493, 0, 0]},
                        {"id": base.id, "reference": None, "config": [], "leave_out": [], "root": [493, 0, 0]},
                        {"id": base.id, "reference": None, "config": {}, "leave_out": ["../up"],
                         "root": [493, 0, 0]},
                        {"id": base.id, "reference": None, "config": {}, "leave_out": [], "root": [493, -1, 0]}):
                with pytest.raises(ValueError):
                    bundles._image_meta(bad)
        finally:
            if saved is None:
                os.environ.pop("ISOLATE_STATE_DIR", None)
            else:
                os.environ["ISOLATE_STATE_DIR"] = saved
        # Its root layer lies over that image only.
        with pytest.raises(isolate.PolicyError, match="snapbase"):
            isolate.Sandbox(isolate.Policy(image=other.reference), snapshot=snap)
        with pytest.raises(isolate.PolicyError, match="runs that image"):
            isolate.Sandbox(isolate.Policy(), snapshot=snap)
        with isolate.Sandbox(isolate.Policy(image=other.reference), image_upper="disk") as elsewhere:
            with pytest.raises(isolate.PolicyError, match="refused"):
                elsewhere.restore(snap)
            assert elsewhere.exec(["cat", "/other"]).stdout == "x"  # it runs on, untouched
        # The same image under a new sandbox (its default tmpfs upper): started from the snapshot, on disk.
        with isolate.Sandbox(isolate.Policy(image=base.reference), snapshot=snap) as started:
            assert _state(started) == "installed\nmine\n"
    finally:
        snap.remove()




@pytest.fixture()
def box(images: tuple[Image, Image], tmp_path: Path) -> Iterator[isolate.Sandbox]:
    """A kept sandbox of the first image (its root's upper layer on disk), with a file written in its root."""
    source = tmp_path / "source"
    source.mkdir()
    source.chmod(0o755)
    workspace = isolate.Workspace(str(source), mode="overlay")
    with isolate.Sandbox(isolate.Policy(image=images[0].reference), workspace=workspace,
                         image_upper="disk") as made:
        assert made.exec(["sh", "-c", "echo start > /data/shared"]).returncode == 0
        yield made


def test_merge_merges_the_image_roots_changes(images: tuple[Image, Image], box: isolate.Sandbox,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = box.fork(2)
    with a, b:
        # a: a new file in /usr/local/bin (0777 in the image, and in the merged root: the directories on its
        # way are made as the image shows them), an image file deleted, a link and a FIFO of the program's (the
        # link stays a link, never followed; the FIFO is never opened); b: a new directory and an edit of the
        # fork point's file.
        assert a.exec(["sh", "-c", "echo a > /usr/local/bin/a-only && rm /data/gone && busybox ln -s "
                                   "/etc/shadow /data/alink && busybox mkfifo /data/afifo && rm /data/piped && "
                                   "busybox mkfifo /data/piped"]).returncode == 0
        assert b.exec(["sh", "-c", "mkdir /data/b && echo b > /data/b/file && echo more >> /data/shared && "
                                   "busybox ln /data/b/file /data/b/same"]).returncode == 0
        merged = isolate.merge([a, b])
        assert not merged.conflicts
        assert {"/usr/local/bin/a-only", "/data/gone", "/data/alink", "/data/b/file", "/data/shared"
                } <= set(merged.merged)
        assert merged.snapshot is not None and merged.snapshot.image == images[0].id
        assert merged.sandbox is not None
        # The FIFOs are not kept: /data/piped is gone (the image's file it replaced does not show again).
        expected = "a\nb\nstart\nmore\ndeleted\n/etc/shadow\n777\nnone\n"
        script = ("cat /usr/local/bin/a-only /data/b/file /data/shared; test -e /data/gone || echo deleted; "
                  "busybox readlink /data/alink; stat -c %a /usr/local/bin; "
                  "test -e /data/piped || test -e /data/afifo || echo none")
        with merged.sandbox as together:
            assert together.exec(["sh", "-c", script]).stdout == expected
        # A file of two names is written once: its names are one file in the merged root layer too.
        root = merged.snapshot.open_root()
        try:
            names = [os.stat(f"data/b/{name}", dir_fd=root, follow_symlinks=False) for name in ("file", "same")]
            assert names[0].st_ino == names[1].st_ino
        finally:
            os.close(root)
        merged.snapshot.remove()
        kept = [a.snapshot(), b.snapshot()]
    try:
        # Snapshots of the forks, merged once the fork point is gone: the root layer each fork started from,
        # kept in its snapshot, is their common start (else the fork point's /data/shared would conflict).
        again = isolate.merge(kept)
        assert not again.conflicts and again.sandbox is not None and again.snapshot is not None
        with again.sandbox as together:
            assert together.exec(["sh", "-c", script]).stdout == expected
        again.snapshot.remove()
        # Shipped as bundles (as to a Ray node: another state directory), with that start: merged there alike.
        bundled = [bundles.export(snap) for snap in kept]
        monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "elsewhere"))
        shipped = [bundles.load(data, digest) for data, digest in bundled]
        there = isolate.merge(shipped, start=False)
        assert not there.conflicts and there.snapshot is not None and "/data/shared" in there.merged
        for snap in [*shipped, there.snapshot]:
            snap.remove()
        monkeypatch.undo()
    finally:
        for snap in kept:
            snap.remove()


def _ours(images: tuple[Image, Image]) -> set[str]:
    """The snapshots of sandboxes of these images (other tests' may come and go meanwhile, and temporary ones)."""
    return {s.name for s in isolate.Snapshot.list()
            if s.image in (images[0].id, images[1].id) and not s.name.startswith("tmp-")}


def test_merge_of_one_root_file_changed_by_both_marks_or_refuses(images: tuple[Image, Image],
                                                                box: isolate.Sandbox) -> None:
    c, d = box.fork(2)
    with c, d:
        assert c.exec(["sh", "-c", "echo c > /data/gone"]).returncode == 0
        assert d.exec(["sh", "-c", "echo d > /data/gone"]).returncode == 0
        before = _ours(images)
        with pytest.raises(isolate.MergeConflictError, match="/data/gone") as refused:
            isolate.merge([c, d], on_conflict="refuse")
        assert [x.path for x in refused.value.result.conflicts] == ["/data/gone"]
        assert _ours(images) == before
        marked = isolate.merge([c, d], start=False)
        assert marked.snapshot is not None and [(x.path, x.kind) for x in marked.conflicts] == [("/data/gone", "text")]
        try:
            with isolate.Sandbox(isolate.Policy(image=images[0].reference), snapshot=marked.snapshot) as started:
                assert started.exec(["cat", "/data/gone"]).stdout.splitlines()[1:4] == ["c", "=======", "d"]
        finally:
            marked.snapshot.remove()


def test_merge_of_branches_of_different_images_is_refused(images: tuple[Image, Image], box: isolate.Sandbox) -> None:
    before = _ours(images)
    with isolate.Sandbox(isolate.Policy(image=images[1].reference), workspace=box.workspace,
                         image_upper="disk") as elsewhere:
        with pytest.raises(isolate.UnsupportedError, match=r"snapbase.*snapother"):
            isolate.merge([box, elsewhere])
    assert _ours(images) == before


def test_merge_of_tree_snapshots_finds_the_roots_start(images: tuple[Image, Image]) -> None:
    # A copy workspace with no source: its snapshots are whole trees, which keep no workspace base; their
    # roots' start is kept all the same (else the fork point's /data/shared would conflict).
    with isolate.Sandbox(isolate.Policy(image=images[0].reference), workspace=isolate.Workspace(mode="copy"),
                         image_upper="disk") as made:
        assert made.exec(["sh", "-c", "echo start > /data/shared"]).returncode == 0
        a, b = made.fork(2)
        with a, b:
            assert a.exec(["sh", "-c", "echo a > /data/a"]).returncode == 0
            assert b.exec(["sh", "-c", "echo more >> /data/shared"]).returncode == 0
            kept = [a.snapshot(), b.snapshot()]
    try:
        assert [s.kind for s in kept] == ["tree", "tree"]
        result = isolate.merge(kept, start=False)
        assert result.snapshot is not None
        result.snapshot.remove()
        assert not result.conflicts and sorted(result.merged) == ["/data/a", "/data/shared"]
    finally:
        for snap in kept:
            snap.remove()


def test_a_restore_started_ahead_brings_back_the_image_roots_changes(images: tuple[Image, Image],
                                                                     tmp_path: Path) -> None:
    """The spare of restore(ahead=True) starts from the snapshot's root layer as a restore does: swapped in, its
    root is the snapshot's, on disk, and a snapshot of it holds the root again."""
    base, _ = images
    source = tmp_path / "source"
    source.mkdir()
    source.chmod(0o755)
    with isolate.Sandbox(isolate.Policy(image=base.reference), workspace=isolate.Workspace(str(source), mode="overlay"),
                         image_upper="disk") as box:
        assert box.exec(["sh", "-c", INSTALL]).returncode == 0
        snap = box.snapshot()
        try:
            for _ in range(2):
                assert box.exec(["sh", "-c", "rm /usr/local/bin/tool; echo later > /data/later"]).returncode == 0
                box.restore(snap, ahead=True)  # the second swaps the spare in
                assert _state(box) == "installed\nmine\n" and box.image_upper == "disk" and box.origin is snap
            again = box.snapshot()
            try:
                assert box.exec(["sh", "-c", "rm /usr/local/bin/tool"]).returncode == 0
                box.restore(again)
                assert _state(box) == "installed\nmine\n"
            finally:
                again.remove()
        finally:
            snap.remove()
