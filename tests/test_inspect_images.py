"""The inspect_ai provider runs a compose service's image: natively (inspect's own eval, the mock model)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY

pytest.importorskip("inspect_ai", reason="inspect_ai is not installed: pip install '.[inspect]'")

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.scorer import Score, Target, accuracy, scorer
from inspect_ai.solver import Generate, TaskState, solver
from inspect_ai.util import sandbox

import isolate
from isolate.image import Image, Store

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[Store]:
    with kit.store_env(str(tmp_path / "store")):
        store = Store(tmp_path / "store")
        kit.oci_layout(str(tmp_path / "box"), [kit.busybox_layer()], ref="inspect-box:1", Env=["PATH=/bin"])
        Image.load(tmp_path / "box", store=store)
        yield store


@solver
def look_around() -> Any:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        result = await sandbox().exec(["sh", "-c", "cat /etc/os-release; echo \"$GREETING\"; "
                                       "ls /usr 2>/dev/null || echo no-host-usr"])
        state.metadata["out"] = result.stdout + result.stderr
        return state

    return solve


@scorer(metrics=[accuracy()])
def in_the_image() -> Any:
    async def score(state: TaskState, target: Target) -> Score:
        out = state.metadata["out"]
        return Score(value=1 if out == "NAME=busybox-scratch\nhello\nno-host-usr\n" else 0, explanation=out)

    return score


def test_a_compose_services_image_runs_natively(store: Store, tmp_path: Path) -> None:
    compose = tmp_path / "compose.yaml"
    compose.write_text("services:\n  default:\n    image: inspect-box:1\n    command: tail -f /dev/null\n"
                       "    init: true\n    network_mode: none\n    environment:\n      GREETING: hello\n")
    task = Task(dataset=[Sample(input="x")], solver=look_around(), scorer=in_the_image(),
                sandbox=("isolate", str(compose)))
    log = eval(task, model="mockllm/model", log_dir=str(tmp_path / "logs"), display="none")[0]
    assert log.status == "success", log.error
    assert log.samples is not None and log.samples[0].scores is not None
    score = next(iter(log.samples[0].scores.values()))
    assert score.value == 1, score.explanation


@pytest.mark.parametrize(("service", "named"), [
    ("build: .", "build"),
    ("image: inspect-box:1\n    volumes: ['/:/host']", "volumes"),
    ("image: inspect-box:1\n    network_mode: host", "network_mode"),
    ("image: inspect-box:1\n    privileged: true", "privileged"),
])
def test_what_the_provider_cannot_honour_is_refused_named(store: Store, tmp_path: Path, service: str,
                                                          named: str) -> None:
    from isolate.integrations.inspect_ai import IsolateSandboxEnvironment

    compose = tmp_path / "compose.yaml"
    compose.write_text(f"services:\n  default:\n    {service}\n")
    import asyncio

    with pytest.raises(isolate.UnsupportedError, match=named):
        asyncio.run(IsolateSandboxEnvironment.task_init("t", str(compose)))
