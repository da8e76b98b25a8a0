"""``isolate.ray.Sandbox``: an ``isolate.Sandbox`` on a node of a Ray cluster, with the same methods.

    sb = isolate.ray.Sandbox(policy, workspace=isolate.Workspace("./repo")).start()
    sb.node_id                        # where it runs
    sb.exec(["pytest", "-q"])         # the same ExecResult as locally
    sb.commit()                       # back into ./repo, on this machine

What differs from a local sandbox, and why:

- the workspace's source is read on the caller's machine and shipped to the
  node (``workspace_on="node"``: it is a path on the node, shared storage);
  ``commit()`` writes to the caller's machine (``on_node=True``: on the node);
- ``processes()`` returns dicts (pid, name, cmdline) of the node's processes,
  not psutil objects of this machine's;
- a sandbox is never named: it belongs to this client, and ends with it;
- a call on a sandbox whose node died raises ``isolate.SandboxLostError``;
- snapshots stay on their node until another node needs one: ``fork(n)``
  places its forks as new sandboxes are placed, ``restore`` and
  ``Sandbox(snapshot=...)`` take a snapshot of any node, and ``isolate.merge``
  takes sandboxes and snapshots of several nodes: the snapshot moves once per
  node, by digest, through Ray's object store (``isolate/ray/layers.py``).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ray

from ..kept.hostfiles import commit_tree, save_download, upload_tree
from ..kernel.tree import Changes
from ..model.errors import IsolationError, PolicyError, SandboxEndedError, SandboxLostError, UnsupportedError
from ..model.policy import Mount, Policy
from ..model.workspace import Workspace
from .direct import Broken, Stashed, TooLarge, open_port
from .host import LARGE
from .placement import Hosts, Placement, outcome, place, settle
from .transfer import pack_tree, unpack_tree

__all__ = ["RemoteProcess", "Sandbox"]

#: How long a call whose sandbox ended under it waits for Ray's word on the node (a node dying takes its
#: sandboxes first, then its host, whose death Ray names).
NODE_VERDICT_SECONDS = 3.0

#: How long one read waits on the node before the caller asks again.
READ_SLICE = 1.0

#: The host calls that may take the direct route (isolate/ray/direct.py): a sandbox's methods and sessions.
DIRECT = frozenset({"call", "session"})


def _has_refs(args: tuple[Any, ...]) -> bool:
    """Whether a call carries refs to the object store (large contents): those go through the actor."""
    for arg in args:
        if isinstance(arg, ray.ObjectRef):
            return True
        if isinstance(arg, (tuple, list)) and _has_refs(tuple(arg)):
            return True
        if isinstance(arg, dict) and _has_refs(tuple(arg.values())):
            return True
    return False


def _check_kwargs(kwargs: Mapping[str, Any]) -> None:
    if kwargs.get("name") is not None:
        raise PolicyError("name: a sandbox on a Ray cluster is unnamed (it belongs to its client and ends with it)",
                          "name")
    unknown = set(kwargs) - {"mounts", "backend", "ttl", "idle_timeout", "name", "image_upper"}
    if unknown:
        raise TypeError(f"Sandbox() got unexpected keyword arguments: {', '.join(sorted(unknown))}")


def _workspace(workspace: Workspace | str | None, workspace_on: str) -> tuple[Workspace | str | None, bytes | None]:
    """The workspace as the node gets it: a Workspace, and the source's tar when it is read here."""
    if workspace_on not in ("caller", "node"):
        raise PolicyError(f"workspace_on: {workspace_on!r} is not caller or node", "workspace_on")
    if workspace is None:
        return None, None
    if workspace_on == "node":
        if isinstance(workspace, os.PathLike):
            workspace = os.fspath(workspace)
        if not isinstance(workspace, (str, Workspace)):
            raise TypeError("workspace must be an isolate.Workspace or a path")
        return workspace, None  # a path on the node: checked there
    if isinstance(workspace, (str, os.PathLike)):
        workspace = Workspace(os.fspath(workspace))
    if workspace.source is None:
        return workspace, None
    if workspace.mode == "bind":
        raise PolicyError("workspace: mode bind shows the source itself, which is on this machine, not on the node; "
                          "use copy or overlay, or workspace_on='node' for a path on the node", "workspace")
    return workspace, pack_tree(workspace.source, workspace.excluded)


