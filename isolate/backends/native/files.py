"""File methods of a kept native sandbox, done as the program would do them.

Every path is resolved by the exec server inside the sandbox, with the
program's uid, mounts and Landlock domain (relative paths from the
workspace); the host only reads or writes the descriptor the server opened
and sends back, after checking it is a regular file (or a directory). So
``..``, absolute paths and links the program planted all resolve inside
the program's own view, and a FIFO cannot hang the host.
"""

from __future__ import annotations

import errno
import os
import re
import stat as stat_mod
from collections.abc import Iterator
from dataclasses import dataclass

from ..._core import lib
from ...model.files import write_all
from ...model.globs import PathGlob
from .protocol import Connection, Stat

#: read_file's default cap.
DEFAULT_READ_LIMIT = 64 << 20


@dataclass(frozen=True)
class DirEntry:
    """One entry of ``list_dir``: path relative to the listed directory."""

    path: str
    type: str  # "file", "dir", "link" or "other"
    size: int
    mode: int
    mtime_ns: int


@dataclass(frozen=True)
class GrepMatch:
    path: str
    line_number: int
    line: str


def _type(mode: int) -> str:
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISLNK(mode):
        return "link"
    return "other"


def open_fd(conn: Connection, path: str, flags: int, mode: int = 0o644) -> tuple[int, Stat]:
    reply = conn.call(lib.ISO_XS_OPEN, [path], flags=flags, mode=mode)
    if reply.fd is None:
        raise OSError(errno.EIO, "the sandbox sent no descriptor", path)
    info = os.fstat(reply.fd)  # the kernel's word on what was opened, not the sandbox's
    return reply.fd, Stat(info.st_mode, info.st_uid, info.st_gid, info.st_nlink, info.st_size, info.st_mtime_ns,
                          info.st_ino, info.st_dev)


def _regular(fd: int, info: Stat, path: str) -> None:
    if info.is_dir:
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not info.is_file:
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)


def open_reader(conn: Connection, path: str) -> int:
    """A blocking descriptor of the regular file at path, opened inside as the program (the caller closes it)."""
    fd, info = open_fd(conn, path, os.O_RDONLY)
    _regular(fd, info, path)
    os.set_blocking(fd, True)
    return fd


def read_bytes(conn: Connection, path: str, limit: int = DEFAULT_READ_LIMIT) -> bytes:
    fd = open_reader(conn, path)
    try:
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise OSError(errno.EFBIG, f"larger than the read limit ({limit} bytes)", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def makedirs(conn: Connection, path: str, mode: int = 0o755, exist_ok: bool = True) -> None:
    parts = [p for p in path.split("/") if p]
    current = "/" if path.startswith("/") else ""
    for i, part in enumerate(parts):
        current = os.path.join(current, part) if current else part
        try:
            conn.call(lib.ISO_XS_MKDIR, [current], mode=mode)
        except FileExistsError:
            if i == len(parts) - 1 and not exist_ok:
                raise
            if not conn.call(lib.ISO_XS_STAT, [current]).stat.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), current) from None


def open_writer(conn: Connection, path: str, append: bool = False, make_parents: bool = True,
                mode: int = 0o644) -> int:
    """A blocking descriptor of the regular file at path, opened (made, emptied unless append) inside as the
    program (the caller closes it)."""
    parent = os.path.dirname(path.rstrip("/"))
    if make_parents and parent and parent != "/":
        makedirs(conn, parent)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd, info = open_fd(conn, path, flags, mode)
    _regular(fd, info, path)
    os.set_blocking(fd, True)
    return fd


def write_bytes(conn: Connection, path: str, data: bytes, append: bool = False, make_parents: bool = True,
                mode: int = 0o644) -> None:
    fd = open_writer(conn, path, append, make_parents, mode)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def stat(conn: Connection, path: str, follow_symlinks: bool = True) -> Stat:
    return conn.call(lib.ISO_XS_STAT if follow_symlinks else lib.ISO_XS_LSTAT, [path]).stat


def list_dir(conn: Connection, path: str = ".", depth: int = 1) -> list[DirEntry]:
    out: list[DirEntry] = []

    def visit(directory: str, prefix: str, level: int) -> None:
        for name, info in sorted(conn.readdir(directory)):
            rel = prefix + name
            out.append(DirEntry(rel, _type(info.mode), info.size, info.mode, info.mtime_ns))
            if level < depth and stat_mod.S_ISDIR(info.mode):
                try:
                    visit(os.path.join(directory, name), rel + "/", level + 1)
                except PermissionError:
                    continue

    visit(path, "", 1)
    return out


def walk_files(conn: Connection, root: str) -> Iterator[str]:
    """Paths (relative to root) of every regular file below root; links are not followed."""
    stack = [("", root)]
    while stack:
        prefix, directory = stack.pop()
        try:
            entries = sorted(conn.readdir(directory))
        except (PermissionError, FileNotFoundError, NotADirectoryError):
            continue
        for name, info in entries:
            rel = prefix + name
            if stat_mod.S_ISDIR(info.mode):
                stack.append((rel + "/", os.path.join(directory, name)))
            elif stat_mod.S_ISREG(info.mode):
                yield rel


def remove(conn: Connection, path: str, recursive: bool = False) -> None:
    info = stat(conn, path, follow_symlinks=False)
    if not info.is_dir:
        conn.call(lib.ISO_XS_UNLINK, [path])
        return
    if recursive:
        for name, _ in list(conn.readdir(path)):
            remove(conn, os.path.join(path, name), recursive=True)
    conn.call(lib.ISO_XS_RMDIR, [path])


def move(conn: Connection, source: str, destination: str, overwrite: bool = True) -> None:
    conn.call(lib.ISO_XS_RENAME, [source, destination], flags=0 if overwrite else 1)  # RENAME_NOREPLACE


def glob_regex(pattern: str) -> PathGlob:
    """The matcher of a glob over relative paths (model/globs.py)."""
    return PathGlob(pattern)


def glob(conn: Connection, pattern: str, root: str = ".") -> list[str]:
    regex = glob_regex(pattern)
    found: list[str] = []
    stack = [("", root)]
    while stack:
        prefix, directory = stack.pop()
        try:
            entries = sorted(conn.readdir(directory))
        except (PermissionError, FileNotFoundError, NotADirectoryError):
            continue
        for name, info in entries:
            rel = prefix + name
            if regex.match(rel):
                found.append(rel)
            if stat_mod.S_ISDIR(info.mode):
                stack.append((rel + "/", os.path.join(directory, name)))
    return sorted(found)


def grep(conn: Connection, regex: str, glob_pattern: str | None = None, root: str = ".", max_matches: int = 1000,
         max_file_size: int = 8 << 20) -> list[GrepMatch]:
    compiled = re.compile(regex)
    name_filter = glob_regex(glob_pattern) if glob_pattern else None
    matches: list[GrepMatch] = []
    for rel in walk_files(conn, root):
        if name_filter is not None and not (name_filter.match(rel) or name_filter.match(os.path.basename(rel))):
            continue
        try:
            data = read_bytes(conn, os.path.join(root, rel), max_file_size)
        except OSError:
            continue  # unreadable for the program, too large, or gone: not searched
        if b"\0" in data[:8192]:
            continue  # binary
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if compiled.search(line):
                matches.append(GrepMatch(rel, number, line))
                if len(matches) >= max_matches:
                    return matches
    return matches
