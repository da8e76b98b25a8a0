"""Image.from_docker: an image of a running local Docker or Podman, by its save stream."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import isolate
from isolate.image import Image, Store


def _engine() -> tuple[str | None, str]:
    """The first engine that answers, or None and why none does."""
    why = []
    for name in ("docker", "podman"):
        if not shutil.which(name):
            why.append(f"no {name} command")
            continue
        answer = subprocess.run([name, "info"], capture_output=True, text=True, timeout=30)
        if answer.returncode == 0:
            return name, ""
        why.append(f"{name} does not answer ({(answer.stderr.strip().splitlines() or ['?'])[-1][:80]})")
    return None, "; ".join(why) + " (tests/docker_env.sh starts dockerd)"


def test_an_absent_engine_is_named_in_one_clear_error(tmp_path: Path) -> None:
    missing = "podman-not-installed-here"
    with pytest.raises(isolate.IsolationError, match=f"no {missing} command on this host"):
        Image.from_docker("busybox:1", engine=missing, store=Store(tmp_path / "store"))


def test_an_image_of_a_running_engine_is_loaded_into_the_store(tmp_path: Path) -> None:
    engine, why = _engine()
    if engine is None:
        pytest.skip(why)
    image_ref = os.environ.get("ISOLATE_TEST_IMAGE", "isolate-test:busybox")
    if subprocess.run([engine, "image", "inspect", image_ref], capture_output=True, timeout=30).returncode != 0:
        pytest.skip(f"{engine} has no {image_ref} (tests/docker_env.sh builds it)")
    store = Store(tmp_path / "store")
    image = Image.from_docker(image_ref, engine=engine, store=store)
    assert Image.get(image_ref, store) == image and image.layers
    assert not os.listdir(os.path.join(store.path, "tmp"))  # the spooled save stream is gone
    with pytest.raises(isolate.IsolationError, match="not found in a running local engine"):
        Image.from_docker("isolate-test:no-such-tag", engine=engine, store=store)


def test_the_save_stream_is_spooled_loaded_and_removed(tmp_path: Path) -> None:
    """The path from an engine's save stream to the store, with a stand-in engine command (a script that
    answers `image inspect` and writes a docker save archive made here): where no engine runs, this part
    is still checked."""
    import imagekit as kit

    archive = tmp_path / "saved.tar"
    kit.docker_archive(str(archive), [kit.layer([{"name": "hello", "data": b"hi\n"}])], tag="standin:1")
    engine = tmp_path / "standin-engine"
    engine.write_text(f'#!/bin/sh\ncase "$1 $2" in\n"image inspect") echo sha256:x ;;\n'
                      f'"save --") [ "$3" = standin:1 ] && cat {archive} ||\n'
                      f'  {{ echo "no such image: $3" >&2; exit 1; }} ;;\n'
                      f'*) echo "no such image: $2" >&2; exit 1 ;;\nesac\n')
    engine.chmod(0o755)
    store = Store(tmp_path / "store")
    image = Image.from_docker("standin:1", engine=str(engine), store=store)
    assert image.reference == "docker.io/library/standin:1" and len(image.layers) == 1
    assert not os.listdir(os.path.join(store.path, "tmp"))
    engine.write_text('#!/bin/sh\ncase "$1" in image) exit 0 ;; save) echo "save: broken" >&2; exit 3 ;; esac\n')
    with pytest.raises(isolate.IsolationError, match="save` failed: save: broken"):
        Image.from_docker("standin:2", engine=str(engine), store=store)
    assert not os.listdir(os.path.join(store.path, "tmp"))


@pytest.mark.parametrize("reference", ["-o/tmp/isolate-test-save-target", "", "a\0b"])
def test_a_reference_that_is_no_name_never_reaches_the_engines_command_line(reference: str, tmp_path: Path) -> None:
    # Before: "-o PATH" went to `docker save` as its option (the engine's output file, written as the caller).
    with pytest.raises(isolate.PolicyError, match="expected an image's name or id"):
        Image.from_docker(reference, store=Store(tmp_path / "store"))
    assert not os.path.exists("/tmp/isolate-test-save-target")
