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

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._core import ffi, init_fd, lib
from ...kernel import fdwait, grants
from ...kernel.overlay import WAY_OUT, Layers, OverlayRefused, layers_for
from ...kernel.places import runtime_dir, state_dir, state_path
from ...model.errors import IsolationError, PolicyError, UnsupportedError
from ...model.policy import DEFAULT_WRITE, Mount, Policy
from ...model.workspace import Workspace
from ..registry import Registry, SandboxRecord
from . import copies, imageroot, pausing
from .datadir import (
    COPY_LAYERS_REFUSED,
    close_layer_fds,
    copy_layers_refused,
    make_copy_layers,
    make_data_dir,
    make_image_upper,
    open_base,
    remove_dir,
    root_source,
)
from .egress import ask_summary
from .popen import Popen
from .protocol import Connection, ServerGone, probe

SERVER_NAME = "isolate-exec-server"
#: How long start() waits for the server to answer its first ping.
START_TIMEOUT = 10.0


class _ServerProcess(Popen):
    """The sandbox's init, whose program is the exec server (not looked up by name)."""

    _program_fd = -1
    _one_shot_upper = False  # its upper layer is the sandbox's (start() chooses), not the one run's

    def __init__(self, args: Any, *, policy: Policy, bind_sources: dict[str, int] | None = None,
                 overlay: Any = None, egress_detached: str | None = None, image_upper: Any = None,
                 **kwargs: Any) -> None:
        self._program_fd = init_fd()
        self._bind_sources = bind_sources
        self._overlay = overlay
        self._image_upper = image_upper
        self._egress_detached = egress_detached
        super().__init__(args, policy=policy, **kwargs)


@dataclass(frozen=True)
class Paths:
    """Where a sandbox's files live on the host: derived from its name, never read from a file."""

    key: str
    socket: str
    meta: str
    data: str
    #: Its egress mediator process's control socket (an egress allow-list; isolate.egress's --query-listen-fd;
    #: not named .sock, which names a sandbox in the runtime directory).
    egress: str = ""

    @classmethod
    def of(cls, key: str) -> Paths:
        run = runtime_dir()
        return cls(key, os.path.join(run, f"{key}.sock"), os.path.join(run, f"{key}.json"),
                   os.path.join(state_dir(), "sandboxes", key), os.path.join(run, f"{key}.egress"))


def _server_policy(policy: Policy, workspace: Workspace, workspace_host: str, mounts: Sequence[Mount],
                   named: bool, ttl: float | None, layered: bool) -> Policy:
    """The policy the sandbox runs with: the workspace shown at its target, the default cwd grant dropped."""
    binds = tuple(policy.binds) + tuple(mounts)
    changes: dict[str, Any] = {"cwd": workspace.target, "die_with_parent": not named, "backend": "native"}
    if layered:
        # A private tmpfs at the target places it among the mounts and gives it Landlock's write rights;
        # the plan mounts the overlay there instead (isolate/kernel/overlay.py).
        changes["tmpfs"] = (*policy.tmpfs, workspace.target)
    else:
        binds = (*binds, Mount(workspace_host, workspace.target, "rw"))
    changes["binds"] = binds
    if policy.write == DEFAULT_WRITE:
        changes["write"] = ()  # a sandbox's writable place is its workspace, not the caller's cwd
    if ttl is not None:
        changes["limits"] = dataclasses.replace(policy.limits, wall_seconds=ttl)
    return policy.replace(**changes)


