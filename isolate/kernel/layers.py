"""Layers: a sandbox's files as a stack of overlay layers, the way container images keep them.

A *layer* is a directory in overlayfs's own format over a workspace's
source: whole files, whiteouts (0/0 character devices: deleted) and opaque
directories (``user.overlay.opaque``: nothing below shows through). A
snapshot of an overlay workspace is one layer: the sandbox's *base* layer
(the snapshot it started from, or nothing) with its upper layer (what it
changed since) laid over it, ``flatten``. A sandbox started from a snapshot
gets a ``clone`` of the snapshot's layer as its base, made of hard links:
the layer's files are never written (overlayfs writes only the upper
layer), so sharing their inodes costs one link per changed file and no
data, whatever the workspace's size. Forking, snapshotting and restoring
therefore cost what changed since the source, not the source.

Everything is reached through directory descriptors with ``O_NOFOLLOW``: a
link a program planted in its upper layer is copied as a link, never
followed, and a FIFO is never opened for reading.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from .links import DIR_FLAGS
from .tree import MAX_DEPTH, Entry, _copy_extents, _descend, _open_file, _remove_tree, walk

OPAQUE_XATTR = "user.overlay.opaque"
#: No set-user-ID or set-group-ID bit on a file isolate copies (they mean nothing in a sandbox, which
#: runs with no_new_privs on nosuid mounts, and would be a host's set-id file in the state directory).
_FILE_BITS = 0o1777
_FILE_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def is_whiteout(info: os.stat_result) -> bool:
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == 0


def make_whiteout(dir_fd: int, name: str) -> None:
    """A whiteout at name (unprivileged since Linux 5.8: the kernel allows 0/0 character devices to anyone)."""
    os.mknod(name, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=dir_fd)


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False


def _own(fd_or_name: int | str, info: os.stat_result, dir_fd: int | None = None) -> None:
    """Give a made node the owner of the node it copies (root only: others make their own files)."""
    if os.geteuid() != 0:
        return
    if isinstance(fd_or_name, int):
        os.fchown(fd_or_name, info.st_uid, info.st_gid)
    else:
        os.chown(fd_or_name, info.st_uid, info.st_gid, dir_fd=dir_fd, follow_symlinks=False)


def _mkdir_like(dir_fd: int, name: str, info: os.stat_result, opaque: bool, filling: bool = False) -> int:
    """A directory name under dir_fd with info's mode and owner (made if missing); its descriptor.
    ``filling``: writable to its owner until the caller sets its mode, once it is filled (a read-only one)."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(found.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        _own(fd, info)
        os.fchmod(fd, (stat.S_IMODE(info.st_mode) & 0o7777) | (0o700 if filling else 0))
        if opaque:
            os.setxattr(fd, OPAQUE_XATTR, b"y")
    except BaseException:
        os.close(fd)
        raise
    return fd


