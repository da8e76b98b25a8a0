"""Host volumes of a create request: host paths below an operator's ``--volume-root``, as isolate Mounts.

A create request names a host path; whoever sends it is not the operator,
and a sandbox given a read-write volume can plant links and rename
directories in it between two creates. So a path is taken only:

- below a root the operator gave (``--volume-root DIR``, resolved once at
  start), with no ``..`` and no link anywhere below the root: each
  component is opened from its parent's descriptor with ``O_NOFOLLOW``
  (isolate.kernel.links.open_directory reaches the root itself the same
  way);
- and the inode the sandbox then shows at the mount path is the one this
  walk opened (compared by device and inode from inside, after start): a
  directory swapped between the walk and isolate's own open of the bind
  source ends the sandbox, refused.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..kernel.links import open_directory
from ..model.errors import PolicyError
from ..model.policy import Mount
from .models import ApiError, VolumeSpec

_WALK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _refused(message: str) -> ApiError:
    return ApiError(400, "VOLUME_NOT_ALLOWED", message)


def check_roots(paths: Sequence[str]) -> tuple[str, ...]:
    """The operator's --volume-root directories as real paths (PolicyError for one that is not a directory)."""
    out = []
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            raise PolicyError(f"--volume-root {path}: not a directory", "volume-root")
        if real == "/":
            raise PolicyError("--volume-root /: the whole filesystem cannot be a volume root; give the directory "
                              "volumes may come from", "volume-root")
        if real not in out:
            out.append(real)
    return tuple(out)


@dataclass(frozen=True)
class Opened:
    """A volume's host path as the walk found it: the mount to make and the inode it must show."""

    spec: VolumeSpec
    mount: Mount
    identity: tuple[int, int]


def _walk(root: str, relative: list[str], shown: str) -> tuple[int, int]:
    fd = open_directory(root)
    try:
        for part in relative:
            try:
                child = os.open(part, _WALK, dir_fd=fd)
            except FileNotFoundError:
                raise _refused(f"volume host path {shown}: does not exist") from None
            info = os.fstat(child)
            os.close(fd)
            fd = child
            if stat.S_ISLNK(info.st_mode):
                raise _refused(f"volume host path {shown}: {part} is a link, which is not followed below a volume "
                               "root (give the real path, under the root)")
        info = os.fstat(fd)
        if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
            raise _refused(f"volume host path {shown}: not a directory or regular file")
        return info.st_dev, info.st_ino
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            raise _refused(f"volume host path {shown}: a component on the way is not a directory") from None
        raise _refused(f"volume host path {shown}: {exc.strerror}") from None
    finally:
        os.close(fd)


def open_volumes(specs: Sequence[VolumeSpec], roots: Sequence[str]) -> list[Opened]:
    """Check each host volume against the roots and open it (ApiError 400 for anything else)."""
    out = []
    for spec in specs:
        path = spec.host_path
        if not roots:
            raise _refused(f"volumes[{spec.name}]: this server mounts no host paths (its operator gives the "
                           "directories volumes may come from with --volume-root DIR)")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise _refused(f"volumes[{spec.name}]: host path {path} goes through '..', which is not followed")
        clean = "/" + "/".join(parts)
        root = next((r for r in roots if clean == r or clean.startswith(r.rstrip("/") + "/")), None)
        if root is None:
            raise _refused(f"volumes[{spec.name}]: host path {clean} is not below a volume root of this server "
                           f"({', '.join(roots)})")
        relative = [p for p in clean[len(root):].split("/") if p]
        identity = _walk(root, relative, clean)
        try:
            mount = Mount(clean, spec.mount_path, "ro" if spec.read_only else "rw")
        except PolicyError as exc:
            raise _refused(f"volumes[{spec.name}]: {exc}") from None
        out.append(Opened(spec, mount, identity))
    return out


def verify(box: Any, opened: Sequence[Opened]) -> None:
    """After start: each mount path shows the inode the walk opened, else the volume was swapped (refused)."""
    for item in opened:
        try:
            seen = box.stat(item.mount.target, follow_symlinks=False)
        except OSError as exc:
            raise _refused(f"volumes[{item.spec.name}]: {item.mount.target} cannot be seen inside ({exc})") from None
        if (seen.dev, seen.ino) != item.identity:
            raise _refused(f"volumes[{item.spec.name}]: host path {item.mount.source} changed while the sandbox "
                           "started (replaced?); not mounted")
