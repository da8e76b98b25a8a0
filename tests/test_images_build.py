"""Building images without a daemon: steps over an image, each run confined in a sandbox, each cached."""

from __future__ import annotations

import io
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import imagekit as kit
import pytest
from conftest import ISOLATE_RUN, NAMESPACES_WHY

import isolate
from isolate.image import Image, PruneStats, Store
from isolate.image.build import BuildError, Stats
from isolate.image.push import export_layer

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")


_PROBED: dict[str, str] = {}


@pytest.fixture()
def base(tmp_path: Path) -> Iterator[Image]:
    with kit.store_env(str(tmp_path / "store")):
        extra = [{"name": "usr", "type": "dir"}, {"name": "usr/local", "type": "dir"},
                 {"name": "usr/local/bin", "type": "dir", "mode": 0o777}, {"name": "app", "type": "dir", "mode": 0o777}]
        kit.oci_layout(str(tmp_path / "base"), [kit.busybox_layer(extra)], ref="base:1",
                       Env=["PATH=/usr/local/bin:/bin"])
        image = Image.load(tmp_path / "base", store=Store(tmp_path / "store"))
        if _PROBED.get("why") is None:
            try:
                image.run("true").build()
                _PROBED["why"] = ""
            except isolate.UnsupportedError as exc:  # an upper layer the host cannot read back, no idmapped mount
                _PROBED["why"] = str(exc)
        if _PROBED["why"]:
            pytest.skip(f"this host builds no image: {_PROBED['why']}")
        yield image


def _steps(base: Image, source: Path) -> isolate.image.build.Build:
    return (base.run("printf '#!/bin/sh\\necho tool:$GREETING\\n' > /usr/local/bin/tool && chmod 755 "
                     "/usr/local/bin/tool")
            .copy(source, "/app/src")
            .env(GREETING="hello").workdir("/app")
            .run(["sh", "-c", "cat src/data.txt > combined && tool >> combined"]))


def test_a_three_step_build_runs_each_step_and_a_second_build_reuses_them(base: Image, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "data.txt").write_text("data\n")
    (source / "link").symlink_to("/etc/shadow")
    first, out = Stats(), io.StringIO()
    image = _steps(base, source).build("built:1", progress=out, stats=first)
    assert (first.steps, first.cached, first.ran) == (5, 0, 2), out.getvalue()
    assert image.config.working_dir == "/app" and "GREETING=hello" in image.config.env
    with isolate.Sandbox(isolate.Policy(image="built:1")) as box:
        ran = box.exec(["sh", "-c", "cat /app/combined; tool; readlink /app/src/link; stat -c %a /app"])
    assert ran.stdout == "data\ntool:hello\ntool:hello\n/etc/shadow\n777\n", ran.stderr
    # A step's files are the image's root's, as the files it was shown (a regular caller's store: theirs).
    combined = os.lstat(os.path.join(image.lower_dirs()[0], "app", "combined"))
    assert combined.st_uid == os.geteuid()
    # Each layer built here, written again for a push, is the very blob built: the image keeps its digests.
    for layer in image.layers[1:]:
        blob = export_layer(image, layer)
        os.unlink(blob.path)
        assert blob.digest == layer
    # Unchanged: every step's layer comes from the cache, nothing runs, the same image.
    second = Stats()
    again = _steps(base, source).build("built:2", stats=second)
    assert (second.cached, second.ran) == (3, 0) and again.id == image.id
    # A copied file changed: its step and those after it are built again, not the one before.
    (source / "data.txt").write_text("changed\n")
    third = Stats()
    changed = _steps(base, source).build("built:3", stats=third)
    assert (third.cached, third.ran) == (1, 1) and changed.id != image.id


def test_an_image_starts_a_build_with_the_run_steps_own_env_and_shell(base: Image) -> None:
    # docs/images.md: any Image starts a build with ``.run(cmd, network=..., env=...)``, as a Build goes on.
    step = base.run("echo $A", env={"A": "1"}, shell=("/bin/ash", "-c")).steps[-1]
    assert (step.args, step.env) == (("/bin/ash", "-c", "echo $A"), (("A", "1"),))


def test_a_build_step_is_confined(base: Image, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o777)
    with pytest.raises(BuildError, match=r"step 1 .*exit status"):
        base.run(f"echo escaped > {outside}/file").build()
    assert not (outside / "file").exists()
    # What a step sees is the image, never the host's files.
    probe = base.run(f"test ! -e {tmp_path} && test ! -e /usr/bin/python3 && echo confined > /app/probe").build()
    with isolate.Sandbox(isolate.Policy(image=probe.reference)) as box:
        assert box.exec(["cat", "/app/probe"]).stdout == "confined\n"


