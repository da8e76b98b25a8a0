"""commit_image: a kept sandbox of an image becomes an image (its writes one more layer)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY

import isolate
from isolate.image import Image, Store
from isolate.image.push import export_layer

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")


def _disk_upper_why() -> str | None:
    from isolate.kernel.overlay import xattr_problem
    from isolate.kernel.places import state_dir

    os.makedirs(state_dir(), exist_ok=True)
    return xattr_problem(state_dir(), state_dir())


@pytest.fixture()
def image(tmp_path: Path) -> Iterator[Image]:
    with kit.store_env(str(tmp_path / "store")):
        extra = [{"name": "usr", "type": "dir"}, {"name": "usr/local", "type": "dir"},
                 {"name": "usr/local/bin", "type": "dir", "mode": 0o777},
                 {"name": "data", "type": "dir", "mode": 0o777},
                 {"name": "data/gone", "data": b"base's\n", "mode": 0o666},
                 {"name": "data/kept", "data": b"kept\n", "mode": 0o666}]
        kit.oci_layout(str(tmp_path / "base"), [kit.busybox_layer(extra)], ref="base:1",
                       Env=["PATH=/usr/local/bin:/bin"], Cmd=["sh"])
        yield Image.load(tmp_path / "base", store=Store(tmp_path / "store"))


def test_a_committed_sandbox_is_an_image_with_its_writes_and_deletions(image: Image) -> None:
    if _disk_upper_why():
        pytest.skip(f"image_upper='disk' is refused here: {_disk_upper_why()}")
    with isolate.Sandbox(isolate.Policy(image=image.reference, env={"ADDED": "yes"}), image_upper="disk") as box:
        made = box.exec(["sh", "-c", "printf '#!/bin/sh\\necho installed\\n' > /usr/local/bin/tool && "
                         "chmod 755 /usr/local/bin/tool && rm /data/gone && mkfifo /data/pipe && "
                         "ln -s /etc/shadow /data/shadow && echo scratch > /tmp/scratch"])
        assert made.returncode == 0, made.stderr
        committed = box.commit_image("committed:1")
        assert box.exec(["tool"]).stdout == "installed\n"  # the sandbox runs on after its commit
    assert committed.reference == "docker.io/library/committed:1"
    assert committed.layers[:-1] == image.layers and len(committed.layers) == 2
    assert "ADDED=yes" in committed.config.env and committed.config.cmd == ("sh",)
    top = committed.lower_dirs()[0]
    # Only the program's writes: no mount point of the sandbox (/proc, /dev, /workspace, /home ...), no /tmp.
    assert sorted(os.listdir(top)) == ["data", "usr"]
    assert os.readlink(os.path.join(top, "data", "shadow")) == "/etc/shadow"  # a link, never followed
    assert stat.S_ISFIFO(os.lstat(os.path.join(top, "data", "pipe")).st_mode)
    gone = os.lstat(os.path.join(top, "data", "gone"))
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0  # the whiteout of the base's file
    with isolate.Sandbox(isolate.Policy(image=committed.reference)) as box:
        ran = box.exec(["sh", "-c", "tool; ls /data; echo $ADDED"])
    assert ran.stdout == "installed\nkept\npipe\nshadow\nyes\n", ran.stderr
    # The layer written again for a push is the very blob committed: the image keeps its digests there.
    blob = export_layer(committed, committed.layers[-1])
    os.unlink(blob.path)
    assert blob.digest == committed.layers[-1]


def test_commit_image_needs_a_sandbox_of_an_image_whose_upper_layer_is_on_disk(image: Image) -> None:
    with isolate.Sandbox(isolate.Policy()) as box, pytest.raises(isolate.UnsupportedError, match="not started from"):
        box.commit_image("nothing:1")
    with isolate.Sandbox(isolate.Policy(image=image.reference), image_upper="tmpfs") as box:
        assert "a private tmpfs" in box.enforced["image"]["root"]
        with pytest.raises(isolate.UnsupportedError, match="image_upper='disk'"):
            box.commit_image("nothing:1")


def test_a_huge_sparse_file_is_refused_before_the_host_reads_it(image: Image) -> None:
    # A few blocks of the sandbox's disk may claim a terabyte: the host would read and compress every byte of it,
    # then unpack it into the store as zeros. Counted at its size against max_image_size, before it is opened.
    if _disk_upper_why():
        pytest.skip(f"image_upper='disk' is refused here: {_disk_upper_why()}")
    with isolate.Sandbox(isolate.Policy(image=image.reference), image_upper="disk") as box:
        made = box.exec(["sh", "-c", "truncate -s 1099511627776 /data/huge && echo small > /data/small"])
        assert made.returncode == 0, made.stderr
        with pytest.raises(isolate.IsolationError, match=r"more than it may carry \(at /data/huge"):
            box.commit_image("huge:1")
        assert box.exec(["cat", "/data/small"]).stdout == "small\n"  # resumed after the refusal
    assert not os.listdir(os.path.join(image.store.path, "tmp"))  # nothing of the read left behind


def test_what_a_mode_keeps_from_its_owner_is_committed_and_pushed_and_the_mode_kept(image: Image,
                                                                                   tmp_path: Path) -> None:
    # A regular user's store keeps an image's mode-000 file as the image has it (Fedora's /etc/shadow), and a program
    # may chmod 000 what it wrote: both are read through a moment's owner bits, their modes put back (a regular
    # user's commit and push raised PermissionError; root reads them anyway).
    import tarfile

    if _disk_upper_why():
        pytest.skip(f"image_upper='disk' is refused here: {_disk_upper_why()}")
    with isolate.Sandbox(isolate.Policy(image=image.reference), image_upper="disk") as box:
        made = box.exec(["sh", "-c", "mkdir /data/d && echo x > /data/d/f && chmod 000 /data/d && echo y > /data/f0 && "
                         "chmod 000 /data/f0"])
        assert made.returncode == 0, made.stderr
        committed = box.commit_image("locked:1")
        assert box.exec(["stat", "-c", "%a", "/data/d", "/data/f0"]).stdout == "0\n0\n"  # as the program left them
    kit.oci_layout(str(tmp_path / "shadow"), [kit.busybox_layer([{"name": "etc/shadow", "data": b"root:*:1::::::\n",
                                                                   "mode": 0}])], ref="shadow:1")
    shadowed = Image.load(tmp_path / "shadow", store=image.store)
    for source, wanted in ((committed, {"data/f0": (0, b"y\n"), "data/d/f": (0o644, b"x\n")}),
                           (shadowed, {"etc/shadow": (0, b"root:*:1::::::\n")})):
        blob = export_layer(source, source.layers[-1])
        try:
            with tarfile.open(blob.path) as tar:
                found = {m.name: (m.mode, tar.extractfile(m).read()) for m in tar if m.name in wanted}  # type: ignore[union-attr]
        finally:
            os.unlink(blob.path)
        assert found == wanted
    store_file = os.path.join(shadowed.lower_dirs()[0], "etc", "shadow")
    assert stat.S_IMODE(os.lstat(store_file).st_mode) == 0  # put back
