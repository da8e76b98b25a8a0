"""Which links on the way to a host path isolate follows: only root's, directly under ``/``.

A program may have written a directory on a path the host later uses (a
grant, the state directory) and left a symbolic link there, to redirect the
host onto anything. Grants (grants.py) and the state directory (places.py)
both walk their paths with this one rule.
"""

from __future__ import annotations

import errno
import os
import stat

from ..model.errors import PolicyError
from .beneath import make_beneath, open_beneath

#: How a directory on a path the host uses for a program is opened: never through a link at its last step
#: (each step of a walk is opened from its parent's descriptor with these flags).
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def host_symlinks(path: str, field_name: str = "read") -> tuple[list[tuple[str, str]], str]:
    """The symlinked components of absolute ``path`` (as (link, text) pairs) and its real path.

    Only root's links directly under ``/`` (``/lib -> usr/lib``, ``/home ->
    /data/home``) are followed. A link deeper down could have been planted by
    an earlier sandbox in a directory it could write, to redirect a later
    grant onto something else: such a path is refused, naming its real path.
    """
    links: list[tuple[str, str]] = []
    current = "/"
    parts = [p for p in path.split("/") if p]
    seen = 0
    while parts:
        part = parts.pop(0)
        candidate = os.path.join(current, part)
        try:
            info = os.lstat(candidate)
        except OSError:
            return links, os.path.realpath(path)
        if stat.S_ISLNK(info.st_mode):
            if current != "/" or info.st_uid != 0:
                raise PolicyError(
                    f"{field_name}: {path} goes through the symlink {candidate} -> {os.readlink(candidate)}; "
                    f"grant the real path ({os.path.realpath(path)}) instead (only root's links directly under / "
                    "are followed, so that a program cannot redirect a later grant)",
                    field_name,
                )
            seen += 1
            if seen > 40:
                return links, os.path.realpath(path)
            text = os.readlink(candidate)
            links.append((candidate, text))
            resolved = text if text.startswith("/") else os.path.join(current, text)
            parts = [p for p in os.path.normpath(resolved).split("/") if p] + parts
            current = "/"
        else:
            current = candidate
    return links, current


def open_directory(path: str, create: bool = False) -> int:
    """A descriptor of the directory at absolute ``path``, reached by the same rule, without a race.

    ``host_symlinks`` checks a path and its caller then uses the path again: between the two, a program
    that can write a directory on the way may swap it for a link (``renameat2(RENAME_EXCHANGE)``). Here
    only root's links directly under ``/`` are read and followed; from the first directory below ``/``
    on, the rest is the one walk beneath a directory (beneath.py: openat2, no link followed). With
    ``create``, a missing directory is made (0700). Raises PolicyError for a link the rule does not
    follow, OSError for anything else.
    """
    parts = [p for p in path.split("/") if p not in ("", ".")]
    fd = os.open("/", DIR_FLAGS)
    hops = 0
    try:
        while parts:  # directly under /
            if ".." in parts:
                raise PolicyError(f"{path}: '..' on the way is not followed", "path")
            part = parts.pop(0)
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(info.st_mode) or info.st_uid != 0 or hops >= 40:
                    raise _not_followed(path, part) from None
                hops += 1
                # The link lies directly under /, so its text, absolute or relative, continues from / (fd).
                parts = [p for p in os.readlink(part, dir_fd=fd).split("/") if p not in ("", ".")] + parts
                continue
            os.close(fd)
            fd = child
            break
        if parts:
            rest = "/".join(parts)
            try:
                child = make_beneath(fd, rest, 0o700) if create else open_beneath(fd, rest, DIR_FLAGS)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _not_followed(path, os.path.basename(str(exc.filename))) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_followed(path: str, part: str) -> PolicyError:
    return PolicyError(f"{path}: {part} on the way is a link (or not a directory), which is not followed there "
                       "(only root's links directly under / are)", "path")
