"""Trees between the caller's machine and a node: a workspace's source out, a commit's tree back.

A tar is only the container. Packing walks the tree without following a link
(a link travels as a link); unpacking makes each entry relative to its
parent's descriptor, never following a link on the way (a member named
``a/b`` after a link ``a`` is refused, not written through it), and takes
regular files, directories and links only, without set-id or sticky bits.
What a link points at is not judged here: nothing that reads the unpacked
tree follows links out of it (a workspace copy, commit and diff refuse them).

A tar is made in memory and has no holes: a tree whose files' sizes pass
``limit`` is refused before packing (a program's sparse file of a terabyte
costs its disk nothing, and would have cost the node's memory all of it).
"""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile
from collections.abc import Callable

from ..image.tarbound import BoundedTarInfo
from ..kernel.beneath import make_beneath
from ..kernel.links import DIR_FLAGS
from ..model.errors import IsolationError

#: The most a commit carries to the caller's machine: its files' sizes, holes counted (see above).
MAX_PACKED = 1 << 30



def pack_tree(path: str, skip: Callable[[str], bool] | None = None, limit: int | None = None) -> bytes:
    """A tar of the directory ``path``, without the entries whose name ``skip`` picks (at any depth);
    ``limit``: the most its files' sizes may add up to (IsolationError past it, naming the largest)."""
    if limit is not None:
        _check_size(path, limit)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if skip is not None and skip(os.path.basename(info.name)):
            return None
        return info if info.isreg() or info.isdir() or info.issym() else None

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in sorted(os.listdir(path)):
            archive.add(os.path.join(path, name), arcname=name, recursive=True, filter=keep)
    return buffer.getvalue()


def _check_size(path: str, limit: int) -> None:
    total, largest = 0, (0, "")
    for top, _dirs, files in os.walk(path):  # links are neither walked nor sized (they travel as links)
        for name in files:
            info = os.lstat(os.path.join(top, name))
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
                largest = max(largest, (info.st_size, os.path.relpath(os.path.join(top, name), path)))
    if total > limit:
        raise IsolationError(f"the workspace's files come to {total} bytes ({largest[1]}: {largest[0]}), more than "
                             f"the {limit} a commit carries to this machine; commit(on_node=True) writes on the "
                             "node, or remove what is not wanted")


def _parts(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise OSError(errno.EINVAL, "a name that leaves the tree", name)
    return parts


def _open_parent(root_fd: int, parts: list[str]) -> int:
    """A descriptor of the directory that holds parts[-1], made as needed, no link followed."""
    return make_beneath(root_fd, "/".join(parts[:-1]), 0o755)  # ELOOP/ENOTDIR: a link or a file on the way


def unpack_tree(data: bytes, into: str) -> None:
    """Unpack ``pack_tree``'s tar into the (new, empty) directory ``into`` (see the module's docstring)."""
    root_fd = os.open(into, DIR_FLAGS)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=BoundedTarInfo) as archive:
            for member in archive:
                if not (member.isreg() or member.isdir() or member.issym()):
                    continue
                parts = _parts(member.name)
                parent = _open_parent(root_fd, parts)
                try:
                    _make(archive, member, parent, parts[-1])
                finally:
                    os.close(parent)
    finally:
        os.close(root_fd)


def _make(archive: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str) -> None:
    mode = member.mode & 0o777
    if member.isdir():
        try:
            os.mkdir(name, mode | 0o700, dir_fd=parent)
        except FileExistsError:
            os.close(os.open(name, DIR_FLAGS, dir_fd=parent))  # a directory already, not a link
        return
    if member.issym():
        os.symlink(member.linkname, name, dir_fd=parent)
        return
    source = archive.extractfile(member)
    assert source is not None
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    with os.fdopen(fd, "wb") as out:
        while chunk := source.read(1 << 20):
            out.write(chunk)
