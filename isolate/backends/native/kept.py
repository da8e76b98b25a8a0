"""A kept native sandbox: one set of namespaces, an exec server inside, many commands.

``start()`` makes the sandbox as ``isolate.Popen`` makes a run, but its
program is the init executable in its exec-server role (csrc/execserver.c),
listening on a socket the host bound in its private runtime directory.
Every later command, file operation or shell is a conversation over that
socket; nothing forks the Python process. The sandbox ends when ``close()``
kills its init (the PID namespace takes everything with it), when its
creator dies (an unnamed sandbox), or, for a named one, at ``rm``/``prune``,
its ``ttl`` or its ``idle_timeout``, which the init and the server enforce
from inside, whoever is left to ask.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._core import ffi, init_fd, lib
from ...errors import IsolationError, UnsupportedError
from ...policy import DEFAULT_WRITE, Mount, Policy
from ...popen import Popen
from ...registry import runtime_dir, state_dir
from ...workspace import Workspace, copy_tree
from .protocol import Connection, ServerGone

SERVER_NAME = "isolate-exec-server"
#: How long start() waits for the server to answer its first ping.
START_TIMEOUT = 10.0


class _ServerProcess(Popen):
    """The sandbox's init, whose program is the exec server (not looked up by name)."""

    _program_fd = -1

    def __init__(self, args: Any, *, policy: Policy, **kwargs: Any) -> None:
        self._program_fd = init_fd()
        super().__init__(args, policy=policy, **kwargs)


@dataclass(frozen=True)
class Paths:
    """Where a sandbox's files live on the host: derived from its name, never read from a file."""

    key: str
    socket: str
    meta: str
    data: str

    @classmethod
    def of(cls, key: str) -> Paths:
        run = runtime_dir()
        return cls(key, os.path.join(run, f"{key}.sock"), os.path.join(run, f"{key}.json"),
                   os.path.join(state_dir(), "sandboxes", key))


def _server_policy(policy: Policy, workspace: Workspace, workspace_host: str, mounts: Sequence[Mount],
                   named: bool, ttl: float | None) -> Policy:
    """The policy the sandbox runs with: the workspace shown at its target, the default cwd grant dropped."""
    binds = tuple(policy.binds) + tuple(mounts) + (Mount(workspace_host, workspace.target, "rw"),)
    changes: dict[str, Any] = {"binds": binds, "cwd": workspace.target, "die_with_parent": not named,
                               "backend": "native"}
    if policy.write == DEFAULT_WRITE:
        changes["write"] = ()  # a sandbox's writable place is its workspace, not the caller's cwd
    if ttl is not None:
        changes["limits"] = dataclasses.replace(policy.limits, wall_seconds=ttl)
    return policy.replace(**changes)