class Sandbox:
    """A sandbox on a node of the Ray cluster (see the module's docstring).

    The arguments are ``isolate.Sandbox``'s, plus where it may run:
    ``node_id`` (that node only), ``resources`` (custom resources the node
    must have, e.g. ``{"sandbox": 1}``), ``labels`` (node labels it must
    carry), and ``workspace_on``; ``image_login``: the registry's (user,
    secret) for the node's pull of the policy's image when it lacks it (sent
    with the create call, used for that pull only).
    """

    def __init__(self, policy: Policy | None = None, *, workspace: Workspace | str | None = None,
                 mounts: Sequence[Mount] = (), node_id: str | None = None,
                 resources: Mapping[str, float] | None = None, labels: Mapping[str, str] | None = None,
                 workspace_on: str = "caller", snapshot: RemoteSnapshot | None = None,
                 image_login: tuple[str, str] | None = None, **kwargs: Any) -> None:
        _check_kwargs(kwargs)
        if image_login is not None and not (isinstance(image_login, tuple) and len(image_login) == 2
                                            and all(isinstance(part, str) for part in image_login)):
            raise TypeError("image_login must be a (user, secret) tuple of two strings")
        #: The registry's (user, secret) for the node's pull of the policy's image (never kept by the node).
        self._image_login = image_login
        self.policy = policy if policy is not None else Policy()
        if not isinstance(self.policy, Policy):
            raise TypeError("policy must be an isolate.Policy")
        if snapshot is not None and not isinstance(snapshot, RemoteSnapshot):
            raise TypeError("snapshot must be a snapshot of an isolate.ray.Sandbox (sb.snapshot())")
        #: The snapshot it starts from (taken on any node), else None.
        self.origin = snapshot
        if snapshot is not None:
            if workspace is not None:
                raise PolicyError("workspace: a sandbox started from a snapshot has the snapshot's workspace (leave "
                                  "workspace= out)", "workspace")
            shipped: tuple[Workspace | str | None, bytes | None, str | None] = snapshot._workspace
            self.workspace, self._source, self._caller_source = shipped
        else:
            self.workspace, self._source = _workspace(workspace, workspace_on)
            self._caller_source = self.workspace.source if isinstance(self.workspace, Workspace) and self._source \
                else None
        self.placement = Placement(node_id, resources, labels)
        self._kwargs = {"mounts": tuple(mounts), **kwargs}
        self.id = uuid.uuid4().hex[:16]
        self.node_id: str | None = None
        self._actor: Any = None
        self._hosts: Hosts | None = None
        self._lost: SandboxLostError | None = None
        self._on_close: Any = None
        self._secret: bytes | None = None
        self._calls = {"direct": 0, "actor": 0}
        self._counting = threading.Lock()  # calls from many threads: no count lost
        self._route_why: str | None = "not started"
        self._route_tls = False
        self.enforced: dict[str, Any] = {}
        #: Always native: a node runs isolate's own sandboxes (the same attribute as isolate.Sandbox's).
        self.backend = "native"

    _on_cluster = True  # isolate.merge of branches of which one is on a cluster: isolate/ray/merging.py

    def __repr__(self) -> str:
        return f"isolate.ray.Sandbox(id={self.id!r}, node_id={self.node_id!r})"

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> Sandbox:
        if self._actor is not None:
            return self
        hosts = Hosts.get()
        source = ray.put(self._source) if self._source is not None and len(self._source) > LARGE else self._source
        origin = self.origin

        def attempt(actor: Any, node: str) -> Any:
            layer = origin.layer_for(node) if origin is not None else None
            return actor.create.remote(self.id, self.policy, dict(self._kwargs), self.workspace, source, layer,
                                       self._image_login)

        # Among the eligible nodes, the one that holds the snapshot first (nothing to ship).
        node_id, info = place(self.placement, attempt, f"sandbox {self.id}", hosts,
                              prefer=origin.holders() if origin is not None else ())
        self._bind(hosts, node_id, info)
        return self

    def _bind(self, hosts: Hosts, node_id: str, info: Mapping[str, Any]) -> None:
        self._hosts, self.node_id, self._actor = hosts, node_id, hosts.actor(node_id)
        self.enforced = dict(info.get("enforced", {}))
        admitted = info.get("admitted", {}).get(self.id, info)  # create_many: each sandbox's own
        self._secret = admitted.get("secret")
        self._route_why = None if self._secret is not None else str(admitted.get("direct_refused")
                                                                     or "the node's host offers no direct route")
        self._route_tls = bool(admitted.get("tls"))
        hosts.learn(node_id, admitted.get("direct"), self._route_tls)
        hosts.count(node_id, 1)

    @property
    def stats(self) -> dict[str, Any]:
        """How its calls reach its node: ``route`` "direct" (a connection of this client to the node's host,
        isolate/ray/direct.py; ``tls`` True when it is TLS, under Ray's TLS) or "actor" (through Ray, with
        ``why``), and how many calls took each."""
        direct = self._route_why is None
        return {"route": "direct" if direct else "actor", "why": self._route_why, "tls": direct and self._route_tls,
                "direct_calls": self._calls["direct"], "actor_calls": self._calls["actor"]}

    @classmethod
    def create_many(cls, n: int, policy: Policy | None = None, *, node_id: str | None = None,
                    resources: Mapping[str, float] | None = None, labels: Mapping[str, str] | None = None,
                    **kwargs: Any) -> list[Sandbox]:
        """n started sandboxes spread over the eligible nodes, each node starting its share side by side.

        A node that refuses (or is lost) has its share started on the others; when none is left, those started
        are ended and the error names every node's reason.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PolicyError(f"n: expected an integer of at least 0, got {n!r}", "n")
        if kwargs.get("workspace") is not None:
            # Not dropped: each node would need the source shipped and kept for its share.
            raise PolicyError("workspace: create_many on a cluster starts empty workspaces; use "
                              "isolate.ray.SandboxPool(workspace=...) or isolate.ray.Sandbox for a workspace",
                              "workspace")
        if kwargs.get("snapshot") is not None:
            raise PolicyError("snapshot: create_many on a cluster starts empty workspaces; use "
                              "isolate.ray.Sandbox(snapshot=...) or fork(n)", "snapshot")
        kwargs.pop("workspace", None)
        kwargs.pop("workspace_on", None)
        kwargs.pop("snapshot", None)
        _check_kwargs(kwargs)
        boxes = [cls(policy, node_id=node_id, resources=resources, labels=labels, **kwargs) for _ in range(n)]
        if not boxes:
            return []
        hosts = Hosts.get()
        waiting, nodes = list(boxes), hosts.candidates(boxes[0].placement)
        reasons: list[str] = []
        try:
            while waiting:
                if not nodes:
                    raise IsolationError(f"{len(waiting)} sandboxes: no node of the Ray cluster would host them: "
                                         + "; ".join(reasons))
                shares = [waiting[i::len(nodes)] for i in range(len(nodes))]
                calls = [(node, share, hosts.actor(node).create_many.remote(
                    [b.id for b in share], boxes[0].policy, dict(boxes[0]._kwargs)))
                    for node, share in zip(nodes, shares, strict=True) if share]
                waiting = []
                for node, share, ref in calls:
                    try:
                        info = outcome(ref, node, f"{len(share)} sandboxes")
                    except PolicyError:
                        raise
                    except IsolationError as exc:  # refused or lost: its share goes to the other nodes
                        reasons.append(f"node {node}: {exc}")
                        nodes.remove(node)
                        waiting.extend(share)
                        continue
                    for box in share:
                        box._bind(hosts, node, info)
        except BaseException:
            for box in boxes:
                box.close()
            raise
        return boxes

    def close(self) -> None:
        """End the sandbox on its node. Idempotent; a lost sandbox closes quietly."""
        actor, self._actor = self._actor, None
        if actor is None:
            return
        assert self._hosts is not None and self.node_id is not None
        self._hosts.count(self.node_id, -1)
        try:
            if self._lost is None:
                outcome(actor.close.remote(self.id), self.node_id, f"sandbox {self.id}")
        except SandboxLostError:
            pass
        finally:
            hook, self._on_close = self._on_close, None
            if hook is not None:
                hook(self)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._host_call("call", self.id, method, args, kwargs)

    def _host_call(self, name: str, *args: Any) -> Any:
        if self._lost is not None:
            raise self._lost
        if self._actor is None:
            raise IsolationError(f"sandbox {self.id}: not running; start() it first")
        assert self.node_id is not None
        what = f"sandbox {self.id}"
        try:
            if name in DIRECT and self._secret is not None and self._hosts is not None and not _has_refs(args):
                route = self._hosts.route(self.node_id)
                if isinstance(route, str):
                    self._route_why = route
                else:
                    self._route_why, self._route_tls = None, route.tls
                    try:
                        value = route.call(self.id, self._secret, name, args[1:])  # args[0]: this sandbox's id
                    except TooLarge:
                        pass  # through the actor, whose object store carries it
                    except Broken as exc:
                        # The outcome is unknown: the actor says whether the node is gone (SandboxLostError, in
                        # the time Ray takes), else the call failed with the connection.
                        outcome(self._actor.node.remote(), self.node_id, what)
                        raise IsolationError(f"{what}: the direct connection to node {self.node_id} broke during "
                                             f"the call ({exc}): it may have run") from None
                    else:
                        with self._counting:
                            self._calls["direct"] += 1
                        if isinstance(value, Stashed):
                            value = pickle.loads(outcome(self._actor.take.remote(value.key), self.node_id, what))
                        return settle(value, self.node_id, what)
            with self._counting:
                self._calls["actor"] += 1
            return outcome(getattr(self._actor, name).remote(*args), self.node_id, what)
        except SandboxLostError as exc:
            self._note_lost(exc)
            raise
        except SandboxEndedError:
            # The sandbox ended under the call: a node dying takes its sandboxes' processes first, and its host
            # says so before Ray names the node's loss. Ray says whether the node is gone, within a moment.
            deadline = time.monotonic() + NODE_VERDICT_SECONDS
            while True:
                try:
                    outcome(self._actor.node.remote(), self.node_id, what)
                except SandboxLostError as lost:
                    self._note_lost(lost)
                    raise lost from None
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _note_lost(self, exc: SandboxLostError) -> None:
        if exc.node_id == self.node_id:  # not another node, whose snapshot this call was fetching
            self._lost = exc
            if self._hosts is not None:
                self._hosts.forget(self.node_id)

    # -- what isolate.Sandbox does ------------------------------------------------------------

    def exec(self, cmd: str | Sequence[str], **kwargs: Any) -> Any:
        """``isolate.Sandbox.exec``, on the node: the same arguments, the same ExecResult."""
        if isinstance(kwargs.get("input"), (bytes, str)) and len(kwargs["input"]) > LARGE:
            kwargs["input"] = ray.put(kwargs["input"])
        return self._call("exec", cmd if isinstance(cmd, str) else [os.fsdecode(a) for a in cmd], **kwargs)

    def spawn(self, cmd: str | Sequence[str], **kwargs: Any) -> RemoteProcess:
        """``isolate.Sandbox.spawn``: stream its output (``for line in proc``, ``proc.stdout.read()``)."""
        for name in ("fd3", "stdin"):
            if kwargs.get(name) is not None:
                raise PolicyError(f"{name}: a descriptor of this machine cannot reach a sandbox on another node",
                                  name)
        info = self._host_call("spawn", self.id, (cmd if isinstance(cmd, str) else list(cmd),), kwargs)
        return RemoteProcess(self, info["key"], info["pid"], info["args"])

    def open_port(self, port: int) -> socket.socket:
        """A TCP connection to ``port`` on the sandbox's own loopback, as a program inside it would make (under its
        network policy): a connection of this client to the node's host, which relays the bytes (the direct
        route's forwarded connection, isolate/ray/direct.py). What the server's port route uses for a sandbox on
        a node (``isolate-run serve --ray``). Raises ConnectorError (nothing listens there, ...), or
        UnsupportedError where the node offers no direct route (it could not listen, or Ray's TLS files do not load
        there or here). Under Ray's TLS the connection is TLS, as the route's calls are."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise PolicyError(f"port: expected a port number (1-65535), got {port!r}", "port")
        if self._lost is not None:
            raise self._lost
        if self._actor is None:
            raise IsolationError(f"sandbox {self.id}: not running; start() it first")
        assert self.node_id is not None
        direct = self._hosts.address(self.node_id) if self._hosts is not None else None
        if self._secret is None or direct is None:
            raise UnsupportedError(f"port {port}: sandbox {self.id} is on node {self.node_id}, whose host offers no "
                                   f"direct route ({self._route_why or 'none'}); its ports cannot be forwarded")
        try:
            return open_port(direct[0], self.id, self._secret, port, direct[1])
        except (OSError, Broken) as exc:
            # Ray says whether the node is gone (SandboxLostError); else the connection failed.
            outcome(self._actor.node.remote(), self.node_id, f"sandbox {self.id}")
            raise IsolationError(f"port {port}: the connection to node {self.node_id}'s host failed ({exc})") \
                from None

    def shell(self, name: str = "default", pty: bool = True) -> RemoteSession:
        return RemoteSession(self, "shell", name, {"pty": pty})

    def python(self, name: str = "default", executable: str = "python3") -> RemoteSession:
        return RemoteSession(self, "python", name, {"executable": executable})

    def remote_code(self, language: str, context_id: str) -> RemoteCodeEngine:
        """A code context of the server's ``/code`` (isolate/server/code), driven by this sandbox's node (its
        interpreter's descriptors are that machine's): ``isolate-run serve --ray``."""
        self._host_call("context_open", self.id, context_id, language)
        return RemoteCodeEngine(self, context_id)

    def read_file(self, path: str, **kwargs: Any) -> Any:
        return self._call("read_file", path, **kwargs)

    def write_file(self, path: str, data: str | bytes, **kwargs: Any) -> None:
        payload: Any = ray.put(data) if len(data) > LARGE else data  # the object store, not one message
        self._call("write_file", path, payload, **kwargs)

    def replace_text(self, path: str, old: str, new: str, count: int | None = None) -> int:
        return int(self._call("replace_text", path, old, new, count))

    def list_dir(self, path: str = ".", depth: int = 1) -> Any:
        return self._call("list_dir", path, depth)

    def stat(self, path: str, follow_symlinks: bool = True) -> Any:
        return self._call("stat", path, follow_symlinks)

    def exists(self, path: str) -> bool:
        return bool(self._call("exists", path))

    def mkdir(self, path: str, parents: bool = True, exist_ok: bool = True, mode: int = 0o755) -> None:
        self._call("mkdir", path, parents, exist_ok, mode)

    def remove(self, path: str, recursive: bool = False) -> None:
        self._call("remove", path, recursive)

    def move(self, source: str, destination: str, overwrite: bool = True) -> None:
        self._call("move", source, destination, overwrite)

    def glob(self, pattern: str, root: str = ".") -> list[str]:
        return list(self._call("glob", pattern, root))

    def grep(self, regex: str, glob: str | None = None, **kwargs: Any) -> Any:
        return self._call("grep", regex, glob, **kwargs)

    def upload(self, host_src: str | os.PathLike[str], dst: str) -> None:
        """Copy a file or tree of this machine into the sandbox (links skipped, as locally)."""
        upload_tree(self, host_src, dst)

    def download(self, src: str, host_dst: str | os.PathLike[str]) -> None:
        """Copy a file of the sandbox to this machine (never through a link or onto a FIFO there)."""
        save_download(self.read_file(src, text=False), host_dst)

    def diff(self) -> Changes:
        result: Changes = self._call("diff")
        return result

    def commit(self, target_dir: str | os.PathLike[str] | None = None, *, on_node: bool = False) -> Changes:
        """Make target_dir match the workspace: on this machine (default: the source read from here), or on
        the node with ``on_node=True``. The same refusals as locally (links out, devices, set-id bits)."""
        if on_node:
            result: Changes = self._call("commit", None if target_dir is None else os.fspath(target_dir))
            return result
        target = target_dir if target_dir is not None else self._caller_source
        if target is None:
            raise IsolationError("commit: this workspace has no source on this machine; give a target directory")
        packed = self._host_call("commit_out", self.id)
        with tempfile.TemporaryDirectory(prefix="isolate-commit-") as tree:
            unpack_tree(packed["tar"], tree)
            fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                filters = self.workspace if isinstance(self.workspace, Workspace) else Workspace()
                changes = commit_tree(fd, target, filters, tree)
            finally:
                os.close(fd)
        changes.refused.update(packed["refused"])
        return changes

    def snapshot(self, name: str | None = None) -> RemoteSnapshot:
        """``isolate.Sandbox.snapshot``, on the node: its files stay there (``remove()`` removes them there)."""
        return RemoteSnapshot(self, self._call("snapshot", name))

    def restore(self, snapshot: RemoteSnapshot, *, ahead: bool = False) -> None:
        """``isolate.Sandbox.restore`` to a snapshot taken on any node (shipped to this one the first time);
        ``ahead``: the next restore to it started now on the node (``isolate.Sandbox.restore``)."""
        if not isinstance(snapshot, RemoteSnapshot):
            raise PolicyError("restore: give a snapshot of an isolate.ray.Sandbox (sb.snapshot())", "snapshot")
        if not isinstance(ahead, bool):
            raise PolicyError(f"ahead: expected True or False, got {ahead!r}", "ahead")
        if snapshot.node_id == self.node_id:
            self._call("restore", snapshot.snapshot, ahead=ahead)
            return
        assert self.node_id is not None
        self._host_call("restore_from", self.id, snapshot.layer_for(self.node_id), ahead)

    def fork(self, n: int = 1, *, processes: bool = False) -> list[Sandbox]:
        """``isolate.Sandbox.fork``: n new sandboxes from this one's files as they are now, placed as new
        sandboxes are (spread over the nodes with the resources and labels this one asked for, this one's node
        first on a tie): a fork on another node starts from this one's snapshot, shipped there once."""
        if processes:
            raise UnsupportedError("fork(processes=True): carrying processes needs checkpoint/restore, which isolate "
                                   "does not drive; fork() carries the files, and the forks start with no process")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PolicyError(f"n: expected an integer of at least 1, got {n!r}", "n")
        point = RemoteSnapshot(self, self._host_call("fork_point", self.id))
        assert self._hosts is not None and self.node_id is not None
        hosts, home = self._hosts, self.node_id
        forks: list[Sandbox] = []
        try:
            nodes = self._spread(hosts, n)
            source = self._source if self._source is None or isinstance(self._source, ray.ObjectRef) \
                else ray.put(self._source)
            calls = []
            for node in nodes:
                fork = Sandbox(self.policy, snapshot=point, **self._kwargs)
                fork.placement = self._fork_placement()
                forks.append(fork)
                calls.append((fork, node, hosts.actor(node).create.remote(
                    fork.id, self.policy, dict(self._kwargs), fork.workspace, source,
                    point.layer_for(node, hold=True))))
            for fork, node, ref in calls:
                try:
                    info = outcome(ref, node, f"fork {fork.id}")
                except PolicyError:
                    raise
                except IsolationError:
                    if node == home:
                        raise
                    # That node refused (or is gone): the fork goes where its parent is.
                    info = outcome(hosts.actor(home).create.remote(
                        fork.id, self.policy, dict(self._kwargs), fork.workspace, source,
                        point.layer_for(home, hold=True)), home, f"fork {fork.id}")
                    node = home
                fork.origin = None  # started: what it holds is its own (the point goes with its last fork)
                fork._bind(hosts, node, info)
        except BaseException:
            for fork in forks:
                fork.close()
            raise
        finally:
            try:
                outcome(hosts.actor(home).settle.remote(point.name), home, f"sandbox {self.id}")
            except SandboxLostError:
                pass
        return forks

    def _fork_placement(self) -> Placement:
        """Where its forks may go: nodes with what it asked of its node (resources, labels), not only its node."""
        return Placement(None, self.placement.resources, self.placement.labels)

    def _spread(self, hosts: Hosts, n: int) -> list[str]:
        """The nodes of n new sandboxes: each the eligible node holding the fewest (this one's first on a tie)."""
        nodes = hosts.candidates(self._fork_placement(), prefer=[self.node_id] if self.node_id else [])
        held = {node: hosts.placed.get(node, 0) for node in nodes}
        out = []
        for _ in range(n):
            node = min(nodes, key=lambda x: held[x])  # the first of the least held: this node on a tie
            held[node] += 1
            out.append(node)
        return out

    def pause(self) -> str:
        return str(self._call("pause"))

    def resume(self) -> str:
        return str(self._call("resume"))

    def processes(self) -> list[dict[str, Any]]:
        """The sandbox's processes on its node: dicts of pid, name and cmdline (its init first)."""
        return list(self._call("processes_summary"))

    def state(self) -> str:
        return str(self._call("state"))

    def usage(self) -> tuple[float, int]:
        """(CPU seconds used so far, memory in use in bytes) of the sandbox's processes, read on its node."""
        cpu, rss = self._call("usage")
        return float(cpu), int(rss)


