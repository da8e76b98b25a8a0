"""The Debian 12 + python3 image (mmdebstrap, tests/imagekit.py's debian_layout) as a sandbox's root: its own
python3, not the host's /usr. The image is built once per CI run (.ci/run's image phase) into a cache the test
reuses; a root caller builds it when the cache lacks it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY

import isolate
from isolate.image import Image, Store

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not shutil.which("mmdebstrap"),
                                reason=NAMESPACES_WHY or "mmdebstrap is not installed (.ci/run's apt line has it)")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    layout = kit.debian_layout(build=False)
    if layout is None:
        pytest.skip(f"the Debian + python image is not built in {kit.DEBIAN_CACHE} (or that directory is writable "
                    "by others): `PYTHONPATH=. python3 tests/imagekit.py debian` builds it, as .ci/run does")
    with kit.store_env(tmp_path_factory.mktemp("debian") / "store") as store:
        yield Image.load(layout, store=Store(store)).reference


def test_python_of_the_image_not_the_hosts(image: str) -> None:
    """python3 --version runs the image's python3; the host's /usr (where mmdebstrap is) is not seen."""
    assert os.path.exists("/usr/bin/mmdebstrap")
    with isolate.Sandbox(policy=isolate.Policy(image=image, backend="native")) as box:
        version = box.exec(["python3", "--version"])
        assert version.returncode == 0, version.stderr
        assert version.stdout.startswith("Python 3.11."), version.stdout
        seen = box.exec(["python3", "-c", "import os, sys; print(sys.executable, os.path.exists('/usr/bin/mmdebstrap'),"
                                          " open('/etc/debian_version').read().strip())"])
        assert seen.returncode == 0, seen.stderr
        executable, host_usr, debian = seen.stdout.split()
        assert executable == "/usr/bin/python3" and host_usr == "False" and debian.startswith("12."), seen.stdout
