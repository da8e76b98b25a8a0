"""A workspace's tree on the host: walked, compared, copied and written back.

Everything here runs on the host, over a tree the sandboxed program wrote.
So every walk goes through directory descriptors opened with ``O_NOFOLLOW``
(a link the program planted is read as a link, never followed), files are
opened non-blocking and must be regular (a FIFO cannot hang the host), and
what is written to the host is never a device, a FIFO, a socket, a set-id
bit or a link that leads out of the tree. Nothing here runs a process.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import stat
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field

from ..model.errors import IsolationError
from ..model.workspace import Workspace
from .beneath import open_beneath
from .links import DIR_FLAGS

_CHUNK = 1 << 20
#: How deep walk() goes. A program can nest directories without end; each level costs the walk a
#: descriptor and a Python frame, so a deeper directory is listed as refused, not descended into.
MAX_DEPTH = 256


@dataclass(frozen=True)
class Entry:
    """One node of a walked tree: kind is "file", "dir" or "link" (anything else is "other")."""

    kind: str
    mode: int
    size: int
    link: str = ""
    #: The inode and its link count: one file under several names (hard links) is told apart.
    ino: int = 0
    nlink: int = 1


@dataclass
class Changes:
    """What a workspace changed against a directory: paths relative to the workspace."""

    added: list[str] = field(default_factory=list)
    modified: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    #: Entries commit will not write to the host, with the reason.
    refused: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.added or self.modified or self.deleted)


def _umask() -> int:
    """The caller's umask, read without changing it (os.umask would race with other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o777
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def host_mode(mode: int) -> int:
    """The permission bits written to the host for a workspace entry's mode.

    No set-user-ID, set-group-ID or sticky bit, and the caller's umask
    applied, as cp does: a program's chmod 777 must not make the user's
    tree writable by every local user.
    """
    return mode & 0o777 & ~_umask()


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "other"


def _open_dir(path: str) -> int:
    try:
        return os.open(path, DIR_FLAGS)
    except OSError as exc:
        raise IsolationError(f"workspace: {path}: {exc.strerror}") from None


def walk(root_fd: int, workspace: Workspace | None = None) -> dict[str, Entry]:
    """Every node under a directory descriptor, by relative path; links are not followed."""
    out: dict[str, Entry] = {}

    def visit(dir_fd: int, prefix: str, depth: int) -> None:
        for name in sorted(os.listdir(dir_fd)):
            if workspace is not None and workspace.excluded(name):
                continue
            rel = prefix + name
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            kind = _kind(info.st_mode)
            if kind == "dir" and depth >= MAX_DEPTH:
                kind = "deep"
            link = os.readlink(name, dir_fd=dir_fd) if kind == "link" else ""
            out[rel] = Entry(kind, stat.S_IMODE(info.st_mode), info.st_size, link, info.st_ino, info.st_nlink)
            if kind == "dir":
                try:
                    child = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    continue  # replaced meanwhile: listed as it was
                try:
                    visit(child, rel + "/", depth + 1)
                finally:
                    os.close(child)

    visit(root_fd, "", 1)
    return out