class NativeSandbox:
    """The native backend of ``isolate.Sandbox`` (see its documentation)."""

    backend = "native"

    def __init__(self, policy: Policy, workspace: Workspace, mounts: Sequence[Mount], name: str | None,
                 ttl: float | None, idle_timeout: float | None) -> None:
        self.policy = policy
        self.workspace = workspace
        self.mounts = tuple(mounts)
        self.name = name
        self.ttl = ttl
        self.idle_timeout = idle_timeout
        self.paths = Paths.of(name or f"anon-{os.getpid()}-{secrets.token_hex(6)}")
        self.process: _ServerProcess | None = None
        self.server_pid = 0  # the exec server's host pid (from the socket's peer credentials)
        self.environment: dict[str, str] = {}
        self.report_enforced: dict[str, Any] = {}
        self.paused = False
        self._files: Connection | None = None

    # -- lifecycle ---------------------------------------------------------------

    @property
    def workspace_host(self) -> str:
        if self.workspace.mode == "bind":
            assert self.workspace.source is not None
            return self.workspace.source
        return os.path.join(self.paths.data, "workspace")

    def start(self) -> None:
        if not self.policy.namespaces:
            raise UnsupportedError("a kept native sandbox needs namespaces (its commands share one PID and mount "
                                   "namespace); use namespaces=True, or backend='docker'")
        if self.name is not None and os.path.exists(self.paths.socket):
            raise IsolationError(f"sandbox {self.name!r} exists already; attach to it or remove it first "
                                 f"(isolate-run sandbox rm {self.name})")
        made_data = False
        listener = None
        try:
            if self.workspace.mode == "copy":
                os.makedirs(os.path.dirname(self.paths.data), mode=0o700, exist_ok=True)
                os.mkdir(self.paths.data, 0o700)
                made_data = True
                os.mkdir(self.workspace_host, 0o755)
                if self.workspace.source is not None:
                    copy_tree(self.workspace.source, self.workspace_host, self.workspace)
            listener = self._listen()
            policy = _server_policy(self.policy, self.workspace, self.workspace_host, self.mounts,
                                    self.name is not None, self.ttl)
            idle_ms = 0 if self.idle_timeout is None else max(1, int(self.idle_timeout * 1000))
            args = [SERVER_NAME, str(listener.fileno()), str(os.geteuid()), str(idle_ms)]
            self.process = _ServerProcess(args, policy=policy, pass_fds=[listener.fileno()],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=self.name is not None)
            listener.close()
            listener = None
            prepared = self.process._prepared
            assert prepared is not None
            self.environment = _environment_of(prepared.plan)
            self.report_enforced = dict(prepared.enforced)
            self._wait_ready()
            self._write_meta()
        except BaseException:
            if listener is not None:
                listener.close()
            self._teardown(remove_data=made_data)
            raise

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with _suppress_missing():
                os.unlink(self.paths.socket)
            old = os.umask(0o177)
            try:
                sock.bind(self.paths.socket)
            finally:
                os.umask(old)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise IsolationError(f"sandbox socket {self.paths.socket}: {exc.strerror}") from None
        return sock

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        assert self.process is not None
        while True:
            if self.process.poll() is not None:
                raise IsolationError(f"the sandbox ended as it started (status {self.process.returncode}); "
                                     "its exec server could not run")
            try:
                conn = Connection(self.paths.socket)
                conn.call(lib.ISO_XS_PING)
                self.server_pid = conn.peer_pid
                self._files = conn
                return
            except ServerGone:
                if time.monotonic() > deadline:
                    raise IsolationError("the sandbox's exec server did not answer within "
                                         f"{START_TIMEOUT:.0f} s") from None
                time.sleep(0.002)

    def _write_meta(self) -> None:
        meta = {"name": self.name, "backend": "native", "policy": self.policy.to_dict(),
                "workspace": {"source": self.workspace.source, "target": self.workspace.target,
                              "mode": self.workspace.mode, "exclude": list(self.workspace.exclude)},
                "mounts": [str(m) for m in self.mounts], "environment": self.environment,
                "enforced": self.report_enforced, "created": time.time(),
                "cgroup": self._cgroup_path()}
        temp = self.paths.meta + f".{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(meta, handle)
        os.rename(temp, self.paths.meta)

    def _cgroup_path(self) -> str | None:
        prepared = self.process._prepared if self.process is not None else None
        cgroup = prepared.cgroup if prepared is not None else None
        return str(cgroup.path) if cgroup is not None and getattr(cgroup, "path", None) else None

    @classmethod
    def attach(cls, name: str) -> NativeSandbox:
        """The running sandbox of that name (made by this user), as its creator left it."""
        paths = Paths.of(name)
        try:
            fd = os.open(paths.meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with os.fdopen(fd) as handle:
                meta = json.load(handle)
        except (OSError, ValueError):
            raise IsolationError(f"no running native sandbox named {name!r} (isolate-run sandbox list)") from None
        ws = meta["workspace"]
        box = cls(Policy.from_dict(meta["policy"]),
                  Workspace(ws["source"], ws["target"], ws["mode"], tuple(ws["exclude"])),
                  [Mount.parse(m) for m in meta["mounts"]], name, None, None)
        box.environment = {str(k): str(v) for k, v in meta["environment"].items()}
        box.report_enforced = dict(meta["enforced"])
        try:
            conn = Connection(paths.socket)
            conn.call(lib.ISO_XS_PING)
        except ServerGone:
            raise IsolationError(f"sandbox {name!r} has ended; remove it with isolate-run sandbox rm {name}") from None
        box.server_pid = conn.peer_pid
        box._files = conn
        return box

    def files(self) -> Connection:
        if self._files is None:
            raise IsolationError("the sandbox is not running; start() it first")
        return self._files

    def connect(self) -> Connection:
        return Connection(self.paths.socket)

    def running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        try:
            with self.connect() as conn:
                conn.call(lib.ISO_XS_PING)
            return True
        except (ServerGone, OSError):
            return False

    def _init_pid(self) -> int | None:
        """The sandbox's init on the host: the exec server's parent (the kernel's word, not a file's)."""
        if self.process is not None:
            return self.process.pid
        if not self.server_pid:
            return None
        import psutil

        try:
            parent = psutil.Process(self.server_pid).parent()
        except psutil.Error:
            return None
        return parent.pid if parent is not None else None

    def processes(self) -> list[Any]:
        """psutil.Process objects of every process in the sandbox, its init first."""
        import psutil

        init = self._init_pid()
        if init is None:
            return []
        try:
            root = psutil.Process(init)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def close(self) -> None:
        """End the sandbox and everything in it; remove its socket, description and copied workspace."""
        self._teardown(remove_data=True)

    def _teardown(self, remove_data: bool) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
        if self.process is not None:
            with _suppress_missing():
                self.process.kill()  # SIGKILL to the init: the PID namespace ends with it
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.process = None
        elif self.server_pid:
            init = self._init_pid()
            if init is not None:
                with _suppress_missing():
                    os.kill(init, signal.SIGKILL)
        self.server_pid = 0
        for path in (self.paths.socket, self.paths.meta):
            with _suppress_missing():
                os.unlink(path)
        if remove_data and self.workspace.mode == "copy" and os.path.isdir(self.paths.data):
            _remove_dir(self.paths.data)

    # -- pause -------------------------------------------------------------------

    def pause(self) -> str:
        """Stop every process: the cgroup freezer where there is a cgroup, else SIGSTOP to each."""
        mechanism = self._freeze(True)
        self.paused = True
        return mechanism

    def resume(self) -> str:
        mechanism = self._freeze(False)
        self.paused = False
        return mechanism

    def _freeze(self, stop: bool) -> str:
        prepared = self.process._prepared if self.process is not None else None
        cgroup = prepared.cgroup if prepared is not None else None
        if cgroup is not None:
            if stop:
                cgroup.freeze()
            else:
                cgroup.thaw()
            return "cgroup-freezer"
        sig = signal.SIGSTOP if stop else signal.SIGCONT
        # Stop from the leaves' side up until nothing new appears: a process
        # that forked meanwhile is stopped in the next round.
        seen: set[int] = set()
        for _ in range(50):
            fresh = [p for p in self.processes() if p.pid not in seen]
            if not fresh:
                break
            for proc in fresh:
                seen.add(proc.pid)
                with _suppress_missing():
                    os.kill(proc.pid, sig)
        return "sigstop"


def _environment_of(plan: Any) -> dict[str, str]:
    """The environment the plan gives the program (the policy's, with PATH, HOME and TMPDIR worked out)."""
    env: dict[str, str] = {}
    i = 0
    while plan.envp[i] != ffi.NULL:
        name, _, value = os.fsdecode(ffi.string(plan.envp[i])).partition("=")
        env[name] = value
        i += 1
    return env


class _suppress_missing:
    """Ignore a process or file that is already gone."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, (ProcessLookupError, FileNotFoundError))


def _remove_dir(path: str) -> None:
    """Remove a sandbox's data directory without following anything the program planted in it."""
    from ...workspace import _remove_tree

    parent = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _remove_tree(parent, os.path.basename(path))
    except OSError:
        pass
    finally:
        os.close(parent)


def environment_for(base: Mapping[str, str], env: Mapping[str, str] | None) -> list[str]:
    merged = dict(base)
    if env:
        for key, value in env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(f"env: {key!r} is not a usable variable")
            merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]