class RemoteSnapshot:
    """A snapshot kept on a node: ``name``, ``node_id``, ``remove()`` (there, and its copies on other nodes).

    It starts, restores and merges sandboxes on any node: the first time another node needs it, its node puts
    it in Ray's object store once (``digest``) and that node fetches it (isolate/ray/layers.py).
    """

    _on_cluster = True  # isolate.merge of branches of which one is on a cluster: isolate/ray/merging.py

    def __init__(self, box: Sandbox, snapshot: Any) -> None:
        self.snapshot, self.name, self.node_id, self._box = snapshot, snapshot.name, box.node_id, box
        self._hosts = box._hosts
        #: What a sandbox started from it has: the workspace, and its source as shipped from this machine.
        self._workspace: tuple[Workspace | str | None, bytes | None, str | None] = (
            box.workspace, box._source, box._caller_source)
        self.policy, self._kwargs = box.policy, dict(box._kwargs)
        self._shipped: dict[str, Any] | None = None
        self._copies: set[str] = set()

    def __repr__(self) -> str:
        return f"isolate.ray.RemoteSnapshot(name={self.name!r}, node_id={self.node_id!r})"

    @property
    def digest(self) -> str | None:
        """The sha256 of its bundle, once it was shipped (None before)."""
        return None if self._shipped is None else str(self._shipped["digest"])

    def holders(self) -> list[str]:
        """The nodes that hold it (its own, and those it was shipped to)."""
        return [str(self.node_id), *sorted(self._copies)]

    def _actor(self, node_id: str) -> Any:
        actor = self._hosts.existing(node_id) if self._hosts is not None else None
        if actor is None:
            raise SandboxLostError(f"snapshot {self.name}: node {node_id} is gone (or this client left it)", node_id)
        return actor

    def layer_for(self, node_id: str, hold: bool = False) -> dict[str, Any]:
        """What node ``node_id`` is handed to find it: on its own node the name; elsewhere the digest and the
        object store's reference of its bundle (put there by its node, once)."""
        assert self.node_id is not None
        layer: dict[str, Any] = {"snapshot": self.snapshot, "node": self.node_id, "hold": hold}
        if node_id == self.node_id:
            return layer
        if self._shipped is None:
            self._shipped = outcome(self._actor(self.node_id).export_snapshot.remote(self.snapshot), self.node_id,
                                    f"snapshot {self.name}")
        self._copies.add(node_id)
        return {**layer, "digest": self._shipped["digest"], "ref": self._shipped["ref"]}

    def remove(self) -> None:
        """Remove it from its node (``IsolationError`` if it is gone there) and its copies from the others."""
        for node in sorted(self._copies):
            try:
                outcome(self._actor(node).remove_snapshot.remote(self.snapshot), node, f"snapshot {self.name}")
            except IsolationError:
                pass  # that node lost it, or is gone
        self._copies.clear()
        assert self.node_id is not None
        outcome(self._actor(self.node_id).remove_snapshot.remote(self.snapshot), self.node_id,
                f"snapshot {self.name}")
        self._shipped = None


