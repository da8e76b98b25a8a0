"""Where isolate keeps its state on the host, and how it reaches it without following a planted link.

- ``state_dir()``: data that may be large and survives a reboot (workspace
  copies, overlay layers): ``$ISOLATE_STATE_DIR``, else
  ``$XDG_STATE_HOME/isolate``, else ``~/.local/state/isolate``.
- ``runtime_dir()``: what the host trusts about a running sandbox (its
  socket and its description): ``/run/isolate`` for root, else
  ``$XDG_RUNTIME_DIR/isolate``, else ``/tmp/isolate-UID``; owned by the
  caller, mode 0700, checked on every use. Where another user took
  ``/tmp/isolate-UID`` first (any local user can: a denial of service), a
  fresh private directory ``/tmp/isolate-UID.XXXXXXXX`` (mkdtemp: an
  unpredictable name, made 0700 by its maker) stands in, found again through
  the link ``runtime-dir`` in the state directory (only the caller's; what it
  points to is trusted only when it is such a directory of the caller's, so
  nobody else can redirect it). A sandbox never gets it writable
  (native runs refuse such a grant), while the state directory may well lie
  under a sandbox's writable home: nothing read from it is trusted for
  a path, a pid or a permission, and every directory isolate makes in it is
  reached through ``open_state_dir()``, which follows no link a program
  could have planted (the host would otherwise copy a workspace, or write
  layers, wherever such a link points).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
from collections.abc import Iterator

from ..model.errors import IsolationError, PolicyError
from .beneath import make_beneath
from .way import check_way


def state_dir() -> str:
    """``$ISOLATE_STATE_DIR``, else ``$XDG_STATE_HOME/isolate``, else ``~/.local/state/isolate``."""
    explicit = os.environ.get("ISOLATE_STATE_DIR")
    if explicit:
        return os.path.abspath(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "isolate")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "isolate")


def state_key() -> str:
    """A short name of the state directory, for the files about it that live in the runtime directory."""
    return hashlib.sha256(os.fsencode(os.path.realpath(state_dir()))).hexdigest()[:16]




def open_state_dir(*parts: str) -> int:
    """A descriptor of ``state_dir()/parts...``, each directory made (0700) if missing; the caller closes it.

    The state directory may lie under a sandbox's writable home, so a program may have replaced any
    directory in it, or on the way to it, by a link. The way to the state directory follows only
    root's links directly under ``/`` (as grants do), and each part below it is opened without
    following a link and must be a directory of this user: what the host then makes through the
    descriptor lands where isolate meant, wherever a link points. Nor may another user be able to
    change the way (way.py: the image store's rule), as the host also uses the path.
    """
    from .links import open_directory

    base = state_dir()
    uid = os.geteuid()
    try:
        fd = open_directory(base, create=True)  # descriptor by descriptor: no swap on the way is followed
    except PolicyError:
        if os.path.lexists(base) and not os.path.islink(base) and not os.path.isdir(base):
            raise IsolationError(f"state directory {base} is not a directory; remove it, or set ISOLATE_STATE_DIR "
                                 "to a directory") from None
        raise IsolationError(f"state directory {base}: the way to it goes through a link, which isolate does not "
                             "follow there (only root's links directly under / are: a program could have planted "
                             f"it); set ISOLATE_STATE_DIR to its real path, {os.path.realpath(base)}") from None
    except OSError as exc:
        raise IsolationError(f"state directory {base}: {exc.strerror}; set ISOLATE_STATE_DIR to a "
                             "writable directory") from None
    where = base
    try:
        if os.fstat(fd).st_uid not in (uid, 0):
            raise IsolationError(f"state directory {base} belongs to another user; set ISOLATE_STATE_DIR to "
                                 "a directory of yours")
        for part in parts:
            if not part or "/" in part or part in (".", ".."):
                raise ValueError(f"not one name: {part!r}")
            where = os.path.join(where, part)
            try:  # one name at a time (beneath.py's walk): each one's owner is asked, those on the way too
                child = make_beneath(fd, part, 0o700)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise IsolationError(f"state directory: {where}: {exc.strerror}; set ISOLATE_STATE_DIR to a "
                                         "writable directory") from None
                raise IsolationError(f"state directory: {where} is not a directory isolate made ({exc.strerror}: "
                                     "a link, or another kind of file); remove it") from None
            os.close(fd)
            fd = child
            if os.fstat(fd).st_uid != uid:
                raise IsolationError(f"state directory: {where} belongs to another user; remove it")
        # The host also uses these directories by path (the image store, a workspace's copy): nothing on the way
        # another user could change (way.py), and the path still names the directory opened.
        named = check_way("state directory", where, "set ISOLATE_STATE_DIR to a directory on a way only you and "
                          "root can change", uid)
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != named:
            raise IsolationError(f"state directory {where} was replaced while it was opened; try again")
    except BaseException:
        os.close(fd)
        raise
    return fd


def state_path(*parts: str) -> str:
    """``state_dir()/parts...`` made and checked as ``open_state_dir()`` does, as a path."""
    os.close(open_state_dir(*parts))
    return os.path.join(state_dir(), *parts)


def runtime_dir(create: bool = True) -> str:
    """The caller's private runtime directory for isolate (see the module's docstring)."""
    uid = os.geteuid()
    if uid == 0 and os.path.isdir("/run"):
        path = "/run/isolate"
    else:
        xdg = os.environ.get("XDG_RUNTIME_DIR", "")
        base = xdg if xdg and os.path.isabs(xdg) and _owned_private(xdg, uid) else None
        path = os.path.join(base, "isolate") if base else f"/tmp/isolate-{uid}"
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise IsolationError(f"runtime directory {path}: cannot create it ({exc.strerror})") from None
    try:
        info = os.lstat(path)
    except OSError:
        if not create:
            return path
        info = None
    if info is not None and _private(info, uid):
        return path
    if info is not None and info.st_uid != uid and path == f"/tmp/isolate-{uid}":
        try:
            return _stand_in(uid, path, info.st_uid)
        except IsolationError:
            if create:
                raise
            return path  # asked only where it would be: nothing of the caller's is anywhere yet
    if not create:
        return path
    raise IsolationError(
        f"runtime directory {path} is not a directory owned by uid {uid} with mode 0700 (someone else made it, "
        "or it is a link): remove it, or set XDG_RUNTIME_DIR to a private directory"
    )


#: In the state directory: a link to the private directory that stands in for a /tmp/isolate-UID another user
#: took (runtime_dir).
STAND_IN_LINK = "runtime-dir"


def _stand_in(uid: int, taken: str, owner: int) -> str:
    """The private directory in place of ``taken`` (another user's): the one the state directory's link names
    when it is still a directory of this user's that only this user can have made, else a fresh one (mkdtemp's
    unpredictable name, under a lock: one for all the caller's processes). Made even for runtime_dir(create=
    False): where it will be is where it is made, and a grant check must see that, not the other user's name
    (which may be a link to anywhere)."""
    import pwd
    import tempfile

    try:
        name = f"uid {owner} ({pwd.getpwuid(owner).pw_name})"
    except KeyError:
        name = f"uid {owner}"

    def refuse(why: str) -> IsolationError:
        return IsolationError(
            f"runtime directory {taken} belongs to {name}, not to uid {uid} (another user made it first), and no "
            f"private directory can stand in for it: {why}; set XDG_RUNTIME_DIR to a private directory of yours, "
            f"or have {taken} removed")

    def named(fd: int) -> str | None:
        try:
            target = os.readlink(STAND_IN_LINK, dir_fd=fd)
        except OSError:
            return None
        head, _, suffix = target.rpartition(".")
        if head == taken and re.fullmatch(r"[A-Za-z0-9_]+", suffix) and _owned_private(target, uid):
            return target
        return None

    try:
        fd = open_state_dir()
    except IsolationError as exc:
        raise refuse(str(exc)) from None
    try:
        found = named(fd)
        if found is not None:
            return found
        try:
            lock = os.open(f"{STAND_IN_LINK}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                           dir_fd=fd)
        except OSError as exc:
            raise refuse(f"{exc.strerror}: {STAND_IN_LINK}.lock in the state directory") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = named(fd)  # another process of the caller's made one meanwhile
            if found is not None:
                return found
            try:
                made = tempfile.mkdtemp(prefix=os.path.basename(taken) + ".", dir=os.path.dirname(taken))
            except OSError as exc:
                raise refuse(f"{exc.strerror} ({os.path.dirname(taken)})") from None
            temporary = f"{STAND_IN_LINK}.{os.getpid()}"
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary, dir_fd=fd)
                os.symlink(made, temporary, dir_fd=fd)
                os.replace(temporary, STAND_IN_LINK, src_dir_fd=fd, dst_dir_fd=fd)
            except OSError as exc:
                os.rmdir(made)  # found by nobody: not left behind
                raise refuse(f"{exc.strerror}: {STAND_IN_LINK} in the state directory") from None
            return made
        finally:
            os.close(lock)
    finally:
        os.close(fd)


def _private(info: os.stat_result, uid: int) -> bool:
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & 0o077


def _owned_private(path: str, uid: int) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return _private(info, uid)


def runtime_subdir(name: str) -> str:
    """``runtime_dir()/name``, made 0700 if missing; refused unless it is a directory of this user."""
    path = os.path.join(runtime_dir(), name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise IsolationError(f"{path}: not a directory of this user; remove it") from None
    return path


@contextlib.contextmanager
def making_in(parent: int) -> Iterator[None]:
    """Held (shared) from making a directory in ``parent`` to locking it (flock): a ``sweeping_in`` of the same
    directory waits for that window to close, so it never takes a directory just made, not yet locked, for
    one its maker left (a maker in another PID namespace has no pid the sweeper could check instead)."""
    fcntl.flock(parent, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(parent, fcntl.LOCK_UN)


def lock_if_left(parent: int, fd: int) -> bool:
    """Whether the directory ``fd`` of ``parent`` was left by its maker: its lock is free, taken now (the
    caller removes it, then closes ``fd``). No maker is between its mkdir and its flock meanwhile."""
    fcntl.flock(parent, fcntl.LOCK_EX)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        fcntl.flock(parent, fcntl.LOCK_UN)
