"""A Dockerfile's build context: its ``.dockerignore``, and the sources of COPY and ADD read beneath it.

A source is opened component by component from the context's descriptor
with ``O_NOFOLLOW``: a link on the way, or ``..`` out of the context, is
refused; a link that is itself a source (or inside a directory copied) is
copied as a link, never followed. A local tar archive given to ADD is
written again as a layer under its destination, its names checked as a
layer's are (no absolute name, no ``..``, no whiteout, no device).
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import os
import stat
import tarfile
from collections.abc import Callable

from ..kernel.beneath import parent_beneath
from ..kernel.links import DIR_FLAGS
from ..model.files import read_input_file
from ..model.globs import PathGlob
from . import Image
from .build import DockerfileError, _existing, _target
from .export import LayerBlob, write_copy
from .tarbound import BoundedTarInfo

MAX_IGNORE_FILE = 1 << 20


# -- .dockerignore ----------------------------------------------------------------------------


def ignore_rules(context: str) -> list[tuple[bool, IgnorePattern]]:
    """The context's .dockerignore: (negated, pattern) in order (the last that matches decides)."""
    path = os.path.join(context, ".dockerignore")
    try:
        # Not followed, never waited on (a FIFO), a regular file only, bounded: the context may be a sandbox's.
        data = read_input_file(path, limit=MAX_IGNORE_FILE, follow=False)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise DockerfileError(f"{path}: {exc.strerror or exc}: refused") from None
    except ValueError:
        raise DockerfileError(f"{path}: past {MAX_IGNORE_FILE} bytes: refused") from None
    lines = data.decode("utf-8", errors="replace").splitlines()
    rules = []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line[1:].strip() if negated else line).lstrip("/")
        if pattern in ("", "."):
            continue
        rules.append((negated, IgnorePattern(pattern, path)))
    return rules


#: The most names a .dockerignore pattern may have (a deeper one matches nothing a build copies, and bounds the walk).
MAX_PATTERN_NAMES = 256


class IgnorePattern(PathGlob):
    """Go's filepath.Match with Docker's ``**`` (any number of directories), matched a name of the path at a time
    (model/globs.py): a pattern also leaves out everything below what it matches."""

    def __init__(self, pattern: str, what: str = ".dockerignore") -> None:
        super().__init__(pattern, below=True)
        if len(self.parts) > MAX_PATTERN_NAMES:
            raise DockerfileError(f"{what}: a pattern of {len(self.parts)} names, past {MAX_PATTERN_NAMES}: refused")


def ignored(rules: list[tuple[bool, IgnorePattern]], rel: str) -> bool:
    result = False
    for negated, pattern in rules:
        if pattern.match(rel):
            result = not negated
    return result


# -- sources ----------------------------------------------------------------------------------


def open_beneath(root_fd: int, rel: str, what: str) -> tuple[int, str]:
    """(descriptor of the parent, last name) of ``rel`` under ``root_fd``: no link on the way, no ``..`` out (the
    kernel's walk, kernel/beneath.py); the last name is there, and may be a link (copied as one)."""
    parts = [p for p in rel.split("/") if p and p != "."]
    if ".." in parts:
        raise DockerfileError(f"{what}: {rel!r} leads out of the context (..): refused")
    if not parts:
        return os.dup(root_fd), "."
    try:
        fd, last = parent_beneath(root_fd, "/".join(parts))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            part = os.path.basename(exc.filename or "")  # the walk names the path as far as the refused part
            raise DockerfileError(f"{what}: {rel!r} goes through {part!r}, a link or no directory: refused "
                                  "(a source is never reached through a link)") from None
        raise DockerfileError(f"{what}: {rel!r}: {exc.strerror}") from None
    try:
        os.stat(last, dir_fd=fd, follow_symlinks=False)
    except OSError as exc:
        os.close(fd)
        raise DockerfileError(f"{what}: {rel!r}: {exc.strerror}") from None
    return fd, last


def _matches(root_fd: int, pattern: str, what: str) -> list[str]:
    """The paths a source names (a glob in its last component expanded, sorted)."""
    clean = os.path.normpath(pattern).lstrip("/")
    if clean.startswith("..") or clean == "..":
        raise DockerfileError(f"{what}: {pattern!r} leads out of the context (..): refused")
    head, tail = os.path.split(clean)
    if not any(c in tail for c in "*?["):
        return [clean]
    if head:
        above, name = open_beneath(root_fd, head, what)
        try:
            parent = os.open(name, DIR_FLAGS, dir_fd=above)
        except OSError as exc:
            raise DockerfileError(f"{what}: {head!r} is a link or no directory: refused ({exc.strerror})") from None
        finally:
            os.close(above)
    else:
        parent = os.dup(root_fd)
    try:
        found = sorted(n for n in os.listdir(parent) if fnmatch.fnmatchcase(n, tail))
    finally:
        os.close(parent)
    if not found:
        raise DockerfileError(f"{what}: {pattern!r} matches no file of the context")
    return [os.path.join(head, n) for n in found]


Chown = tuple[str, "str | None"]  # COPY --chown's USER and GROUP (owners.parse_chown), resolved in the image


