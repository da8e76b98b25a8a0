"""isolate inside a Docker container, as many agents run it: what each `docker run` setup gives.

Uses the image tests/container_image.sh builds (Debian 12 with this checkout
installed); skips, saying why, where there is no engine or no image.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

IMAGE = "isolate-test:debian12-isolate"


def _why_not() -> str | None:
    if not shutil.which("docker"):
        return "no docker client"
    probe = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no image {IMAGE} (bash tests/container_image.sh builds it, after ../shared/vm/build.sh)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
UNCONFINED = ["--security-opt", "seccomp=unconfined", "--security-opt", "systempaths=unconfined"]


def in_container(options: list[str], user: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "run", "--rm", *options, "-u", user, "-w", "/work", IMAGE, "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("user", ["root", "alice"])
def test_default_docker_run_refuses_naming_the_container_and_the_ways_out(user: str) -> None:
    result = in_container([], user, "isolate-run -- true")
    assert result.returncode == 125
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "container whose seccomp profile blocks user namespaces" in line
    assert "--security-opt seccomp=unconfined" in line and "--no-namespaces" in line
    assert "start dockerd" not in line and "doctor" not in line


def test_masked_proc_is_named_with_its_docker_option() -> None:
    result = in_container(["--security-opt", "seccomp=unconfined"], "alice", "isolate-run -- true")
    assert result.returncode == 125
    assert "systempaths=unconfined" in result.stderr and "doctor" not in result.stderr


def test_unconfined_container_runs_a_real_sandbox_as_a_user() -> None:
    result = in_container(UNCONFINED, "alice", "isolate-run -- sh -c 'id -u; ls /; touch made' && ls made")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "1000" and "made" in result.stdout.split()
    assert "opt" not in result.stdout.split()  # the container's /opt (the venv) is not granted


def test_no_namespaces_as_root_does_real_work() -> None:
    script = ("isolate-run --no-namespaces -- sh -c 'id -u; t=$(mktemp) && echo tmp-ok; "
              "echo \"int main(void){return 0;}\" > t.c && gcc t.c -o t && ./t && echo gcc-ok'")
    result = in_container([], "root", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1000", "tmp-ok", "gcc-ok"]


def test_doctor_says_it_runs_in_a_container() -> None:
    result = in_container([], "root", "isolate-run doctor")
    assert "inside a docker container" in result.stdout


def test_unconfined_container_root_gets_a_sandbox_by_another_route() -> None:
    # overlayfs and no CAP_SYS_ADMIN: no idmapped mount. /work is alice's, so
    # the program runs as alice, never as root; a root-owned cwd is refused.
    script = "isolate-run -- sh -c 'id -u; cat /etc/shadow 2>/dev/null || echo no-shadow'"
    result = in_container(UNCONFINED, "root", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1000", "no-shadow"]
    refused = in_container(UNCONFINED, "root", "mkdir /w2 && cd /w2 && isolate-run -- true")
    assert refused.returncode == 125 and "chown 65534 /w2" in refused.stderr
    assert "/proc/self/fd" not in refused.stderr
