"""Unpacking a snapshot's archive of tmpfs mounts into a fresh sandbox: only into its own private areas.

The archive was made inside the sandbox a snapshot was taken of, by whatever
``tar`` that sandbox had: what it says is the program's word. The sandbox it
is unpacked into may show host directories inside the same areas (``mounts``,
``binds``, ``write=`` grants under ``/tmp``, ``/var/tmp`` or the home), which
an unpacking by path, or by that sandbox's own ``tar``, would write on the host.

So no program runs and no path is followed: the host parses the archive in
memory and writes each member through descriptors. The root of each area is
opened by the sandbox's exec server (in its mount namespace, as the program)
and sent back; from there every directory is reached by the kernel's walk
(openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV:
kernel/beneath.py), which stays on the area's own mount: a host mount inside
the area is another mount, a link is not followed, and a member beneath
either is skipped and reported. Existing
entries that are not the area's (a mount point) are never replaced; files are
created ``O_EXCL`` and owned by the program's uid.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from .._core import lib
from ..image.tarbound import BoundedTarInfo
from ..kernel.beneath import make_beneath, open_beneath
from ..kernel.links import DIR_FLAGS

_CHUNK = 1 << 20


class _Skip(Exception):
    """A member that does not land in the area's own file system: skipped, with the reason."""


@dataclass
class Area:
    """One private tmpfs mount of the sandbox, opened (its root's descriptor and file system)."""

    path: str
    fd: int
    dev: int
    #: Directories made or met, to get their own mode and time once their contents are in.
    dirs: list[tuple[list[str], int, float]] = field(default_factory=list)


