"""``isolate.agents``: the sandbox patterns agent projects write by hand, over ``isolate.Sandbox``.

- ``AgentSandboxes``: one named sandbox per agent id, recreated when its
  configuration (policy, workspace, mounts, backend) changes, pruned when
  idle or old, with ``list``/``rm``/``prune``.
- ``agent_files(target)``: ``read``/``write``/``edit``/``ls`` tools for an
  agent that stay beneath a root and never follow a link: over a
  ``Sandbox`` (``SandboxFiles``) or over a plain host directory
  (``HostFiles``: openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) semantics,
  built from ``O_NOFOLLOW`` directory descriptors, one component at a time).
- ``branches(policy)``: a branch per attempt (``setup_branch``,
  ``execute_command``, ``execute_python``, ``commit_to_host``, ``clean_up``,
  ``clean_up_all``), native or Docker behind one protocol, with a fallback
  from one to the other that is warned about and recorded, never silent.
- ``wrap(argv, policy)``: the ``isolate-run`` command line that runs argv
  under the policy, for agents that only know how to prefix a command.

Everything here uses the public methods of ``Sandbox``; nothing runs outside a sandbox.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .errors import IsolationError, PolicyError, UnsupportedError
from .policy import DEFAULT_HOME, DEFAULT_KEEP_ENV, DEFAULT_READ, DEFAULT_TMPFS, DEFAULT_WRITE, Egress, Mount, Policy
from .registry import runtime_dir, state_dir
from .sandbox import ExecResult, Sandbox, _seconds
from .workspace import _DIR_FLAGS, Changes, Workspace, _open_file

__all__ = ["AgentFiles", "AgentRecord", "AgentSandboxes", "BranchStrategy", "DockerBranches", "HostFiles",
           "NativeBranches", "SandboxConfig", "SandboxFiles", "StrategyFallbackWarning", "ToolError", "agent_files",
           "branches", "wrap"]


# -- the configuration of an agent's sandbox ----------------------------------------------------------------


@dataclass(frozen=True)
class SandboxConfig:
    """What an agent's sandbox is made from; ``config_hash()`` changes when any of it does."""

    policy: Policy = field(default_factory=Policy)
    workspace: Workspace = field(default_factory=Workspace)
    mounts: tuple[Mount, ...] = ()
    #: "native" or "docker"; None: the policy's backend ("auto" means native, as for Sandbox).
    backend: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise PolicyError("SandboxConfig: policy must be an isolate.Policy", "policy")
        workspace = self.workspace
        if isinstance(workspace, (str, os.PathLike)):
            workspace = Workspace(os.fspath(workspace))
        if not isinstance(workspace, Workspace):
            raise PolicyError("SandboxConfig: workspace must be an isolate.Workspace or a directory", "workspace")
        object.__setattr__(self, "workspace", workspace)
        mounts = (self.mounts,) if isinstance(self.mounts, (str, Mount)) else tuple(self.mounts)
        object.__setattr__(self, "mounts", tuple(Mount.parse(m, "ro") if isinstance(m, str) else m for m in mounts))
        backend = self.backend or (self.policy.backend if self.policy.backend != "auto" else "native")
        if backend not in ("native", "docker"):
            raise PolicyError(f"SandboxConfig: backend {backend!r} is not native or docker", "backend")
        object.__setattr__(self, "backend", backend)

    def config_hash(self) -> str:
        """sha256 over the policy's own hash, the workspace, the mounts and the backend."""
        ws = self.workspace
        blob = json.dumps({"policy": self.policy.config_hash(),
                           "workspace": [ws.source, ws.target, ws.mode, list(ws.exclude)],
                           "mounts": [str(m) for m in self.mounts], "backend": self.backend},
                          sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def of(cls, sandbox: Sandbox) -> SandboxConfig:
        """The configuration a sandbox runs with (for an attached one: as its creator recorded it)."""
        return cls(sandbox.policy, sandbox.workspace, tuple(sandbox.mounts), sandbox.backend)


# -- one sandbox per agent ----------------------------------------------------------------------------------

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,23}$")


@dataclass(frozen=True)
class AgentRecord:
    """An agent's sandbox as the manager knows it (times are seconds since the epoch)."""

    agent_id: str
    name: str
    config_hash: str
    created: float
    last_used: float