class Links:
    """The files a copy has written, by their source's inode: a file with several names (hard links) is
    copied once and linked under its other names, so that a program's thousand names of one big file cost
    the host one copy, as they cost the program."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.seen: dict[tuple[int, int], str] = {}

    def link(self, info: os.stat_result, dst_dir: int, target: str) -> bool:
        first = self.seen.get((info.st_dev, info.st_ino)) if info.st_nlink > 1 else None
        if first is None:
            return False
        try:
            os.link(first, target, src_dir_fd=self.root_fd, dst_dir_fd=dst_dir, follow_symlinks=False)
        except OSError:
            return False
        return True

    def add(self, info: os.stat_result, rel: str) -> None:
        if info.st_nlink > 1:
            self.seen[(info.st_dev, info.st_ino)] = rel


def copy_node(src_dir: int, name: str, info: os.stat_result, dst_dir: int, dst_name: str | None = None,
              links: Links | None = None, rel: str = "") -> None:
    """Copy one non-directory node (file data, link text, whiteout, FIFO) to dst_dir; what is there goes.
    ``links``/``rel``: the copy's hard links so far, and this node's path in it."""
    target = dst_name or name
    _remove_tree(dst_dir, target)
    if stat.S_ISREG(info.st_mode):
        if links is not None and links.link(info, dst_dir, target):
            return
        src = os.open(name, _FILE_READ, dir_fd=src_dir)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                return  # swapped meanwhile: not a file any more
            write_file(src, dst_dir, target, info)
        finally:
            os.close(src)
        if links is not None:
            links.add(info, rel)
    elif stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(name, dir_fd=src_dir), target, dir_fd=dst_dir)
        _own(target, info, dst_dir)
    elif is_whiteout(info):
        make_whiteout(dst_dir, target)
    elif stat.S_ISFIFO(info.st_mode):
        os.mkfifo(target, stat.S_IMODE(info.st_mode) & _FILE_BITS, dir_fd=dst_dir)
        _own(target, info, dst_dir)
    # Sockets and devices are not kept (nothing can be read from them).


def write_file(src_fd: int, dst_dir: int, name: str, info: os.stat_result) -> None:
    """A new file name under dst_dir with src_fd's data (holes kept), info's mode and owner."""
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_dir)
    try:
        _copy_extents(src_fd, out)
        _own(out, info)
        os.fchmod(out, stat.S_IMODE(info.st_mode) & _FILE_BITS)
    finally:
        os.close(out)


def clone(src_fd: int, dst_fd: int, hard_links: bool = True) -> int:
    """Fill the empty directory dst_fd with the layer src_fd: directories made, every other node a hard
    link of the layer's (``hard_links=False``, or across file systems: copied). How many nodes."""
    count = 0
    links = Links(dst_fd)

    def visit(src: int, dst: int, depth: int, prefix: str) -> None:
        nonlocal count
        for name in os.listdir(src):
            info = os.stat(name, dir_fd=src, follow_symlinks=False)
            count += 1
            if stat.S_ISDIR(info.st_mode):
                if depth >= MAX_DEPTH:
                    continue
                child = os.open(name, DIR_FLAGS, dir_fd=src)
                try:
                    out = _mkdir_like(dst, name, info, _opaque(child), filling=True)
                    try:
                        visit(child, out, depth + 1, prefix + name + "/")
                        os.fchmod(out, stat.S_IMODE(info.st_mode) & 0o7777)  # filled: its own mode
                    finally:
                        os.close(out)
                finally:
                    os.close(child)
                continue
            if hard_links:
                try:
                    os.link(name, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                        raise
            copy_node(src, name, info, dst, links=links, rel=prefix + name)

    visit(src_fd, dst_fd, 1, "")
    return count


def flatten_over(base_fd: int | None, upper_fd: int, out_fd: int) -> None:
    """One layer in ``out_fd``: ``base_fd`` (a layer, or None) cloned, then ``upper_fd`` laid over it; the
    directory takes the upper layer's mode (and, for root, its owner)."""
    if base_fd is not None:
        clone(base_fd, out_fd)
    info = os.fstat(upper_fd)
    os.fchmod(out_fd, stat.S_IMODE(info.st_mode))
    if os.geteuid() == 0:
        os.fchown(out_fd, info.st_uid, info.st_gid)
    flatten(upper_fd, out_fd)


def flatten(upper_fd: int, out_fd: int) -> int:
    """Lay the upper layer upper_fd over the layer in out_fd (a clone of the base layer), as overlayfs shows
    them together: out_fd becomes the one layer that means both. How many nodes were copied."""
    count = 0
    links = Links(out_fd)

    def visit(src: int, dst: int, depth: int, prefix: str) -> None:
        nonlocal count
        for name in os.listdir(src):
            try:
                info = os.stat(name, dir_fd=src, follow_symlinks=False)
            except FileNotFoundError:
                continue
            count += 1
            if not stat.S_ISDIR(info.st_mode):
                copy_node(src, name, info, dst, links=links, rel=prefix + name)
                continue
            if depth >= MAX_DEPTH:
                continue
            child = os.open(name, DIR_FLAGS, dir_fd=src)
            try:
                try:
                    below = os.stat(name, dir_fd=dst, follow_symlinks=False)
                except FileNotFoundError:
                    below = None
                opaque = _opaque(child)
                if opaque and below is not None:
                    _remove_tree(dst, name)  # nothing of the base shows through an opaque directory
                elif below is not None and not stat.S_ISDIR(below.st_mode):
                    # A directory where the base layer deleted or replaced the source's node: the source's
                    # node stays hidden only if the directory is opaque.
                    opaque = True
                out = _mkdir_like(dst, name, info, opaque, filling=True)
                try:
                    visit(child, out, depth + 1, prefix + name + "/")
                    os.fchmod(out, stat.S_IMODE(info.st_mode) & 0o7777)  # filled: its own mode
                finally:
                    os.close(out)
            finally:
                os.close(child)

    visit(upper_fd, out_fd, 1, "")
    return count


# -- reading a tree or a layer as the files it means ------------------------------------------------


def _next_data(fd: int, pos: int, size: int) -> int:
    try:
        return min(os.lseek(fd, pos, os.SEEK_DATA), size)
    except OSError:  # ENXIO: only a hole from pos on
        return size


def _same_data(a: int, b: int, size: int) -> bool:
    """Whether the first size bytes of the files a and b are equal: a chunk at a time, where both have
    holes skipped (a program's sparse file of a terabyte costs its disk nothing; read whole, or read
    through, it would cost the caller's memory or an hour)."""
    pos = 0
    while pos < size:
        start = min(_next_data(a, pos, size), _next_data(b, pos, size))
        if start > pos:
            pos = start  # zeros on both sides
            continue
        end = min(pos + (1 << 20), size)
        if _pread_all(a, end - pos, pos) != _pread_all(b, end - pos, pos):
            return False
        pos = end
    return True


def _pread_all(fd: int, size: int, pos: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = os.pread(fd, size - got, pos + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class View:
    """The files of a tree (a directory) or of a layer over a source, by relative path.

    ``entries``: every node, as ``tree.walk`` gives it; ``open(rel)``: one of its regular files;
    ``key(rel)``: (st_dev, st_ino) of the node, so that a node shared with another view (the source's
    own, or a hard link of a base layer's) is known equal without reading it.
    """

    def __init__(self, entries: dict[str, Entry], opener: Callable[[str], int],
                 key: Callable[[str], tuple[int, int]], fds: list[int],
                 holder: Callable[[str], int] | None = None) -> None:
        self.entries = entries
        self.open = opener
        self.key = key
        self._fds = fds
        #: The descriptor of the tree or layer whose node shows at rel (None: the view has no such node).
        self._holder = holder

    def node(self, rel: str) -> os.stat_result | None:
        """rel's node as it is in the tree or layer that holds it (mode, owner), not following a link."""
        if self._holder is None or rel not in self.entries:
            return None
        parent = _descend(self._holder(rel), os.path.dirname(rel))
        try:
            return os.stat(os.path.basename(rel), dir_fd=parent, follow_symlinks=False)
        finally:
            if parent != self._holder(rel):
                os.close(parent)

    @classmethod
    def of_tree(cls, fd: int) -> View:
        """A directory's tree (the view owns fd)."""
        dev = os.fstat(fd).st_dev
        entries = walk(fd)
        return cls(entries, lambda rel: _open_file(fd, rel), lambda rel: (dev, entries[rel].ino), [fd],
                   lambda rel: fd)

    @classmethod
    def of_layers(cls, layer_fds: list[int]) -> View:
        """Layers laid over each other as overlayfs shows them, lowest first (an image's layers and a root
        layer over them: whiteouts and opaque directories hide what lies below); the view owns the descriptors."""
        from ..model.workspace import Workspace
        from .overlay import merged_view

        entries: dict[str, Entry] = {}
        held: dict[str, int] = {}
        try:
            for index, fd in enumerate(layer_fds):
                merged = merged_view(-1, fd, Workspace(), entries)
                entries = merged.entries
                held = {rel: index if rel in merged.upper else held[rel] for rel in entries}
            devs = [os.fstat(fd).st_dev for fd in layer_fds]
        except BaseException:
            for fd in layer_fds:
                os.close(fd)
            raise

        def key(rel: str) -> tuple[int, int]:
            return (devs[held[rel]], -1 - entries[rel].ino)  # a layer's inode numbers are kept negated

        return cls(entries, lambda rel: _open_file(layer_fds[held[rel]], rel), key, list(layer_fds),
                   lambda rel: layer_fds[held[rel]])

    @classmethod
    def of_layer(cls, source_fd: int | None, layer_fd: int) -> View:
        """A layer over a source directory (None: over nothing); the view owns both descriptors."""
        from ..model.workspace import Workspace
        from .overlay import merged_view

        lower = walk(source_fd) if source_fd is not None else {}
        merged = merged_view(source_fd if source_fd is not None else -1, layer_fd, Workspace(), lower)
        upper_dev = os.fstat(layer_fd).st_dev
        lower_dev = os.fstat(source_fd).st_dev if source_fd is not None else -1

        def opener(rel: str) -> int:
            if rel in merged.upper or source_fd is None:
                return _open_file(layer_fd, rel)
            return _open_file(source_fd, rel)

        def key(rel: str) -> tuple[int, int]:
            ino = merged.entries[rel].ino
            return (upper_dev, -1 - ino) if rel in merged.upper else (lower_dev, ino)

        def holder(rel: str) -> int:
            return layer_fd if rel in merged.upper or source_fd is None else source_fd

        return cls(merged.entries, opener, key, [fd for fd in (source_fd, layer_fd) if fd is not None], holder)

    def read(self, rel: str) -> bytes:
        fd = self.open(rel)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def same(self, rel: str, other: View) -> bool:
        """Whether rel is the same node here and in other (kind, mode, link text, content)."""
        a, b = self.entries.get(rel), other.entries.get(rel)
        if a is None or b is None:
            return a is b
        if a.kind != b.kind or (a.mode & 0o7777) != (b.mode & 0o7777) or a.link != b.link:
            return False
        if a.kind != "file" or self.key(rel) == other.key(rel):
            return True
        if a.size != b.size:
            return False
        mine, theirs = self.open(rel), other.open(rel)
        try:
            return _same_data(mine, theirs, a.size)
        finally:
            os.close(mine)
            os.close(theirs)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


# -- writing a layer or a tree path by path ---------------------------------------------------------


def _parent(root_fd: int, rel: str, layered: bool) -> int:
    """The directory holding rel under root_fd, each missing directory on the way made (0755).

    A node of another kind on the way (a deleted directory's whiteout, when an edit inside it is kept over
    the deletion) becomes a directory: in a layer an opaque one, so that what the deletion hid stays hidden.
    """
    # Not beneath.make_beneath: a node of another kind on the way is replaced here, where that walk refuses it.
    fd = root_fd
    for part in [p for p in os.path.dirname(rel).split("/") if p]:
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                os.unlink(part, dir_fd=fd)
                os.mkdir(part, 0o755, dir_fd=fd)
                if layered:
                    _set_opaque(fd, part)
        try:
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
        finally:
            if fd != root_fd:
                os.close(fd)
        fd = nxt
    return fd


def _set_opaque(dir_fd: int, name: str) -> None:
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.setxattr(fd, OPAQUE_XATTR, b"y")
    finally:
        os.close(fd)


def put(root_fd: int, rel: str, entry: Entry, layered: bool, data: bytes | None = None,
        src_fd: int = -1, owner: os.stat_result | None = None, replaced_kind: str | None = None) -> None:
    """Make rel under root_fd the node entry describes (file data from data or src_fd).

    ``layered``: root_fd is a layer over a source; a directory replacing a node of another kind
    (``replaced_kind``) is made opaque there, so that nothing of the replaced node shows through.
    """
    parent = _parent(root_fd, rel, layered)
    name = os.path.basename(rel)
    mode = stat.S_IFMT(stat.S_IFDIR if entry.kind == "dir" else stat.S_IFREG) | (entry.mode & 0o7777)
    info = os.stat_result((mode, 0, 0, 1, owner.st_uid if owner else os.geteuid(),
                           owner.st_gid if owner else os.getegid(), 0, 0, 0, 0))
    try:
        if entry.kind == "dir":
            if replaced_kind not in (None, "dir"):
                _remove_tree(parent, name)
            os.close(_mkdir_like(parent, name, info, layered and replaced_kind not in (None, "dir")))
            return
        _remove_tree(parent, name)
        if entry.kind == "link":
            os.symlink(entry.link, name, dir_fd=parent)
            _own(name, info, parent)
        elif entry.kind == "file":
            if data is not None:
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=parent)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(out, view):]
                    _own(out, info)
                    os.fchmod(out, entry.mode & _FILE_BITS)
                finally:
                    os.close(out)
            else:
                write_file(src_fd, parent, name, info)
    finally:
        if parent != root_fd:
            os.close(parent)


def delete(root_fd: int, rel: str, layered: bool) -> None:
    """rel is no more: removed from a tree; in a layer, a whiteout hides the source's node."""
    parent = _parent(root_fd, rel, layered)
    try:
        name = os.path.basename(rel)
        _remove_tree(parent, name)
        if layered:
            make_whiteout(parent, name)
    finally:
        if parent != root_fd:
            os.close(parent)




def materialize(view: View, out_fd: int) -> int:
    """Fill the empty directory out_fd with the files view means, as a plain tree (whole files, no whiteout,
    no opaque directory): a layer over its lower tree made one tree. How many nodes were written."""
    import dataclasses

    count = 0
    dirs: list[tuple[str, int]] = []
    for rel, entry in view.entries.items():  # a directory before what it holds
        if entry.kind not in ("dir", "file", "link"):
            continue  # a FIFO, socket or device, or a directory too deep: not kept (as copy_tree)
        count += 1
        if entry.kind == "dir":
            # Writable to its maker while it is filled; its own mode last, deepest first (a read-only one).
            put(out_fd, rel, dataclasses.replace(entry, mode=entry.mode | 0o700), False)
            dirs.append((rel, entry.mode & 0o7777))
            continue
        if entry.kind == "link":
            put(out_fd, rel, entry, False)
            continue
        src = view.open(rel)
        try:
            put(out_fd, rel, entry, False, src_fd=src, owner=os.fstat(src))
        finally:
            os.close(src)
    for rel, mode in sorted(dirs, key=lambda d: -d[0].count("/")):
        fd = _descend(out_fd, rel)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return count
