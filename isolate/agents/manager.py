"""Per-agent sandboxes: one named sandbox per agent id, recreated when its configuration changes."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..kept.sandbox import Sandbox, _seconds
from ..kernel.places import runtime_dir, state_key
from ..model.errors import IsolationError, PolicyError, UnsupportedError
from ..model.policy import Mount, Policy
from ..model.workspace import Workspace

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
    ``agents-KEY.sqlite3`` in the runtime directory; whether a sandbox is
    reused is decided by the configuration the running sandbox reports, not by
    that file.
    """

    def __init__(self, prefix: str = "agent", *, idle: float | None = 3600.0, max_age: float | None = 24 * 3600.0,
                 db_path: str | None = None) -> None:
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            raise PolicyError(f"prefix {prefix!r}: use 1 to 24 letters, digits, '_' or '-', starting with a letter "
                              "or digit", "prefix")
        self.prefix = prefix
        self.idle = _seconds(idle, "idle")
        self.max_age = _seconds(max_age, "max_age")
        # In the runtime directory, as the registry: SQLite follows a link at its file or journal, and the
        # state directory may lie in a sandbox's writable home.
        self.db_path = db_path or os.path.join(runtime_dir(), f"agents-{state_key()}.sqlite3")
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
            conn = sqlite3.connect(self.db_path, timeout=60.0)  # as the sandbox registry waits (backends/registry.py)
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
    from ..backends.registry import Registry

    return "docker" if any(r.name == name for r in Registry().all() if r.engine != "native") else "native"


def _remove_named(name: str) -> bool:
    """End and remove the kept sandbox of that name, native or Docker (as ``isolate-run sandbox rm``)."""
    from ..backends.native.named import remove_native

    if remove_native(name):
        return True
    if _backend_of(name) != "docker":
        return False
    try:
        from ..backends.docker import sandbox as docker_sandbox

        return bool(docker_sandbox.remove_sandbox(name))
    except (ImportError, IsolationError):
        return False
