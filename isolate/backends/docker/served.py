"""The Docker backend of ``isolate.Sandbox``: a container whose main process is isolate's exec server.

The init executable (static, nothing needed in the image) is bound read-only
at ``/.isolate/isolate-exec-server`` and is the container's command, its
PID 1. Nothing can hand a descriptor into a container, so the server binds
its listening socket itself, in a host directory made for this sandbox
(mode 0700, owned by the container's user) that is bound at ``/.isolate/run``.
From there on the host speaks the native backend's protocol: a command
starts in a few milliseconds (no ``docker exec``), every file operation runs
in the container as its user, through its mounts and links, and spawn,
shells and terminals work as natively.

Who may talk to the server: it accepts a connection only from a peer outside
the container's PID namespace with the caller's uid; the host accepts a
server only if the socket's listener is the container's main process (the
engine's ``State.Pid``). A process of the container can unlink the socket
and listen in its place (it shares the server's uid), never pass that check.

The workspace is a host directory bound at its target: a copy made under the
state directory (chowned to the container's user when the caller is root),
or the source itself (``bind``); ``diff``/``commit`` read it from the host as
natively. Mounts go through ``isolate.kernel.grants`` as the policy's write grants
do. Named sandboxes keep the kept-container conventions (container
``isolate-NAME``, the registry, ``sandbox list/rm/prune``) and are reused by
name while their configuration is unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import socket
import stat
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ..._core import INIT_PATH, lib
from ...kernel.grants import resolve_grant
from ...kernel.links import DIR_FLAGS
from ...kernel.places import runtime_dir, state_dir
from ...kernel.tree import _open_dir
from ...model.errors import IsolationError, PolicyError, SetupError, UnsupportedError
from ...model.policy import DEFAULT_WRITE, Mount, Policy
from ...model.workspace import Workspace
from ..native.datadir import dir_identity, make_data_dir, remove_dir
from ..native.kept import _pair, _suppress_missing
from ..native.protocol import Connection, ServerGone, probe
from ..registry import Registry, SandboxRecord
from .spec import LABEL, LABEL_SPEC_HASH, BindMount, ContainerSpec, default_image, program_ids

SERVER_TARGET = "/.isolate/isolate-exec-server"
SOCKET_DIR_TARGET = "/.isolate/run"
SOCKET_NAME = "server.sock"
#: Marks a kept container whose main process is the exec server (not ``sleep``).
LABEL_SERVER = "isolate.exec-server"
#: How long start() waits for the server's socket.
START_TIMEOUT = 20.0


@dataclass(frozen=True)
class DockerPaths:
    """Where a Docker sandbox's host files live: derived from its name, never read from a file."""

    name: str
    run: str  # the socket directory, bound into the container
    socket: str
    meta: str
    data: str  # the copied workspace's parent

    @classmethod
    def of(cls, name: str) -> DockerPaths:
        # Apart from the native sandboxes' files (NAME.sock, NAME.json, sandboxes/NAME): names never collide.
        base = os.path.join(runtime_dir(), "docker")
        with contextlib.suppress(FileExistsError):
            os.mkdir(base, 0o700)
        run = os.path.join(base, f"{name}.d")
        return cls(name, run, os.path.join(run, SOCKET_NAME), os.path.join(base, f"{name}.json"),
                   os.path.join(state_dir(), "docker-sandboxes", name))


def _peer_pid(conn: Connection) -> int:
    raw = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", raw)[0])


