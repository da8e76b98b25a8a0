"""What a pull holds in memory: bounded by design (isolate/image/budget.py), not by its layers' size or number, nor
by how many pulls one process runs at once."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest

from isolate.image import BadImageError, Store, budget
from isolate.image.archive import host_platform

REGISTRY = shutil.which("docker-registry")
SKOPEO = shutil.which("skopeo")
#: Layers of each of the two images pulled at once, and each one's bytes (one file of zeros, uncompressed: what an
#: unpack holds does not depend on what the bytes are).
LAYERS, LAYER_BYTES = 4, 24 << 20
#: What the two pulls at once may add to the peak RSS of a process that pulled a small image before. Measured here:
#: 6 to 7 MiB with the bound (four layers at once, a few chunks of 256 KiB each), 94 MiB without it (eight layers at
#: once, each reading ahead by chunks of 1 MiB: a peak of 131 MiB).
GROWTH_MIB = 40


def _layout(path: Path, name: str, layers: int, size: int) -> None:
    """An OCI layout (ref "1") of ``layers`` uncompressed layers, each one file of ``size`` zeros, written to disk
    as it is made (never held whole here)."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    descriptors, diff_ids = [], []
    for number in range(layers):
        work = path / "layer.tar"
        with tarfile.open(work, "w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(f"{name}-{number}")
            info.size, info.mtime = size, 1700000000
            tar.addfile(info, kit.Zeros(size))  # type: ignore[arg-type]
        sha = hashlib.sha256()
        with open(work, "rb") as handle:
            while chunk := handle.read(1 << 20):
                sha.update(chunk)
        digest = "sha256:" + sha.hexdigest()
        work.rename(blobs / digest[7:])
        diff_ids.append(digest)
        descriptors.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest,
                            "size": os.path.getsize(blobs / digest[7:])})
    os_, arch = host_platform()
    config = json.dumps({"architecture": arch, "os": os_, "config": {},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": kit.digest(config), "size": len(config)},
                           "layers": descriptors}).encode()
    for blob in (config, manifest):
        (blobs / kit.digest(blob)[7:]).write_bytes(blob)
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": kit.digest(manifest),
         "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "1"}}]}))
    (path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))


# The peak is the process's own (VmHWM): its ru_maxrss starts at its parent's peak (kept across the fork and exec),
# so under a pytest grown larger than the pulls it never moved, and the bound could not fail.
_PULLS = """
import sys, threading
from isolate.image import Image, Store

def peak():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))

store, small, *large = sys.argv[1:]
Image.pull(small, store=Store(store))  # everything a pull imports and opens: the process's base
base = peak()
failed = []

def pull(ref):
    try:
        Image.pull(ref, store=Store(store))
    except BaseException as exc:
        failed.append(repr(exc))

threads = [threading.Thread(target=pull, args=(ref,)) for ref in large]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not failed, failed
print(base, peak())
"""


def test_pulls_at_once_in_one_process_hold_a_bounded_memory_whatever_their_layers(tmp_path: Path) -> None:
    # Two pulls of four layers each, in two threads of one process (as the server pulls for two requests): eight
    # layers unpacked at once, each reading ahead, before the bound; four now, whatever the number of pulls.
    if REGISTRY is None or SKOPEO is None:
        pytest.skip("docker-registry and skopeo are not installed (apt-get install docker-registry skopeo)")
    with kit.loopback_registry(str(tmp_path), REGISTRY) as address:
        refs = []
        for name, layers, size in (("small", 1, 1 << 10), ("one", LAYERS, LAYER_BYTES), ("two", LAYERS, LAYER_BYTES)):
            _layout(tmp_path / name, name, layers, size)
            kit.push(SKOPEO, f"{tmp_path / name}:1", f"{address}/memory/{name}:1", str(tmp_path))
            refs.append(f"{address}/memory/{name}:1")
        done = subprocess.run([sys.executable, "-c", _PULLS, str(tmp_path / "store"), *refs], capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    base, peak = (int(field) for field in done.stdout.split())
    assert (peak - base) / 1024 <= GROWTH_MIB, f"peak RSS {peak // 1024} MiB, {(peak - base) // 1024} MiB over the base"
    for name in ("one", "two"):
        for number in range(LAYERS):
            found = [os.path.join(root, f"{name}-{number}") for root, _, files in os.walk(tmp_path / "store" / "layers")
                     if f"{name}-{number}" in files]
            assert len(found) == 1 and os.path.getsize(found[0]) == LAYER_BYTES


def _zstd_blob(tmp_path: Path, name: str, window_log: int) -> tuple[str, Path]:
    """A zstd layer whose frame asks for a window of 2**window_log bytes (its content size not written: the
    decoder cannot take less)."""
    zstandard = pytest.importorskip("zstandard")
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log, write_content_size=False)
    streamed = zstandard.ZstdCompressor(compression_params=params).compressobj()  # its size unknown: the window kept
    blob = streamed.compress(kit.layer([{"name": name, "data": b"z" * 1000}])) + streamed.flush()
    path = tmp_path / name
    path.write_bytes(blob)
    return kit.digest(blob), path


def test_a_zstd_window_past_its_bound_is_refused_in_one_line_and_nothing_kept(tmp_path: Path) -> None:
    digest, path = _zstd_blob(tmp_path, "huge", 28)  # 256 MiB: past zstd's own default bound, 128 MiB
    store = Store(tmp_path / "store")
    with pytest.raises(BadImageError, match="window is 268435456 bytes"):
        store.ensure_layer(digest, lambda: open(path, "rb"), diff_id=None, what="layer")
    damaged = _zstd_blob(tmp_path, "small", 20)[1].read_bytes()[:6] + b"\xff" * 20  # its header, then no block
    (tmp_path / "damaged").write_bytes(damaged)
    with pytest.raises(BadImageError, match="damaged"):
        store.ensure_layer(kit.digest(damaged), lambda: open(tmp_path / "damaged", "rb"), diff_id=None, what="layer")
    assert os.listdir(os.path.join(store.path, "layers")) == []
    assert os.listdir(os.path.join(store.path, "tmp")) == []


def test_a_zstd_layer_of_a_large_window_unpacks_alone_and_a_small_one_beside_others(tmp_path: Path) -> None:
    # The test holds one of the process's slots (a layer of another pull unpacking): a layer whose decoder holds
    # 128 MiB waits for it, one of a small window does not.
    large, large_path = _zstd_blob(tmp_path, "large", 27)
    small, small_path = _zstd_blob(tmp_path, "small", 20)
    store = Store(tmp_path / "store")
    errors: list[BaseException] = []

    def ensure(digest: str, path: Path) -> Any:
        try:
            store.ensure_layer(digest, lambda: open(path, "rb"), diff_id=None, what="layer")
        except BaseException as exc:
            errors.append(exc)

    with budget.slot():
        ensure(small, small_path)  # beside the slot held
        assert store.has_layer(small) and not errors
        waiting = threading.Thread(target=ensure, args=(large, large_path))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not store.has_layer(large)  # it waits for every slot
    waiting.join(60)
    assert not errors and store.has_layer(large)
    assert budget.SLOTS.free == budget.SLOTS.count and budget.CONTENTS.free == budget.CONTENTS.total