class NativeSandbox:
    """The native backend of ``isolate.Sandbox`` (see its documentation)."""

    backend = "native"

    def __init__(self, policy: Policy, workspace: Workspace, mounts: Sequence[Mount], name: str | None,
                 ttl: float | None, idle_timeout: float | None, start_from: Any = None) -> None:
        self.policy = policy
        #: A snapshot to start from (isolate.Snapshot: its open_data() is a descriptor of its layer or tree;
        #: None: the workspace's source).
        self.start_from = start_from
        self.workspace = workspace
        self.mounts = tuple(mounts)
        self.name = name
        self.ttl = ttl
        self.idle_timeout = idle_timeout
        self.paths = Paths.of(name or f"anon-{os.getpid()}-{secrets.token_hex(6)}")
        self.process: _ServerProcess | None = None
        #: The init's host pid and start time (psutil's create_time): together they name it, even after pid reuse.
        self.init_identity: tuple[int, float] | None = None
        self.environment: dict[str, str] = {}
        #: (st_dev, st_ino) of the copied workspace's data directory and of the workspace in it, taken when
        #: start() made them. They lie in the state directory, which a sandbox granted the home may rewrite:
        #: diff, commit and removal only touch the directories that still carry these identities.
        self.data_identity: tuple[int, int] | None = None
        self.workspace_identity: tuple[int, int] | None = None
        self.report_enforced: dict[str, Any] = {}
        #: A sandbox of an image: its upper layer on the host (imageroot.HostUpper; None: a private tmpfs).
        self.image_upper: Any = None
        #: Sandbox(image_upper=...): "disk", the upper layer in the state directory (commit_image reads it
        #: there); "tmpfs", a private tmpfs; None, as the kernel allows (the disk before Linux 6.6).
        self.image_upper_wanted: str | None = None
        #: Set before start() by the image builder: the program owns the image's files (imageroot.HostUpper).
        self.image_as_owner = False
        #: A copy workspace kept as layers (isolate/backends/native/copies.py): the token of its private copy
        #: (the overlay's lower layer), and whether a snapshot's layer lies between it and the upper layer.
        #: None: the copy is the workspace itself (no source, or layers refused: ``copy_refused`` says why).
        self.copy: str | None = None
        self.copy_base = False
        self.copy_refused: str | None = None
        self.paused = False
        self.frozen = False
        self.resumed_at: float | None = None
        #: Why the host ended the sandbox while it ran (see end()), for the errors that follow.
        self.ended_because: str | None = None
        self._query_lock = threading.Lock()
        self._files: Connection | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- lifecycle ---------------------------------------------------------------

    @property
    def workspace_host(self) -> str:
        if self.workspace.mode == "bind":
            assert self.workspace.source is not None
            return self.workspace.source
        if self.layered:
            return os.path.join(self.paths.data, "overlay", "upper")  # what the host reads the changes from
        return os.path.join(self.paths.data, "workspace")

    @property
    def layered(self) -> bool:
        """Whether the workspace is an overlay's upper layer (an overlay workspace, or a copy kept as layers)."""
        return self.workspace.mode == "overlay" or self.copy is not None

    @property
    def data_dir(self) -> str:
        return self.paths.data

    def start(self) -> None:
        copying = self.workspace.mode == "copy" and self.workspace.source is not None
        refusal = copy_layers_refused() if copying else None
        if copying and refusal is None:
            try:
                self._start(copy_layers=True)
                return
            except OverlayRefused as exc:
                # The overlay over the private copy cannot be made here (no overlayfs in a user namespace, a
                # state directory without user xattrs): a copy workspace still works, as a whole copy, and
                # says so in its enforced report.
                refusal = COPY_LAYERS_REFUSED[state_dir()] = str(exc).removeprefix("workspace mode overlay: ")
                refusal = refusal.removesuffix("; " + WAY_OUT)
        self.copy, self.copy_base, self.copy_refused = None, False, refusal
        self._start(copy_layers=False)

    def _start(self, copy_layers: bool) -> None:
        if not self.policy.namespaces and self.workspace.mode == "overlay":
            raise UnsupportedError("workspace mode overlay: the overlay is mounted inside the sandbox's user and "
                                   "mount namespaces, and namespaces=False has none; use namespaces=True (a kept "
                                   "native sandbox needs them whatever its workspace)")
        if self.policy.seccomp == "strict":
            raise UnsupportedError("seccomp strict: a kept sandbox's exec server accepts the host's connections on a "
                                   "unix socket, which the strict profile refuses (accept4); use seccomp default, "
                                   "or isolate.run for a strict one-shot run")
        if not self.policy.namespaces:
            raise UnsupportedError("a kept native sandbox needs namespaces (its commands share one PID and mount "
                                   "namespace); use namespaces=True, or backend='docker'")
        if self.name is not None and os.path.exists(self.paths.socket):
            raise IsolationError(f"sandbox {self.name!r} exists already; attach to it or remove it first "
                                 f"(isolate-run sandbox rm {self.name})")
        made_data = False
        listener = None
        workspace_fd = -1
        layers = None
        try:
            if self.workspace.mode == "overlay":
                layers = layers_for(self.workspace, self.paths.data)  # refused before anything is made
            # A snapshot of an image sandbox holds the image root's layer: laid over the image from the upper
            # layer's directory, which is then on disk whatever was asked (kept/snapshots.py).
            root_from = root_source(self.start_from) if self.policy.image is not None else None
            on_disk = self.policy.image is not None and (self.image_upper_wanted == "disk" or root_from is not None)
            # Before Linux 6.6 a tmpfs upper layer cannot take every change (runupper.py): unless the tmpfs or
            # its size was asked for, on disk where the state directory keeps user.* attributes, else the tmpfs,
            # its limit reported.
            # Not for a User run as a subordinate id: the caller could not remove its files there (plan.py).
            disk_by_default = (self.policy.image is not None and self.image_upper_wanted is None and not on_disk
                               and _disk_by_default(self.policy) and not _maps_range(self.policy))
            on_disk = on_disk or disk_by_default
            if copy_layers:
                # The lower layer's path is the private copy's, known once it is chosen (below).
                layers = Layers("", self.workspace.target, os.path.join(self.paths.data, "overlay"))
                made = make_copy_layers(self.paths.key, self.workspace, layers, self.start_from)
                self.data_identity, self.workspace_identity, self.copy, self.copy_base = made
                made_data = True
                layers = dataclasses.replace(layers, source=copies.tree_path(self.copy))
                if self.copy_base:
                    layers = dataclasses.replace(layers, base_fd=open_base(self.paths.key))
                lower_fd = copies.open_tree(self.copy)
                layers = dataclasses.replace(layers, source_fd=lower_fd)
            elif self.workspace.mode in ("copy", "overlay") or on_disk:
                self.data_identity, self.workspace_identity = make_data_dir("sandboxes", self.paths.key,
                                                                            self.workspace, layers, self.start_from)
                made_data = True
                if layers is not None and self.start_from is not None:
                    layers = dataclasses.replace(layers, base_fd=open_base(self.paths.key))
            if on_disk:
                try:
                    self.image_upper = make_image_upper(self.paths.data, self.data_identity, self.image_as_owner,
                                                         root_from)
                    if disk_by_default:
                        self.image_upper = dataclasses.replace(
                            self.image_upper, purpose="on disk: a tmpfs keeps no user.* attributes before Linux 6.6")
                except UnsupportedError:
                    if not disk_by_default:
                        raise
            listener = self._listen()
            # A copied workspace is a new directory each time: the policy binds a stand-in beside it and
            # this run binds the workspace in its place, so that every sandbox of one policy shares one
            # prepared plan (paths resolved, rules and filters built) instead of making its own.
            shown, bind_sources = self.workspace_host, None
            if self.workspace.mode == "copy" and not copy_layers:
                shown = _stand_in()
                workspace_fd = os.open(self.workspace_host, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                info = os.fstat(workspace_fd)
                if (info.st_dev, info.st_ino) != self.workspace_identity:
                    raise IsolationError(f"{self.workspace_host}: replaced while the sandbox was made")
                bind_sources = {shown: workspace_fd}
            policy = _server_policy(self.policy, self.workspace, shown, self.mounts,
                                    self.name is not None, self.ttl, layers is not None)
            idle_ms = 0 if self.idle_timeout is None else max(1, int(self.idle_timeout * 1000))
            # A spare monitor, forked ahead, takes the fork off each command's start; it is one more
            # process of the sandbox, so none where the policy counts them.
            spare = "0" if self.policy.limits.pids is not None else "1"
            # The host as the exec server sees it: the caller, or 0 where its subordinate ids are mapped.
            args = [SERVER_NAME, str(listener.fileno()), str(imageroot.caller_inside(policy)), str(idle_ms), "0",
                    spare]
            self.process = _ServerProcess(args, policy=policy, bind_sources=bind_sources,
                                          pass_fds=[listener.fileno()],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=self.name is not None,
                                          overlay=layers,
                                          egress_detached=self.paths.egress if self.name is not None else None,
                                          image_upper=self.image_upper)
            listener.close()
            listener = None
            layers = close_layer_fds(layers)
            if workspace_fd >= 0:
                os.close(workspace_fd)
                workspace_fd = -1
            prepared = self.process._prepared
            assert prepared is not None
            self.environment = _environment_of(prepared.plan)
            self.report_enforced = dict(prepared.enforced)
            if copy_layers:
                self.report_enforced["workspace"] = _copy_enforced(self.workspace, self.report_enforced)
            elif self.copy_refused is not None:
                self.report_enforced["workspace"] = {
                    "mode": "copy", "mechanism": f"a private copy of {self.workspace.source}, bound writable",
                    "snapshots": "whole copies: the copy cannot be an overlay's lower layer here "
                                 f"({self.copy_refused})"}
            self._wait_ready()
            self._write_meta()
            if self.name is not None:
                now = time.time()
                Registry().record(SandboxRecord("native", self.name, self.paths.key, self.policy.config_hash(),
                                                "", "", now, now))
            if self.name is None:
                # An unnamed sandbox dies with its creator; its files go at exit or collection at the latest.
                self._finalizer = weakref.finalize(self, _remove_files, self.paths, self.data_identity, self.copy,
                                                   os.getpid())
        except BaseException as exc:
            close_layer_fds(layers)
            if listener is not None:
                listener.close()
            if workspace_fd >= 0:
                os.close(workspace_fd)
            self._teardown(remove_data=made_data)
            if isinstance(exc, OSError):
                # A file of its own vanished or was swapped while it was made (a program that can write
                # the state directory): refused, in the error every caller expects.
                raise IsolationError(f"sandbox: could not make it: {exc.strerror or exc}: "
                                     f"{exc.filename or self.paths.data}") from None
            raise

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with _suppress_missing():
                os.unlink(self.paths.socket)
            # Not os.umask(): the umask is the process's, and a sandbox another thread forks meanwhile
            # would make its directories with it (create_many starts many at once). The runtime
            # directory is the caller's alone (0700), so the socket's mode before the chmod lets no
            # one else in.
            sock.bind(self.paths.socket)
            os.chmod(self.paths.socket, 0o600)
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
                self._files = conn
                self.init_identity = _identity(self.process.pid)
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
                "init": list(self.init_identity) if self.init_identity else None,
                "data": list(self.data_identity) if self.data_identity else None,
                "workspace_dir": list(self.workspace_identity) if self.workspace_identity else None,
                "copy": self.copy, "copy_base": self.copy_base, "copy_refused": self.copy_refused}
        if self.image_upper is not None:  # commit_image and snapshots of an attached sandbox read it
            host = self.image_upper
            meta["image_upper"] = {"state": host.state, "identity": list(host.identity),
                                   "as_owner": host.as_owner, "base": host.base}
        temp = self.paths.meta + f".{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(meta))  # one write: json.dump writes piece by piece
        os.rename(temp, self.paths.meta)

    @classmethod
    def attach(cls, name: str, ping: bool = True) -> NativeSandbox:
        """The running sandbox of that name (made by this user), as its creator left it.

        ``ping=False`` does not ask the exec server (a paused sandbox would not answer).
        """
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
        init = meta.get("init")
        if isinstance(init, list) and len(init) == 2:
            box.init_identity = (int(init[0]), float(init[1]))
        box.data_identity = _pair(meta.get("data"))
        box.workspace_identity = _pair(meta.get("workspace_dir"))
        copy = meta.get("copy")
        box.copy = copy if copies.valid(copy) and ws["mode"] == "copy" else None
        box.copy_base = meta.get("copy_base") is True
        box.copy_refused = str(meta["copy_refused"]) if meta.get("copy_refused") else None
        upper = meta.get("image_upper")
        if isinstance(upper, dict) and _pair(upper.get("identity")) is not None:
            from .imageroot import HostUpper

            box.image_upper = HostUpper(str(upper["state"]), _pair(upper["identity"]) or (0, 0),
                                        bool(upper.get("as_owner")), bool(upper.get("base")))
        if not ping:
            return box
        try:
            conn = Connection(paths.socket)
            conn.call(lib.ISO_XS_PING)
        except ServerGone:
            raise IsolationError(f"sandbox {name!r} has ended; remove it with isolate-run sandbox rm {name}") from None
        box._files = conn
        return box

    def open_workspace(self) -> int:
        """A descriptor of the workspace on the host (copy mode: only the directory start() made)."""
        from ...kernel.tree import _open_dir

        fd = _open_dir(self.workspace_host)
        if self.workspace.mode != "bind":
            info = os.fstat(fd)
            if self.workspace_identity is None or (info.st_dev, info.st_ino) != self.workspace_identity:
                os.close(fd)
                raise IsolationError(f"workspace {self.workspace_host} is not the directory this sandbox was made "
                                     "with (replaced, or reached through a planted link); not read")
        return fd

    def files(self) -> Connection:
        if self.ended_because is not None:
            raise IsolationError(f"the sandbox was ended by the host: {self.ended_because}")
        if self._files is None:
            raise IsolationError("the sandbox is not running; start() it first")
        if self._files.closed:  # dropped after an answer that did not come: start a fresh conversation
            self._files = self.connect()
        return self._files

    def connect(self) -> Connection:
        if self.ended_because is not None:
            raise IsolationError(f"the sandbox was ended by the host: {self.ended_because}")
        return Connection(self.paths.socket)

    def why_stream(self) -> Any:
        """Denial tracing: the init's stream of refusals (why.WhyStream), or None."""
        prepared = self.process._prepared if self.process is not None else None
        return prepared.why_stream if prepared is not None else None

    def egress_summary(self) -> dict[str, Any] | None:
        """The in-process mediator's summary, or the mediator process's (asked on its query socket,
        which only the process that started the sandbox holds)."""
        prepared = self.process._prepared if self.process is not None else None
        if prepared is None:
            return None
        if prepared.mediator is not None:
            summary: dict[str, Any] = prepared.mediator.summary()
            return summary
        if prepared.mediator_query is None:
            return None
        with self._query_lock:
            return ask_summary(prepared.mediator_query)

    def end(self, reason: str, wait: bool = True) -> bool:
        """SIGKILL to the init, from the host (no process inside can stop that): the PID namespace and
        everything in it end; the files stay until close(). ``wait=False``: not reaped here (close() does)."""
        if self.ended_because is None:
            self.ended_because = reason
        if self.process is not None:
            if self.process.poll() is not None:
                return False
            with _suppress_missing():
                self.process.kill()
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=10)
            return True
        init = self._init_pid()
        if init is None:
            return False
        with _suppress_missing():
            os.kill(init, signal.SIGKILL)
        return True

    def state(self) -> str:
        """"running", "ended", or "not answering" (paused, or its exec server killed from inside)."""
        if self.process is not None and self.process.poll() is not None:
            return "ended"
        answer = probe(self.connect)
        if answer != "gone":
            return answer
        return "ended" if self._init_pid() is None else "not answering"

    def _init_pid(self) -> int | None:
        """The sandbox's init on the host, if it still runs (a reused pid is told apart by its start time)."""
        if self.process is not None:
            return self.process.pid
        if self.init_identity is None:
            return None
        pid, started = self.init_identity
        return pid if _identity(pid) == (pid, started) else None

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
        if self.name is not None:
            Registry().forget("native", self.name)

    def detach(self) -> None:
        """Let go of the sandbox without ending it (its file conversation is closed)."""
        if self._files is not None:
            self._files.close()
            self._files = None

    def _teardown(self, remove_data: bool) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
        prepared = self.process._prepared if self.process is not None else None
        if prepared is not None and prepared.mediator_query is not None:
            prepared.mediator_query.close()
            prepared.mediator_query = None
        if self.process is not None:
            with _suppress_missing():
                self.process.kill()  # SIGKILL to the init: the PID namespace ends with it
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.process = None
        else:
            init = self._init_pid()
            if init is not None:
                _kill_and_wait(init)
        self.init_identity = None
        if self._finalizer is not None:
            self._finalizer.detach()
        _remove_files(self.paths, self.data_identity if remove_data and self.workspace.mode != "bind" else None,
                      self.copy if remove_data else None)

    # -- pause -------------------------------------------------------------------

    def pause(self) -> str:
        """Stop every process: the cgroup freezer where there is a cgroup, else SIGSTOP to each."""
        mechanism = self._freeze(True)
        self.paused = True
        self.frozen = mechanism == "cgroup-freezer"
        return mechanism

    def resume(self) -> str:
        mechanism = self._freeze(False)
        if self.frozen:
            self.resumed_at = time.monotonic()
        self.paused = self.frozen = False
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
        init = self._init_pid()
        if not stop:
            pausing.continue_all(self.processes, init)
        else:
            pausing.stop_all(self.processes, init)
        return "sigstop"