class AgentSandboxes:
    """One kept, named sandbox per agent id (see the module's docstring).

    ``prefix`` namespaces the sandboxes of this manager: agent ``a`` of
    prefix ``p`` gets the sandbox ``p-<sha256 of "a", 32 hex digits>``, so any
    string is an id and none chooses a path or another agent's sandbox.
    ``idle``: seconds without ``get`` after which the sandbox is removed (by
    ``prune``, or replaced by the next ``get``); ``max_age``: seconds after its
    creation. Both are also given to the sandbox itself (``idle_timeout``
    and ``ttl``), which ends itself then even if no one prunes (a sandbox
    this manager holds keeps a connection, so it is not idle for its server).
    ``None`` (or ``math.inf``): never.

    What the manager remembers (agent ids, creation and use times) lies in
    ``agents.sqlite3`` under the state directory; whether a sandbox is
    reused is decided by the configuration the running sandbox reports, not by
    that file.
    """

    def __init__(self, prefix: str = "agent", *, idle: float | None = 3600.0, max_age: float | None = 24 * 3600.0,
                 db_path: str | None = None) -> None:
        if not isinstance(prefix, str) or not _PREFIX.match(prefix):
            raise PolicyError(f"prefix {prefix!r}: use 1 to 24 letters, digits, '_' or '-', starting with a letter "
                              "or digit", "prefix")
        self.prefix = prefix
        self.idle = _seconds(idle, "idle")
        self.max_age = _seconds(max_age, "max_age")
        self.db_path = db_path or os.path.join(state_dir(), "agents.sqlite3")
        #: What the last get() did: "created", "reused", or "recreated (<why>)".
        self.last_action: str | None = None
        self._held: dict[str, Sandbox] = {}
        self._lock = threading.RLock()

    def __enter__(self) -> AgentSandboxes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def name_of(self, agent_id: str) -> str:
        """The sandbox name of an agent id (a hash of it: the id never becomes a name or a path)."""
        if not isinstance(agent_id, str):
            raise TypeError("agent_id must be a string")
        try:
            raw = agent_id.encode("utf-8")
        except UnicodeEncodeError:
            raise PolicyError("agent_id: not encodable as UTF-8 (a lone surrogate)", "agent_id") from None
        return f"{self.prefix}-{hashlib.sha256(raw).hexdigest()[:32]}"

    def get(self, agent_id: str, config: SandboxConfig | Policy | None = None) -> Sandbox:
        """The agent's running sandbox: reused while its configuration hash matches, else made afresh.

        An idle or too old sandbox, or one that ended, is replaced too;
        ``last_action`` says which of these happened.
        """
        if config is None:
            config = SandboxConfig()
        elif isinstance(config, Policy):
            config = SandboxConfig(config)
        elif not isinstance(config, SandboxConfig):
            raise TypeError("config must be an isolate.agents.SandboxConfig or an isolate.Policy")
        name = self.name_of(agent_id)
        want = config.config_hash()
        with self._locked():
            now = time.time()
            rec = self._record(agent_id)
            box = self._held.pop(agent_id, None)
            why = self._expired(rec, now) if rec is not None else None
            if why is None:
                if box is None:
                    box = _attach(name)
                    if box is None and config.backend == "native" and _running(name):
                        raise IsolationError(
                            f"the sandbox of agent {agent_id!r} ({name}) runs but does not answer (paused, or its "
                            f"exec server was killed from inside): resume it, or rm it (isolate-run sandbox rm {name})")
                if box is not None:
                    if SandboxConfig.of(box).config_hash() != want:
                        why = "configuration changed"
                    elif not _alive(box):
                        why = "ended"
                elif rec is not None and config.backend == "native":
                    why = "ended"
                elif rec is not None and rec.config_hash != want:
                    why = "configuration changed"
            created = rec.created if rec is not None else now
            made = False
            if box is None or why is not None:
                if box is not None:
                    _close_quietly(box)
                if why is not None or config.backend == "native":
                    _remove_named(name)  # what an ended one left (a Docker one of the same config is reused)
                box = Sandbox(config.policy, workspace=config.workspace, mounts=config.mounts, name=name,
                              backend=config.backend, ttl=self.max_age,
                              idle_timeout=self.idle if self.idle is not None else math.inf)
                box.start()
                if why is not None or rec is None:
                    created = now
                made = True
            self.last_action = f"recreated ({why})" if why is not None else "created" if made else "reused"
            self._held[agent_id] = box
            self._save(AgentRecord(agent_id, name, want, created, now))
            return box

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This object's threads, and every process of this user with the same prefix, one at a time.

        Without it, a second process that finds no sandbox yet would clear the name (what an ended
        one left) while the first is starting it. The lock file lies in the private runtime directory.
        """
        with self._lock:
            path = os.path.join(runtime_dir(), f"{self.prefix}.agents.lock")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise IsolationError(f"agent lock {path}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _expired(self, rec: AgentRecord, now: float) -> str | None:
        if self.max_age is not None and now - rec.created > self.max_age:
            return f"older than max_age {self.max_age:g} s"
        if self.idle is not None and now - rec.last_used > self.idle:
            return f"idle longer than {self.idle:g} s"
        return None

    def list(self) -> list[AgentRecord]:
        """The agents of this prefix that have a sandbox (or had one not yet pruned)."""
        with self._db() as db:
            rows = db.execute("SELECT agent_id, config_hash, created, last_used FROM agents WHERE prefix = ? "
                              "ORDER BY agent_id", (self.prefix,)).fetchall()
        return [AgentRecord(str(a), self.name_of(str(a)), str(h), float(c), float(u)) for a, h, c, u in rows]

    def rm(self, agent_id: str) -> bool:
        """End and remove the agent's sandbox; False when it had none."""
        name = self.name_of(agent_id)
        with self._locked():
            box = self._held.pop(agent_id, None)
            if box is not None:
                _close_quietly(box)
            removed = _remove_named(name) or box is not None
            with self._db() as db:
                cursor = db.execute("DELETE FROM agents WHERE prefix = ? AND agent_id = ?", (self.prefix, agent_id))
            return removed or cursor.rowcount > 0

    def prune(self) -> builtins.list[tuple[str, str]]:
        """Remove the sandboxes that are idle, too old or ended; (agent id, why) of each."""
        done = []
        now = time.time()
        for rec in self.list():
            why = self._expired(rec, now)
            if why is None and rec.agent_id not in self._held and _backend_of(rec.name) != "docker" \
                    and not _running(rec.name):
                why = "ended"  # a paused one is not asked (it would not answer), only looked at
            if why is not None:
                self.rm(rec.agent_id)
                done.append((rec.agent_id, why))
        return done

    def close(self) -> None:
        """Let go of the sandboxes this object holds; they keep running (for get, list, rm, prune)."""
        with self._lock:
            for box in self._held.values():
                with contextlib.suppress(IsolationError, OSError):
                    box.detach()
            self._held.clear()

    # -- the agents table --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        try:
            os.makedirs(os.path.dirname(self.db_path), mode=0o700, exist_ok=True)
            conn = sqlite3.connect(self.db_path, timeout=10.0)
        except (OSError, sqlite3.Error) as exc:
            raise IsolationError(f"agent table {self.db_path}: cannot open it ({exc}); set ISOLATE_STATE_DIR to a "
                                 "writable directory") from None
        try:
            conn.execute("CREATE TABLE IF NOT EXISTS agents (prefix TEXT NOT NULL, agent_id TEXT NOT NULL, "
                         "config_hash TEXT NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL, "
                         "PRIMARY KEY (prefix, agent_id))")
            with conn:
                yield conn
        except sqlite3.Error as exc:
            raise IsolationError(f"agent table {self.db_path}: {exc}; remove the file to start afresh") from None
        finally:
            conn.close()

    def _record(self, agent_id: str) -> AgentRecord | None:
        with self._db() as db:
            row = db.execute("SELECT config_hash, created, last_used FROM agents WHERE prefix = ? AND agent_id = ?",
                             (self.prefix, agent_id)).fetchone()
        if row is None:
            return None
        try:  # the file lies in the state directory, which a sandbox may write: numbers are checked
            created, last_used = float(row[1]), float(row[2])
        except (TypeError, ValueError):
            created = last_used = 0.0
        if math.isnan(created) or math.isnan(last_used):
            created = last_used = 0.0
        return AgentRecord(agent_id, self.name_of(agent_id), str(row[0]), created, last_used)

    def _save(self, rec: AgentRecord) -> None:
        with self._db() as db:
            db.execute("INSERT OR REPLACE INTO agents VALUES (?, ?, ?, ?, ?)",
                       (self.prefix, rec.agent_id, rec.config_hash, rec.created, rec.last_used))


