"""Who could change the way to a host directory isolate uses by path: only root and the caller, or refused.

A directory (the image store, the state directory) is named by a path, and
what the path names is decided by every directory looked in on the way and
every link followed. Anyone who may write one of those directories may rename
the next step away and put their own (or a link) in its place; each later use
of the path then goes there. ``unsafe_way`` walks the path as the kernel
resolves it (each link's text spliced in, ``..`` to the parent) and asks of
each directory looked in, the last one included: owned by root or the caller,
and writable by no one else unless sticky (there only an entry's owner or the
directory's may rename it); and of each link: owned by root or the caller.

A directory writable by its group is refused, even one whose group seems to
hold the caller alone: who holds a group is not the caller's to know (other
accounts' primary group, NSS sources beyond /etc/group, a group password
``newgrp`` takes, set-group-id programs) and may change after the check,
while the kernel grants the write to every process that holds it.

Once a directory holds, only root or the caller can change the way to it, so
the verdict is kept per process with what each step was (device, inode, mode,
owner; a link's text too, as an inode number may be used again) and checked
again by one ``lstat`` per step: unchanged steps resolve the same way to the
same verdict, and any change (a chmod, a rename, a link re-pointed) walks
again.
"""

from __future__ import annotations

import os
import stat

from ..model.errors import IsolationError

#: How many links one path may go through (the kernel's own limit).
_MAX_HOPS = 40
#: A step of a walk: its path, (st_dev, st_ino, st_mode, st_uid) as it was, and a link's text (else None).
_Step = tuple[str, tuple[int, int, int, int], str | None]
#: Paths judged safe: (path, uid) -> each step looked at.
_SAFE: dict[tuple[str, int], tuple[_Step, ...]] = {}
_SAFE_MAX = 256


def _identity(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_mode, info.st_uid


def unsafe_way(path: str, uid: int | None = None) -> str | None:
    """What on the way to absolute ``path`` (the directory itself included) a uid other than root and ``uid``
    (the caller's effective uid by default) could change, naming the directory or link; None: nothing."""
    return _judged(path, os.geteuid() if uid is None else uid)[0]


def check_way(what: str, path: str, way_out: str, uid: int | None = None) -> tuple[int, int]:
    """IsolationError (``what PATH: DIRECTORY is ...: another user could ...; WAY_OUT``) unless ``unsafe_way``
    finds nothing on the way to ``path``; else (st_dev, st_ino) of the directory ``path`` names."""
    unsafe, steps = _judged(path, os.geteuid() if uid is None else uid)
    if unsafe is not None:
        raise IsolationError(f"{what} {path}: {unsafe}: another user could rename it and put their own in its "
                             f"place; {way_out}")
    return steps[-1][1][0], steps[-1][1][1]


def _judged(path: str, uid: int) -> tuple[str | None, tuple[_Step, ...]]:
    key = (path, uid)
    steps = _SAFE.get(key)
    if steps is not None:
        try:
            if all(_identity(os.lstat(step)) == known and (text is None or os.readlink(step) == text)
                   for step, known, text in steps):
                return None, steps
        except OSError:
            pass
        _SAFE.pop(key, None)
    unsafe, walked = _walk(path, (0, uid))
    if unsafe is None:
        if len(_SAFE) >= _SAFE_MAX:
            _SAFE.clear()
        _SAFE[key] = walked
    return unsafe, walked


def _walk(path: str, trusted: tuple[int, int]) -> tuple[str | None, tuple[_Step, ...]]:
    if not path.startswith("/"):
        return f"{path} is not an absolute path", ()
    walked: list[_Step] = []
    todo = [p for p in path.split("/") if p not in ("", ".")]
    todo.reverse()  # popped from the end
    current, hops = "/", 0
    try:
        info = os.lstat("/")
    except OSError as exc:
        return f"/: {exc.strerror}", ()
    unsafe = _directory("/", info, trusted)
    walked.append(("/", _identity(info), None))
    while unsafe is None and todo:
        part = todo.pop()
        if part == "..":  # the parent of a directory already looked at: itself already looked at
            current = os.path.dirname(current)
            continue
        step = os.path.join(current, part)
        try:
            info = os.lstat(step)
        except OSError as exc:
            return f"{step}: {exc.strerror}", ()
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in trusted:
                return f"{step} is a symbolic link of uid {info.st_uid}", ()
            hops += 1
            if hops > _MAX_HOPS:
                return f"{step}: too many links", ()
            try:
                text = os.readlink(step)
            except OSError as exc:
                return f"{step}: {exc.strerror}", ()
            walked.append((step, _identity(info), text))
            if text.startswith("/"):
                current = "/"
            todo.extend(reversed([p for p in text.split("/") if p not in ("", ".")]))
            continue
        if not stat.S_ISDIR(info.st_mode):
            return f"{step} is not a directory", ()
        walked.append((step, _identity(info), None))
        unsafe = _directory(step, info, trusted)
        current = step
    if unsafe is None and walked[-1][0] != current:  # ended in '..': the directory named is last, as check_way says
        try:
            walked.append((current, _identity(os.lstat(current)), None))
        except OSError as exc:
            return f"{current}: {exc.strerror}", ()
    return unsafe, tuple(walked)


def _directory(step: str, info: os.stat_result, trusted: tuple[int, int]) -> str | None:
    if info.st_uid not in trusted:
        return f"{step} belongs to uid {info.st_uid}"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"{step} is writable by {'others' if info.st_mode & 0o002 else 'its group'} (mode " \
               f"{stat.S_IMODE(info.st_mode):o}, not sticky)"
    return None