def _open_area(conn: Any, path: str, host_devs: set[int]) -> Area | None:
    """The area's root, opened inside by the exec server; None when it is not a private file system."""
    try:
        reply = conn.call(lib.ISO_XS_OPEN, [path], flags=os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    if reply.fd is None:
        return None
    info = os.fstat(reply.fd)
    if not stat.S_ISDIR(info.st_mode) or info.st_dev in host_devs:
        os.close(reply.fd)
        return None
    return Area(path, reply.fd, info.st_dev)


def _descend(area: Area, parts: Sequence[str], create: bool) -> int:
    """A descriptor of the directory area/parts, each step on the area's own file system."""
    path = "/".join(parts)
    try:
        if create:
            return make_beneath(area.fd, path, 0o700, same_mount=True)
        return open_beneath(area.fd, path or ".", DIR_FLAGS, same_mount=True)
    except FileNotFoundError:
        raise _Skip("its directory is missing") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _Skip("it lies beneath a link or a file") from None
        if exc.errno == errno.EXDEV:  # the walk stays on the area's own mount (RESOLVE_NO_XDEV)
            raise _Skip("it lies in a host directory mounted there") from None
        raise


def _clear(dir_fd: int, name: str, area: Area, is_dir: bool) -> bool:
    """Make room for name; True when a directory of that name is there and stays (a directory member)."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if info.st_dev != area.dev:
        raise _Skip("a host directory or file is mounted there")
    if stat.S_ISDIR(info.st_mode):
        if is_dir:
            return True
        raise _Skip("a directory is there")
    os.unlink(name, dir_fd=dir_fd)
    return False


def _member(tar: tarfile.TarFile, member: tarfile.TarInfo, area: Area, parts: list[str],
            owner: tuple[int, int] | None) -> None:
    parent = _descend(area, parts[:-1], create=True)
    name = parts[-1]
    try:
        kept = _clear(parent, name, area, member.isdir())
        mode = member.mode & 0o1777  # no set-id bit: the host makes these files, not the program
        if member.isdir():
            if not kept:
                os.mkdir(name, 0o700, dir_fd=parent)
                if owner:
                    os.chown(name, *owner, dir_fd=parent, follow_symlinks=False)
                area.dirs.append((parts, mode, member.mtime))  # a directory that was there keeps its own
        elif member.isreg():
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=parent)
            try:
                _write(tar, member, fd)
                if owner:
                    os.fchown(fd, *owner)
                os.fchmod(fd, mode)
                os.utime(fd, (member.mtime, member.mtime))
            finally:
                os.close(fd)
        elif member.issym():
            os.symlink(member.linkname, name, dir_fd=parent)  # stored, never followed
            if owner:
                os.chown(name, *owner, dir_fd=parent, follow_symlinks=False)
        elif member.islnk():
            target = _inside(member.linkname, area)
            if target is None:
                raise _Skip(f"it links to {member.linkname}, outside {area.path}")
            src = _descend(area, target[:-1], create=False)
            try:
                if os.stat(target[-1], dir_fd=src, follow_symlinks=False).st_dev != area.dev:
                    raise _Skip("it links to a host file mounted there")
                os.link(target[-1], name, src_dir_fd=src, dst_dir_fd=parent, follow_symlinks=False)
            finally:
                os.close(src)
        elif member.isfifo():
            os.mkfifo(name, mode, dir_fd=parent)
            if owner:
                os.chown(name, *owner, dir_fd=parent, follow_symlinks=False)
        else:
            raise _Skip("a device is not restored")
    finally:
        os.close(parent)


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, fd: int) -> None:
    """The member's data into fd; a sparse one's holes stay holes (as tar --sparse made them)."""
    source = tar.extractfile(member)
    assert source is not None
    sparse: list[tuple[int, int]] | None = getattr(member, "sparse", None)  # typeshed says int: it is not
    regions = sparse if sparse is not None else [(0, member.size)]
    for offset, length in regions:
        source.seek(offset)
        while length > 0 and (chunk := source.read(min(length, _CHUNK))):
            view = memoryview(chunk)
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset, length = view[written:], offset + written, length - written
    os.ftruncate(fd, member.size)


def _inside(name: str, area: Area) -> list[str] | None:
    """The components of archive member name within area (strictly beneath its root), else None."""
    parts = [p for p in name.strip("/").split("/") if p not in ("", ".")]
    prefix = [p for p in area.path.split("/") if p]
    if ".." in parts or len(parts) <= len(prefix) or parts[:len(prefix)] != prefix:
        return None
    return parts[len(prefix):]


def _finish_dirs(area: Area) -> None:
    """Directories get their mode and time last, deepest first (a read-only one is filled before)."""
    for parts, mode, mtime in sorted(area.dirs, key=lambda d: -len(d[0])):
        try:
            fd = _descend(area, parts, create=False)
        except (_Skip, OSError):
            continue
        try:
            os.fchmod(fd, mode)
            os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)


def unpack(conn: Any, archive: IO[bytes], areas: Sequence[str], host_paths: Sequence[str],
           owner: tuple[int, int] | None) -> list[str]:
    """Unpack archive (a seekable file) into the sandbox behind conn, only into areas; the members skipped,
    each with why.

    host_paths: the host directories and files the sandbox shows (its mounts' and grants' sources), whose
    file systems an area's root must not be on. owner: the program's uid and gid, given to what is made
    (None: the caller's own, who is the program's).
    """
    host_devs = set()
    for path in host_paths:
        try:
            host_devs.add(os.stat(path).st_dev)
        except OSError:
            continue
    opened: dict[str, Area | None] = {}
    skipped: list[str] = []
    try:
        with tarfile.open(fileobj=archive, mode="r:", tarinfo=BoundedTarInfo) as tar:
            for member in tar:
                found = None
                for path in areas:
                    parts = _inside(member.name, Area(path, -1, 0))
                    if parts is not None:
                        found = (path, parts)
                        break
                if found is None:
                    skipped.append(f"/{member.name.lstrip('/')}: not in a private tmpfs mount of this sandbox")
                    continue
                path, parts = found
                if path not in opened:
                    opened[path] = _open_area(conn, path, host_devs)
                area = opened[path]
                if area is None:
                    skipped.append(f"/{member.name.lstrip('/')}: {path} is not a private tmpfs mount here")
                    continue
                try:
                    _member(tar, member, area, parts, owner)
                except _Skip as why:
                    skipped.append(f"/{member.name.lstrip('/')}: {why}")
        for area in opened.values():
            if area is not None:
                _finish_dirs(area)
    finally:
        for area in opened.values():
            if area is not None:
                os.close(area.fd)
    return skipped
