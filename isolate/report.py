"""The report of a run: what happened, and what was enforced by which mechanism.

The same shape for every backend; ``to_json`` gives the document of SPEC's
"The report" section, written by ``isolate-run --report``.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import signal as signal_mod
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import IsolationError

#: Values of ``status``.
STATUSES = ("ok", "exited", "signaled", "timeout", "memory", "cpu", "file-size", "setup-error")


@dataclass
class Report:
    """What a run did. ``status`` names the limit when a limit ended the run."""

    status: str = "ok"
    exit_code: int | None = 0
    signal: int | None = None
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    user_seconds: float = 0.0
    system_seconds: float = 0.0
    max_rss_bytes: int = 0
    oom_kills: int = 0
    backend: str = "native"
    enforced: dict[str, Any] = field(default_factory=dict)
    denied: list[dict[str, Any]] = field(default_factory=list)
    #: Limits the run reached without (necessarily) being ended by them, e.g. ``pids``.
    limits_reached: list[str] = field(default_factory=list)
    #: Per mechanism, whether its denials can reach ``denied`` on this run and host, and why not:
    #: ``{"seccomp": {"observed": true, "detail": ...}, "landlock": {"observed": false, ...}}``.
    #: An empty ``denied`` means "none seen" only where ``observed`` is true.
    denials_observed: dict[str, dict[str, Any]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal_mod.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"


def status_for(returncode: int, limit_hit: str | None = None) -> tuple[str, int | None, int | None]:
    """(status, exit_code, signal) from a subprocess-style return code.

    ``limit_hit`` names a limit known to have ended the run (from the init or a
    cgroup); otherwise SIGXCPU and SIGXFSZ name theirs.
    """
    if returncode >= 0:
        exit_code, sig = returncode, None
        status = "ok" if returncode == 0 else "exited"
    else:
        exit_code, sig = None, -returncode
        status = "signaled"
        if sig == signal_mod.SIGXCPU:
            status = "cpu"
        elif sig == signal_mod.SIGXFSZ:
            status = "file-size"
    if limit_hit:
        status = limit_hit
    return status, exit_code, sig


def check_report_path(path: str) -> None:
    """Refuse, before anything runs, a report path that is a symlink or not a regular file."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise IsolationError(f"--report {path}: its directory {parent} does not exist") from None
        return
    except OSError as exc:
        raise IsolationError(f"--report {path}: cannot check it: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise IsolationError(f"--report {path}: is a symbolic link; refusing to write through it")
    if not stat.S_ISREG(info.st_mode):
        raise IsolationError(f"--report {path}: is not a regular file; choose a file path")


def write_report(path: str, report: Report) -> None:
    """Write ``report`` to ``path``, never through a symlink nor onto a non-regular file.

    The file is opened with O_NOFOLLOW and checked with fstat before it is
    truncated, so a link planted at ``path`` (by the sandboxed program, in a
    writable directory) cannot redirect the write.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno_mod.ELOOP:
            raise IsolationError(f"--report {path}: is a symbolic link; refusing to write through it") from None
        raise IsolationError(f"--report {path}: cannot open it: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IsolationError(f"--report {path}: is not a regular file; choose a file path")
        os.ftruncate(fd, 0)
        data = (report.to_json() + "\n").encode()
        while data:
            written = os.write(fd, data)
            data = data[written:]
    finally:
        os.close(fd)