def _attach(name: str) -> Sandbox | None:
    """The running sandbox of that name, or None."""
    try:
        return Sandbox.attach(name)
    except (IsolationError, OSError):
        return None


def _running(name: str) -> bool:
    """Whether the named native sandbox still has processes (asking nothing of it: it may be paused)."""
    try:
        box = Sandbox.attach(name, ping=False)
    except (IsolationError, OSError):
        return False
    try:
        return bool(box.processes())
    except UnsupportedError:
        return True
    except (IsolationError, OSError):
        return False
    finally:
        box.detach()


def _alive(box: Sandbox) -> bool:
    try:
        box.stat("/")
    except UnsupportedError:
        return True  # a backend without file methods: its own start() revives or recreates it
    except (IsolationError, OSError):
        return False
    return True


def _close_quietly(box: Sandbox) -> None:
    with contextlib.suppress(IsolationError, OSError):
        box.close()


def _backend_of(name: str) -> str:
    from .registry import Registry

    return "docker" if any(r.name == name for r in Registry().all() if r.engine != "native") else "native"


def _remove_named(name: str) -> bool:
    """End and remove the kept sandbox of that name, native or Docker (as ``isolate-run sandbox rm``)."""
    from .sandbox_cli import remove_native

    if remove_native(name):
        return True
    if _backend_of(name) != "docker":
        return False
    try:
        from .backends.docker import sandbox as docker_sandbox

        return bool(docker_sandbox.remove_sandbox(name))
    except (ImportError, IsolationError):
        return False


