"""The private upper layer of an image's root: what a program does to the image's directories holds, on every
kernel isolate runs on (before Linux 6.6 a tmpfs keeps no user.* attributes, which overlayfs needs for an
opaque directory and a directory renamed)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY

import isolate
from isolate.image import Image, Store
from isolate.kernel import overlay

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")

SCRIPT = """
set -e
rm -r /data/tree
mkdir /data/tree
echo "after mkdir: $(ls -A /data/tree)"
echo new > /data/tree/new
echo "tree: $(ls -A /data/tree)"
mv /data/kept /data/moved
echo "moved: $(ls -A /data/moved)"
test ! -e /data/kept && echo "kept gone"
"""


@pytest.fixture()
def image(tmp_path: Path) -> Iterator[Image]:
    with kit.store_env(str(tmp_path / "store")):
        entries = [{"name": "data", "type": "dir", "mode": 0o777},
                   {"name": "data/tree", "type": "dir", "mode": 0o777},
                   {"name": "data/tree/old", "data": b"old\n", "mode": 0o666},
                   {"name": "data/tree/sub", "type": "dir", "mode": 0o777},
                   {"name": "data/tree/sub/deep", "data": b"deep\n", "mode": 0o666},
                   {"name": "data/kept", "type": "dir", "mode": 0o777},
                   {"name": "data/kept/inside", "data": b"in\n", "mode": 0o666}]
        kit.oci_layout(str(tmp_path / "upper"), [kit.busybox_layer(), kit.layer(entries)], ref="upper:1",
                       Env=["PATH=/bin"])
        yield Image.load(tmp_path / "upper", store=Store(tmp_path / "store"))


def test_a_directory_of_the_image_removed_and_made_again_is_empty(image: Image) -> None:
    policy = isolate.Policy(image=image.reference, backend="native")
    result = isolate.run(["sh", "-c", SCRIPT], policy=policy, capture_output=True, text=True, timeout=60)
    root = result.report.enforced["image"]["root"]
    if overlay._kernel() < (6, 6):
        # The tmpfs keeps no user.* attributes: the run's upper layer is on disk, in the state directory...
        if "on disk" not in root:
            # ... unless the state directory keeps none either: overlayfs then refuses (EIO) rather than show a
            # wrong tree, and the report says so.
            assert result.returncode != 0 and "Input/output error" in result.stderr, result.stdout + result.stderr
            assert "removing or renaming a non-empty directory" in root
            return
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["after mkdir: ", "tree: new", "moved: inside", "kept gone"], (
        result.stdout + result.stderr)


def test_before_linux_6_6_a_one_shot_runs_upper_layer_is_on_disk_and_removed_after(
        image: Image, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Taken as the kernel before 6.6 would be (only the version the choice reads; the overlay is the kernel's):
    # the upper layer is made in the state directory and is gone when the run has ended, and a run directory
    # whose caller has ended is removed by the next run.
    from isolate.backends.native import runupper
    from isolate.kernel.places import state_dir

    monkeypatch.setattr(overlay, "_kernel", lambda: (6, 1))
    runs = os.path.join(state_dir(), runupper.RUNS)
    os.makedirs(os.path.join(runs, "999999999-1-0123456789ab", "image", "upper", "left"), exist_ok=True)
    policy = isolate.Policy(image=image.reference, backend="native")
    if overlay.xattr_problem(runs, runs):
        pytest.skip(str(overlay.xattr_problem(runs, runs)))
    result = isolate.run(["sh", "-c", SCRIPT], policy=policy, capture_output=True, text=True, timeout=60)
    assert "on disk" in result.report.enforced["image"]["root"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["after mkdir: ", "tree: new", "moved: inside", "kept gone"]
    assert os.listdir(runs) == []


def test_a_run_directory_of_a_caller_in_another_pid_namespace_is_not_swept(
        image: Image, monkeypatch: pytest.MonkeyPatch) -> None:
    # A caller in another PID namespace sharing the state directory (a container) names its run directory by a
    # PID that means another process here, or none: before, the next run's sweep took it for ended and removed
    # the upper layer from under its running sandbox. Its lock (held while the run lasts) says it runs.
    import subprocess
    import sys

    from isolate.backends.native import runupper
    from isolate.kernel.places import state_dir

    monkeypatch.setattr(overlay, "_kernel", lambda: (6, 1))
    runs = os.path.join(state_dir(), runupper.RUNS)
    held = os.path.join(runs, "1-1-0123456789ab")  # PID 1 of this namespace is another process (start time)
    os.makedirs(os.path.join(held, "image", "upper"), exist_ok=True)
    if overlay.xattr_problem(runs, runs):
        pytest.skip(str(overlay.xattr_problem(runs, runs)))
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys\n"
                               "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.read()",
                               held], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        result = isolate.run(["true"], policy=isolate.Policy(image=image.reference, backend="native"),
                             timeout=60)
        assert result.returncode == 0
        assert os.path.isdir(os.path.join(held, "image", "upper")), "a held run directory was swept"
    finally:
        holder.communicate("")
    result = isolate.run(["true"], policy=isolate.Policy(image=image.reference, backend="native"), timeout=60)
    assert not os.path.exists(held)  # its caller ended: the next run's sweep removes it


def test_a_kept_sandboxs_upper_layer_on_disk_takes_every_change(image: Image) -> None:
    # A kept sandbox's upper layer lies in its state directory (for commit_image): a disk keeps user.* attributes
    # on every kernel, so the opaque directory and the rename work there before Linux 6.6 as well.
    try:
        box = isolate.Sandbox(isolate.Policy(image=image.reference, backend="native"), image_upper="disk").start()
    except isolate.UnsupportedError as exc:
        pytest.skip(str(exc))  # the state directory keeps no user.* attributes here
    with box:
        assert "on disk" in box.enforced["image"]["root"]
        result = box.exec(["sh", "-c", SCRIPT])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["after mkdir: ", "tree: new", "moved: inside", "kept gone"], (
        result.stdout + result.stderr)


def test_before_linux_6_6_a_kept_sandboxs_upper_layer_is_on_disk_unasked(
        image: Image, monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.kernel.places import state_dir

    monkeypatch.setattr(overlay, "_kernel", lambda: (6, 1))
    if overlay.xattr_problem(state_dir(), state_dir()):
        pytest.skip(str(overlay.xattr_problem(state_dir(), state_dir())))
    with isolate.Sandbox(isolate.Policy(image=image.reference, backend="native")) as box:
        assert "on disk" in box.enforced["image"]["root"]
        result = box.exec(["sh", "-c", SCRIPT])
    assert result.returncode == 0, result.stdout + result.stderr


def test_before_linux_6_6_an_asked_tmpfs_size_still_bounds_the_image_roots_writes(
        image: Image, monkeypatch: pytest.MonkeyPatch) -> None:
    # The upper layer on disk by default (before Linux 6.6) is bounded by the disk only: a policy that asks for a
    # tmpfs size keeps the tmpfs it asked for (its EIO limit reported), not a silently unbounded disk.
    monkeypatch.setattr(overlay, "_kernel", lambda: (6, 1))
    policy = isolate.Policy(image=image.reference, backend="native", limits=isolate.Limits(tmpfs_size="1M"))
    write = "dd if=/dev/zero of=/data/big bs=64k count=64 2>/dev/null && echo wrote"
    result = isolate.run(["sh", "-c", write], policy=policy, capture_output=True, text=True, timeout=60)
    assert "on disk" not in result.report.enforced["image"]["root"]
    assert "wrote" not in result.stdout, result.stdout + result.stderr
    with isolate.Sandbox(policy) as box:
        assert box.image_upper == "tmpfs"
        assert "wrote" not in box.exec(["sh", "-c", write]).stdout
