"""The report of a run: what happened, and what was enforced by which mechanism.

The same shape for every backend; ``to_json`` gives the document of SPEC's
"The report" section, written by ``isolate-run --report``.
"""

from __future__ import annotations

import json
import os
import signal as signal_mod
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import IsolationError
from .files import write_all

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
    #: Egress by name: each destination reached and each refused, with counts:
    #: ``{"allowed": [{"host", "port", "count"}], "denied": [{"host" | "address", "port", "count", "reason"}]}``.
    egress: dict[str, Any] | None = None

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


class ReportTarget:
    """Where ``--report`` goes: the path's directory, held open from before the run.

    The sandboxed program may be able to write that directory (a report
    inside the writable cwd), or one above it, and replace it by a symbolic
    link while it runs. So the directory is opened once, before anything
    starts, and the report is written relative to that descriptor: a
    temporary file created there with ``O_EXCL|O_NOFOLLOW``, then renamed
    over the final name. Whatever the program left at the final name (a
    link, a FIFO, a file) is replaced, never followed, opened or truncated;
    a directory there fails the write. ``close()`` releases the directory.
    """

    def __init__(self, path: str, label: str = "--report") -> None:
        self.path = path
        self.label = label
        parent, self.name = os.path.split(os.path.abspath(path))
        if not self.name:
            raise IsolationError(f"{label} {path}: names a directory; choose a file path")
        try:
            self._dir_fd: int | None = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise IsolationError(f"{label} {path}: its directory {parent} cannot be opened: {exc.strerror}") from None
        try:
            info = os.stat(self.name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            self.close()
            raise IsolationError(f"{label} {path}: cannot check it: {exc.strerror}") from None
        problem = ("is a symbolic link; refusing to write through it" if stat.S_ISLNK(info.st_mode) else
                   None if stat.S_ISREG(info.st_mode) else "is not a regular file; choose a file path")
        if problem:
            self.close()
            raise IsolationError(f"{label} {path}: {problem}")

    def write(self, report: Report) -> None:
        """Write the report (once); raises ``IsolationError`` naming the path."""
        if self._dir_fd is None:
            raise IsolationError(f"{self.label} {self.path}: already written")
        self.write_bytes((report.to_json() + "\n").encode())

    def write_bytes(self, data: bytes) -> None:
        """Write data as the file's content (once); raises ``IsolationError`` naming the path."""
        if self._dir_fd is None:
            raise IsolationError(f"{self.label} {self.path}: already written")
        try:
            self._write(self._dir_fd, data)
        finally:
            self.close()

    def _write(self, dir_fd: int, data: bytes) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for attempt in range(100):
            temporary = f".{self.name}.{os.getpid()}.{attempt}.tmp"
            try:
                fd = os.open(temporary, flags, 0o644, dir_fd=dir_fd)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                raise IsolationError(f"{self.label} {self.path}: cannot write it: {exc.strerror}") from None
        else:
            raise IsolationError(f"{self.label} {self.path}: cannot create a temporary file beside it")
        try:
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            os.rename(temporary, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            try:
                os.unlink(temporary, dir_fd=dir_fd)
            except OSError:
                pass
            raise IsolationError(f"{self.label} {self.path}: cannot write it: {exc.strerror}") from None

    @property
    def pending(self) -> bool:
        """True until the report is written or the target closed."""
        return self._dir_fd is not None

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
