"""What ``isolate-mcp`` keeps between tool calls: its sandboxes, their commands (output tails, streams,
waits) and sessions, the bounds on each, the tools' errors and argument models.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

from ..kept.sandbox import Sandbox, SandboxProcess, Shell
from ..kernel.fdwait import ready
from ..model.errors import IsolationError, PolicyError
from ..model.policy import Policy

#: The tail of each output stream a command run keeps (what it prints beyond is dropped as it comes).
OUTPUT_LIMIT = 1 << 20


#: How many sandboxes one server holds at most, unless told (--max-sandboxes): an agent in a loop stops there.
DEFAULT_MAX_SANDBOXES = 16


#: The most output of a running command held for streaming (a client slower than the command gets less).
STREAM_LIMIT = 256 << 10


#: The most commands a sandbox holds for the client (running, or ended and not yet collected with
#: command_get_status): each costs the host descriptors, a thread and up to twice OUTPUT_LIMIT.
MAX_COMMANDS = 64


#: The most sessions (persistent shells) a sandbox holds at once.
MAX_SESSIONS = 16


#: How long a file_read may be without a range.
READ_LIMIT = 16 << 20


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _one_line(exc: BaseException) -> str:
    """An exception as one line a model can act on (no traceback)."""
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, IsolationError):
        where = exc.filename if exc.filename is not None else ""
        text = f"{where}: {exc.strerror}" if where else exc.strerror
        if exc.filename2 is not None:
            text += f" (-> {exc.filename2})"
    else:
        text = str(exc) or type(exc).__name__
    first = " ".join(text.split("\n", 1)[0].split())
    return first if len(first) <= 500 else first[:497] + "..."


def _tool_errors(fn: F) -> F:
    """Every failure of a tool reaches the client as a tool error of one line."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ToolError:
            raise
        except Exception as exc:
            raise ToolError(_one_line(exc)) from None

    return wrapper  # type: ignore[return-value]


async def _thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a blocking Sandbox call in a worker thread (the event loop keeps serving)."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def _octal_mode(mode: int | str, what: str) -> int:
    """OpenSandbox spells a mode as the digits of its octal form (755); "0o755" and "755" are taken too."""
    text = str(mode).strip().lower().removeprefix("0o")
    if isinstance(mode, bool) or not re.fullmatch(r"[0-7]{1,4}", text):
        raise PolicyError(f"{what}: expected the octal digits of a file mode (644, 755), got {mode!r}", what)
    return int(text, 8)


