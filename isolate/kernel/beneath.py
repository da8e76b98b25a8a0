"""One walk down a relative path from a directory descriptor: no link followed, never out of it.

``open_beneath`` asks the kernel (openat2(2) with ``RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``, and ``RESOLVE_NO_XDEV`` with
``same_mount``; csrc/beneath.c). Where openat2 is missing (ENOSYS: kernels
before 5.6; ENOSYS or EPERM from a seccomp filter that refuses it) the same
answers come from a walk component by component: each directory opened
``O_PATH | O_NOFOLLOW`` from its parent's descriptor and checked to be one,
``..`` going back to the descriptor it came from, the last component opened
with ``O_NOFOLLOW``. ``ISOLATE_NO_OPENAT2=1`` takes that walk always (its
tests, and a kernel whose openat2 is in doubt).

The answers, either way: a symbolic link anywhere is ELOOP (at the end: the
link itself with ``O_PATH | O_NOFOLLOW``, ENOTDIR with ``O_DIRECTORY |
O_NOFOLLOW``, as open(2) answers); a component on the way that is no
directory (a file, a FIFO, a device) is ENOTDIR; an absolute path, or a
``..`` above the start, is EXDEV, as is a mount point crossed with
``same_mount``; a NUL byte is EINVAL. The OSError's filename is the path as
far as the component refused (``a/link`` of ``a/link/b``), so a caller can
name it. Only the flags make the last open safe: a FIFO or device there is
opened as the flags say (``O_NONBLOCK`` and a check of the kind are the
caller's). ``parent_beneath`` stops short of the last name, ``make_beneath``
makes the directories missing on the way.
"""

from __future__ import annotations

import errno
import os
import stat

from .._core import ffi, lib

#: A directory on the way, as the walk opens it: openat2 opens none at all.
_STEP = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: A directory opened to read it or to work beneath it (the usual final flags of a walk).
DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

#: Whether openat2 answers here: None until first asked.
_OPENAT2: list[bool | None] = [None]


def open_beneath(dir_fd: int, path: str, flags: int = DIR_OPEN, mode: int = 0o777, *,
                 same_mount: bool = False) -> int:
    """A descriptor of ``path`` below ``dir_fd`` opened with ``flags`` (``mode`` with O_CREAT), reached through
    no symbolic link and never above ``dir_fd`` (nor, with ``same_mount``, onto another mount); OSError as the
    module's docstring says."""
    raw = _checked(path)
    if _openat2_answers(dir_fd):
        while True:
            fd = int(lib.iso_open_beneath(dir_fd, raw, flags, mode, 1 if same_mount else 0))
            if fd >= 0:
                return fd
            err = ffi.errno
            if err != errno.EINTR:  # a FIFO's open waited and a signal came: its handler runs here, then again
                break
        if err in (errno.ENOSYS, errno.EPERM) and not _openat2_works(dir_fd):
            _OPENAT2[0] = False  # refused by a filter since: the walk from now on
        elif err not in (errno.EAGAIN, errno.EACCES):
            raise OSError(err, os.strerror(err), _where(dir_fd, path, same_mount))
        # EAGAIN: a '..' raced every try; the walk's own '..' needs no check. EACCES: the walk says why, as
        # exactly: Linux 6.1 (the VM) refuses a link in a sticky directory of everyone's another user owns
        # (fs.protected_symlinks) with EACCES before RESOLVE_NO_SYMLINKS's ELOOP, and the callers tell a link
        # (ELOOP) from a refusal (ci6: a snapshot's archive with a link in /tmp failed to unpack there).
    return walk_components(dir_fd, path, flags, mode, same_mount=same_mount)


def parent_beneath(dir_fd: int, path: str, *, same_mount: bool = False) -> tuple[int, str]:
    """(a descriptor of the directory that holds ``path``'s last name, that name), walked as open_beneath does;
    a path with no last name (empty, ``.``, or ending in ``..``) is EINVAL."""
    _checked(path)
    if path.startswith("/"):
        raise OSError(errno.EXDEV, "an absolute path", path)
    head, _, last = path.rstrip("/").rpartition("/")
    if last in ("", ".", ".."):
        raise OSError(errno.EINVAL, "no last name", path)
    return open_beneath(dir_fd, head or ".", DIR_OPEN, same_mount=same_mount), last


