"""A directory tree written as an OCI layer: a store's unpacked layer (to push it), or a sandbox's upper layer
(to commit it).

The tar is canonical, so that the same tree gives the same blob (a push of an
image the registry holds already uploads nothing, and a layer committed,
unpacked and exported again keeps its digest): entries in sorted order, PAX
headers, no user or group names, integer modification times (0 for links,
FIFOs and whiteouts, whose times the store does not keep), no set-id bits (the
store holds none), gzip with no name and no time.

What overlayfs keeps becomes what OCI says: a 0/0 character device is the
whiteout ``.wh.NAME``, a directory whose ``user.overlay.opaque`` is ``y`` is
followed by ``.wh..wh..opq``. Another device node is refused (never opened),
a FIFO is an entry (never opened), a socket is left out (it is no content:
whoever made it is gone). Every node is reached from the descriptor of its
directory with ``O_NOFOLLOW``, a file is opened ``O_NONBLOCK`` and checked to
be the regular file just listed, and a link is read, never followed: a tree a
sandbox wrote (its upper layer) is read safely from the host.

Owners: a root caller's tree keeps its owners, ``owners`` mapping host ids to
the image's (a sandbox's program ran as another uid); a regular user's files
are all that user's on disk, and are written as root's (0:0), which is what
they were in the image.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from ..kernel.links import DIR_FLAGS
from ..model.errors import IsolationError
from .unpack import OPAQUE_MARKER, OPAQUE_XATTR, WHITEOUT_PREFIX

GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_DEPTH = 512
_CHUNK = 1 << 20


@dataclass(frozen=True)
class LayerBlob:
    """A layer written: its file (gzip), its digest, the digest of its tar (the config's diff id), its size."""

    path: str
    digest: str
    diff_id: str
    size: int
    media_type: str = GZIP_LAYER


class _Hashing(io.RawIOBase):
    """A writer that hashes and counts what goes through it."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__()
        self.out = out
        self.sha = hashlib.sha256()
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.out.write(view)
        self.count += len(view)
        return len(view)


class _File(io.RawIOBase):
    """A regular file's descriptor read by tarfile, exactly ``size`` bytes (it may not grow or shrink)."""

    def __init__(self, fd: int, size: int, name: str) -> None:
        super().__init__()
        self.fd, self.left, self.name = fd, size, name

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.left)
        if want == 0:
            return 0
        data = os.read(self.fd, want)
        if not data:
            raise IsolationError(f"layer: {self.name} shrank while it was read: refused (pause the sandbox)")
        buffer[:len(data)] = data
        self.left -= len(data)
        return len(data)


def write_layer(root_fd: int, path: str, *, owners: Callable[[int, int], tuple[int, int]] | None = None,
                what: str = "layer", leave_out: frozenset[str] = frozenset(), max_size: int | None = None) -> LayerBlob:
    """Write the tree under ``root_fd`` as a gzip layer at ``path`` (created, never followed).

    ``leave_out``: paths (relative, no leading slash) not written, nor the directories on their way unless
    something else in them is (a sandbox's mount points, which the plan made in its upper layer). ``max_size``:
    the most its files may come to, each counted at its size (holes too) before it is read."""
    map_ids = owners or (lambda uid, gid: (uid, gid))

    def fill(tar: tarfile.TarFile) -> None:
        writer = _Writer(tar, os.geteuid() == 0, map_ids, what, leave_out)
        writer.own_tree = True
        writer.budget = None if max_size is None else [max_size]
        writer.tree(root_fd, "", 0)

    return _write(path, fill)


def layer_into(tar: tarfile.TarFile, root_fd: int, *, what: str, budget: list[int] | None = None) -> None:
    """Add the tree under ``root_fd`` to ``tar`` as ``write_layer`` writes it (whiteouts, opaque directories,
    links never followed). ``budget``: ``[bytes]`` its files may come to (shared by the calls given it)."""
    writer = _Writer(tar, os.geteuid() == 0, lambda uid, gid: (uid, gid), what)
    writer.own_tree = True
    writer.budget = budget
    writer.tree(root_fd, "", 0)


