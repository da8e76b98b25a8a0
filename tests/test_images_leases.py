"""Prune never takes the layers a running sandbox stands on (isolate/image/leases.py), whoever started it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import imagekit as kit
import pytest
from conftest import ISOLATE_RUN, NAMESPACES_WHY

import isolate
from isolate.image import Image, Store, leases
from isolate.image import store as store_module

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[Store]:
    with kit.store_env(str(tmp_path / "store")):
        yield Store(tmp_path / "store")


def _load(store: Store, tmp: Path) -> Image:
    # Layers of this test's own (a random entry): prune also keeps a layer any sandbox the caller can see
    # mounts, and the suite's other sandboxes (the other caller's run beside this one) mount the plain
    # busybox layer, and the other caller runs this very test beside this one.
    own = {"name": "etc/leases-test", "data": os.urandom(16).hex().encode()}
    kit.oci_layout(str(tmp / "leased"), [kit.busybox_layer([own]), kit.layer([{"name": "marker", "data": b"here\n"},
                                                                               own])],
                   ref="leased:1", Env=["PATH=/bin"])
    return Image.load(tmp / "leased", store=store)


def _present(image: Image) -> bool:
    return all(os.path.isdir(d) for d in image.lower_dirs())


def test_prune_keeps_a_kept_sandboxs_layers_until_it_ends(store: Store, tmp_path: Path) -> None:
    image = _load(store, tmp_path)
    with isolate.Sandbox(isolate.Policy(image=image.reference, backend="native")) as box:
        image.remove()
        assert Image.prune(store) == []
        assert _present(image)
        assert box.exec(["cat", "/marker"]).stdout == "here\n"
    assert sorted(Image.prune(store)) == sorted(image.layers)
    assert not os.listdir(os.path.join(store.path, "leases"))


def test_prune_keeps_the_layers_of_a_replayed_isolate_run(store: Store, tmp_path: Path, workdir: str) -> None:
    from isolate.backends.native.imageroot import upper_limits

    if upper_limits():
        pytest.skip("before Linux 6.6 an image run's upper layer is on disk, made for each run: not replayed")
    image = _load(store, tmp_path)
    command = [ISOLATE_RUN, "--image", "leased:1", "--", "sh", "-c", "echo ready; read line; cat /marker"]
    assert subprocess.run(command, input="\n", capture_output=True, text=True, cwd=workdir,
                          timeout=60).returncode == 0  # the plan is written: the next run is the binary's
    env = dict(os.environ, ISOLATE_RUN_TRACE="1")
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=workdir, env=env) as run:
        assert run.stdout is not None and run.stdout.readline() == "ready\n"
        image.remove()
        assert Image.prune(store) == []
        out, err = run.communicate("go\n", timeout=60)
    assert "replaying the cached plan" in err
    assert run.returncode == 0 and out == "here\n", err
    assert not os.listdir(os.path.join(store.path, "leases"))  # the binary removed its lease at the end
    # The binary exits on the init's report, while the init itself may still be ending (its PID namespace, then
    # the mount namespace that holds the image's overlay): prune keeps the layers until that mount is gone.
    deadline = time.monotonic() + 10
    while not (removed := Image.prune(store)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(removed) == sorted(image.layers)


def test_a_lease_of_an_ended_process_is_no_lease(store: Store, tmp_path: Path) -> None:
    image = _load(store, tmp_path)
    ended = subprocess.Popen(["true"])
    ended.wait()
    stale = leases.write(store.path, os.getpid(), [os.path.dirname(d) for d in image.lower_dirs()])
    assert stale is not None
    os.rename(stale, os.path.join(store.path, "leases", f"{ended.pid}-1"))  # its pid, not its start time
    image.remove()
    assert sorted(Image.prune(store)) == sorted(image.layers)
    assert not os.listdir(os.path.join(store.path, "leases"))


def test_a_sandbox_of_a_pruned_layer_is_refused_not_mounted_half_gone(store: Store, tmp_path: Path) -> None:
    image = _load(store, tmp_path)
    assert isolate.run(["true"], policy=isolate.Policy(image=image.reference, backend="native")).returncode == 0
    image.remove()
    Image.prune(store)
    with pytest.raises(isolate.IsolationError, match="not in the image store"):
        isolate.run(["true"], policy=isolate.Policy(image=image.reference, backend="native"))


def test_a_lease_of_a_sandbox_of_another_pid_namespace_is_kept(store: Store, tmp_path: Path) -> None:
    # Before: a caller in another PID namespace sharing the store (a container) leased its layers as PID-START of
    # its own namespace; here that pid is another process or none, so prune took the lease for ended and removed
    # the layers from under its running sandbox. Only a pruner of the lease's namespace may judge it now.
    import sys

    image = _load(store, tmp_path)
    code = ("import os, sys\nfrom isolate.image import leases\n"
            "print(leases.write(sys.argv[1], os.getpid(), sys.argv[2:]), flush=True)\nsys.stdin.read()\n")
    holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
                               sys.executable, "-c", code, str(store.path),
                               *[os.path.dirname(d) for d in image.lower_dirs()]],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        held = holder.stdout.readline().strip()
        assert os.path.basename(held).startswith("1-"), held  # its pid there
        image.remove()
        assert Image.prune(store) == [], "the layers of another PID namespace's running sandbox were pruned"
        assert os.path.basename(held) in os.listdir(os.path.join(store.path, "leases"))
    finally:
        holder.communicate("")
    # Ended, but this namespace cannot tell: kept until a pruner of its own namespace (or its sandbox's end).
    assert Image.prune(store) == []
    os.unlink(os.path.join(store.path, "leases", os.path.basename(held)))
    assert sorted(Image.prune(store)) == sorted(image.layers)


def test_another_users_sandbox_of_the_same_layer_holds_none_of_this_callers(store: Store, tmp_path: Path) -> None:
    # The mount table names a layer by its digest alone: another user's prune (its own store, an image sharing
    # this layer) took a running sandbox of root's for one of its own and kept its layers.
    python, other = "/usr/bin/python3", 64321
    tree = os.path.dirname(os.path.dirname(os.path.abspath(isolate.__file__)))
    if os.geteuid() != 0 or not os.path.exists(python) or not shutil.which("setpriv"):
        pytest.skip("root runs the sandbox, another uid asks (setpriv, the system's python3)")
    if not _others_can_read(tree):
        pytest.skip(f"another user cannot read {tree}")
    image = _load(store, tmp_path)
    code = "from isolate.image.store import layers_in_use; print(' '.join(sorted(layers_in_use())))"
    with isolate.Sandbox(isolate.Policy(image=image.reference, backend="native")) as box:
        assert box.exec(["cat", "/marker"]).stdout == "here\n"
        mine = {d.removeprefix("sha256:") for d in image.layers}
        assert mine <= store_module.layers_in_use()  # the caller's own sandbox: in use
        asked = subprocess.run(["setpriv", f"--reuid={other}", f"--regid={other}", "--clear-groups", python, "-c",
                                code], env={"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": tree}, cwd="/",
                               capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    assert not mine & set(asked.stdout.split()), asked.stdout


def _others_can_read(path: str) -> bool:
    parts = os.path.realpath(path).split("/")
    return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o005 == 0o005 for i in range(1, len(parts) + 1))