def make_beneath(dir_fd: int, path: str, mode: int = 0o777, *, same_mount: bool = False) -> int:
    """A descriptor of the directory ``path`` below ``dir_fd`` (DIR_OPEN), each missing directory on the way
    made first (``mode``, less the umask), walked as open_beneath does: a link, a file or (``same_mount``) a
    mount on the way is refused as there, never made through or beside."""
    for _ in range(path.count("/") + 2):
        try:
            return open_beneath(dir_fd, path or ".", DIR_OPEN, same_mount=same_mount)
        except FileNotFoundError as exc:
            missing = str(exc.filename)  # the path as far as the first name missing
        parent, name = parent_beneath(dir_fd, missing, same_mount=same_mount)
        try:
            os.mkdir(name, mode, dir_fd=parent)
        except FileExistsError:
            pass  # made meanwhile: opened as any other
        finally:
            os.close(parent)
    raise OSError(errno.ENOENT, "removed again as it was made", path)


def walk_components(dir_fd: int, path: str, flags: int = DIR_OPEN, mode: int = 0o777, *,
                    same_mount: bool = False) -> int:
    """open_beneath's answer without openat2: the walk, one component at a time."""
    _checked(path)
    if path.startswith("/"):
        raise OSError(errno.EXDEV, "an absolute path", path)
    if not path:
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    names = path.split("/")
    while len(names) > 1 and names[-1] in ("", "."):  # "a/", "a/.": a itself, which must be a directory
        names.pop()
        flags |= os.O_DIRECTORY
    mount = _mount_of(dir_fd) if same_mount else None
    stack = [dir_fd]  # the start is the caller's: never closed here
    done: list[str] = []
    try:
        for i, name in enumerate(names):
            done.append(name)
            last = i == len(names) - 1
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) == 1:
                    raise OSError(errno.EXDEV, "'..' leads above the start", "/".join(done))
                os.close(stack.pop())
                continue
            if last:
                return _open_last(stack[-1], name, flags, mode, mount, "/".join(done))
            stack.append(_step(stack[-1], name, mount, "/".join(done)))
        # The path ends in '..' (or is '.'): the directory held last, opened again with the caller's flags.
        return _open_last(stack[-1], ".", flags, mode, mount, path)
    finally:
        for fd in stack[1:]:
            os.close(fd)


def _checked(path: str) -> bytes:
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise OSError(errno.EINVAL, "a NUL byte in the name", path.replace("\0", "\\0"))
    return raw


def _step(dir_fd: int, name: str, mount: int | None, where: str) -> int:
    """A directory on the way: refused when it is a link (ELOOP), no directory (ENOTDIR) or, with ``mount``,
    on another mount (EXDEV)."""
    try:
        fd = os.open(name, _STEP, dir_fd=dir_fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, where) from None
    kind = os.fstat(fd).st_mode
    err = errno.ELOOP if stat.S_ISLNK(kind) else None if stat.S_ISDIR(kind) else errno.ENOTDIR
    if err is None and mount is not None and _mount_of(fd) != mount:
        err = errno.EXDEV
    if err is not None:
        os.close(fd)
        raise OSError(err, os.strerror(err), where)
    return fd


def _open_last(dir_fd: int, name: str, flags: int, mode: int, mount: int | None, where: str) -> int:
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as exc:
        err = exc.errno
        if err == errno.ENOTDIR and not flags & os.O_NOFOLLOW and name != ".":
            # O_DIRECTORY met a link: the kernel's walk says ELOOP for any link it would have to follow.
            try:
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    err = errno.ELOOP
            except OSError:
                pass
        raise OSError(err, os.strerror(err or 0), where) from None
    if mount is not None and _mount_of(fd) != mount:
        os.close(fd)
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), where)
    return fd


def _where(dir_fd: int, path: str, same_mount: bool) -> str:
    """The path as far as the component openat2 refused, found again by the walk (each directory O_PATH, the
    last one not opened at all); the whole path when nothing on the way is refused now."""
    try:
        fd = walk_components(dir_fd, path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, same_mount=same_mount)
    except OSError as exc:
        return str(exc.filename)
    os.close(fd)
    return path


def _openat2_answers(dir_fd: int) -> bool:
    known = _OPENAT2[0]
    if known is None:
        known = _OPENAT2[0] = os.environ.get("ISOLATE_NO_OPENAT2", "") in ("", "0") and _openat2_works(dir_fd)
    return known


def _openat2_works(dir_fd: int) -> bool:
    """Whether openat2 opens ``dir_fd`` itself (ENOSYS or a filter's EPERM: it is missing)."""
    fd = int(lib.iso_open_beneath(dir_fd, b".", os.O_PATH | os.O_CLOEXEC, 0, 0))
    if fd >= 0:
        os.close(fd)
        return True
    return ffi.errno not in (errno.ENOSYS, errno.EPERM)


def _mount_of(fd: int) -> int:
    """The mount ``fd`` lies on: its mount id (/proc/self/fdinfo), or its device where /proc is missing."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1 - os.fstat(fd).st_dev
