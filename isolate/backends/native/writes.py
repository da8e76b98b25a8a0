"""A root caller's writable paths: how the program gets to write them (idmapped mounts, their
owner's uid, or plain permissions), probed once in the parent; and the system paths a default
writable working directory may not be.
"""

from __future__ import annotations

import errno as errno_mod
import os
from collections.abc import Sequence
from functools import lru_cache

from ..._core import ffi, lib
from ...kernel import grants
from ...kernel.hostinfo import filesystem_type as _filesystem_type
from ...model.errors import PolicyError, UnsupportedError
from ...model.policy import Policy

_IDMAP_PROBED: dict[tuple[int, int, int], str | None] = {}


def _idmap_problem(device: int, path: str, uid: int, gid: int) -> str | None:
    """None when ``path``'s file system (``device``) takes an idmapped mount here, else why not.

    Probed once per file system (and mapping), in the parent, with the very
    call a run makes; never discovered by a failure in the child. (A kept
    sandbox's workspace is a new directory each time: the path is not the key.)
    """
    key = (device, uid, gid)
    if key not in _IDMAP_PROBED:
        _IDMAP_PROBED[key] = _probe_idmap(path, uid, gid)
    return _IDMAP_PROBED[key]


def _probe_idmap(path: str, uid: int, gid: int) -> str | None:
    userns = int(lib.iso_make_idmap_userns(uid, gid))
    if userns < 0:
        err = ffi.errno
        return f"a user namespace for the mapping cannot be made ({os.strerror(err)})"
    fd = int(lib.iso_open_idmapped_tree(os.fsencode(path), userns))
    err = ffi.errno
    os.close(userns)
    if fd >= 0:
        os.close(fd)
        return None
    if err == errno_mod.EPERM:
        return ("this process may not make idmapped mounts (EPERM: no CAP_SYS_ADMIN over the file system, "
                "as inside a container)")
    kind = _filesystem_type(path)
    return (f"its file system ({kind}) does not support idmapped mounts ({os.strerror(err)}; overlayfs, a "
            "container's root, never does; tmpfs only from Linux 6.3)")


def _writable_by(info: os.stat_result, uid: int, gid: int) -> bool:
    if info.st_uid == uid:
        return bool(info.st_mode & 0o200)
    if info.st_gid == gid:
        return bool(info.st_mode & 0o020)
    return bool(info.st_mode & 0o002)


def _write_route(write: Sequence[str], policy: Policy, uid: int, gid: int,
                 no_idmap: str | None = None) -> tuple[str, int, int]:
    """How a root caller's program gets its writable paths: (route, program uid, program gid).

    "idmapped" where every writable path's file system takes an idmapped
    mount (the program is uid 65534 but owns what root owns there). Where one
    does not, the program must still never hold power over host files, so it
    is never root: "owner" runs it as the one non-root owner of all the
    writable paths (unless uid= says otherwise), "plain" keeps 65534 where the
    paths are writable by it; otherwise the run is refused, naming the cause
    and the ways out.
    """
    infos = {path: os.stat(grants.host_symlinks(path, "write")[1]) for path in write}
    problems = {path: no_idmap or _idmap_problem(info.st_dev, grants.host_symlinks(path, "write")[1], uid, gid)
                for path, info in infos.items()}
    failing = {path: why for path, why in problems.items() if why}
    if not failing:
        return "idmapped", uid, gid
    path, why = next(iter(failing.items()))
    owners = {(info.st_uid, info.st_gid) for info in infos.values()}
    if policy.uid is None and len(owners) == 1 and next(iter(owners))[0] != 0:
        owner_uid, owner_gid = next(iter(owners))
        # Never the root group: a root-group directory gives the program 65534's group instead.
        return "owner", owner_uid, (policy.gid if policy.gid is not None else owner_gid or gid)
    if all(_writable_by(info, uid, gid) for info in infos.values()):
        return "plain", uid, gid
    raise UnsupportedError(
        f"write: {path}: a root caller's program runs as uid {uid}, which cannot write there: it would own its "
        f"writable paths through an idmapped mount, but {why}; ways out: work in a directory owned by a regular "
        "user (the program then "
        f"runs as that user), make {path} writable by uid {uid} (chown {uid} {path}), pass --uid N for a "
        "directory owned by uid N, or run isolate-run as a regular user"
    )


@lru_cache(maxsize=8)
def _idmap_userns(uid: int, gid: int) -> int:
    fd = int(lib.iso_make_idmap_userns(uid, gid))
    if fd < 0:
        err = ffi.errno
        raise UnsupportedError(
            f"a root caller's writable paths need an idmapped mount, and creating its user namespace failed: "
            f"{os.strerror(err)}; run as a regular user, or pass uid= of the paths' owner"
        )
    return fd


#: Where a root caller's default writable cwd is refused: the default read-only
#: system paths and the kernel's own trees. Writable there, the program
#: (owning what root owns, through the idmapped mount) could rewrite /etc.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/boot",
                "/proc", "/sys", "/dev")


def _refuse_system_cwd(real_cwd: str) -> None:
    """Refuse "cwd writable" (the default ".") for a root caller whose cwd is a system path.

    An explicit absolute grant of the same directory is the caller's choice and stays allowed."""
    for top in SYSTEM_PATHS:
        real_top = os.path.realpath(top)
        if real_cwd == real_top or real_cwd.startswith(real_top.rstrip("/") + "/"):
            raise PolicyError(
                f"write: the working directory {real_cwd} is a system path ({top}), and the default makes the "
                "working directory writable: run from a project directory, or grant it explicitly by its path "
                f"(--rw {real_cwd}), or --chdir to a directory that is not a system path",
                "write",
            )