def _copy_enforced(workspace: Workspace, enforced: dict[str, Any]) -> dict[str, Any]:
    """A copy workspace's report: the overlay's, told as a copy."""
    overlay = dict(enforced.get("workspace") or {})
    return {**overlay, "mode": "copy",
            "mechanism": f"a private copy of {workspace.source}, made once, as the read-only lower layer of an "
                         "overlayfs (userxattr) in the sandbox's user namespace",
            "snapshots": "layers: a snapshot, fork or restore costs what changed since the copy"}


def _stand_in() -> str:
    """The directory a copied workspace's policy binds, replaced by the workspace in each run (real path)."""
    return grants.host_symlinks(state_path("sandboxes", ".workspace-stand-in"), "binds")[1]


def _identity(pid: int) -> tuple[int, float] | None:
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None  # dead, not yet reaped (its parent is gone, and the host's init may be slow to)
        return pid, process.create_time()
    except psutil.Error:
        return None


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


def _disk_by_default(policy: Policy) -> bool:
    from .imageroot import disk_by_default

    return disk_by_default(policy)


def _maps_range(policy: Policy) -> bool:
    """Whether a sandbox of ``policy`` maps the caller's subordinate ids (the caller is root inside)."""
    return os.geteuid() != 0 and imageroot.caller_inside(policy) == 0


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _kill_and_wait(init: int, timeout: float = 10.0) -> None:
    """SIGKILL another process's sandbox init and return once it has exited.

    The kernel kills every process of the init's PID namespace as the init exits, before its pidfd turns
    readable: after this, nothing of the sandbox answers (a close from attach() would otherwise return
    while its exec server still did). Through a pidfd opened first, so a reused pid is never signalled.
    """
    try:
        pidfd = os.pidfd_open(init)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd (kernel < 5.3): signal by pid, without the wait
        with _suppress_missing():
            os.kill(init, signal.SIGKILL)
        return
    try:
        with _suppress_missing():
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        fdwait.ready([pidfd], timeout=timeout)
    finally:
        os.close(pidfd)


def _remove_files(paths: Paths, data: tuple[int, int] | None, copy: str | None = None, maker: int = 0) -> None:
    """Remove the socket and description; with data (its identity), the data directory start() made, and then
    the private copy it used (``copy``: its token) if nothing else uses it. ``maker``: the process that started
    the sandbox; a child forked since removes nothing (its exit runs the finalizers it inherited, and the
    sandbox, its workspace included, is its parent's)."""
    if maker and maker != os.getpid():
        return
    for path in (paths.socket, paths.meta, paths.egress):
        with _suppress_missing():
            os.unlink(path)
    if data is not None:
        remove_dir(paths.data, data)
        copies.release(copy)


def environment_for(base: Mapping[str, str], env: Mapping[str, str] | None) -> list[str]:
    merged = dict(base)
    if env:
        for key, value in env.items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                raise PolicyError(f"env: {key!r} is not a variable name", "env")
            if not isinstance(value, str) or "\0" in value:
                raise PolicyError(f"env: the value of {key} must be a string without NUL bytes", "env")
            merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]
