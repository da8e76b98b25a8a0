"""Volumes of a create request, as isolate Mounts: host paths below an operator's ``--volume-root``, and
named (``pvc``) volumes, directories of the server's volume store.

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

A named volume is what a Docker named volume is to Docker: a directory the
server keeps (``<volume store>/<claimName>``, made on first use unless
``createIfNotExists`` is false), walked the same way from the store, its
``subPath`` included; one the create made is removed with the last sandbox
using it when ``deleteOnSandboxTermination`` asks. Who uses a named volume
is counted from the moment a create claims it (NamedVolumes), under the lock
that decides whether that create made it: a create still starting counts,
whatever order the starts end in, and a volume about to be removed is first
renamed out of the store under that lock, so no create can take it then.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..kernel.beneath import open_beneath
from ..kernel.links import open_directory
from ..model.errors import PolicyError
from ..model.policy import Mount
from .models import ApiError, VolumeSpec

_WALK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _refused(message: str) -> ApiError:
    return ApiError(400, "VOLUME_NOT_ALLOWED", message)


def check_roots(paths: Sequence[str], flag: str = "--volume-root") -> tuple[str, ...]:
    """The operator's --volume-root (or --volume-store) directories as real paths (PolicyError for one that is
    not a directory)."""
    out = []
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            raise PolicyError(f"{flag} {path}: not a directory", flag.lstrip("-"))
        if real == "/":
            raise PolicyError(f"{flag} /: the whole filesystem cannot hold volumes; give the directory volumes "
                              "may come from", flag.lstrip("-"))
        if real not in out:
            out.append(real)
    return tuple(out)


@dataclass(frozen=True)
class Opened:
    """A volume's host path as the walk found it: the mount to make and the inode it must show."""

    spec: VolumeSpec
    mount: Mount
    identity: tuple[int, int]
    #: A named volume this create made (its directory in the store), else None.
    made: str | None = None
    #: A named volume's directory in the store, claimed (NamedVolumes.release it once).
    held: str | None = None


def _walk(root: str, relative: list[str], shown: str) -> tuple[int, int]:
    fd = open_directory(root)
    try:
        target = open_beneath(fd, "/".join(relative) or ".", _WALK)
    except OSError as exc:
        raise _walk_refused(shown, exc) from None
    finally:
        os.close(fd)
    try:
        info = os.fstat(target)
    finally:
        os.close(target)
    if stat.S_ISLNK(info.st_mode):  # the last name, opened as itself (O_PATH | O_NOFOLLOW)
        raise _link_refused(shown, relative[-1])
    if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
        raise _refused(f"volume host path {shown}: not a directory or regular file")
    return info.st_dev, info.st_ino


def _walk_refused(shown: str, exc: OSError) -> ApiError:
    if exc.errno == errno.ENOENT:
        return _refused(f"volume host path {shown}: does not exist")
    if exc.errno == errno.ELOOP:  # the walk names the path as far as the link
        return _link_refused(shown, os.path.basename(exc.filename or ""))
    if exc.errno == errno.ENOTDIR:
        return _refused(f"volume host path {shown}: a component on the way is not a directory")
    return _refused(f"volume host path {shown}: {exc.strerror}")


def _link_refused(shown: str, part: str) -> ApiError:
    return _refused(f"volume host path {shown}: {part} is a link, which is not followed below a volume root (give "
                    "the real path, under the root)")


class NamedVolumes:
    """The named volumes in use: how many creates and sandboxes hold each, and which go with their last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[str, int] = {}
        self._doomed: set[str] = set()

    def claim(self, spec: VolumeSpec, store: str) -> tuple[str, str | None]:
        """Hold the named volume (made when missing and asked to): its path, and that path again if made here."""
        assert spec.claim is not None
        path = os.path.join(store, spec.claim)
        with self._lock:
            made = _claim_directory(spec, store)
            self._users[path] = self._users.get(path, 0) + 1
            if made is not None and spec.delete_on_end:
                self._doomed.add(path)
        return path, made

    def adopt(self, path: str, doomed: bool) -> None:
        """Hold a named volume again for a sandbox a restarted server serves (as its record says)."""
        with self._lock:
            self._users[path] = self._users.get(path, 0) + 1
            if doomed:
                self._doomed.add(path)

    def doomed(self, path: str) -> bool:
        """Whether the volume goes with its last holder."""
        with self._lock:
            return path in self._doomed

    def users(self, path: str) -> int:
        with self._lock:
            return self._users.get(path, 0)

    def release(self, path: str, undo: bool = False) -> None:
        """One holder less. The last removes the volume when the create that made it asked; ``undo``: a create
        that made it failed, and it goes if no one else holds it and it is still empty."""
        with self._lock:
            left = self._users.get(path, 1) - 1
            if left > 0:
                self._users[path] = left
                return
            self._users.pop(path, None)
            if path not in self._doomed:
                if undo:
                    with contextlib.suppress(OSError):
                        os.rmdir(path)
                return
            self._doomed.discard(path)
            # Out of the store before the lock goes: a create from now on makes a new volume of that name.
            trash = os.path.join(os.path.dirname(path), f".removed-{secrets.token_hex(8)}")
            try:
                os.rename(path, trash)
            except OSError:
                return
        shutil.rmtree(trash, ignore_errors=True)  # never follows a link planted inside


def _claim_directory(spec: VolumeSpec, store: str) -> str | None:
    """Make the named volume's directory in the store when missing and asked to; its path if made here."""
    assert spec.claim is not None
    fd = open_directory(store)
    try:
        if not spec.create:
            return None  # the walk refuses it when missing
        try:
            os.mkdir(spec.claim, 0o755, dir_fd=fd)
        except FileExistsError:
            return None
        return os.path.join(store, spec.claim)
    except OSError as exc:
        raise ApiError(500, "VOLUME_STORE_ERROR", f"volumes[{spec.name}]: cannot make named volume {spec.claim} "
                       f"in {store}: {exc.strerror}") from None
    finally:
        os.close(fd)


def release(opened: Sequence[Opened], named: NamedVolumes | None, undo: bool = False) -> None:
    """Let go of the named volumes of ``opened`` (``undo``: their create failed)."""
    for item in opened:
        if item.held is not None and named is not None:
            named.release(item.held, undo=undo and item.made is not None)


def open_volumes(specs: Sequence[VolumeSpec], roots: Sequence[str], store: str | None = None,
                 named: NamedVolumes | None = None) -> list[Opened]:
    """Check each volume (host paths against the roots, named ones in the store) and open it (ApiError 400).

    The named volumes are held in ``named`` (release them, see ``release``); on a refusal, none is."""
    out: list[Opened] = []
    try:
        for spec in specs:
            out.append(_open(spec, roots, store, named))
    except BaseException:
        release(out, named, undo=True)
        raise
    return out


def _open(spec: VolumeSpec, roots: Sequence[str], store: str | None, named: NamedVolumes | None) -> Opened:
    if spec.claim is not None:
        assert store is not None and named is not None
        held, made = named.claim(spec, store)
        try:
            relative = [spec.claim, *(p for p in spec.host_path.split("/") if p not in ("", "."))]
            identity = _walk(store, relative, f"named volume {'/'.join(relative)}")
            try:
                mount = Mount(os.path.join(store, *relative), spec.mount_path, "ro" if spec.read_only else "rw")
            except PolicyError as exc:
                raise _refused(f"volumes[{spec.name}]: {exc}") from None
        except BaseException:
            named.release(held, undo=made is not None)
            raise
        return Opened(spec, mount, identity, made, held)
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
    return Opened(spec, mount, identity)


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