# -- file tools for an agent ----------------------------------------------------------------------------------

#: The largest file read() returns (an agent's context is small; read a part with execute_command instead).
DEFAULT_MAX_BYTES = 1 << 20


class ToolError(IsolationError):
    """A file tool refused or failed; the message is written for the agent (what, why, what to do)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


@runtime_checkable
class AgentFiles(Protocol):
    """The file tools an agent gets: paths are relative to ``root`` (or absolute beneath it)."""

    root: str

    def read(self, path: str) -> str: ...

    def write(self, path: str, content: str) -> str: ...

    def edit(self, path: str, old: str, new: str, *, replace_all: bool = False) -> str: ...

    def ls(self, path: str = ".") -> list[str]: ...


def _components(path: str, root: str) -> list[str]:
    """path's components below root ('.' and empty ones dropped, '..' kept); an absolute path must lie under root."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ToolError(f"{path!r} is not a path; give a path relative to {root}", str(path))
    rel = path
    if path.startswith("/"):
        norm = os.path.normpath(path)
        if norm != root and not norm.startswith(root.rstrip("/") + "/"):
            raise ToolError(f"{path}: outside the workspace {root}; use a path relative to it", path)
        rel = path[len(root):] if path.startswith(root) else norm[len(root):]
    return [p for p in rel.split("/") if p not in ("", ".")]


def _beneath(parts: list[str], path: str, root: str) -> list[str]:
    """parts with each '..' applied; one that would climb above root is refused."""
    out: list[str] = []
    for part in parts:
        if part == "..":
            if not out:
                raise ToolError(f"{path}: '..' leads out of the workspace {root}; stay inside it", path)
            out.pop()
        else:
            out.append(part)
    return out


def _link_refused(path: str) -> ToolError:
    return ToolError(f"{path}: a symbolic link is on the way; the file tools never follow links "
                     "(use the path it points to, if that lies in the workspace)", path)


