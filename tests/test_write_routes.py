"""A root caller's writable paths where idmapped mounts are impossible (overlayfs: a container's root).

The program must still never hold power over host files: it runs as the one
non-root owner of the writable paths, or as 65534 where they are writable by
it, and otherwise the run is refused with the cause and the ways out.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
from conftest import ISOLATE_RUN, ROOT, skip_unless_runnable

pytestmark = pytest.mark.skipif(not ROOT, reason="the routes are those of a root caller")

CLI = [ISOLATE_RUN]


@pytest.fixture
def overlay() -> Iterator[str]:
    """An overlayfs mount (no idmapped mounts on it), as a container's root is."""
    base = tempfile.mkdtemp(prefix="isolate-ovl-")
    for name in ("lower", "upper", "work", "merged"):
        os.mkdir(os.path.join(base, name))
    merged = os.path.join(base, "merged")
    options = f"lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work"
    if subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, merged]).returncode != 0:
        pytest.skip("overlayfs cannot be mounted here")
    os.chmod(merged, 0o755)
    try:
        yield merged
    finally:
        subprocess.run(["umount", "-l", merged], check=False)
        subprocess.run(["rm", "-rf", base], check=False)


def run(cwd: str, script: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="isolate-report-") as reports:
        report = os.path.join(reports, "r.json")
        result = subprocess.run([*CLI, "--report", report, "--", "sh", "-c", script], cwd=cwd,
                                capture_output=True, text=True, timeout=60)
        data = json.load(open(report)) if os.path.exists(report) else {}
    return result, data


def test_owner_route_runs_as_the_paths_owner(overlay: str) -> None:
    work = os.path.join(overlay, "alice")
    os.mkdir(work)
    os.chown(work, 1000, 1000)
    result, report = run(work, "id -u; touch made; cat /etc/shadow >/dev/null 2>&1 || echo shadow-denied")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1000", "shadow-denied"]
    assert os.stat(os.path.join(work, "made")).st_uid == 1000
    assert report["enforced"]["write_ownership"] == "owner"  # type: ignore[index]


def test_plain_route_where_65534_may_write(overlay: str) -> None:
    work = os.path.join(overlay, "shared")
    os.mkdir(work)
    os.chmod(work, 0o777)
    result, report = run(work, "id -u; touch made")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["65534"]
    assert report["enforced"]["write_ownership"] == "plain"  # type: ignore[index]


def test_root_owned_path_is_refused_with_the_cause(overlay: str) -> None:
    work = os.path.join(overlay, "project")
    os.mkdir(work)
    result, report = run(work, "touch made")
    assert result.returncode == 125
    line = result.stderr.strip()
    assert "\n" not in line and "overlay" in line and "/proc/self/fd" not in line
    assert f"chown 65534 {work}" in line and "--uid" in line
    assert not os.path.exists(os.path.join(work, "made"))
    assert report["status"] == "setup-error"


def cli(cwd: str, *args: str) -> subprocess.CompletedProcess[str]:
    skip_unless_runnable(args)
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_no_namespaces_root_gets_a_usable_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Without namespaces there is no idmapped mount: the cwd is written with
    # plain permissions, so the program runs as the directory's owner, and
    # its TMPDIR is a private directory (there is no private /tmp).
    work = tmp_path_factory.mktemp("alice")
    os.chown(work, 1000, 0)  # the root group: never given to the program
    result = cli(str(work), "--no-namespaces", "--", "sh", "-c", 'id -u; id -G; t=$(mktemp) && echo tmp-ok; touch made')
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1000", "65534", "tmp-ok"]
    assert os.stat(os.path.join(work, "made")).st_uid == 1000


def test_no_namespaces_root_owned_cwd_is_refused_not_silently_unwritable(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    work = tmp_path_factory.mktemp("project")
    os.chmod(work, 0o755)
    result = cli(str(work), "--no-namespaces", "--", "touch", "made")
    assert result.returncode == 125
    assert "plain permissions" in result.stderr and f"chown 65534 {work}" in result.stderr
    assert not os.path.exists(os.path.join(work, "made"))


def test_no_namespaces_explicit_tmpfs_is_refused(tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp("any")
    result = cli(str(work), "--no-namespaces", "--tmpfs", "/tmp", "--", "true")
    assert result.returncode == 125 and "--tmpfs needs a mount namespace" in result.stderr
