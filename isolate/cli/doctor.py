"""``isolate-run doctor``: what this host can enforce, mechanism by mechanism.

Each check exercises the real mechanism where it can (a user namespace is
created, a sandbox is started) rather than guessing from version numbers.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .._version import __version__


@dataclass
class Check:
    mechanism: str
    available: bool
    detail: str


DOCTOR_HINT = "; run `isolate-run doctor` to see what this host can enforce"


def _check(name: str, probe: Callable[[], tuple[bool, str]]) -> Check:
    try:
        ok, detail = probe()
    except Exception as exc:  # a doctor reports every failure, it never crashes
        # Messages elsewhere send the user here: the doctor must not send them back.
        message = str(exc).replace(DOCTOR_HINT, "")
        ok, detail = False, f"{type(exc).__name__}: {message}"
    return Check(name, ok, detail)


def _landlock() -> tuple[bool, str]:
    from ..kernel import landlock

    abi = landlock.abi()
    if abi == 0:
        return False, "the kernel has no Landlock (needs Linux 5.13+ with lsm=landlock)"
    extras = []
    if abi >= 4:
        extras.append("TCP bind/connect rules")
    if abi >= 5:
        extras.append("ioctl on devices")
    if abi >= 6:
        extras.append("signal and abstract-socket scoping")
    if abi >= 9:
        extras.append("unix socket lookup rules")
    unix = "" if abi >= 9 else "; unix sockets under network none/loopback: connect() supervised by the init"
    return True, f"ABI {abi}" + (f" ({', '.join(extras)})" if extras else "") + unix


def _userns() -> tuple[bool, str]:
    from ..backends import native
    from ..kernel import hostinfo

    err = native.userns_error()
    where = hostinfo.container()
    inside = f" (inside a {where} container)" if where else ""
    if err:
        return False, f"cannot create a user namespace{inside}: {os.strerror(err)}: {hostinfo.userns_advice(err)}"
    return True, f"unprivileged user namespaces work for this caller{inside}"


def _sandbox() -> tuple[bool, str]:
    import tempfile

    from ..model.policy import Policy
    from ..oneshot import runs as popen

    with tempfile.TemporaryDirectory(prefix="isolate-doctor-") as workdir:
        result = popen.run(["true"], policy=Policy(backend="native"), cwd=workdir)
        if result.returncode != 0:
            return False, f"a default sandbox ran /bin/true with status {result.returncode}"
    namespaces = ",".join(result.report.enforced.get("namespaces", []))
    return True, f"started a sandbox with namespaces {namespaces}, a built root and an init"


def _egress() -> tuple[bool, str]:
    """Egress by name: a sandbox whose allow-list is empty asks isolate's DNS for a name, which refuses it."""
    import tempfile

    from ..model.policy import Egress, Policy
    from ..oneshot import runs as popen

    with tempfile.TemporaryDirectory(prefix="isolate-doctor-") as workdir:
        result = popen.run(["getent", "hosts", "isolate-doctor.invalid"],
                           policy=Policy(backend="native", network=Egress(())), cwd=workdir, capture_output=True)
    denied = [e.get("host") for e in (result.report.egress or {}).get("denied", [])]
    if "isolate-doctor.invalid" not in denied:
        return False, f"the mediator did not answer the sandbox's DNS (getent exited {result.returncode})"
    return True, ("the mediator answers inside a sandbox (its DNS refused a name off the allow-list); "
                  "--allow-host works")


def _idmap() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return True, "not needed: the caller is not root, the program runs as the caller"
    from .._core import ffi, lib
    from ..backends import native

    fd = native._idmap_userns(native.NOBODY, native.NOBODY)
    tree = lib.iso_open_idmapped_tree(os.fsencode(os.getcwd()), fd)
    if tree < 0:
        return False, f"idmapped mount of {os.getcwd()} failed: {os.strerror(ffi.errno)} (writable paths need it)"
    os.close(tree)
    return True, f"idmapped mounts work on {os.getcwd()} (files the program writes stay the caller's)"


def _subids() -> tuple[bool, str]:
    from ..kernel import subids

    if os.geteuid() == 0:
        from ..kernel import privateids

        ids = privateids.cached()
        if isinstance(ids, str):
            return False, f"an image's User (other than root) is refused (65534 for best effort): {ids}"
        return True, f"an image's User runs in isolate's private id range: {ids.describe()}"
    found = subids.find(os.geteuid(), os.getegid())
    if isinstance(found, str):
        return False, f"an image's User (other than root) runs as the caller: {found}"
    return True, f"an image's User runs as that user: {found.describe()}"


def _seccomp() -> tuple[bool, str]:
    from ..kernel import seccomp

    ok, detail = seccomp.available()
    return bool(ok), str(detail)


def _cgroups() -> tuple[bool, str]:
    from ..kernel import cgroup

    info: dict[str, Any] = cgroup.doctor_info()
    features: dict[str, dict[str, Any]] = info.get("features", {})
    parts = []
    for name, feature in sorted(features.items()):
        if feature.get("available"):
            parts.append(f"{name} ({feature.get('version')}: {feature.get('path')})")
        else:
            parts.append(f"{name}: no ({feature.get('why')})")
    usable = any(f.get("available") for f in features.values())
    detail = f"versions {', '.join(info.get('versions', [])) or 'none'}; " + "; ".join(parts)
    if info.get("hint"):
        detail += f"; way out: {info['hint']}"
    return usable, detail


def _docker() -> tuple[bool, str]:
    from ..backends import docker

    ok, detail = docker.available()
    return bool(ok), str(detail)


CHECKS: list[tuple[str, Callable[[], tuple[bool, str]]]] = [
    ("landlock", _landlock),
    ("user-namespaces", _userns),
    ("sandbox", _sandbox),
    ("egress", _egress),
    ("idmapped-mounts", _idmap),
    ("subordinate-ids", _subids),
    ("seccomp", _seccomp),
    ("cgroups", _cgroups),
    ("docker", _docker),
]


def run_checks() -> list[Check]:
    return [_check(name, probe) for name, probe in CHECKS]


def doctor_main(args: list[str]) -> int:
    unknown = [a for a in args if a != "--json"]
    if unknown:
        print(f"isolate-run doctor: unknown option {unknown[0]!r} (the only one is --json)", file=sys.stderr)
        return 125
    checks = run_checks()
    host: dict[str, Any] = {
        "isolate": __version__,
        "kernel": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "uid": os.geteuid(),
    }
    if "--json" in args:
        print(json.dumps({"host": host, "checks": [asdict(c) for c in checks]}, indent=2))
        return 0
    print(f"isolate {host['isolate']} on Linux {host['kernel']} ({host['machine']}), uid {host['uid']}")
    width = max(len(c.mechanism) for c in checks)
    for c in checks:
        mark = "yes" if c.available else "no "
        print(f"  {c.mechanism.ljust(width)}  {mark}  {c.detail}")
    return 0
