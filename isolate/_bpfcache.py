"""A per-user disk cache of compiled seccomp filters.

Compiling the default profile with libseccomp takes milliseconds, and a CLI
starts a new process every time: the compiled program is kept under the
user's cache directory, keyed by everything it depends on (isolate's version
and filter code, the profile's content, the flags, the machine). A cached
program is used only from a directory and file owned by the caller and
writable by no one else, so no other user can weaken a filter.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._version import __version__
from .grants import read_input_file

_SECCOMP_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp.py")


@dataclass(frozen=True)
class CachedFilter:
    """The fields of seccomp.CompiledFilter that a plan needs."""

    bpf: bytes
    notify_errnos: Mapping[int, int]
    notify_default_errno: int | None
    profile: str

    @property
    def notify(self) -> bool:
        return bool(self.notify_errnos) or self.notify_default_errno is not None


def _directory() -> str | None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "isolate", "seccomp") if os.path.isabs(base) else None


def key(mode: str, flags: tuple[bool, ...]) -> str | None:
    """The cache key of a filter, or None when its inputs cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(_SECCOMP_SOURCE, "rb") as handle:
            digest.update(handle.read())
        if mode not in ("default", "strict", "none"):
            digest.update(read_input_file(mode))
            mode = os.path.abspath(mode)
    except (OSError, ValueError):
        return None
    digest.update(json.dumps([__version__, mode, list(flags), platform.machine()]).encode())
    return digest.hexdigest()


def _trusted(info: os.stat_result) -> bool:
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def load(cache_key: str) -> CachedFilter | None:
    directory = _directory()
    if directory is None:
        return None
    try:
        if not _trusted(os.lstat(directory)):
            return None
        fd = os.open(os.path.join(directory, cache_key + ".json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not _trusted(info):
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data: Any = json.loads(handle.read())
        return CachedFilter(
            bpf=bytes.fromhex(data["bpf"]),
            notify_errnos={int(k): int(v) for k, v in data["notify_errnos"].items()},
            notify_default_errno=data["notify_default_errno"],
            profile=data["profile"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


def store(cache_key: str, compiled: Any) -> None:
    """Keep ``compiled`` (a seccomp.CompiledFilter); failures only cost the next compile."""
    directory = _directory()
    if directory is None:
        return
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _trusted(os.lstat(directory)):
            return
        data = {
            "bpf": compiled.bpf.hex(),
            "notify_errnos": {str(k): v for k, v in compiled.notify_errnos.items()},
            "notify_default_errno": compiled.notify_default_errno,
            "profile": compiled.profile,
        }
        fd, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle)
        os.replace(temporary, os.path.join(directory, cache_key + ".json"))
    except OSError:
        return