def write_copy(sources: list[tuple[int, str]], destination: str, path: str, *, into: bool,
               exclude: Callable[[str], bool] | None = None, what: str = "copy",
               existing: Callable[[str], os.stat_result | None] | None = None,
               prefixes: list[str] | None = None, owner: tuple[int, int] | None = None,
               mode: int | None = None) -> LayerBlob:
    """A layer of host files (``sources``: (directory descriptor, name) pairs) put at ``destination`` (absolute)
    as COPY puts them: a directory's contents into it, a file (or link, never followed) at it, or into it when
    ``into``. Owned by root, modification times 0 (the layer depends on names, contents and modes only), the
    directories on the way as the image has them (``existing(rel)``: its node there, or None), else made 0755
    root's. ``exclude``: paths left out, relative to a source directory, or prefixed with that source's entry of
    ``prefixes`` when given (a build context's paths). ``owner``: (uid, gid) of what is copied and of the
    directories the copy makes, instead of root (COPY --chown); ``mode``: the permission bits of what is copied,
    links aside (COPY --chmod)."""
    target = destination.strip("/")
    uid_gid = owner if owner is not None else (0, 0)

    def fill(tar: tarfile.TarFile) -> None:
        writer = _Writer(tar, True, lambda uid, gid: uid_gid, what, fixed_time=True, exclude=exclude)
        writer.mode = mode
        parts = [p for p in target.split("/") if p]
        for i in range(1, len(parts) + (0 if not into and sources and not _is_dir(*sources[0]) else 1)):
            rel = "/".join(parts[:i])
            found = existing(rel) if existing is not None else None
            if found is not None and stat.S_ISDIR(found.st_mode):
                info = _Writer(tar, os.geteuid() == 0, lambda uid, gid: (uid, gid), what).info(rel, found,
                                                                                             tarfile.DIRTYPE)
            else:
                info = tarfile.TarInfo(rel)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                info.uid, info.gid = uid_gid
            writer.add(info)
        for number, (dir_fd, name) in enumerate(sources):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                child = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                prefix = prefixes[number].strip("/") if prefixes else ""
                writer.source_prefix = f"{prefix}/" if prefix and prefix != "." else ""
                try:
                    writer.tree(child, target + "/" if target else "", 1)
                finally:
                    os.close(child)
            else:
                rel = f"{target}/{name}" if into else target
                writer.one(dir_fd, name, rel.strip("/"), st)

    return _write(path, fill)


def _is_dir(dir_fd: int, name: str) -> bool:
    return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)


def _write(path: str, fill: Callable[[tarfile.TarFile], None]) -> LayerBlob:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        compressed = _Hashing(handle)
        with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=6) as zipped:
            plain = _Hashing(zipped)  # type: ignore[arg-type]
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                fill(tar)
    return LayerBlob(path, "sha256:" + compressed.sha.hexdigest(), "sha256:" + plain.sha.hexdigest(),
                     compressed.count)