def test_a_build_step_makes_new_entries_in_the_images_root(base: Image) -> None:
    # As docker build's RUN: the step's root is the image (its private upper layer), new top-level entries included.
    built = base.run("mkdir /srv2 && echo made > /srv2/file && ln -s srv2 /link2 && echo top > /top-file").build()
    with isolate.Sandbox(isolate.Policy(image=built.reference)) as box:
        assert box.exec(["cat", "/srv2/file", "/link2/file", "/top-file"]).stdout == "made\nmade\ntop\n"
        # A kept sandbox of an image is a container's root too: where the program owns / (a regular caller's, whose
        # store holds their own files; a root caller's program is never root), it adds to it (its upper layer) ...
        if box.exec(["sh", "-c", 'test "$(stat -c %u /)" = "$(id -u)"']).returncode == 0:
            made = box.exec(["sh", "-c", "mkdir /made && echo x > /made/f && cat /made/f"])
            assert made.stdout == "x\n", made.stderr
        # ... and never writes the kernel's file systems mounted under it, which a rule on / would reach.
        for path in ("/proc/self/oom_score_adj", "/proc/self/comm", "/proc/sysrq-trigger"):
            assert box.exec(["sh", "-c", f"echo 0 > {path}"]).returncode != 0, path
    # A host path granted read-only holds FIFOs and sockets no mount flag keeps: the root is then granted by its
    # directories only, and the report says why.
    with isolate.Sandbox(isolate.Policy(image=built.reference, read=["/etc/hostname"])) as box:
        denied = box.exec(["sh", "-c", "mkdir /made2"])
        assert denied.returncode != 0
        assert "no new entry in /" in denied.report.enforced["image"]["root"]


def _intermediates(store: Store) -> list[str]:
    return [i.reference for i in Image.list(store) if i.reference.startswith("localhost/isolate-build:")]


def test_prune_of_the_build_cache_takes_what_no_image_needs(base: Image) -> None:
    from isolate.image.build import CacheMount

    store = base.store
    cache = CacheMount("/var/cache/tool", id=f"prune-test-{os.urandom(4).hex()}")
    steps = base.run("echo 1 > /var/cache/tool/seen && echo a > /usr/local/bin/a", caches=[cache]).run(
        "echo b > /usr/local/bin/b")
    kept = steps.build("kept:1")
    scratch = base.run("echo only-here > /usr/local/bin/c").build()  # no tag: only the build cache names it
    cache_dir = cache.host_dir(store)
    assert os.path.isfile(os.path.join(cache_dir, "seen")) and len(_intermediates(store)) >= 2
    # docker image prune: the build cache stays.
    assert Image.prune(store) == []
    assert scratch.reference in _intermediates(store) and os.path.isdir(cache_dir)
    # docker builder prune -a: the images between steps, the layers only they name, the cache mounts.
    cli = subprocess.run([ISOLATE_RUN, "image", "--image-store", store.path, "prune", "--build-cache"],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert re.match(r"removed \d+ unused layers?, \d+ build images, 1 cache mount, \d+ step cache", cli.stdout), \
        cli.stdout
    assert _intermediates(store) == [] and not os.path.exists(cache_dir)
    assert scratch.layers[-1] not in [layer for i in Image.list(store) for layer in i.layers]
    assert not os.listdir(os.path.join(store.path, "cache-mounts"))
    # What a tagged image still holds is its steps' cache: a second build runs nothing.
    again = Stats()
    assert steps.build("kept:2", stats=again).id == kept.id and (again.cached, again.ran) == (2, 0)
    with isolate.Sandbox(isolate.Policy(image="kept:1")) as box:
        assert box.exec(["cat", "/usr/local/bin/a", "/usr/local/bin/b"]).stdout == "a\nb\n"
    stats = PruneStats()
    Image.prune(store, build_cache=True, stats=stats)
    assert (stats.layers, stats.steps) == (0, 0)  # the step whose layer went has no entry left either


def test_prune_leaves_a_running_builds_cache_mount_and_images(base: Image) -> None:
    from isolate.image.build import CacheMount

    store = base.store
    cache = CacheMount("/cache", id=f"running-{os.urandom(4).hex()}")
    cache_dir = cache.host_dir(store)
    first = base.run("echo first > /usr/local/bin/first").build()  # an image between steps, the build's parent
    failed: list[BaseException] = []

    def build() -> None:
        try:
            first.run("echo started > /cache/started; i=0; while [ ! -e /cache/go ] && [ $i -lt 3000 ]; do sleep 0.02; "
                      "i=$((i+1)); done; "
                      "cat /cache/go > /usr/local/bin/done", caches=[cache]).build("running:1")
        except BaseException as exc:
            failed.append(exc)

    worker = threading.Thread(target=build)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(cache_dir, "started")) and worker.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stats = PruneStats()
        Image.prune(store, build_cache=True, stats=stats)
        assert stats.cache_mounts == 0 and os.path.isfile(os.path.join(cache_dir, "started"))
        assert first.reference in _intermediates(store)  # the running build stands on it
    finally:
        with open(os.path.join(cache_dir, "go"), "w") as handle:
            handle.write("went\n")
        worker.join(60)
    assert not failed, failed
    with isolate.Sandbox(isolate.Policy(image="running:1")) as box:
        assert box.exec(["cat", "/usr/local/bin/done"]).stdout == "went\n"
    Image.prune(store, build_cache=True)
    assert not os.path.exists(cache_dir)