class RemoteCodeEngine:
    """The engine of a server code context (``CodeContext``) whose interpreter runs on a Ray node: a cell is
    started there, and its events are taken a batch at a time (each call waits for the next)."""

    #: How long one call for a cell's events waits on the node before it answers with none.
    WAIT = 1.0

    def __init__(self, box: Sandbox, context_id: str) -> None:
        self._box = box
        self.id = context_id
        self.count = 0

    def run(self, code: str, emit: Callable[[str, Any], None]) -> None:
        self._box._host_call("context_run", self.id, code)
        while True:
            for kind, value in self._box._host_call("context_events", self.id, self.WAIT):
                emit(kind, value)
                if kind == "done":
                    self.count = int(value.get("count") or self.count)
                    return

    def interrupt(self) -> None:
        self._box._host_call("context_interrupt", self.id)

    def close(self) -> None:
        try:
            self._box._host_call("context_close", self.id)
        except IsolationError:  # its sandbox or its node is gone: the context ended with it
            pass


class RemoteSession:
    """A persistent shell or Python interpreter of a remote sandbox (``run``, ``close``, ``alive``)."""

    def __init__(self, box: Sandbox, kind: str, name: str, opened: dict[str, Any]) -> None:
        self.box, self.kind, self.name, self._opened = box, kind, name, opened

    def _session(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.box._host_call("session", self.box.id, self.kind, self.name, method, args,
                                   {**kwargs, "open": self._opened})

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._session("run", *args, **kwargs)

    def interrupt(self) -> None:
        self._session("interrupt")

    @property
    def alive(self) -> bool:
        return bool(self._session("alive"))

    def close(self) -> None:
        self._session("close")


class _RemoteStream:
    """A spawned command's stdout or stderr, read from its node: ``read()``, ``readline()``, iteration."""

    def __init__(self, process: RemoteProcess, name: str) -> None:
        self._process, self._name, self._buffer, self._ended = process, name, b"", False

    def _fill(self, size: int = 1 << 16) -> bool:
        while not self._ended:
            chunk = self._process._read(self._name, size)
            if chunk is None:
                continue  # nothing yet: ask again
            if not chunk:
                self._ended = True
                return False
            self._buffer += chunk
            return True
        return False

    def read1(self, size: int = 1 << 16) -> bytes:
        """What is there now, or the next chunk to come (at most size bytes); b"" at the end."""
        if not self._buffer:
            self._fill(size)
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def read(self, size: int = -1) -> bytes:
        while (size < 0 or len(self._buffer) < size) and self._fill():
            pass
        cut = len(self._buffer) if size < 0 else size
        data, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return data

    def readline(self) -> bytes:
        while b"\n" not in self._buffer and self._fill():
            pass
        end = self._buffer.find(b"\n") + 1 or len(self._buffer)
        line, self._buffer = self._buffer[:end], self._buffer[end:]
        return line

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line


class RemoteProcess:
    """A command started by ``Sandbox.spawn`` on a node, as ``isolate.SandboxProcess`` is locally."""

    def __init__(self, box: Sandbox, key: str, pid: int, args: list[str]) -> None:
        self.box, self._key, self.pid, self.args = box, key, pid, args
        self.stdout = _RemoteStream(self, "stdout")
        self.stderr = _RemoteStream(self, "stderr")

    def _read(self, stream: str, size: int) -> bytes | None:
        result: bytes | None = self.box._host_call("read", self._key, stream, size, READ_SLICE)
        return result

    def _process(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.box._host_call("process", self._key, method, args, kwargs)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.stdout)

    def write(self, data: str | bytes) -> None:
        self._process("write", data)

    def close_stdin(self) -> None:
        self._process("close_stdin")

    def signal(self, sig: int, descendants: bool = False) -> None:
        self._process("signal", sig, descendants)

    def kill(self) -> None:
        self._process("kill")

    def poll(self) -> int | None:
        result: int | None = self._process("poll")
        return result

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; ``subprocess.TimeoutExpired`` after ``timeout`` seconds, as locally."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return int(self._process("wait", min(READ_SLICE, left) if left is not None else READ_SLICE))
            except subprocess.TimeoutExpired:
                if left is not None and left <= READ_SLICE:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0) from None

    @property
    def returncode(self) -> int | None:
        result: int | None = self._process("returncode")
        return result

    @property
    def report(self) -> Any:
        return self._process("report")

    def close(self) -> None:
        if self.box._actor is not None and self.box._lost is None:
            try:
                self.box._host_call("release", self._key)
            except SandboxLostError:
                pass