class _Writer:
    def __init__(self, tar: tarfile.TarFile, root: bool, owners: Callable[[int, int], tuple[int, int]],
                 what: str, leave_out: frozenset[str] = frozenset(), *, fixed_time: bool = False,
                 exclude: Callable[[str], bool] | None = None) -> None:
        self.tar, self.root, self.owners, self.what = tar, root, owners, what
        self.fixed_time, self.exclude = fixed_time, exclude
        self.source_prefix = ""  # a copy's source-relative path of the directory walked (for exclude)
        self.first_name: dict[tuple[int, int], str] = {}  # (dev, ino) of a file with several names: its first
        self.leave_out = leave_out
        self.on_the_way = {"/".join(p.split("/")[:i]) for p in leave_out for i in range(1, p.count("/") + 1)}
        self.pending: list[tarfile.TarInfo] = []  # directories on the way to a path left out, not written yet
        self.budget: list[int] | None = None  # [bytes the files may still come to], when bounded
        self.mode: int | None = None  # every entry's permission bits but a link's (COPY --chmod), when given
        #: A tree of the caller's own making (a layer of its store, a sandbox's upper layer), not a build context:
        #: what its mode keeps from its owner is read through a moment's owner bits (_readable).
        self.own_tree = False

    def add(self, info: tarfile.TarInfo, data: Any = None) -> None:
        for directory in self.pending:
            self.tar.addfile(directory)
        self.pending.clear()
        self.tar.addfile(info, data)

    def info(self, name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode) & 0o1777 if self.mode is None or kind == tarfile.SYMTYPE else self.mode
        info.uid, info.gid = self.owners(st.st_uid, st.st_gid) if self.root else (0, 0)
        info.uname = info.gname = ""
        info.mtime = int(st.st_mtime) if kind in (tarfile.REGTYPE, tarfile.DIRTYPE) and not self.fixed_time else 0
        return info

    def marker(self, name: str) -> None:
        info = tarfile.TarInfo(name)
        info.mode, info.mtime = 0o600, 0
        self.add(info)

    def tree(self, dir_fd: int, prefix: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise IsolationError(f"{self.what}: {prefix} is more than {_MAX_DEPTH} directories deep: refused")
        if not prefix and not self.fixed_time and _opaque(dir_fd):
            self.marker(OPAQUE_MARKER)
        for name in sorted(os.listdir(dir_fd)):
            rel = prefix + name
            if rel in self.leave_out:
                continue
            source_rel = self.source_prefix + name
            if self.exclude is not None and self.exclude(source_rel):
                continue
            if name.startswith(WHITEOUT_PREFIX):
                # A file named like a whiteout would be read back as one: not what the tree holds.
                raise IsolationError(f"{self.what}: /{rel}: a name starting with {WHITEOUT_PREFIX} is an OCI "
                                     "whiteout in a layer: refused")
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            mode = st.st_mode
            if stat.S_ISCHR(mode) and st.st_rdev == 0 and not self.fixed_time:  # a copy's host files: a device
                self.marker(prefix + WHITEOUT_PREFIX + name)
            elif stat.S_ISDIR(mode):
                with self._readable(dir_fd, name, rel, st, 0o500):  # held through the walk: x for each lookup
                    self._directory(dir_fd, name, rel, st, source_rel, depth)
            elif stat.S_ISLNK(mode):
                info = self.info(rel, st, tarfile.SYMTYPE)
                info.linkname = os.readlink(name, dir_fd=dir_fd)
                self.add(info)
            elif stat.S_ISREG(mode):
                self.file(dir_fd, name, rel, st)
            elif stat.S_ISFIFO(mode):
                self.add(self.info(rel, st, tarfile.FIFOTYPE))
            elif stat.S_ISSOCK(mode):
                continue
            else:
                raise IsolationError(f"{self.what}: /{rel} is a device node: refused (an image carries none)")

    def _directory(self, dir_fd: int, name: str, rel: str, st: os.stat_result, source_rel: str, depth: int) -> None:
        try:
            child = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except PermissionError:
            raise self._unreadable(rel) from None
        try:
            if (os.fstat(child).st_dev, os.fstat(child).st_ino) != (st.st_dev, st.st_ino):
                raise IsolationError(f"{self.what}: /{rel}: replaced while it was read: refused")
            info = self.info(rel, st, tarfile.DIRTYPE)
            if rel in self.on_the_way:
                self.pending.append(info)
            else:
                self.add(info)
            if not self.fixed_time and _opaque(child):
                self.marker(f"{rel}/{OPAQUE_MARKER}")
            saved, self.source_prefix = self.source_prefix, source_rel + "/"
            try:
                self.tree(child, rel + "/", depth + 1)
            finally:
                self.source_prefix = saved
            if self.pending and self.pending[-1] is info:
                self.pending.pop()  # nothing in it was written
        finally:
            os.close(child)

    @contextlib.contextmanager
    def _readable(self, dir_fd: int, name: str, rel: str, st: os.stat_result, bits: int) -> Iterator[None]:
        """``name`` made readable (``bits`` of its owner's) while the block runs, where this tree is the caller's own
        making and the caller, not root, owns it: a regular user's store keeps an image's mode-000 file (Fedora's
        /etc/shadow) as the image has it, and a program may chmod 000 what it wrote in its upper layer; root reads
        them anyway. Its mode is put back after; the node is reached through an O_PATH descriptor of the very inode
        listed (never a link: chmod through /proc follows that descriptor only)."""
        if not self.own_tree or os.geteuid() == 0 or st.st_uid != os.geteuid() or st.st_mode & bits == bits:
            yield
            return
        held = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            found = os.fstat(held)
            if (found.st_dev, found.st_ino) != (st.st_dev, st.st_ino) or stat.S_IFMT(found.st_mode) != \
                    stat.S_IFMT(st.st_mode):
                raise IsolationError(f"{self.what}: /{rel}: replaced while it was read: refused")
            through = f"/proc/self/fd/{held}"
            os.chmod(through, stat.S_IMODE(found.st_mode) | bits)
            try:
                yield
            finally:
                os.chmod(through, stat.S_IMODE(found.st_mode))
        finally:
            os.close(held)

    def _unreadable(self, rel: str) -> IsolationError:
        return IsolationError(f"{self.what}: /{rel}: its mode keeps it from this user, who cannot read it: refused "
                              "(give it read permission, or build as root)")

    def one(self, dir_fd: int, name: str, rel: str, st: os.stat_result) -> None:
        """A single non-directory (a copy's file, link or FIFO source) written as ``rel``."""
        if stat.S_ISLNK(st.st_mode):
            info = self.info(rel, st, tarfile.SYMTYPE)
            info.linkname = os.readlink(name, dir_fd=dir_fd)
            self.add(info)
        elif stat.S_ISREG(st.st_mode):
            self.file(dir_fd, name, rel, st)
        elif stat.S_ISFIFO(st.st_mode):
            self.add(self.info(rel, st, tarfile.FIFOTYPE))
        else:
            raise IsolationError(f"{self.what}: {name} is a device node or a socket: refused")

    def file(self, dir_fd: int, name: str, rel: str, st: os.stat_result) -> None:
        if st.st_nlink > 1:
            first = self.first_name.setdefault((st.st_dev, st.st_ino), rel)
            if first != rel:
                info = self.info(rel, st, tarfile.LNKTYPE)
                info.linkname = first
                self.add(info)
                return
        try:
            with self._readable(dir_fd, name, rel, st, 0o400):
                fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except PermissionError:
            raise self._unreadable(rel) from None
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise IsolationError(f"{self.what}: /{rel}: replaced while it was read: refused")
            if self.budget is not None:
                # The size read (the opened file's, not the one listed: it may have grown since), holes counted:
                # a sparse file of a few blocks may claim a terabyte, and every byte of it is read and unpacked.
                self.budget[0] -= opened.st_size
                if self.budget[0] < 0:
                    raise IsolationError(f"{self.what}: its files come to more than it may carry (at /{rel}, "
                                         f"{opened.st_size} bytes, holes counted): refused")
            info = self.info(rel, opened, tarfile.REGTYPE)
            info.size = opened.st_size
            self.add(info, _File(fd, opened.st_size, rel))
        finally:
            os.close(fd)


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False


def remember(store: Any, layer_digest: str, blob: LayerBlob) -> None:
    """Keep what a layer exports to beside it (a layer of the store, never followed through a link)."""
    path = os.path.join(store.layer_dir(layer_digest), "export.json")
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"digest": blob.digest, "diff_id": blob.diff_id, "size": blob.size}, handle)
    os.replace(tmp, path)
