"""Facts about the host that explain why a mechanism is missing, and the ways out that work there.

Read from /proc, /sys and the root directory only; this module runs nothing.
The advice names real causes (a container's seccomp profile, a masked /proc,
a chroot, a sysctl that exists on this kernel) and only ways out that can
work on this host: never "start dockerd" to someone inside a container, nor a
sysctl this kernel does not have.
"""

from __future__ import annotations

import errno as errno_mod
import os
from functools import lru_cache

#: The ways out of a container, as ``docker run`` options.
DOCKER_OPTIONS = "--security-opt seccomp=unconfined --security-opt systempaths=unconfined"

#: The same ways out for a Kubernetes pod: its securityContext (docs/kubernetes.md; deploy/kubernetes/).
POD_OPTIONS = ("give the pod a seccomp profile that allows user namespaces (seccompProfile Localhost with "
               "isolate's deploy/kubernetes/seccomp-isolate.json, or Unconfined), hostUsers: false and "
               "procMount: Unmasked")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _root_fstype() -> str | None:
    """The file system type mounted at / (the last such mount wins), from /proc/self/mountinfo."""
    kind = None
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/" and " - " in line:
            kind = line.split(" - ", 1)[1].split()[0]
    return kind


@lru_cache(maxsize=1)
def container() -> str | None:
    """"docker", "podman", "kubernetes", "lxc" or "container" when this process runs in one, else None."""
    # The marker files alone are not enough (a VM image made from a container
    # image keeps /.dockerenv): a container's root is an overlay as well.
    # A pod first: every pod has the variable, whatever its runtime (a node that runs
    # pods with Docker leaves /.dockerenv too), and its ways out are the pod's spec.
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    overlay_root = _root_fstype() in ("overlay", "fuse-overlayfs", "aufs")
    if os.path.exists("/.dockerenv") and overlay_root:
        return "docker"
    if os.path.exists("/run/.containerenv") and overlay_root:
        return "podman"
    environ = _read("/proc/1/environ") or ""
    if "container=lxc" in environ:
        return "lxc"
    cgroups = _read("/proc/self/cgroup") or ""
    for marker, name in (("docker", "docker"), ("containerd", "docker"), ("kubepods", "kubernetes"),
                         ("libpod", "podman"), ("lxc", "lxc")):
        if marker in cgroups:
            return name
    return "container" if "container=" in environ else None


def seccomp_filtered() -> bool:
    """Whether this process itself already runs under a seccomp filter (a container's profile)."""
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("Seccomp:"):
            return line.split()[1:] == ["2"]
    return False


#: CAP_SETGID (6) and CAP_SETUID (7): root needs both to write a user namespace's id maps.
_SETID_CAPS = (1 << 6) | (1 << 7)


def lacks_setid_caps() -> bool:
    """Whether this process is root without CAP_SETUID or CAP_SETGID (a container's capabilities dropped)."""
    if os.geteuid() != 0:
        return False
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16) & _SETID_CAPS != _SETID_CAPS
    return False


def chrooted() -> bool:
    """Whether this process's root is not the root of PID 1 (a chroot: user namespaces are refused there)."""
    try:
        return not os.path.samestat(os.stat("/"), os.stat("/proc/1/root/"))
    except OSError:
        return False


def _sysctl(name: str) -> str | None:
    value = _read("/proc/sys/" + name.replace(".", "/"))
    return value.strip() if value is not None else None


def userns_advice(err: int) -> str:
    """Why a user namespace cannot be made here (``err`` from the attempt), and the ways out."""
    causes: list[str] = []
    outs: list[str] = []
    where = container()
    way_out = POD_OPTIONS if where == "kubernetes" else f"start the container with {DOCKER_OPTIONS}"
    setid = err == errno_mod.EPERM and lacks_setid_caps()
    if setid:
        # Root maps its ids from outside (0 to 65534), which takes these capabilities:
        # the EPERM may be theirs, not the seccomp profile's.
        causes.append("root without CAP_SETUID and CAP_SETGID cannot map its ids into a user namespace")
        user = "the pod's runAsUser" if where == "kubernetes" else "e.g. docker run -u 1000"
        outs.append(f"run as a regular user ({user}), or keep those two capabilities")
    if where and seccomp_filtered() and err == errno_mod.EPERM:
        blocks = "may also block" if setid else "blocks"
        causes.append(f"inside a {where} container whose seccomp profile {blocks} user namespaces")
        outs.append(way_out)
    elif where:
        causes.append(f"inside a {where} container")
        outs.append(way_out)
    if chrooted():
        causes.append("in a chroot (the kernel refuses user namespaces there)")
    if _sysctl("kernel.unprivileged_userns_clone") == "0" and os.geteuid() != 0:
        causes.append("kernel.unprivileged_userns_clone is 0")
        outs.append("as root: sysctl -w kernel.unprivileged_userns_clone=1")
    if _sysctl("user.max_user_namespaces") == "0":
        causes.append("user.max_user_namespaces is 0")
        outs.append("as root: sysctl -w user.max_user_namespaces=15000")
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1" and os.geteuid() != 0:
        causes.append("AppArmor restricts unprivileged user namespaces")
        outs.append("as root: sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile "
                    "for the interpreter")
    outs.append("--no-namespaces (Landlock, seccomp and rlimits only)")
    outs.append("--best-effort (runs without them, saying so)")
    cause = "; ".join(causes) if causes else "the kernel refused it"
    return f"{cause}; ways out: " + "; ".join(outs)


def proc_mount_advice() -> str:
    """Ways out when a fresh /proc cannot be mounted (a container masks parts of its /proc)."""
    where = container()
    if where == "kubernetes":
        return ("inside a kubernetes container, parts of /proc are masked, so a fresh /proc cannot be mounted; "
                "set procMount: Unmasked in the container's securityContext (it needs hostUsers: false), "
                "or run with --no-namespaces")
    if where:
        return (f"inside a {where} container, parts of /proc are masked, so a fresh /proc cannot be mounted; "
                "start the container with --security-opt systempaths=unconfined, or run with --no-namespaces")
    return ("a fresh /proc cannot be mounted here (parts of the host's /proc are covered by other mounts); "
            "run with --no-namespaces")


def filesystem_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/self/mountinfo), or "unknown"."""
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return kind


@lru_cache(maxsize=1)
def userns_error() -> int:
    """0 when this caller can create a user namespace, else the errno."""
    from .._core import lib

    return int(lib.iso_probe_userns())
