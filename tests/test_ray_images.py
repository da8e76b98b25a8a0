"""isolate.ray with an image: the reference travels, each node pulls it into its own store on first need."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NAMESPACES_WHY, ray_cluster
from test_images_registry import registry  # noqa: F401  (the loopback registry fixture)

import isolate
from isolate.image import Image, Store

ray = pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils")
import isolate.ray as iray  # noqa: E402  (after the skip: it imports ray)

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head and two worker nodes, each worker with an image store of its own (both empty)."""
    temp = tempfile.mkdtemp(prefix="iray-images-")
    # Not in Ray's temporary directory, which Ray makes writable by everyone (a store there is refused).
    images = tempfile.mkdtemp(prefix="iray-images-")
    stores = [str(Path(images) / f"store-{i}") for i in range(2)]
    c, workers = ray_cluster({"num_cpus": 1, "temp_dir": temp}, [
        {"num_cpus": 1, "resources": {f"worker{i}": 1}, "env_vars": {"ISOLATE_IMAGE_STORE": store}}
        for i, store in enumerate(stores)])
    c.stores, c.workers = stores, workers
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        iray.shutdown()
        ray.shutdown()
        c.shutdown()
        for directory in (images, temp):
            subprocess.run(["rm", "-rf", "--one-file-system", directory], check=False)


def test_each_node_pulls_the_image_into_its_own_store(cluster: Any, registry: str) -> None:  # noqa: F811
    ref = f"{registry}/tests/busybox:1"
    policy = isolate.Policy(image=ref, backend="native")
    boxes = [iray.Sandbox(policy, resources={f"worker{i}": 1}).start() for i in range(2)]
    try:
        for box in boxes:
            assert box.exec(["cat", "/etc/os-release"]).stdout == "NAME=busybox-scratch\n"
    finally:
        for box in boxes:
            box.close()
    for store in cluster.stores:  # each node's own copy, pulled there
        assert [image.reference for image in Image.list(Store(store))] == [ref]