def _open_file(dir_fd: int, rel: str) -> int:
    """A regular file under dir_fd, reached without following any link."""
    fd = open_beneath(dir_fd, rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", rel)
    return fd


def _descend(dir_fd: int, rel_dir: str) -> int:
    """A descriptor of rel_dir under dir_fd, every component a real directory (dir_fd itself for "")."""
    parts = [p for p in rel_dir.split("/") if p]
    return open_beneath(dir_fd, "/".join(parts), DIR_FLAGS) if parts else dir_fd


def _same_content(a_fd: int, b_fd: int) -> bool:
    while True:
        a = os.read(a_fd, _CHUNK)
        b = os.read(b_fd, _CHUNK)
        if a != b:
            return False
        if not a:
            return True


#: How many links one link's resolution may go through (the kernel's own limit).
_MAX_HOPS = 40


def _leads_out(rel: str, entries: dict[str, Entry]) -> bool:
    """Whether the link at rel, resolved as the kernel would through the tree's other links, leaves the tree.

    Looking at the link's text alone is not enough: ``a/b -> ..`` stays
    inside, but ``c -> a/b/..`` then names the tree's parent. Absolute links
    are refused (never written), so a path through one meets whatever the
    target has there: it is followed by its name only.
    """
    stack = [p for p in os.path.dirname(rel).split("/") if p]
    parts = entries[rel].link.split("/")
    parts.reverse()
    hops = 0
    while parts:
        part = parts.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                return True
            stack.pop()
            continue
        entry = entries.get("/".join([*stack, part]))
        if entry is not None and entry.kind == "link" and not os.path.isabs(entry.link):
            hops += 1
            if hops > _MAX_HOPS:
                return True  # a loop: never written, whatever it would mean
            parts.extend(reversed(entry.link.split("/")))
            continue
        stack.append(part)
    return False


def _refusal(rel: str, entry: Entry, entries: dict[str, Entry]) -> str | None:
    """Why commit will not carry this entry to the host (None: it will)."""
    if entry.kind == "deep":
        return f"a directory more than {MAX_DEPTH} levels deep (not walked)"
    if entry.kind == "other":
        return "not a regular file, directory or link (devices, FIFOs and sockets stay in the sandbox)"
    if entry.kind == "link":
        text = entry.link
        if os.path.isabs(text):
            return f"a link to an absolute path ({text}) would lead out of the tree"
        if _leads_out(rel, entries):
            return f"a link ({text}) that leads out of the tree"
    return None


#: Opens a file of a tree by its relative path: a regular file, reached without following a link.
Opener = Callable[[str], int]


def diff(workspace_fd: int, other_fd: int | None, workspace: Workspace, hard_links: bool = False, *,
         mine: dict[str, Entry] | None = None, open_mine: Opener | None = None,
         theirs: dict[str, Entry] | None = None, same: Container[str] = ()) -> Changes:
    """What makes ``other`` (None: an empty tree) equal to the workspace; excluded names are left alone.

    A file with several names in the workspace (hard links) is written
    once, under its first name: its other names are refused, or a program
    could make one file of N bytes cost the host N bytes per name
    (``hard_links=True``: every name is written, for a trusted tree).

    A workspace that is no single directory (an overlay's merged view) is
    given as ``mine`` (its entries) and ``open_mine`` (how to open one of its
    files); ``theirs``: other's entries when already walked; ``same``: paths
    known to be the very same node in both (not compared).
    """
    if mine is None:
        mine = walk(workspace_fd, workspace)
    if theirs is None:
        theirs = walk(other_fd, workspace) if other_fd is not None else {}
    opener = open_mine if open_mine is not None else functools.partial(_open_file, workspace_fd)
    changes = Changes()
    first_name: dict[int, str] = {}
    for rel, entry in mine.items():
        why = _refusal(rel, entry, mine)
        if not why and entry.kind == "file" and entry.nlink > 1 and not hard_links:
            first = first_name.setdefault(entry.ino, rel)
            if first != rel:
                why = f"another name (hard link) of {first}, which is written once"
        if why:
            changes.refused[rel] = why
            continue
        old = theirs.get(rel)
        if old is None:
            changes.added.append(rel)
        elif rel in same:
            continue
        elif old.kind != entry.kind or (entry.kind == "link" and old.link != entry.link):
            changes.modified.append(rel)
        elif entry.kind == "file" and (old.size != entry.size or (old.mode & 0o777) != host_mode(entry.mode)
                                       or not _files_equal(opener, other_fd, rel)):
            changes.modified.append(rel)
    for rel in theirs:
        if rel not in mine and not any(rel.startswith(r + "/") for r in changes.refused):
            parent = os.path.dirname(rel)
            # Under a deleted directory, the directory's deletion says it all.
            if not parent or parent in mine:
                changes.deleted.append(rel)
    return changes


def _files_equal(open_a: Opener, b_dir: int | None, rel: str) -> bool:
    if b_dir is None:
        return False
    try:
        a = open_a(rel)
    except OSError:
        return False
    try:
        b = _open_file(b_dir, rel)
    except OSError:
        os.close(a)
        return False
    try:
        return _same_content(a, b)
    finally:
        os.close(a)
        os.close(b)


# -- writing to the host ------------------------------------------------------


def _open_removable(name: str, dir_fd: int) -> int:
    """A descriptor of the directory name under dir_fd, made listable and writable by its owner if it was not.

    A program (or overlayfs, whose work directory is mode 000) may leave a
    directory its owner cannot read or write: a caller who is not root could
    then never remove it. Its mode is changed through an O_PATH descriptor,
    never by a name a link could have replaced meanwhile.
    """
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if os.fstat(path_fd).st_uid != os.geteuid():
                raise
            os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
        finally:
            os.close(path_fd)
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    info = os.fstat(fd)
    if info.st_mode & 0o700 != 0o700 and info.st_uid == os.geteuid():
        os.fchmod(fd, stat.S_IMODE(info.st_mode) | 0o700)
    return fd


def _remove_tree(dir_fd: int, name: str) -> None:
    """Remove name under dir_fd, recursively, never following a link.

    A tree the program made may be nested without end: this holds two
    descriptors and no recursion whatever the depth. It goes down into the
    first subdirectory it finds, and back up through ".." once a directory
    is empty, checking that the parent reached is the one it came from.
    """
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = _open_removable(name, dir_fd)
    top = os.fstat(fd)
    path: list[tuple[str, int, int]] = []  # (name, st_dev, st_ino) of each directory below the top one
    try:
        while True:
            below = None
            for entry in os.listdir(fd):
                try:
                    entry_info = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(entry_info.st_mode):
                    below = (entry, entry_info)
                    break
                os.unlink(entry, dir_fd=fd)
            if below is not None:
                child = _open_removable(below[0], fd)
                child_info = os.fstat(child)
                path.append((below[0], child_info.st_dev, child_info.st_ino))
                os.close(fd)
                fd = child
                continue
            if not path:
                break
            done, dev, ino = path.pop()
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = parent
            # ".." must be the directory this came down from, and hold the one it leaves: a tree
            # moved meanwhile is not followed out.
            came_from = (path[-1][1], path[-1][2]) if path else (top.st_dev, top.st_ino)
            here = os.fstat(fd)
            there = os.stat(done, dir_fd=fd, follow_symlinks=False)
            if (here.st_dev, here.st_ino) != came_from or (there.st_dev, there.st_ino) != (dev, ino):
                raise OSError(errno.ESTALE, "a directory moved while it was being removed", done)
            os.rmdir(done, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_state_entry(kind: str, name: str) -> None:
    """Remove the directory ``state_dir()/kind/name`` and its tree, if it is one: found through the state
    directory's descriptor and removed as the directory found there, never through a link."""
    from .places import open_state_dir

    try:
        parent = open_state_dir(kind)
    except (OSError, IsolationError):
        return
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            remove_dir_at(parent, name, (info.st_dev, info.st_ino))
    except OSError:
        pass
    finally:
        os.close(parent)


def remove_dir_at(parent: int, name: str, identity: tuple[int, int]) -> None:
    """Remove the directory ``name`` of the directory ``parent`` and its tree, if it still is ``identity``
    (its st_dev, st_ino): a directory swapped in meanwhile is left alone; nothing on the way is followed."""
    try:
        child = os.open(name, DIR_FLAGS, dir_fd=parent)
        try:
            info = os.fstat(child)
            if (info.st_dev, info.st_ino) != identity:
                return
            for entry in os.listdir(child):
                _remove_tree(child, entry)
        finally:
            os.close(child)
        os.rmdir(name, dir_fd=parent)
    except OSError:
        pass


def _ensure_dir(dir_fd: int, name: str, mode: int) -> None:
    """A real directory named name under dir_fd (a link or file there is replaced)."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.mkdir(name, mode & 0o777, dir_fd=dir_fd)
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        os.mkdir(name, mode & 0o777, dir_fd=dir_fd)


def _copy_extents(src_fd: int, out: int) -> None:
    """Copy src_fd's data to out, holes kept as holes, up to the size src_fd had when the copy began.

    A program can make a sparse file of a petabyte at no cost: copied byte
    by byte it would fill the host's disk, so only the data extents are
    written (SEEK_DATA/SEEK_HOLE), and data appended meanwhile is not.
    """
    size = os.fstat(src_fd).st_size
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src_fd, pos, os.SEEK_DATA)
            end = min(os.lseek(src_fd, start, os.SEEK_HOLE), size)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break  # nothing but a hole up to the end
            if exc.errno != errno.EINVAL:
                raise
            start, end = pos, size  # no hole support here: all of it is data
        while start < end:
            chunk = os.pread(src_fd, min(_CHUNK, end - start), start)
            if not chunk:
                end = start  # shrunk meanwhile
                break
            view = memoryview(chunk)
            while view:
                written = os.pwrite(out, view, start)
                view = view[written:]
                start += written
        pos = max(end, pos + 1)
    os.ftruncate(out, size)


def _write_file(src_fd: int, dir_fd: int, name: str, mode: int) -> None:
    """Copy src_fd to name under dir_fd through a fresh temporary file, then rename it into place."""
    temp = f".{name[:200]}.isolate-{secrets.token_hex(4)}"
    # No set-user-ID, set-group-ID or sticky bit ever reaches the host.
    out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o777,
                  dir_fd=dir_fd)
    try:
        _copy_extents(src_fd, out)
        os.fchmod(out, mode & 0o777)
    except BaseException:
        os.close(out)
        os.unlink(temp, dir_fd=dir_fd)
        raise
    os.close(out)
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        info = None
    if info is not None and stat.S_ISDIR(info.st_mode):
        _remove_tree(dir_fd, name)
    os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def apply(workspace_fd: int, target_fd: int, changes: Changes, entries: dict[str, Entry],
          open_file: Opener | None = None) -> None:
    """Write changes (computed by diff against target) from the workspace into target.

    ``open_file``: how to open one of the workspace's files (default: under workspace_fd).
    """
    opener = open_file if open_file is not None else functools.partial(_open_file, workspace_fd)
    for rel in sorted(changes.deleted, key=lambda r: -r.count("/")):
        parent = _descend(target_fd, os.path.dirname(rel))
        try:
            _remove_tree(parent, os.path.basename(rel))
        finally:
            if parent != target_fd:
                os.close(parent)
    for rel in sorted(changes.added + changes.modified, key=lambda r: (r.count("/"), r)):
        entry = entries[rel]
        parent = _descend(target_fd, os.path.dirname(rel))
        name = os.path.basename(rel)
        try:
            if entry.kind == "dir":
                _ensure_dir(parent, name, host_mode(entry.mode))
                os.chmod(name, host_mode(entry.mode), dir_fd=parent, follow_symlinks=False)
            elif entry.kind == "link":
                _remove_tree(parent, name)
                os.symlink(entry.link, name, dir_fd=parent)
            elif entry.kind == "file":
                src = opener(rel)
                try:
                    _write_file(src, parent, name, host_mode(entry.mode))
                finally:
                    os.close(src)
        finally:
            if parent != target_fd:
                os.close(parent)


def copy_tree(source: str | int, destination: str | int, workspace: Workspace) -> None:
    """Fill the empty directory destination (a path, or a descriptor the caller keeps) with source's tree
    (a path, or a descriptor the caller keeps; links as links, no special files)."""
    src_fd = os.dup(source) if isinstance(source, int) else _open_dir(source)
    try:
        dst_fd = os.dup(destination) if isinstance(destination, int) else _open_dir(destination)
    except BaseException:
        os.close(src_fd)
        raise
    try:
        entries = walk(src_fd, workspace)
        changes = diff(src_fd, None, workspace, hard_links=True)
        changes.added = [r for r in changes.added if not any(r.startswith(x + "/") for x in changes.refused)]
        apply(src_fd, dst_fd, changes, entries)
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def entries_of(path: str, workspace: Workspace) -> tuple[int, dict[str, Entry]]:
    """A descriptor of the directory and its walk (the caller closes the descriptor)."""
    fd = _open_dir(path)
    return fd, walk(fd, workspace)


def listed(changes: Changes) -> Iterator[tuple[str, str]]:
    for name in ("added", "modified", "deleted"):
        for rel in getattr(changes, name):
            yield name, rel


def check_target(path: str, forbidden: Sequence[str]) -> str:
    """A commit target: an existing directory, not inside one of ``forbidden`` (the workspace itself)."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise IsolationError(f"commit: {path} is not a directory")
    for other in forbidden:
        other_real = os.path.realpath(other)
        if real == other_real or real.startswith(other_real.rstrip("/") + "/"):
            raise IsolationError(f"commit: {path} lies inside the sandbox's own workspace")
    return real