@contextlib.contextmanager
def _tool_errors(op: str, path: str) -> Iterator[None]:
    """OSError and friends as one line an agent can act on."""
    try:
        yield
    except ToolError:
        raise
    except FileNotFoundError:
        raise ToolError(f"{op} {path}: no such file or directory (ls its directory to see what is there)",
                        path) from None
    except IsADirectoryError:
        raise ToolError(f"{op} {path}: is a directory (ls it instead)", path) from None
    except NotADirectoryError:
        raise ToolError(f"{op} {path}: a component of the path is not a directory", path) from None
    except PermissionError:
        raise ToolError(f"{op} {path}: permission denied (the sandbox's policy does not allow it)", path) from None
    except UnicodeDecodeError:
        raise ToolError(f"{op} {path}: not UTF-8 text (a binary file; inspect it with a command)", path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_refused(path) from None
        if exc.errno == errno.EROFS:
            raise ToolError(f"{op} {path}: read-only here (the sandbox's policy does not let the program write "
                            "there)", path) from None
        if exc.errno == errno.EFBIG:
            raise ToolError(f"{op} {path}: larger than the read limit; look at a part of it with a command",
                            path) from None
        raise ToolError(f"{op} {path}: {exc.strerror or exc}", path) from None
    except IsolationError as exc:
        raise ToolError(f"{op} {path}: {exc}", path) from None


def _replaced(text: str, old: str, new: str, path: str, replace_all: bool) -> tuple[str, int]:
    if not isinstance(old, str) or not old:
        raise ToolError(f"edit {path}: old must be the non-empty text to replace", path)
    found = text.count(old)
    if found == 0:
        raise ToolError(f"edit {path}: the old text does not occur in the file; read it and copy the text "
                        "exactly (whitespace included)", path)
    if found > 1 and not replace_all:
        raise ToolError(f"edit {path}: the old text occurs {found} times; include more context so it is unique, "
                        "or pass replace_all=True", path)
    return text.replace(old, new), found


class SandboxFiles:
    """File tools over a running ``Sandbox``, confined to ``root`` (default: its workspace).

    The sandbox's file methods already resolve every path inside the
    sandbox, as the program, so nothing here can reach further than the
    program itself. On top, the tools keep the agent beneath ``root``: an
    absolute path elsewhere, or a ``..`` above it, is refused, and so is a
    path through a link (each component is checked without following links
    before the operation; a program that swaps one in meanwhile reaches only
    what it may reach anyway).
    """

    def __init__(self, sandbox: Sandbox, root: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.sandbox = sandbox
        root = root if root is not None else sandbox.workspace.target
        if not isinstance(root, str) or not os.path.isabs(root):
            raise PolicyError(f"root {root!r}: an absolute path inside the sandbox", "root")
        self.root = os.path.normpath(root)
        self.max_bytes = max_bytes

    def _resolve(self, path: str, op: str) -> str:
        parts = _beneath(_components(path, self.root), path, self.root)
        current = self.root
        for part in parts:
            current = f"{current.rstrip('/')}/{part}"
            with _tool_errors(op, path):
                try:
                    info = self.sandbox.stat(current, follow_symlinks=False)
                except FileNotFoundError:
                    return f"{self.root.rstrip('/')}/{'/'.join(parts)}"  # the rest does not exist yet
            if stat.S_ISLNK(info.mode):
                raise _link_refused(path)
        return current

    def read(self, path: str) -> str:
        target = self._resolve(path, "read")
        with _tool_errors("read", path):
            return str(self.sandbox.read_file(target, limit=self.max_bytes))

    def write(self, path: str, content: str) -> str:
        target = self._resolve(path, "write")
        data = content.encode()
        with _tool_errors("write", path):
            self.sandbox.write_file(target, data)
        return f"wrote {len(data)} bytes to {path}"

    def edit(self, path: str, old: str, new: str, *, replace_all: bool = False) -> str:
        target = self._resolve(path, "edit")
        with _tool_errors("edit", path):
            text, found = _replaced(str(self.sandbox.read_file(target, limit=self.max_bytes)), old, new, path,
                                    replace_all)
            self.sandbox.write_file(target, text)
        return f"replaced {found} occurrence{'s' if found > 1 else ''} in {path}"

    def ls(self, path: str = ".") -> list[str]:
        target = self._resolve(path, "ls")
        with _tool_errors("ls", path):
            entries = self.sandbox.list_dir(target)
        return sorted(e.path + ("/" if e.type == "dir" else "@" if e.type == "link" else "") for e in entries)


class HostFiles:
    """File tools over a plain host directory (no sandbox), never leaving it.

    As openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS): the root is opened
    once; each path is walked from that descriptor one component at a time,
    every directory opened ``O_NOFOLLOW | O_DIRECTORY``, the last component
    ``O_NOFOLLOW`` (a link anywhere is refused, a FIFO is not waited on);
    ``..`` goes back to the descriptor it came from, and above the root is
    refused. A file is written through a new temporary file renamed into
    place, so a link planted at its name is replaced, never written through.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = os.path.realpath(os.fspath(root))  # the caller's own choice of directory: links in it are fine
        try:
            self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise PolicyError(f"HostFiles: {self.root}: {exc.strerror}", "root") from None
        self.max_bytes = max_bytes

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> HostFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _walk(self, parts: list[str], path: str, create: bool = False) -> int:
        """A new descriptor of the directory that parts name beneath the root, reached through no link."""
        if self._fd < 0:
            raise ToolError("the file tools were closed", path)
        stack = [os.dup(self._fd)]
        try:
            for part in parts:
                if part == "..":
                    if len(stack) == 1:
                        raise ToolError(f"{path}: '..' leads out of the workspace {self.root}; stay inside it", path)
                    os.close(stack.pop())
                    continue
                stack.append(self._open_dir(stack[-1], part, path, create))
            return stack.pop()
        finally:
            for fd in stack:
                os.close(fd)

    @staticmethod
    def _open_dir(dir_fd: int, name: str, path: str, create: bool) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=dir_fd)  # the umask applies
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(dir_fd, name):
                raise _link_refused(path) from None
            raise

    def _split(self, path: str, op: str) -> tuple[int, str]:
        """(descriptor of the parent directory, last component) of a file path."""
        parts = _components(path, self.root)
        if not parts or parts[-1] == "..":
            raise ToolError(f"{op} {path}: is a directory (ls it instead)", path)
        return self._walk(parts[:-1], path, create=op == "write"), parts[-1]

    def read(self, path: str) -> str:
        return self._read(path, "read")

    def _read(self, path: str, op: str) -> str:
        with _tool_errors(op, path):
            parent, name = self._split(path, op)
            try:
                info = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISLNK(info.st_mode):
                    raise _link_refused(path)
                if stat.S_ISDIR(info.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory")
                try:
                    fd = _open_file(parent, name)  # O_NOFOLLOW | O_NONBLOCK, and a regular file only
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise ToolError(f"{op} {path}: not a regular file (a FIFO, socket or device)", path) from None
                    raise
            finally:
                os.close(parent)
            try:
                if os.fstat(fd).st_size > self.max_bytes:
                    raise OSError(errno.EFBIG, "larger than the read limit")
                chunks, total = [], 0
                while chunk := os.read(fd, min(1 << 20, self.max_bytes + 1 - total)):
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise OSError(errno.EFBIG, "larger than the read limit")
            finally:
                os.close(fd)
            return b"".join(chunks).decode()

    def write(self, path: str, content: str) -> str:
        data = content.encode()
        self._write(path, data, "write")
        return f"wrote {len(data)} bytes to {path}"

    def _write(self, path: str, data: bytes, op: str) -> None:
        with _tool_errors(op, path):
            parent, name = self._split(path, op)
            try:
                try:
                    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
                except FileNotFoundError:
                    info = None
                if info is not None and stat.S_ISLNK(info.st_mode):
                    raise _link_refused(path)
                if info is not None and stat.S_ISDIR(info.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory")
                if info is not None and not stat.S_ISREG(info.st_mode):
                    raise ToolError(f"{op} {path}: not a regular file (a FIFO, socket or device)", path)
                temp = f".{name[:200]}.agent-{secrets.token_hex(4)}"
                out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                              dir_fd=parent)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(out, view):]
                    if info is not None:  # keep the file's permissions, never a set-id bit
                        os.fchmod(out, stat.S_IMODE(info.st_mode) & 0o777)
                    os.close(out)
                    out = -1
                    # rename replaces a link planted meanwhile (never follows it) and fails on a directory.
                    os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
                except BaseException:
                    if out >= 0:
                        os.close(out)
                    with contextlib.suppress(OSError):
                        os.unlink(temp, dir_fd=parent)
                    raise
            finally:
                os.close(parent)

    def edit(self, path: str, old: str, new: str, *, replace_all: bool = False) -> str:
        text, found = _replaced(self._read(path, "edit"), old, new, path, replace_all)
        self._write(path, text.encode(), "edit")
        return f"replaced {found} occurrence{'s' if found > 1 else ''} in {path}"

    def ls(self, path: str = ".") -> list[str]:
        with _tool_errors("ls", path):
            fd = self._walk(_components(path, self.root), path)
            try:
                out = []
                for name in os.listdir(fd):
                    try:
                        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                    except FileNotFoundError:
                        continue
                    out.append(name + ("/" if stat.S_ISDIR(mode) else "@" if stat.S_ISLNK(mode) else ""))
                return sorted(out)
            finally:
                os.close(fd)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def agent_files(target: Sandbox | str | os.PathLike[str], *, root: str | None = None,
                max_bytes: int = DEFAULT_MAX_BYTES) -> SandboxFiles | HostFiles:
    """File tools over a sandbox (beneath ``root``, default its workspace) or over a host directory."""
    if isinstance(target, Sandbox):
        return SandboxFiles(target, root, max_bytes=max_bytes)
    if root is not None:
        raise TypeError("root= is for a sandbox; for a host directory, give the directory itself")
    return HostFiles(target, max_bytes=max_bytes)


# -- a branch per attempt -------------------------------------------------------------------------------------


@runtime_checkable
class BranchStrategy(Protocol):
    """A branch per attempt: each branch a private copy of a source directory, in a sandbox of its own."""

    name: str
    #: Why this strategy runs: "first choice", or what the ones before it failed with.
    reason: str

    def setup_branch(self, source_dir: str | os.PathLike[str]) -> str: ...

    def execute_command(self, branch_id: str, cmd: str | Sequence[str], *,
                        timeout: float | None = None) -> ExecResult: ...

    def execute_python(self, branch_id: str, code: str, *, timeout: float | None = None) -> ExecResult: ...

    def commit_to_host(self, branch_id: str, target_dir: str | os.PathLike[str]) -> Changes: ...

    def clean_up(self, branch_id: str) -> None: ...

    def clean_up_all(self) -> None: ...

    def __enter__(self) -> BranchStrategy: ...

    def __exit__(self, *exc_info: object) -> None: ...


class StrategyFallbackWarning(RuntimeWarning):
    """A branch strategy could not be made and the next one is used (the message says why)."""


class _SandboxBranches:
    """Branches as kept sandboxes of one backend (the two strategies differ only by it)."""

    name: str = ""

    def __init__(self, policy: Policy | None = None, *, exclude: Sequence[str] = (), python: str = "python3") -> None:
        policy = policy if policy is not None else Policy()
        if not isinstance(policy, Policy):
            raise TypeError("policy must be an isolate.Policy")
        self.policy = policy.replace(backend=self.name)
        self.exclude = tuple(exclude)
        self.python = python
        self.reason = "first choice"
        self._branches: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._probe()

    def _probe(self) -> None:
        """Make (and end) one sandbox as a branch would: raises what keeps this strategy from working here."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="isolate-probe-") as empty:
            box = Sandbox(self.policy, workspace=Workspace(empty, mode="copy", exclude=self.exclude),
                          backend=self.name)
            try:
                box.start()
            finally:
                _close_quietly(box)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(branches={len(self._branches)}, reason={self.reason!r})"

    def __enter__(self) -> _SandboxBranches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.clean_up_all()

    def setup_branch(self, source_dir: str | os.PathLike[str]) -> str:
        """A new branch: a sandbox whose workspace is a private copy of source_dir; its id."""
        workspace = Workspace(os.fspath(source_dir), mode="copy", exclude=self.exclude)
        box = Sandbox(self.policy, workspace=workspace, backend=self.name)
        box.start()
        branch_id = f"{self.name}-{secrets.token_hex(8)}"
        with self._lock:
            self._branches[branch_id] = box
        return branch_id

    def _box(self, branch_id: str) -> Sandbox:
        with self._lock:
            box = self._branches.get(branch_id)
        if box is None:
            raise IsolationError(f"no branch {branch_id!r} here (cleaned up, or made by another strategy)")
        return box

    def execute_command(self, branch_id: str, cmd: str | Sequence[str], *,
                        timeout: float | None = None) -> ExecResult:
        """Run a command (a string goes to /bin/sh -c) in the branch's workspace."""
        return self._box(branch_id).exec(cmd, timeout=timeout)

    def execute_python(self, branch_id: str, code: str, *, timeout: float | None = None) -> ExecResult:
        """Run code with the sandbox's python3, fed on its standard input (no state kept between calls)."""
        return self._box(branch_id).exec([self.python, "-"], input=code, timeout=timeout)

    def commit_to_host(self, branch_id: str, target_dir: str | os.PathLike[str]) -> Changes:
        """Make target_dir equal to the branch's workspace (Sandbox.commit); what was written."""
        return self._box(branch_id).commit(target_dir)

    def clean_up(self, branch_id: str) -> None:
        """End the branch's sandbox and remove its copy."""
        with self._lock:
            box = self._branches.pop(branch_id, None)
        if box is None:
            raise IsolationError(f"no branch {branch_id!r} here (cleaned up already?)")
        box.close()

    def clean_up_all(self) -> None:
        with self._lock:
            boxes = list(self._branches.values())
            self._branches.clear()
        for box in boxes:
            _close_quietly(box)


class NativeBranches(_SandboxBranches):
    """Branches as native kept sandboxes (namespaces, Landlock, seccomp; nothing needed inside)."""

    name = "native"


class DockerBranches(_SandboxBranches):
    """Branches as kept containers of the local Docker engine."""

    name = "docker"

    def _probe(self) -> None:
        from .backends.docker import available

        ok, why = available()
        if not ok:
            raise UnsupportedError(why)
        super()._probe()


STRATEGIES: dict[str, type[_SandboxBranches]] = {"native": NativeBranches, "docker": DockerBranches}


def branches(policy: Policy | None = None, *, prefer: Sequence[str] = ("native", "docker"),
             exclude: Sequence[str] = (), python: str = "python3") -> BranchStrategy:
    """The first strategy of ``prefer`` that can make a sandbox here.

    Falling back is never silent: a ``StrategyFallbackWarning`` names the
    strategy that runs and why the ones before it could not, and so does the
    returned strategy's ``reason`` (its ``name`` says which runs). When none
    can be made, ``UnsupportedError`` gives each one's reason.
    """
    if isinstance(prefer, str) or not prefer:
        raise PolicyError("prefer: a non-empty list of strategies, e.g. ('native', 'docker')", "prefer")
    failures: list[str] = []
    for name in prefer:
        kind = STRATEGIES.get(name)
        if kind is None:
            raise PolicyError(f"prefer: {name!r} is not one of {', '.join(STRATEGIES)}", "prefer")
        try:
            strategy = kind(policy, exclude=exclude, python=python)
        except (IsolationError, OSError) as exc:
            failures.append(f"{name}: {exc}")
            continue
        if failures:
            strategy.reason = f"fallback: {'; '.join(failures)}"
            warnings.warn(f"isolate.agents: branches run on the {name} strategy, because {'; '.join(failures)}",
                          StrategyFallbackWarning, stacklevel=2)
        return strategy
    raise UnsupportedError(f"no branch strategy can make a sandbox here: {'; '.join(failures)}")


# -- wrap: the isolate-run command line of a policy ----------------------------------------------------------

_LIMIT_FLAGS = (("memory", "--memory"), ("cpu_seconds", "--cpu"), ("cpus", "--cpus"), ("wall_seconds", "--wall"),
                ("pids", "--pids"), ("open_files", "--nofile"), ("file_size", "--fsize"),
                ("tmpfs_size", "--tmpfs-size"))


def _number(value: float) -> str:
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 1e15):
        return str(int(value))  # --wall=60, not --wall=60.0 (read back as the same number)
    return repr(float(value))


def wrap(argv: Sequence[str], policy: Policy | None = None, *,
         program: Sequence[str] = ("isolate-run",)) -> list[str]:
    """The ``isolate-run`` command line that runs argv under policy.

    Every field is written as its flag (``--flag=value``, so a value may
    start with '-'), and the flags are read back with isolate-run's own
    parser: a field that no flag can express (``new_session=False``,
    ``die_with_parent=False``, a default ``keep_env`` or ``tmpfs`` entry
    dropped, an empty ``Egress``, a bind whose path holds ':', a read-only
    bind over a writable one, which isolate-run would mount in the other order) raises
    ``PolicyError`` naming it, never dropped. Relative paths stay relative:
    run the line in the directory the policy is meant for. ``program`` is
    the command that is isolate-run (e.g. ``[sys.executable, "-m", "isolate.cli"]``).
    """
    policy = policy if policy is not None else Policy()
    if not isinstance(policy, Policy):
        raise TypeError("policy must be an isolate.Policy")
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a list of arguments, not one string")
    command = [os.fsdecode(a) for a in argv]
    if not command:
        raise PolicyError("command: nothing to run; give a command", "command")
    flags = _flags(policy)
    _check_round_trip(policy, flags)
    return [*program, *flags, "--", *command]


def _flags(policy: Policy) -> list[str]:
    default = Policy()
    for name in ("new_session", "die_with_parent"):
        if getattr(policy, name) != getattr(default, name):
            raise PolicyError(f"{name}={getattr(policy, name)!r}: isolate-run has no flag for it; run the command "
                              "with isolate.run or a Sandbox instead", name)
    flags: list[str] = []
    if policy.read != DEFAULT_READ or policy.write != DEFAULT_WRITE:
        flags.append("--no-defaults")
        flags += [f"--ro={p}" for p in policy.read]
        flags += [f"--rw={p}" for p in policy.write]
    flags += [f"--tmpfs={p}" for p in policy.tmpfs if p not in DEFAULT_TMPFS]
    if isinstance(policy.network, Egress):
        flags += [f"--allow-host={h}" for h in policy.network.hosts]
    elif policy.network != "none":
        flags.append(f"--net={policy.network}")
    flags += [f"--unix-socket={p}" for p in policy.unix_sockets]
    for name, flag in _LIMIT_FLAGS:
        value = policy.limits.value(name)
        if value is not None:
            flags.append(f"{flag}={_number(value)}")
    if policy.seccomp != "default":
        flags.append(f"--seccomp={policy.seccomp}")
    flags += [f"--env={k}={v}" for k, v in policy.env.items()]
    flags += [f"--keep-env={n}" for n in policy.keep_env if n not in DEFAULT_KEEP_ENV]
    if policy.home != DEFAULT_HOME:
        flags.append(f"--home={policy.home if policy.home is not None else 'none'}")
    flags += [f"--home-file={f}" for f in policy.home_files]
    if policy.cwd is not None:
        flags.append(f"--chdir={policy.cwd}")
    for name in ("uid", "gid"):
        if getattr(policy, name) is not None:
            flags.append(f"--{name}={getattr(policy, name)}")
    if not policy.namespaces:
        flags.append("--no-namespaces")
    if policy.best_effort:
        flags.append("--best-effort")
    if policy.backend != "auto":
        flags.append(f"--backend={policy.backend}")
    if policy.image is not None:
        flags.append(f"--image={policy.image}")
    # isolate-run orders its --bind mounts before its --ro-bind ones (_comparable says when that matters).
    flags += [f"--bind={m.source}:{m.target}" for m in policy.binds if m.mode == "rw"]
    flags += [f"--ro-bind={m.source}:{m.target}" for m in policy.binds if m.mode == "ro"]
    return flags


def _comparable(policy: Policy) -> dict[str, Any]:
    """The fields, with what isolate-run resolves at once (bind sources, the cwd) resolved alike on both sides."""
    out = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    binds = [(os.path.abspath(os.path.expanduser(m.source)), m.target, m.mode) for m in policy.binds]
    targets = [b[1] for b in binds]
    if not any(t != u and t.startswith(u.rstrip("/") + "/") for t in targets for u in targets):
        binds.sort(key=lambda b: b[1])  # no mount lies under another: their order changes nothing
    out["binds"] = tuple(binds)
    out["cwd"] = os.path.abspath(policy.cwd) if policy.cwd is not None else None
    return out


def _check_round_trip(policy: Policy, flags: list[str]) -> None:
    from .cli import CliError, build_parser, policy_from_args

    try:
        back = policy_from_args(build_parser().parse_args([*flags, "--", "true"]))
    except (CliError, PolicyError) as exc:
        field_name = getattr(exc, "field", None) or "policy"
        raise PolicyError(f"{field_name}: isolate-run cannot express this policy ({exc})", field_name) from None
    want, got = _comparable(policy), _comparable(back)
    for name, value in want.items():
        if got[name] != value:
            raise PolicyError(f"{name}: isolate-run has no flag that gives {value!r} (its flags give {got[name]!r}); "
                              "run the command with isolate.run or a Sandbox instead", name)
