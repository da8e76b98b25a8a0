"""The node side: one ``SandboxHost`` actor per node (per client) holds that node's sandboxes.

Each sandbox is a native ``isolate.Sandbox`` started by the actor's process on
its node, confined exactly as a local one (the node enforces or refuses: a
policy it cannot enforce fails there, with the node's reason). The actor is
their creator: each sandbox's init watches the actor's process, so when the
actor dies (its node removed, the client gone and Ray ending the actors it
owned) every sandbox of the node ends with it.

A policy's image travels as its reference: each node pulls it into its own
image store the first time one of its sandboxes needs it (``_image_here``).

The methods take and return plain data; an exception is returned as a value
(``Failure``) and raised again on the caller's side as itself, not wrapped in
Ray's task error. Large file contents travel through Ray's object store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import select
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from ..backends.native.loopback import connect_once
from ..backends.native.named import sweep_unnamed
from ..kept.pool import SandboxPool
from ..kept.sandbox import Sandbox, SandboxProcess
from ..kept.snapshots import Snapshot, sweep_temporary_snapshots
from ..kernel.places import runtime_subdir
from ..model import hooks
from ..model.errors import IsolationError, PolicyError, UnsupportedError
from ..model.policy import Policy
from ..model.workspace import Workspace
from .channel import ray_uses_tls, tls_context
from .direct import PORT_CONNECT_TIMEOUT, Failure, Listener
from .layers import Layers
from .transfer import MAX_PACKED, pack_tree, unpack_tree

#: File contents past this size go through the object store as their own object.
LARGE = 1 << 20

#: Shipped sources no sandbox uses any longer that a node keeps unpacked (the least recently used beyond go).
KEEP_IDLE = 4

#: The Sandbox methods a caller may run by name (anything else is refused).
CALLS = frozenset({
    "exec", "read_file", "write_file", "replace_text", "list_dir", "stat", "exists", "mkdir", "remove", "move",
    "glob", "grep", "diff", "commit", "pause", "resume", "processes_summary", "enforced_report", "state", "usage",
    "snapshot", "restore",
})
SESSION_CALLS = {"shell": frozenset({"run", "close", "alive"}),
                 "python": frozenset({"run", "close", "alive", "interrupt"})}
PROCESS_CALLS = frozenset({"write", "close_stdin", "signal", "kill", "poll", "wait", "returncode", "report"})


def _usage(box: Sandbox) -> tuple[float, int]:
    """CPU seconds (its processes' and their reaped children's) and resident memory of a sandbox's processes."""
    cpu, rss = 0.0, 0
    for process in box.processes():
        try:
            times = process.cpu_times()
            cpu += times.user + times.system + times.children_user + times.children_system
            rss += process.memory_info().rss
        except Exception:  # it ended meanwhile
            continue
    return cpu, rss


def _attempt(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # every failure goes back to the caller, as itself
        return Failure(exc)


def _image_here(policy: Policy, login: tuple[str, str] | None = None) -> None:
    """The policy's image in this node's image store (its caller's own): pulled from its registry when this node
    does not have it yet (concurrent pulls of one layer on a node fetch it once: the store's locks); ``login``:
    the registry's (user, secret) the caller gave, used for this pull only, never kept."""
    if policy.image is None or policy.backend == "docker":
        return
    from ..image import Image

    if Image.find(policy.image) is None:
        Image.pull(policy.image, login=login)


def _scratch() -> str:
    """Where this host unpacks shipped sources and packs commits: under the caller's runtime directory (0700,
    checked, hidden in every sandbox), not the state directory, which lies under the home a sandbox may be
    granted: there a program could swap the directory for a link between the check and the use of its path."""
    return runtime_subdir("ray")


class _Context:
    """A code context on this node: the events of its running cell, gathered for the caller to take."""

    def __init__(self, sid: str, context: Any) -> None:
        self.sid = sid
        self.context = context
        self._cond = threading.Condition()
        self._events: list[tuple[str, Any]] = []
        self._running = False

    def start(self, code: str) -> None:
        with self._cond:
            if self._running:
                raise IsolationError("a cell of this context is running")
            self._running, self._events = True, []
        threading.Thread(target=self._run, args=(code,), daemon=True, name="isolate-ray-context").start()

    def _emit(self, kind: str, value: Any) -> None:
        with self._cond:
            self._events.append((kind, value))
            if kind == "done":
                self._running = False
            self._cond.notify_all()

    def _run(self, code: str) -> None:
        self.context.run(code, self._emit)  # it always ends with "done"

    def events(self, timeout: float) -> list[tuple[str, Any]]:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._events) or not self._running, timeout=max(0.0, timeout))
            taken, self._events = self._events, []
            return taken