def _owner(image: Image, chown: Chown | None, what: str) -> tuple[int, int] | None:
    from .owners import resolve

    return None if chown is None else resolve(image, chown[0], chown[1], what)


def _copy_layer(root: str, patterns: list[str], destination: str, what: str,
                rules: list[tuple[bool, IgnorePattern]], chown: Chown | None = None,
                mode: int | None = None) -> Callable[[Image, str], LayerBlob]:
    """A builder layer of sources under ``root`` (the context, or a stage's layer); ``chown``, ``mode``: COPY's
    --chown (resolved in the image the copy lands in) and --chmod."""

    def make(image: Image, out: str) -> LayerBlob:
        owner = _owner(image, chown, what)
        root_fd = os.open(root, DIR_FLAGS)
        opened: list[tuple[int, str]] = []
        try:
            names = [m for p in patterns for m in _matches(root_fd, p, what)]
            for rel in names:
                if rules and ignored(rules, rel):
                    continue
                opened.append(open_beneath(root_fd, rel, what))
            if not opened:
                raise DockerfileError(f"{what}: no source left (.dockerignore leaves them all out)")

            kept = [rel for rel in names if not (rules and ignored(rules, rel))]

            def exclude(rel: str) -> bool:  # rel: context-relative (write_copy's prefixes)
                return ignored(rules, os.path.normpath(rel))

            into = destination.endswith("/") or len(opened) > 1
            if len(opened) > 1 and not destination.endswith("/"):
                raise DockerfileError(f"{what}: several sources need a destination ending in /")
            return write_copy(opened, _target(image, destination), out, into=into,
                              exclude=exclude if rules else None, what=what, prefixes=kept,
                              existing=functools.partial(_existing, image.lower_dirs()), owner=owner, mode=mode)
        finally:
            for fd, _ in opened:
                os.close(fd)
            os.close(root_fd)

    return make


def _archive_layer(context: str, source: str, destination: str, what: str, chown: Chown | None = None,
                   mode: int | None = None) -> Callable[[Image, str], LayerBlob]:
    """ADD of a local tar archive: its entries under ``destination`` (names checked as a layer's are), owned by
    root or ``chown``'s owner; ``mode``: every entry's but a link's."""

    def make(image: Image, out: str) -> LayerBlob:
        from .export import _write
        from .unpack import entry_name

        uid, gid = _owner(image, chown, what) or (0, 0)

        root_fd = os.open(context, DIR_FLAGS)
        try:
            parent, name = open_beneath(root_fd, source, what)
        finally:
            os.close(root_fd)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        finally:
            os.close(parent)
        target = _target(image, destination).strip("/")
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise DockerfileError(f"{what}: {source!r} is not a regular file")

            def fill(tar: tarfile.TarFile) -> None:
                parts = [p for p in target.split("/") if p]
                for i in range(1, len(parts) + 1):
                    info = tarfile.TarInfo("/".join(parts[:i]))
                    info.type, info.mode, info.mtime, info.uid, info.gid = tarfile.DIRTYPE, 0o755, 0, uid, gid
                    tar.addfile(info)
                total = 0
                try:
                    with tarfile.open(fileobj=handle, mode="r|*", tarinfo=BoundedTarInfo) as archive:
                        for member in archive:
                            total += max(member.size, 0)
                            if total > image.store.max_image_size:
                                raise DockerfileError(f"{what}: {source} unpacks past max_image_size "
                                                      f"({image.store.max_image_size} bytes): refused")
                            rel = entry_name(member.name, what)
                            if not rel:
                                continue
                            if rel.rsplit("/", 1)[-1].startswith(".wh."):
                                raise DockerfileError(f"{what}: {member.name!r} in {source}: a name an OCI layer "
                                                      "reads as a whiteout: refused")
                            if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                                raise DockerfileError(f"{what}: {member.name!r} in {source} is a device or FIFO: "
                                                      "refused")
                            copy = tarfile.TarInfo(f"{target}/{rel}" if target else rel)
                            copy.type, copy.mode, copy.mtime, copy.size = (member.type, member.mode & 0o1777,
                                                                           int(member.mtime), member.size)
                            copy.uid, copy.gid = uid, gid
                            if mode is not None and not member.issym():
                                copy.mode = mode
                            if member.issym():
                                copy.linkname = member.linkname
                            elif member.islnk():
                                linked = entry_name(member.linkname, what)
                                copy.linkname = f"{target}/{linked}" if target else linked
                            tar.addfile(copy, archive.extractfile(member) if member.isfile() else None)
                except (tarfile.TarError, EOFError, ValueError, OverflowError) as exc:
                    # A damaged archive, its compressed stream cut short, a header's number no tar takes:
                    # the Dockerfile's mistake, said in one line (never a traceback).
                    raise DockerfileError(f"{what}: {source}: not a valid tar archive ({exc})") from None

            return _write(out, fill)

    return make


def _is_archive(context: str, source: str, what: str) -> bool:
    root_fd = os.open(context, DIR_FLAGS)
    try:
        parent, name = open_beneath(root_fd, source, what)
    finally:
        os.close(root_fd)
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            return False
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        with os.fdopen(fd, "rb") as handle:
            head = handle.read(512)
    finally:
        os.close(parent)
    return head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00" or (
        len(head) >= 262 and head[257:262] == b"ustar")
