"""``python -m benchmarks.soak`` for two minutes (4 clients): mixed work against one ``isolate-run serve``, then no
error, no descriptor, mount or kept sandbox left and memory within its bound (the script's exit status; its
docstring states the bounds). ``ISOLATE_SOAK_SECONDS`` changes the duration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("uvicorn", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("psutil")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_soak_two_minutes() -> None:
    seconds = os.environ.get("ISOLATE_SOAK_SECONDS", "120")
    done = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--seconds", seconds, "--clients", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=float(seconds) + 600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert results["requests"] > 0 and results["errors"] == 0 and not results["problems"], results["problems"]
    assert {"create", "command", "download", "delete"} <= set(results["operations"])
