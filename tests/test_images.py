"""Images: a policy naming an image is run from that image, or refused; never run on the host's root."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ISOLATE_RUN, skip_unless_runnable

import isolate
from isolate.oneshot import runs


def test_native_with_an_image_is_refused_not_run_on_the_hosts_root() -> None:
    policy = isolate.Policy(image="debian:12", backend="native")
    with pytest.raises(isolate.UnsupportedError, match=r"image: .*--backend docker"):
        isolate.run(["cat", "/etc/os-release"], policy=policy, capture_output=True)


def test_best_effort_does_not_drop_the_image() -> None:
    policy = isolate.Policy(image="debian:12", backend="native", best_effort=True)
    with pytest.raises(isolate.UnsupportedError, match="image: "):
        isolate.run(["true"], policy=policy)


def test_auto_with_an_image_never_chooses_native() -> None:
    policy = isolate.Policy(image="debian:12", best_effort=True)
    try:
        backend = runs.choose_backend(policy)
    except isolate.UnsupportedError as exc:
        assert "image: " in str(exc)  # no Docker here: refused, naming the image as the cause
    else:
        assert backend == "docker"


def test_the_cli_refuses_a_native_image_with_one_line() -> None:
    args = ["--backend", "native", "--image", "debian:12", "--", "cat", "/etc/os-release"]
    skip_unless_runnable(args)
    env = dict(os.environ, ISOLATE_RUN_TRACE="1")
    for _ in range(2):  # the second run must not replay a plan the first one cached
        result = subprocess.run([ISOLATE_RUN, *args], capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 125, result.stderr
        assert "PRETTY_NAME" not in result.stdout
        errors = [line for line in result.stderr.splitlines() if "trace:" not in line]
        assert len(errors) == 1 and "--backend docker" in errors[0], result.stderr
        assert "replaying the cached plan" not in result.stderr