def _range(header: str, size: int) -> slice:
    """``bytes=A-B``, ``bytes=A-`` or ``bytes=-N`` (HTTP's spelling) as a slice."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if match is None or (not match.group(1) and not match.group(2)):
        raise PolicyError(f"range_header: expected bytes=START-END, got {header!r}", "range_header")
    first, last = match.group(1), match.group(2)
    if not first:
        return slice(max(0, size - int(last)), size)
    start = int(first)
    end = int(last) + 1 if last else size
    if end <= start:
        raise PolicyError(f"range_header: {header!r} is empty", "range_header")
    return slice(start, end)


class _Tail:
    """The last ``limit`` bytes of a stream, and whether anything was dropped."""

    def __init__(self, limit: int = OUTPUT_LIMIT) -> None:
        self.data = bytearray()
        self.limit = limit
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[:len(self.data) - self.limit]
            self.truncated = True

    def text(self) -> str:
        return bytes(self.data).decode(errors="replace")


class _Pending:
    """Output chunks not yet streamed to the client, at most ``limit`` bytes (a flood is not queued)."""

    def __init__(self, limit: int = STREAM_LIMIT) -> None:
        self.lock = threading.Lock()
        self.chunks: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.dropped = {"stdout": 0, "stderr": 0}
        self.limit = limit

    def add(self, name: str, chunk: bytes) -> None:
        with self.lock:
            room = self.limit - sum(len(c) for c in self.chunks.values())
            self.chunks[name] += chunk[:max(0, room)]
            self.dropped[name] += max(0, len(chunk) - max(0, room))

    def take(self) -> list[tuple[str, str, int]]:
        """(stream, text, bytes) for each stream with something new; what was dropped is said in the text."""
        with self.lock:
            out = []
            for name, data in self.chunks.items():
                if data or self.dropped[name]:
                    text = data.decode(errors="replace")
                    if self.dropped[name]:
                        text += f"[... {self.dropped[name]} bytes not streamed; the result has the tail ...]\n"
                    out.append((name, text, len(data) + self.dropped[name]))
                    self.chunks[name] = bytearray()
                    self.dropped[name] = 0
            return out


class _Execution:
    """A command started by command_run: its output is drained by a thread as it comes."""

    def __init__(self, process: SandboxProcess, timeout: float | None,
                 on_chunk: Callable[[str, bytes], None] | None = None) -> None:
        self.id = "exec-" + secrets.token_hex(6)
        self.process = process
        self.timeout = timeout
        self.started = time.monotonic()
        self.ended: float | None = None
        self.stdout, self.stderr = _Tail(), _Tail()
        self.on_chunk = on_chunk
        self.done = threading.Event()
        self.error: BaseException | None = None
        process.close_stdin()
        self._thread = threading.Thread(target=self._drain, name=self.id, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        streams = {self.process.stdout_fd: ("stdout", self.stdout)}
        if self.process.stderr_fd >= 0:
            streams[self.process.stderr_fd] = ("stderr", self.stderr)
        try:
            for fd in streams:
                os.set_blocking(fd, False)
            exited = False
            # Past this, the sandbox's monitor did not take its own timeout: a process of the sandbox
            # may have stopped it (same uid). The command is killed, and then given up on.
            deadline = None if self.timeout is None else self.started + self.timeout + 10.0
            killed = False
            while True:
                # The exit is polled: a background process of the command may keep the pipes
                # open after it ended, and is not waited for (as Sandbox.exec).
                if streams:
                    # poll, not select: many commands (or sandboxes) put descriptors past FD_SETSIZE.
                    for fd in ready(list(streams), timeout=0.05):
                        self._read(fd, streams)
                else:
                    time.sleep(0.05)  # the command closed its output and goes on
                if exited:
                    for fd in list(streams):
                        while fd in streams and self._read(fd, streams):
                            pass
                    break
                exited = self.process.poll() is not None
                if not exited and deadline is not None and time.monotonic() > deadline:
                    if killed:
                        raise IsolationError("the command outlived its timeout and its kill: the sandbox's exec "
                                             "server does not answer (stopped by a process inside?)")
                    self.process.kill()
                    killed, deadline = True, deadline + 10.0
        except BaseException as exc:  # the thread's end is reported by the caller
            self.error = exc
        finally:
            self.ended = time.monotonic()
            self.done.set()

    def _read(self, fd: int, streams: dict[int, tuple[str, _Tail]]) -> bool:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            del streams[fd]
            return False
        name, tail = streams[fd]
        tail.add(chunk)
        if self.on_chunk is not None:
            self.on_chunk(name, chunk)
        return True

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def result(self) -> dict[str, Any]:
        running = self.running  # read once: the result and the caller's decision to forget it must agree
        if self.error is not None:
            raise self.error
        if running:
            return {"id": self.id, "status": "running", "exit_code": None, "stdout": self.stdout.text(),
                    "stderr": self.stderr.text(), "truncated": self.stdout.truncated or self.stderr.truncated,
                    "duration_seconds": round(time.monotonic() - self.started, 3)}
        code = self.process.wait(30.0)
        report = self.process.report
        status = report.status if report is not None else "exited"
        return {"id": self.id, "status": status, "exit_code": code, "stdout": self.stdout.text(),
                "stderr": self.stderr.text(), "truncated": self.stdout.truncated or self.stderr.truncated,
                "duration_seconds": round((self.ended or time.monotonic()) - self.started, 3)}

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        try:
            self.kill()
        finally:
            self.done.wait(5.0)
            self.process.close()


@dataclasses.dataclass
class _Entry:
    id: str
    box: Sandbox
    created: float
    keep: bool
    metadata: dict[str, str]
    paused: str | None = None  # the mechanism, while paused
    executions: dict[str, _Execution] = dataclasses.field(default_factory=dict)
    sessions: dict[str, Shell] = dataclasses.field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        return {"sandbox_id": self.id, "name": self.box.name, "backend": self.box.backend,
                "state": "paused" if self.paused else "running", "kept": self.keep,
                "workspace": self.box.workspace.target if self.box.backend == "native" else None,
                "created_at": self.created,
                "metadata": dict(self.metadata),
                "running_commands": sorted(e.id for e in self.executions.values() if e.running),
                "sessions": sorted(self.sessions)}


class _State:
    """The sandboxes this server holds (by id), and the policy every one of them gets."""

    def __init__(self, policy: Policy, profile: str | None, max_sandboxes: int) -> None:
        self.policy = policy
        self.profile = profile
        self.max_sandboxes = max_sandboxes
        self.entries: dict[str, _Entry] = {}
        self.lock = threading.Lock()

    def get(self, sandbox_id: str, *, running: bool = True) -> _Entry:
        entry = self.entries.get(sandbox_id)
        if entry is None:
            known = ", ".join(sorted(self.entries)) or "none"
            raise IsolationError(f"no sandbox {sandbox_id!r} in this server (it has: {known}); sandbox_create one, "
                                 "or sandbox_connect a kept one")
        if running and entry.paused:
            raise IsolationError(f"sandbox {sandbox_id!r} is paused; sandbox_resume it first")
        return entry

    def close_all(self) -> None:
        """At exit: end every sandbox, except kept ones (let go of those)."""
        with self.lock:
            entries = list(self.entries.values())
            self.entries.clear()
        for entry in entries:
            for execution in entry.executions.values():
                try:
                    execution.close()
                except Exception:
                    pass
            try:
                if entry.keep:
                    entry.box.detach()  # a paused one stays paused
                else:
                    if entry.paused:
                        entry.box.resume()
                    entry.box.close()
            except Exception as exc:
                print(f"isolate-mcp: sandbox {entry.id}: {_one_line(exc)}", file=sys.stderr)


class MoveEntry(BaseModel):
    """One move: ``source`` to ``destination`` (replaced if it exists)."""

    source: str
    destination: str


class ContentReplaceEntry(BaseModel):
    """Replace ``old_content`` by ``new_content`` in ``path``: every occurrence, or exactly ``count`` of them."""

    path: str
    old_content: str
    new_content: str
    count: int | None = None


class DirectoryEntry(BaseModel):
    """A directory to create (parents too); ``mode`` in octal digits."""

    path: str
    mode: int | str = 755


def _entry_info(path: str, info: Any) -> dict[str, Any]:
    import stat as stat_mod

    kind = ("dir" if stat_mod.S_ISDIR(info.mode) else "file" if stat_mod.S_ISREG(info.mode)
            else "link" if stat_mod.S_ISLNK(info.mode) else "other")
    return {"path": path, "type": kind, "size": info.size, "mode": f"{stat_mod.S_IMODE(info.mode):o}",
            "owner": info.uid, "group": info.gid, "modified_at": info.mtime_ns / 1e9}