class DockerKept:
    """The Docker backend of ``isolate.Sandbox`` (see the module's docstring)."""

    backend = "docker"

    def __init__(self, policy: Policy, workspace: Workspace, mounts: tuple[Mount, ...] | list[Mount],
                 name: str | None, ttl: float | None, idle_timeout: float | None) -> None:
        if workspace.mode not in ("copy", "bind"):
            raise UnsupportedError(f"workspace mode {workspace.mode!r}: not on the Docker backend of Sandbox; use "
                                   "mode copy or bind there, or the native backend")
        if policy.seccomp == "strict":
            raise UnsupportedError("seccomp strict: a kept Docker sandbox's exec server listens on a unix socket, "
                                   "which the strict profile refuses (socket, bind, accept4); use seccomp default")
        self.policy = policy
        self.workspace = workspace
        self.mounts = tuple(mounts)
        self.name = name
        self.box_name = name if name is not None else f"tmp-{secrets.token_hex(6)}"
        self.ttl = ttl if ttl is not None else (float(policy.limits.wall_seconds)
                                                if policy.limits.wall_seconds is not None else None)
        self.idle_timeout = idle_timeout
        self.paths = DockerPaths.of(self.box_name)
        self.environment: dict[str, str] = {}
        self.report_enforced: dict[str, Any] = {}
        self.container_id: str | None = None
        self.server_pid: int | None = None
        self.data_identity: tuple[int, int] | None = None
        self.workspace_identity: tuple[int, int] | None = None
        self.run_identity: tuple[int, int] | None = None
        self.last_action: str | None = None
        self.paused = False
        self.frozen = False
        self.resumed_at: float | None = None
        #: Why the host ended the sandbox while it ran (see end()), for the errors that follow.
        self.ended_because: str | None = None
        self._spec_hash = ""
        self._files: Connection | None = None
        self._armed: str | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def container_name(self) -> str:
        from .kept import kept_container_name

        return kept_container_name(self.box_name)

    @property
    def workspace_host(self) -> str:
        if self.workspace.mode == "bind":
            assert self.workspace.source is not None
            return self.workspace.source
        return os.path.join(self.paths.data, "workspace")

    @property
    def data_dir(self) -> str:
        return self.paths.data

    # -- lifecycle ---------------------------------------------------------------

    def _kept_hash(self, image: str) -> str:
        """What decides whether a container of this name can be reused: policy, workspace, mounts, lifetimes."""
        ws = self.workspace
        data = {"policy": self.policy.config_hash(), "image": image, "mounts": [str(m) for m in self.mounts],
                "workspace": [ws.source, ws.target, ws.mode, list(ws.exclude)], "ttl": self.ttl,
                "idle": self.idle_timeout, "uid": os.geteuid()}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def _container_policy(self) -> Policy:
        """As natively: the workspace bound at its target and the default cwd; no write grant of the caller's cwd."""
        binds = tuple(self.policy.binds) + self.mounts + (Mount(self.workspace_host, self.workspace.target, "rw"),)
        changes: dict[str, Any] = {"binds": binds, "cwd": self.workspace.target, "backend": "docker",
                                   "die_with_parent": self.name is None}
        if self.policy.write == DEFAULT_WRITE:
            changes["write"] = ()
        return self.policy.replace(**changes)

    def _spec(self) -> ContainerSpec:
        from . import prepare

        spec = prepare(self._container_policy(), server_socket=True)
        extra = (BindMount(INIT_PATH, SERVER_TARGET, True, resolve_grant(INIT_PATH, "exec server")),
                 BindMount(self.paths.run, SOCKET_DIR_TARGET, False, resolve_grant(self.paths.run, "socket directory")))
        # The server is PID 1 (it reaps what is orphaned to it): no docker-init in front of it.
        return dataclasses.replace(spec, mounts=spec.mounts + extra, init=False)

    def start(self) -> None:
        from . import client, engine_address
        from .engine import _engine_errors

        api = client().api
        import docker.errors

        image = self.policy.image or default_image()
        kept_hash = self._kept_hash(image)
        cname = self.container_name
        try:
            info = api.inspect_container(cname)
        except docker.errors.NotFound:
            info = None
        except Exception as exc:
            with _engine_errors(f"inspect the kept container {cname}"):
                raise exc
        if info is not None:
            labels = (info.get("Config") or {}).get("Labels") or {}
            if labels.get(LABEL) != "1":
                raise PolicyError(f"sandbox {self.box_name!r}: a container named {cname} exists and was not made by "
                                  "isolate; choose another sandbox name or remove that container", "name")
            if (self.name is not None and labels.get(LABEL_SERVER) == "1" and labels.get(LABEL_SPEC_HASH) == kept_hash
                    and self._reuse(info)):
                return
            if (info.get("State") or {}).get("Running"):
                # As natively: a running sandbox is never replaced by one that only shares its name (its
                # workspace would go with it); whoever may end it says so (close, rm).
                raise IsolationError(f"sandbox {self.box_name!r} exists already, running with another "
                                     "configuration; attach to it, or remove it first (isolate-run sandbox rm "
                                     f"{self.box_name})")
            with _engine_errors(f"remove the outdated kept container {cname}"):
                with contextlib.suppress(docker.errors.NotFound):
                    api.remove_container(info["Id"], force=True, v=True)
            remove_files(self.box_name)
        made = False
        try:
            self._make_dirs()
            made = True
            spec = self._spec()
            self._describe(spec, image)
            idle_ms = 0 if self.idle_timeout is None else max(1, int(self.idle_timeout * 1000))
            ttl_ms = 0 if self.ttl is None else max(1, int(self.ttl * 1000))
            labels = spec.labels("kept", self.box_name)
            labels[LABEL_SPEC_HASH] = kept_hash
            labels[LABEL_SERVER] = "1"
            command = [SERVER_TARGET, f"{SOCKET_DIR_TARGET}/{SOCKET_NAME}", str(os.geteuid()), str(idle_ms),
                       str(ttl_ms)]
            with _engine_errors(f"create the kept container {cname} from {spec.image}"):
                created = api.create_container(
                    image=spec.image, entrypoint=command, command=[], name=cname, user=spec.user,
                    working_dir=spec.working_dir, labels=labels,
                    host_config=api.create_host_config(**spec.host_config()), detach=True)
            self.container_id = str(created["Id"])
            if self.name is None:
                from .watch import watchdog

                watchdog.arm(self.container_id, "rm")  # an unnamed sandbox dies with this process
                self._armed = self.container_id
            spec.verify_binds()  # the engine binds the paths at start: the last moment to look
            with _engine_errors(f"start the kept container {cname}"):
                api.start(self.container_id)
            self._wait_ready()
            self._run_dir_owner(0, 0)
            self.last_action = "created"
            self._write_meta()
            now = time.time()
            Registry().record(SandboxRecord(engine_address(), self.box_name, self.container_id, spec.config_hash,
                                            kept_hash, spec.image, now, now))
            if self.name is None:
                self._finalizer = weakref.finalize(self, _remove_all, self.box_name, self.container_id, None,
                                                   os.getpid())
        except BaseException:
            if self.container_id is not None:
                with contextlib.suppress(Exception):
                    api.remove_container(self.container_id, force=True, v=True)
                self._disarm()
                self.container_id = None
            if made:
                remove_files(self.box_name, self._identities())
            raise

    def _reuse(self, info: dict[str, Any]) -> bool:
        """Take over the running (or stopped) container of this name; False when its files are not ours any more."""
        from . import client
        from .engine import _engine_errors

        try:
            meta = _read_meta(self.paths)
        except IsolationError:
            return False
        self._load(meta)
        if meta.get("container") != info["Id"] or not self._files_intact():
            return False
        self.container_id = str(info["Id"])
        if not (info.get("State") or {}).get("Running"):
            spec = self._spec()  # every bind resolved and checked again before the engine binds it anew
            if spec.spec_hash() != meta.get("spec_hash"):
                return False
            self._run_dir_owner(*program_ids(self.policy))  # its server binds its socket anew
            with _engine_errors(f"restart the kept container {self.container_name}"):
                client().api.start(self.container_id)
            self.last_action = "restarted"
        else:
            self.last_action = "reused"
        self._wait_ready()
        self._run_dir_owner(0, 0)
        return True

    def _run_dir_owner(self, uid: int, gid: int) -> None:
        """Give the socket directory to the container's user (its server binds there) or back to root.

        A root caller takes it back once the server listens: the program,
        which shares the server's uid, can then neither replace the socket
        nor fill the host's /run with files of its own. (A caller who is not
        root is the container's user itself; the listener check in connect()
        is what holds there.)
        """
        if os.geteuid() != 0:
            return
        fd = os.open(self.paths.run, DIR_FLAGS)
        try:
            info = os.fstat(fd)
            if self.run_identity is None or (info.st_dev, info.st_ino) != self.run_identity:
                raise IsolationError(f"sandbox {self.box_name!r}: {self.paths.run} is not the directory this sandbox "
                                     "was made with; remove it with isolate-run sandbox rm " + self.box_name)
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)

    def _make_dirs(self) -> None:
        uid, gid = program_ids(self.policy)
        for path in (self.paths.run, self.paths.meta):
            if os.path.lexists(path):
                raise IsolationError(f"sandbox {self.box_name!r}: {path} is left from an earlier one; remove it with "
                                     f"isolate-run sandbox rm {self.box_name}")
        os.mkdir(self.paths.run, 0o700)
        self.run_identity = dir_identity(self.paths.run)
        if os.geteuid() == 0:
            os.chown(self.paths.run, uid, gid)  # the server, as the container's user, binds its socket here
        if self.workspace.mode != "copy":
            return
        self.data_identity, self.workspace_identity = make_data_dir("docker-sandboxes", self.box_name,
                                                                    self.workspace)
        if os.geteuid() == 0 and (uid, gid) != (0, 0):
            _chown_tree(self.workspace_host, uid, gid)  # the program owns its workspace, as on the native backend

    def _describe(self, spec: ContainerSpec, image: str) -> None:
        from . import client

        try:
            image_env = (client().api.inspect_image(spec.image).get("Config") or {}).get("Env") or []
        except Exception:
            image_env = []
        env: dict[str, str] = {}
        for item in image_env:
            key, sep, value = str(item).partition("=")
            if sep:
                env[key] = value
        env.update(dict(spec.environment))
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        self.environment = env
        enforced = dict(spec.enforced)
        enforced["kept"] = "exec-server (the container's main process)"
        enforced.pop("die_with_parent", None)
        if self.name is None:
            enforced["die_with_parent"] = "watchdog"
        if "cpu_seconds" in enforced:
            enforced["cpu_seconds"] = "docker-ulimit (per process)"
        if self.ttl is not None:
            enforced["wall_seconds"] = "exec-server-ttl"
        self.report_enforced = enforced
        self._spec_hash = spec.spec_hash()

    def _wait_ready(self) -> None:
        from . import client

        api = client().api
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            state = api.inspect_container(self.container_id)["State"]
            if not state.get("Running"):
                code = state.get("ExitCode")
                raise SetupError(f"sandbox {self.box_name!r}: the container's exec server ended as it started "
                                 f"(status {code}{'; ' + state['Error'] if state.get('Error') else ''}); "
                                 "it could not listen on its socket (does the seccomp profile refuse socket, bind, "
                                 "listen or accept4?)", "docker")
            self.server_pid = int(state.get("Pid") or 0)
            try:
                conn = self.connect()
                conn.call(lib.ISO_XS_PING)
                self._files = conn
                return
            except ServerGone:
                if time.monotonic() > deadline:
                    raise SetupError(f"sandbox {self.box_name!r}: the exec server did not answer within "
                                     f"{START_TIMEOUT:.0f} s at {self.paths.socket} (does the engine share this "
                                     "machine's filesystem? a remote DOCKER_HOST cannot bind it)", "docker") from None
                time.sleep(0.005)

    def _write_meta(self) -> None:
        ws = self.workspace
        meta = {"name": self.name, "backend": "docker", "container": self.container_id,
                "policy": self.policy.to_dict(),
                "workspace": {"source": ws.source, "target": ws.target, "mode": ws.mode, "exclude": list(ws.exclude)},
                "mounts": [str(m) for m in self.mounts], "environment": self.environment,
                "enforced": self.report_enforced, "created": time.time(), "ttl": self.ttl,
                "idle": self.idle_timeout, "spec_hash": self._spec_hash,
                "data": list(self.data_identity) if self.data_identity else None,
                "workspace_dir": list(self.workspace_identity) if self.workspace_identity else None,
                "run": list(self.run_identity) if self.run_identity else None}
        temp = self.paths.meta + f".{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(meta, handle)
        os.rename(temp, self.paths.meta)

    def _load(self, meta: dict[str, Any]) -> None:
        self.environment = {str(k): str(v) for k, v in meta["environment"].items()}
        self.report_enforced = dict(meta["enforced"])
        self._spec_hash = str(meta.get("spec_hash") or "")
        self.data_identity = _pair(meta.get("data"))
        self.workspace_identity = _pair(meta.get("workspace_dir"))
        self.run_identity = _pair(meta.get("run"))

    def _identities(self) -> dict[str, Any]:
        return {"data": self.data_identity, "run": self.run_identity}

    def _files_intact(self) -> bool:
        try:
            if self.run_identity is None or dir_identity(self.paths.run) != self.run_identity:
                return False
            if self.workspace.mode == "copy":
                os.close(self.open_workspace())
        except (OSError, IsolationError):
            return False
        return True

    @classmethod
    def attach(cls, name: str, ping: bool = True) -> DockerKept:
        """The running Docker sandbox of that name, made by this user."""
        from . import client

        paths = DockerPaths.of(name)
        meta = _read_meta(paths)
        ws = meta["workspace"]
        box = cls(Policy.from_dict(meta["policy"]), Workspace(ws["source"], ws["target"], ws["mode"],
                                                              tuple(ws["exclude"])),
                  [Mount.parse(m) for m in meta["mounts"]], name, meta.get("ttl"), meta.get("idle"))
        box._load(meta)
        box.container_id = str(meta["container"])
        try:
            state = client().api.inspect_container(box.container_id)["State"]
        except Exception:
            raise IsolationError(f"sandbox {name!r}: its container is gone; remove it with "
                                 f"isolate-run sandbox rm {name}") from None
        if not state.get("Running"):
            raise IsolationError(f"sandbox {name!r} has ended; remove it with isolate-run sandbox rm {name}, or "
                                 "make it again (Sandbox(name=...).start() restarts it)")
        box.server_pid = int(state.get("Pid") or 0)
        if ping and not state.get("Paused"):
            box._files = box.connect()
            box._files.call(lib.ISO_XS_PING)
        return box

    def connect(self) -> Connection:
        """A conversation with the server: the socket's listener must be the container's main process.

        The socket directory is writable from inside: the path's last
        component is opened without following a link and must be a socket,
        so nothing planted there leads the host to connect elsewhere.
        """
        if self.ended_because is not None:
            raise IsolationError(f"the sandbox was ended by the host: {self.ended_because}")
        try:
            fd = os.open(self.paths.socket, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ServerGone(f"the sandbox does not answer ({self.paths.socket}: {exc.strerror})") from None
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                raise IsolationError(f"sandbox {self.box_name!r}: {self.paths.socket} is not a socket (replaced "
                                     "from inside?); not used")
            conn = Connection(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        pid = _peer_pid(conn)
        if pid != self.server_pid:
            from . import client

            with contextlib.suppress(Exception):  # restarted since: its main process has a new pid
                self.server_pid = int(client().api.inspect_container(self.container_id)["State"].get("Pid") or 0)
            if pid != self.server_pid or pid == 0:
                conn.close()
                raise IsolationError(f"sandbox {self.box_name!r}: its socket is not served by the container's main "
                                     "process (replaced from inside?); not used")
        return conn

    def files(self) -> Connection:
        if self.ended_because is not None:
            raise IsolationError(f"the sandbox was ended by the host: {self.ended_because}")
        if self._files is None or self._files.closed:
            self._files = self.connect()
        return self._files

    def open_workspace(self) -> int:
        fd = _open_dir(self.workspace_host)
        if self.workspace.mode == "copy":
            info = os.fstat(fd)
            if self.workspace_identity is None or (info.st_dev, info.st_ino) != self.workspace_identity:
                os.close(fd)
                raise IsolationError(f"workspace {self.workspace_host} is not the directory this sandbox was made "
                                     "with (replaced, or reached through a planted link); not read")
        return fd

    def state(self) -> str:
        from . import client

        try:
            state = client().api.inspect_container(self.container_id)["State"]
        except Exception:
            return "ended"
        if not state.get("Running"):
            return "ended"
        if state.get("Paused"):
            return "not answering"
        answer = probe(self.connect)
        return "ended" if answer == "gone" else answer

    def processes(self) -> list[Any]:
        import psutil

        if not self.server_pid:
            return []
        try:
            root = psutil.Process(self.server_pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def pause(self) -> str:
        import docker.errors as docker_errors

        from . import client
        from .engine import _engine_errors

        with _engine_errors(f"pause the container of sandbox {self.box_name!r}"):
            for attempt in range(3):
                try:
                    client().api.pause(self.container_id)
                    break
                except docker_errors.APIError as exc:
                    # runc gives up a freeze that its processes did not all reach in its time (a busy host, a
                    # process forking): it thawed them, and a next try usually freezes them.
                    if attempt == 2 or "unable to freeze" not in str(exc):
                        raise
                    time.sleep(0.2)
        self.paused = self.frozen = True
        return "cgroup-freezer"

    def egress_summary(self) -> dict[str, Any] | None:
        return None  # egress by name is the native backend's

    def end(self, reason: str) -> bool:
        """Kill the container from the host: its main process (the exec server) and everything in it end;
        the container and files stay until close()."""
        from . import client

        if self.ended_because is None:
            self.ended_because = reason
        if self.container_id is None:
            return False
        try:
            client().api.kill(self.container_id)
        except Exception:  # not running (ended already), or the engine is gone with it
            return False
        return True

    def resume(self) -> str:
        from . import client
        from .engine import _engine_errors

        with _engine_errors(f"resume the container of sandbox {self.box_name!r}"):
            client().api.unpause(self.container_id)
        self.paused = self.frozen = False
        self.resumed_at = time.monotonic()
        return "cgroup-freezer"

    def detach(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None

    def close(self) -> None:
        """Remove the container, its socket directory, description and copied workspace, and its record."""
        self.detach()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self.container_id is not None:
            _remove_all(self.box_name, self.container_id, self._identities())
        self._disarm()
        self.container_id = None
        self.server_pid = None

    def _disarm(self) -> None:
        if self._armed is not None:
            from .watch import watchdog

            watchdog.disarm(self._armed, "rm")
            self._armed = None


def _read_meta(paths: DockerPaths) -> dict[str, Any]:
    try:
        fd = os.open(paths.meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd) as handle:
            meta = json.load(handle)
    except (OSError, ValueError):
        raise IsolationError(f"no running sandbox named {paths.name!r} (isolate-run sandbox list)") from None
    if not isinstance(meta, dict) or meta.get("backend") != "docker":
        raise IsolationError(f"no running sandbox named {paths.name!r} (isolate-run sandbox list)")
    return meta


def _chown_tree(top: str, uid: int, gid: int) -> None:
    """Give a freshly copied tree (nobody else has seen it yet) to the container's user, links not followed."""
    os.chown(top, uid, gid, follow_symlinks=False)
    for _dir, dirs, files, dir_fd in os.fwalk(top, follow_symlinks=False):
        for name in dirs + files:
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)


def remove_files(name: str, identities: dict[str, Any] | None = None) -> None:
    """Remove a Docker sandbox's socket directory, description and copied workspace (those start() made).

    ``identities`` (else the description's) name the directories: one that
    is not the same inode any more is left alone.
    """
    paths = DockerPaths.of(name)
    if identities is None:
        try:
            meta = _read_meta(paths)
            identities = {"data": _pair(meta.get("data")), "run": _pair(meta.get("run"))}
        except IsolationError:
            identities = {}
    with _suppress_missing():
        os.unlink(paths.meta)
    run = identities.get("run")
    if run is not None:
        remove_dir(paths.run, run)
    data = identities.get("data")
    if data is not None:
        remove_dir(paths.data, data)


def _remove_all(name: str, container_id: str, identities: dict[str, Any] | None = None, maker: int = 0) -> None:
    if maker and maker != os.getpid():
        return  # a child forked since (its exit runs the finalizers it inherited): the container is its parent's
    from . import engine_address
    from .kept import remove_container

    with contextlib.suppress(IsolationError):
        remove_container(container_id)
    remove_files(name, identities)
    with contextlib.suppress(Exception):
        Registry().forget(engine_address(), name)