class SandboxHost:
    """The actor of one node (see the module's docstring)."""

    def __init__(self) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self._lock = threading.Lock()
        self._boxes: dict[str, Sandbox] = {}
        self._sources: dict[str, str] = {}  # sandbox or pool id: its shipped source here
        # sha256 of a shipped source: [where it is unpacked, its users, when its last user left]
        self._trees: dict[str, list[Any]] = {}
        self._tree_of: dict[str, str] = {}
        self._unpacking: dict[str, threading.Lock] = {}
        self._processes: dict[str, SandboxProcess] = {}
        self._pools: dict[str, SandboxPool] = {}
        #: The server's code contexts (isolate/server/code) of this node's sandboxes: id -> _Context.
        self._contexts: dict[str, _Context] = {}
        #: The snapshots this node holds by digest, shipped here or sent from here (isolate/ray/layers.py).
        self.layers = Layers(self.node_id)
        # What an earlier host on this machine left when it was killed with its node (no close() ran).
        sweep_unnamed()
        sweep_temporary_snapshots()
        #: The direct route's port (isolate/ray/direct.py), at the node's address as Ray knows it, TLS with Ray's
        #: certificates under Ray's TLS (isolate/ray/channel.py); none when it cannot listen, or Ray's TLS files
        #: do not load here (calls go through this actor).
        self._direct: Listener | None = None
        self.direct_refused: str | None = None
        try:
            tls = tls_context(server_side=True) if ray_uses_tls() else None
            self._direct = Listener(ray.util.get_node_ip_address(), self._direct_call, tls, self._open_port)
        except UnsupportedError as exc:
            self.direct_refused = str(exc)
        except OSError as exc:
            self.direct_refused = f"cannot listen: {exc}"
        self._ended = threading.Event()

    # -- sandboxes ---------------------------------------------------------------------

    def node(self) -> str:
        return str(self.node_id)

    def count(self) -> int:
        with self._lock:
            return len(self._boxes)

    # -- the direct route (isolate/ray/direct.py) ------------------------------------------------

    def _admit(self, sid: str) -> dict[str, Any]:
        """What the client of sandbox ``sid`` needs to call it directly: the route's address and the sandbox's
        secret (handed out here, through Ray, only), or why there is no route."""
        if self._direct is None:
            return {"direct": None, "direct_refused": self.direct_refused}
        return {"direct": self._direct.address, "secret": self._direct.admit(sid), "tls": self._direct.tls is not None}

    def _direct_call(self, sid: str, operation: str, args: tuple[Any, ...]) -> Any:
        """A proved request of the direct route, for sandbox ``sid`` only: its Sandbox calls and sessions."""
        if operation == "call":
            return self._call(sid, *args)
        if operation == "session":
            return self.session(sid, *args)
        return Failure(PolicyError(f"{operation}: not a call of the direct route", "operation"))

    def _open_port(self, sid: str, port: int) -> socket.socket:
        """A forwarded connection of the direct route (the server's port route): a connection to ``port`` on
        sandbox ``sid``'s loopback, made by a connector inside it, under its own network policy."""
        return connect_once(self._box(sid), port, PORT_CONNECT_TIMEOUT)

    def take(self, key: str) -> Any:
        """A direct call's result too large for its frame (the object store carries it)."""
        blob = self._direct.take(key) if self._direct is not None else None
        if blob is None:
            return Failure(IsolationError("that result was taken already, or its sandbox closed"))
        return ray.put(blob) if len(blob) > LARGE else blob

    def watch(self) -> None:
        """Answers when this host shuts down: a client waiting on the direct route sees the actor end with its
        node as Ray sees it (the call fails with the actor)."""
        self._ended.wait()

    def _workspace(self, sid: str, workspace: Workspace | str | None, source: bytes | None) -> Workspace | None:
        if isinstance(workspace, str):
            return Workspace(workspace)  # a path on this node
        if source is None or workspace is None:
            return workspace
        where = self._tree(source)
        self._sources[sid] = where
        return Workspace(where, target=workspace.target, mode=workspace.mode, exclude=workspace.exclude)

    def _tree(self, source: bytes) -> str:
        """The shipped source unpacked on this node, once per content: the sandboxes (and forks) given the same
        source share it, read-only (an overlay's lower layer; a copy workspace's start and what diff compares
        with; commit on the node is refused without a directory of its own). Removed with its last user."""
        digest = hashlib.sha256(source).hexdigest()
        with self._lock:
            guard = self._unpacking.setdefault(digest, threading.Lock())
        with guard:
            with self._lock:
                tree = self._trees.get(digest)
                if tree is not None:
                    tree[1] += 1
                    return str(tree[0])
            where = tempfile.mkdtemp(prefix=f"source-{digest[:16]}-", dir=_scratch())
            os.chmod(where, 0o755)  # a root caller's program (another uid) reads a copied workspace's source
            try:
                unpack_tree(source, where)
            except BaseException:
                shutil.rmtree(where, ignore_errors=True)
                raise
            with self._lock:
                self._trees[digest] = [where, 1, 0.0]
                self._tree_of[where] = digest
            return where

    def create(self, sid: str, policy: Policy, kwargs: dict[str, Any], workspace: Workspace | str | None,
               source: bytes | None, layer: dict[str, Any] | None = None,
               image_login: tuple[str, str] | None = None) -> Any:
        """Start a sandbox here: its id, or the node's reason it cannot (as a Failure). ``layer``: start from
        that snapshot (taken here, or shipped from another node: see isolate/ray/layers.py); ``image_login``:
        for the pull of the policy's image, when this node lacks it."""
        def start() -> dict[str, Any]:
            _image_here(policy, image_login)
            try:
                shown = self._workspace(sid, workspace, source)
                if layer is None:
                    box = Sandbox(policy, workspace=shown, **kwargs)
                else:
                    snap = self.layers.here(layer, hold=sid if layer.get("hold") else None)
                    box = Sandbox(policy, snapshot=self._shown(snap, sid), **kwargs)
                box.start()
            except BaseException:
                self._drop_source(sid)
                self.layers.release(sid)
                raise
            with self._lock:
                self._boxes[sid] = box
            return {"node_id": self.node_id, "enforced": box.enforced, **self._admit(sid)}
        return _attempt(start)

    def _shown(self, snap: Snapshot, sid: str) -> Snapshot:
        """The snapshot as sandbox ``sid`` sees it: over its own copy of a shipped source (a snapshot shipped from
        another node names that node's copy of the source, and a sandbox here has its own)."""
        where = self._sources.get(sid)
        if where is None or snap.workspace.source == where:
            return snap
        return dataclasses.replace(snap, workspace=dataclasses.replace(snap.workspace, source=where))

    # -- snapshots between nodes (isolate/ray/layers.py) -------------------------------------

    def fork_point(self, sid: str) -> Any:
        """A snapshot of sandbox ``sid`` for its forks to start from, here and on other nodes: removed once the
        last fork started from it here is closed (``settle``)."""
        def run() -> Snapshot:
            box = self._box(sid)
            return self.layers.point(box.snapshot())
        return _attempt(run)

    def settle(self, name: str) -> None:
        """A fork point no fork here holds is removed (its forks on other nodes hold their own copies)."""
        self.layers.settle(name)

    def export_snapshot(self, snapshot: Any) -> Any:
        """A snapshot of this node into the object store, once: its digest and [its ref]."""
        return _attempt(lambda: self.layers.export(snapshot))

    def layers_received(self) -> int:
        """How many snapshot bundles this node fetched and unpacked (each digest once)."""
        return self.layers.received

    def restore_from(self, sid: str, layer: dict[str, Any], ahead: bool = False) -> Any:
        """Restore sandbox ``sid`` to a snapshot taken here or shipped from another node (``ahead``: see
        ``isolate.Sandbox.restore``)."""
        def run() -> None:
            box = self._box(sid)
            box.restore(self._shown(self.layers.here(layer, hold=None), sid), ahead=ahead is True)
        return _attempt(run)

    def merge(self, sid: str, branches: list[tuple[str, Any]], base: dict[str, Any] | None, policy: Policy | None,
              kwargs: dict[str, Any], workspace: Workspace | str | None, source: bytes | None,
              options: dict[str, Any]) -> Any:
        """``isolate.merge`` here of branches of this node (("sandbox", sid)) and snapshots taken here or shipped
        here (("layer", layer)); the merged sandbox is ``sid`` (with ``options["start"]``)."""
        def run() -> dict[str, Any]:
            from ..kept.merge import merge
            from ..kept.snapshots import take

            temporary: list[Snapshot] = []
            try:
                shown = self._workspace(sid, workspace, source)
                items: list[Any] = []
                for kind, value in branches:
                    if kind == "sandbox":
                        box = self._box(value)
                        snap = take(box, None, box.origin, areas=False, temporary=True)
                        temporary.append(snap)
                    else:
                        snap = self.layers.here(value, hold=None)
                    items.append(self._shown(snap, sid) if shown is not None else snap)
                start_base = None if base is None else self._shown(self.layers.here(base, hold=None), sid)
                result = merge(items, start_base, policy=policy, on_conflict=options["on_conflict"],
                               name=options["name"], start=False)
                assert result.snapshot is not None
                out: dict[str, Any] = {"node_id": self.node_id, "merged": result.merged,
                                       "conflicts": result.conflicts, "snapshot": result.snapshot}
                if options["start"]:
                    box = Sandbox(policy or Policy(), snapshot=result.snapshot, **kwargs).start()
                    with self._lock:
                        self._boxes[sid] = box
                    out["enforced"] = box.enforced
                    out.update(self._admit(sid))
                else:
                    self._drop_source(sid)
                return out
            except BaseException:
                self._drop_source(sid)
                raise
            finally:
                for snap in temporary:
                    snap.remove()
        return _attempt(run)

    def create_many(self, sids: list[str], policy: Policy, kwargs: dict[str, Any]) -> Any:
        """Start len(sids) sandboxes here side by side (no workspace source: each starts empty or from a node
        path)."""
        def start() -> dict[str, Any]:
            _image_here(policy)
            boxes = Sandbox.create_many(len(sids), policy, **kwargs)
            with self._lock:
                self._boxes.update(zip(sids, boxes, strict=True))
            admitted = {sid: self._admit(sid) for sid in sids}
            return {"node_id": self.node_id, "admitted": admitted}
        return _attempt(start)

    def _box(self, sid: str) -> Sandbox:
        with self._lock:
            box = self._boxes.get(sid)
        if box is None:
            raise IsolationError(f"sandbox {sid}: not on node {self.node_id} (closed, or never started here)")
        return box

    def call(self, sid: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = self._call(sid, method, args, kwargs)
        if method == "read_file" and isinstance(result, (bytes, str)) and len(result) > LARGE:
            return ray.put(result)  # the caller fetches it from the object store
        return result

    def _call(self, sid: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in CALLS:
            return Failure(PolicyError(f"{method}: not a Sandbox method this host runs", "method"))

        def run() -> Any:
            box = self._box(sid)
            # Large contents come as refs to the object store (write_file's data, exec's input).
            resolved = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
            named = {k: ray.get(v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()}
            if method == "processes_summary":
                return [{"pid": p.pid, "name": p.name(), "cmdline": p.cmdline()} for p in box.processes()]
            if method == "enforced_report":
                return box.enforced
            if method == "state":
                return box._impl.state()
            if method == "usage":
                return _usage(box)
            if method == "commit" and (not resolved or resolved[0] is None) and box.workspace.source in self._tree_of:
                raise PolicyError("commit(on_node=True): the workspace's source was shipped from the caller's "
                                  "machine (commit() writes there); give a directory of the node", "target_dir")
            return getattr(box, method)(*resolved, **named)
        return _attempt(run)

    def fork(self, sid: str, sids: list[str]) -> Any:
        """Fork the sandbox ``sid`` here into len(sids) new ones (its files as they are now)."""
        def run() -> dict[str, Any]:
            forks = self._box(sid).fork(len(sids))
            with self._lock:
                self._boxes.update(zip(sids, forks, strict=True))
            return {"node_id": self.node_id, "admitted": {fork: self._admit(fork) for fork in sids}}
        return _attempt(run)

    def remove_snapshot(self, snapshot: Any) -> Any:
        """Remove a snapshot taken on this node, or its copy shipped here (isolate.Snapshot.remove, here)."""
        return _attempt(lambda: self.layers.remove(snapshot))

    def commit_out(self, sid: str) -> Any:
        """The workspace as a tar, for a commit on the caller's machine: commit() into an empty directory
        here (links out of the tree, devices and set-id bits refused as always), then packed."""
        def run() -> Any:
            box = self._box(sid)
            where = tempfile.mkdtemp(prefix=f"commit-{sid}-", dir=_scratch())
            try:
                refused = box.commit(where).refused
                data = pack_tree(where, limit=MAX_PACKED)
            finally:
                shutil.rmtree(where, ignore_errors=True)
            return {"tar": ray.put(data) if len(data) > LARGE else data, "refused": refused}
        return _attempt(run)

    def close(self, sid: str) -> None:
        if self._direct is not None:
            self._direct.retire(sid)
        with self._lock:
            box = self._boxes.pop(sid, None)
            doomed = [key for key in self._processes if key.startswith(sid + "/")]
            processes = [self._processes.pop(key) for key in doomed]
            contexts = [self._contexts.pop(key) for key, c in list(self._contexts.items()) if c.sid == sid]
        for context in contexts:
            context.context.close()
        for process in processes:
            process.close()
        if box is not None:
            box.close()
        self._drop_source(sid)
        self.layers.release(sid)

    def _drop_source(self, sid: str) -> None:
        """Sandbox or pool ``sid`` no longer uses its shipped source: a source no one uses is kept a while (the
        next sandbox or fork given it starts without unpacking it), the least recently used past KEEP_IDLE go."""
        doomed: list[str] = []
        with self._lock:
            where = self._sources.pop(sid, None)
            digest = self._tree_of.get(where) if where is not None else None
            tree = self._trees.get(digest) if digest is not None else None
            if tree is not None:
                tree[1] -= 1
                if tree[1] <= 0:
                    tree[2] = time.monotonic()
                    idle = sorted((t[2], d) for d, t in self._trees.items() if t[1] <= 0)
                    for _, old in idle[:max(0, len(idle) - KEEP_IDLE)]:
                        doomed.append(self._trees.pop(old)[0])
                        del self._tree_of[doomed[-1]]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    def _drop_trees(self) -> None:
        with self._lock:
            doomed = [t[0] for t in self._trees.values()]
            self._trees.clear()
            self._tree_of.clear()
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    # -- shells and interpreters ----------------------------------------------------------

    def session(self, sid: str, kind: str, name: str, method: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        if method not in SESSION_CALLS.get(kind, ()):
            return Failure(PolicyError(f"{kind}.{method}: not a session method this host runs", "method"))

        def run() -> Any:
            box = self._box(sid)
            session: Any = box.shell(name, **kwargs.pop("open", {})) if kind == "shell" else \
                box.python(name, **kwargs.pop("open", {}))
            attribute = getattr(session, method)
            return attribute(*args, **kwargs) if callable(attribute) else attribute
        return _attempt(run)

    # -- code contexts (the server's /code of a sandbox here: serve --ray) ----------------------------------

    def context_open(self, sid: str, context_id: str, language: str) -> Any:
        """A code context (isolate/server/code) of sandbox ``sid``, its interpreter driven from here: its
        descriptors (a socket pair, the driver's stdout and stderr) are this machine's."""
        def run() -> str:
            if hooks.code_context is None:  # pragma: no cover - the package sets it on import
                raise IsolationError("code contexts: isolate.model.hooks.code_context is not set")
            context = _Context(sid, hooks.code_context(self._box(sid), language, context_id))
            with self._lock:
                self._contexts[context_id] = context
            return context_id
        return _attempt(run)

    def _context(self, context_id: str) -> _Context:
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise IsolationError(f"context {context_id}: closed")
        return context

    def context_run(self, context_id: str, code: str) -> Any:
        """Start one cell; its events come from ``context_events``."""
        return _attempt(lambda: self._context(context_id).start(code))

    def context_events(self, context_id: str, timeout: float) -> Any:
        """The running cell's events so far ([kind, value], ending with ["done", answer]), after waiting up to
        ``timeout`` seconds for the first."""
        return _attempt(lambda: self._context(context_id).events(timeout))

    def context_interrupt(self, context_id: str) -> Any:
        return _attempt(lambda: self._context(context_id).context.interrupt())

    def context_close(self, context_id: str) -> None:
        with self._lock:
            context = self._contexts.pop(context_id, None)
        if context is not None:
            context.context.close()

    # -- spawned commands -----------------------------------------------------------------

    def spawn(self, sid: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def run() -> dict[str, Any]:
            process = self._box(sid).spawn(*args, **kwargs)
            key = f"{sid}/{uuid.uuid4().hex}"
            with self._lock:
                self._processes[key] = process
            return {"key": key, "pid": process.pid, "args": process.args}
        return _attempt(run)

    def _process(self, key: str) -> SandboxProcess:
        with self._lock:
            process = self._processes.get(key)
        if process is None:
            raise IsolationError("the process was closed")
        return process

    def read(self, key: str, stream: str, size: int, timeout: float) -> Any:
        """Up to ``size`` bytes of the process's stdout or stderr: b"" at its end, None if nothing came within
        ``timeout`` seconds (the caller asks again)."""
        def run() -> bytes | None:
            process = self._process(key)
            fd = process.stdout_fd if stream == "stdout" else process.stderr_fd
            if fd < 0:
                return b""
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            try:
                return os.read(fd, size)
            except OSError:  # EIO: a terminal's last user is gone
                return b""
        return _attempt(run)

    def process(self, key: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in PROCESS_CALLS:
            return Failure(PolicyError(f"{method}: not a process method this host runs", "method"))

        def run() -> Any:
            attribute = getattr(self._process(key), method)
            return attribute(*args, **kwargs) if callable(attribute) else attribute
        return _attempt(run)

    def release(self, key: str) -> None:
        with self._lock:
            process = self._processes.pop(key, None)
        if process is not None:
            process.close()

    # -- this node's warm pools -------------------------------------------------------------

    def pool_open(self, pool_id: str, policy: Policy, size: int, kwargs: dict[str, Any],
                  workspace: Workspace | str | None, source: bytes | None) -> Any:
        def run() -> dict[str, Any]:
            _image_here(policy)
            try:
                pool = SandboxPool(policy, size=size, workspace=self._workspace(pool_id, workspace, source),
                                   **kwargs)
            except BaseException:
                self._drop_source(pool_id)
                raise
            with self._lock:
                self._pools[pool_id] = pool
            return {"node_id": self.node_id}
        return _attempt(run)

    def pool_acquire(self, pool_id: str, sid: str, timeout: float | None) -> Any:
        def run() -> dict[str, Any]:
            with self._lock:
                pool = self._pools.get(pool_id)
            if pool is None:
                raise IsolationError(f"pool {pool_id}: not on node {self.node_id}")
            box = pool.acquire(timeout)
            with self._lock:
                self._boxes[sid] = box
            return {"node_id": self.node_id, **self._admit(sid)}
        return _attempt(run)

    def pool_stats(self, pool_id: str) -> dict[str, int]:
        with self._lock:
            pool = self._pools.get(pool_id)
        return pool.stats if pool is not None else {"warm": 0, "in_use": 0, "starting": 0}

    def pool_close(self, pool_id: str) -> None:
        with self._lock:
            pool = self._pools.pop(pool_id, None)
        if pool is not None:
            pool.close()
        self._drop_source(pool_id)

    def pool_resize(self, pool_id: str, size: int) -> Any:
        with self._lock:
            pool = self._pools.get(pool_id)
        return _attempt(lambda: pool.resize(size)) if pool is not None else None

    def shutdown(self) -> None:
        """End every sandbox and pool of this host (the client's last word before it lets the actor go)."""
        with self._lock:
            sids, pools = list(self._boxes), list(self._pools)
        for sid in sids:
            self.close(sid)
        for pool_id in pools:
            self.pool_close(pool_id)
        self.layers.close()
        self._drop_trees()
        self.unlisten()
        self._ended.set()

    def unlisten(self) -> None:
        """Close the direct route's port and its connections (its clients call through this actor from now)."""
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()
            self.direct_refused = "the host stopped listening"

