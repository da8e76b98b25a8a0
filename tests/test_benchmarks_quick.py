"""The benchmark harness still runs: its quick mode on a tiny subset, into a temporary directory.

No figure is asserted (shared machines are noisy); what is checked is that
every section produced figures or a stated reason, and that the JSON, the
markdown and the summary are written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import isolate
from isolate.kernel import landlock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _native_works() -> str | None:
    # As the harness does: a working directory under /var/tmp, readable by a root caller's program.
    with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else None) as workdir:
        os.chmod(workdir, 0o755)
        try:
            done = isolate.run(["/bin/true"], policy=isolate.Policy(backend="native"), cwd=workdir)
        except isolate.IsolationError as exc:
            return str(exc)
    return None if done.returncode == 0 else f"isolate.run exited {done.returncode}"


def test_quick_mode_writes_results(tmp_path: os.PathLike[str]) -> None:
    reason = _native_works()
    if reason:
        pytest.skip(f"the native backend cannot run here, so there is nothing to benchmark: {reason}")
    # A copy of the harness, run from outside the tree: ``isolate`` is then the installed package (in a tree
    # copied for an unprivileged run, the source directory's isolate/ has no compiled core).
    base = os.fspath(tmp_path)
    shutil.copytree(os.path.join(REPO, "benchmarks"), os.path.join(base, "pkg", "benchmarks"),
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    # The images section builds its images with the tests' kit, as it finds it in a checkout.
    os.mkdir(os.path.join(base, "pkg", "tests"))
    shutil.copy(os.path.join(REPO, "tests", "imagekit.py"), os.path.join(base, "pkg", "tests"))
    out = os.path.join(base, "out")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-docker", "--rounds", "3", "--out", out],
        cwd=os.path.join(base, "pkg"), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    with open(os.path.join(out, "quick.json"), encoding="utf-8") as f:
        results = json.load(f)
    assert results["mode"] == "quick"
    for field in ("kernel", "cpu_model", "cores", "memory_gib", "python"):
        assert results["machine"][field], field
    assert not os.path.exists(os.path.join(out, "latest.json")), "quick mode must not write the full results"

    spawn = results["spawn"]
    assert spawn["rounds"] == 3
    for parent in ("small", "1GiB"):
        variants = spawn["parents"][parent]["variants"]
        # The Landlock-only variant runs without namespaces: a kernel without Landlock refuses it.
        for key in ("subprocess", "isolate.run", "cli") + (("isolate.run/ll",) if landlock.abi() else ()):
            assert variants[key]["n"] + variants[key].get("failures", 0) == 3, (parent, key, variants[key])
            assert variants[key]["median_ms"] > 0
        for key, entry in variants.items():
            assert "median_ms" in entry or entry.get("skipped"), (parent, key, entry)
        assert variants["docker-run"]["skipped"]  # --no-docker
    assert {g["goal"] for g in results["spawn_analysis"]["goals"]}

    syscalls = results["overhead"].get("syscalls")
    if syscalls is None:
        assert results["overhead"]["skipped"]  # no gcc here
    else:
        assert set(syscalls["ns_per_call"]) == {"unsandboxed", "seccomp=none", "seccomp=default", "seccomp=strict"}
    assert results["throughput"]["per_second"]["isolate.run"]["1 worker"] > 0
    assert results["memory"]["kib_per_sandbox"]["isolate (default policy)"]
    egress = results["egress"]
    assert "error" not in egress, egress
    assert egress["sandboxed"]["latency"]["mediated"]["median_ms"] > 0
    assert egress["sandboxed"]["throughput"]["mediated_mb_s"] > 0 and egress["mediator"]["throughput"]["ratio"]
    cli = results["cli"]["variants"]
    for key in ("binary warm", "binary cold", "python CLI"):
        assert cli[key]["n"] == 3 and cli[key]["median_ms"] > 0, (key, cli[key])
    branches = results["branches"]
    assert "error" not in branches, branches
    assert branches["restore_checked"] and branches["docker"]["skipped"]
    for what in ("snapshot", "fork", "restore"):
        assert branches["isolate"][what]["n"] == 3 and branches["isolate"][what]["median_ms"] > 0, what
        assert branches["copy_workspace"][what]["n"] == 3 and branches["copy_workspace"][what]["median_ms"] > 0
    assert branches["copy_workspace_restore_checked"]
    build = results["build"]
    assert "error" not in build, build
    for which in ("cold", "cached"):
        assert build[which]["isolate (API)"]["n"] == 1 and build[which]["isolate-run"]["median_ms"] > 0, which
    assert build["isolate_steps"] == {"cold": {"steps": 3, "cached": 0, "ran": 2},
                                      "cached": {"steps": 3, "cached": 3, "ran": 0}}

    with open(os.path.join(out, "quick.md"), encoding="utf-8") as f:
        text = f.read()
    assert "## Spawn latency of /bin/true" in text and "isolate.run, default policy" in text
    assert "goal:" in done.stdout
