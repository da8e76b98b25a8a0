"""A copy workspace's private copy, made once and shared by what starts from it.

``Workspace(source, mode="copy")`` on the native backend copies the source
once, into ``<state dir>/copies/TOKEN/tree``, and mounts that copy as the
read-only lower layer of an overlayfs at the workspace's target (as an
overlay workspace mounts its source: isolate/kernel/overlay.py); the
program's writes land in the sandbox's upper layer. The copy is never
written after it is made, so the source may change without the sandbox
seeing it, and snapshots, forks and restores handle the upper layer as an
overlay workspace's (isolate/kernel/layers.py): they cost what changed since
the copy, not the copy.

The copy is shared by the sandbox that made it, its snapshots, and the
sandboxes started from those: each holds a hard link of the copy's
``users`` file in its own directory (``copy-user``), so the file's link
count, less its own name, is how many use the copy. Removing a sandbox's
data directory or a snapshot's directory takes its link with it; ``release``
then removes the copy once nothing links it. Adding a user and removing a
copy happen under one lock (``flock`` of ``<state dir>/copies``): a copy is
never removed while a new user links it. A copy whose users were killed
without a word goes when their directories are swept (``sweep``).

Everything is reached through descriptors that follow no link (as a
sandbox's data directory: ``places.open_state_dir``).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from ...kernel.links import DIR_FLAGS
from ...kernel.places import open_state_dir
from ...kernel.tree import remove_dir_at
from ...model.errors import IsolationError

KIND = "copies"
USERS = "users"
#: The name of a user's link of a copy's ``users`` file, in the user's own directory.
USER_LINK = "copy-user"


@contextmanager
def _locked() -> Iterator[int]:
    """The copies directory's descriptor, under its exclusive lock."""
    fd = open_state_dir(KIND)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # the lock goes with the descriptor


def valid(token: object) -> bool:
    return isinstance(token, str) and len(token) == 24 and all(c in "0123456789abcdef" for c in token)


def create(user_fd: int) -> tuple[str, int]:
    """A new, empty copy, its first user linked from user_fd's directory: (its token, a descriptor of its
    ``tree``, for the caller to fill and close)."""
    token = secrets.token_hex(12)
    with _locked() as parent:
        os.mkdir(token, 0o700, dir_fd=parent)
        fd = os.open(token, DIR_FLAGS, dir_fd=parent)
        try:
            os.close(os.open(USERS, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=fd))
            os.link(USERS, USER_LINK, src_dir_fd=fd, dst_dir_fd=user_fd, follow_symlinks=False)
            os.mkdir("tree", 0o755, dir_fd=fd)
            return token, os.open("tree", DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)


def add_user(token: str, user_fd: int) -> None:
    """Link user_fd's directory to the copy (it stays while that link does)."""
    with _locked() as parent:
        try:
            fd = os.open(_checked(token), DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise IsolationError(f"workspace: the private copy it started from ({token}) is gone") from None
        try:
            os.link(USERS, USER_LINK, src_dir_fd=fd, dst_dir_fd=user_fd, follow_symlinks=False)
        finally:
            os.close(fd)


def open_tree(token: str) -> int:
    """A descriptor of the copy's tree (the caller closes it)."""
    parent = open_state_dir(KIND)
    try:
        fd = os.open(_checked(token), DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise IsolationError(f"workspace: its private copy ({token}) is gone") from None
    finally:
        os.close(parent)
    try:
        return os.open("tree", DIR_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def tree_path(token: str) -> str:
    from ...kernel.places import state_path

    return state_path(KIND, _checked(token), "tree")


def release(token: str | None) -> None:
    """Remove the copy if nothing links it any more (a user's directory was removed)."""
    if token is None or not valid(token):
        return
    try:
        with _locked() as parent:
            _remove_unused(parent, token)
    except (OSError, IsolationError):
        pass  # the state directory cannot be reached now (swapped?): a later sweep removes the copy


def sweep() -> list[str]:
    """Remove every copy nothing links (users removed by a sweep of what killed creators left)."""
    try:
        with _locked() as parent:
            return [token for token in sorted(os.listdir(parent)) if valid(token) and _remove_unused(parent, token)]
    except (OSError, IsolationError):
        return []


def _remove_unused(parent: int, token: str) -> bool:
    try:
        fd = os.open(token, DIR_FLAGS, dir_fd=parent)
    except OSError:
        return False
    try:
        try:
            users = os.stat(USERS, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            users = None
        if users is not None and (not stat.S_ISREG(users.st_mode) or users.st_nlink > 1):
            return False
        info = os.fstat(fd)
    finally:
        os.close(fd)
    remove_dir_at(parent, token, (info.st_dev, info.st_ino))
    return True


def _checked(token: str) -> str:
    if not valid(token):
        raise IsolationError(f"workspace: {token!r} names no private copy")
    return token
