"""Small file-system steps on cgroup directories: writes, pid lists, locks, removal, hand-over to a
delegated owner; and the errors of cgroups.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from ...model.errors import UnsupportedError

log = logging.getLogger("isolate.kernel.cgroup")


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


# -- small file-system helpers -------------------------------------------------


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_pids(directory: str) -> list[int]:
    try:
        text = _read_text(os.path.join(directory, "cgroup.procs"))
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_dir(path: str, blocking: bool) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when someone else holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rmdir_quiet(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _rmdir_parent(path: str) -> None:
    """Remove an empty v1 ``isolate`` parent that this user made (never one an admin handed over)."""
    try:
        if os.stat(path).st_uid == os.geteuid():
            os.rmdir(path)
    except OSError:
        pass


def _why(exc: OSError, what: str) -> str:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"cannot {what}: permission denied for uid {os.geteuid()} (not delegated to it)"
    if exc.errno == errno.EROFS:
        return f"cannot {what}: the cgroup file system is mounted read-only"
    return f"cannot {what}: {reason}"


class _NotHere(Exception):
    """This hierarchy/version cannot host the run; ``str(self)`` says why."""


class CgroupUnavailableError(UnsupportedError):
    """No cgroup this process may write can enforce what was asked.

    ``reasons`` lists why each candidate failed; ``hint`` says how to delegate one.
    """

    def __init__(self, message: str, reasons: tuple[str, ...], hint: str) -> None:
        super().__init__(message)
        self.reasons = reasons
        self.hint = hint


def _swap_total() -> int:
    try:
        for line in _read_text("/proc/meminfo").splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


#: The files of a cgroup that its delegatee must own to use it (cgroup v2's
#: delegation rules; v1 has ``tasks`` instead of ``cgroup.threads``).
_DELEGATED_FILES = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control", "tasks")


def _hand_over(path: str) -> None:
    """Give a cgroup that root just made inside another user's cgroup to that user.

    A root run inside a cgroup delegated to a user (systemd's Delegate=yes,
    User=) would otherwise leave root-owned ``isolate/`` directories there,
    after which the user's own runs cannot create their cgroups in them.
    """
    if os.geteuid() != 0:
        return
    try:
        owner = os.stat(os.path.dirname(path))
    except OSError:
        return
    if owner.st_uid == 0:
        return
    for name in ("", *_DELEGATED_FILES):
        try:
            os.chown(os.path.join(path, name) if name else path, owner.st_uid, owner.st_gid, follow_symlinks=False)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not hand %s over to uid %d: %s", path, owner.st_uid, exc)


def _mkdir_cgroup(path: str) -> None:
    os.mkdir(path)
    _hand_over(path)


def _ensure_dir(path: str) -> None:
    try:
        _mkdir_cgroup(path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _NotHere(_why(exc, f"create {path}")) from None
