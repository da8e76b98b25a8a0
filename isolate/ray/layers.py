"""Snapshots between the nodes of a cluster: each node's host actor holds its snapshots by digest.

A snapshot taken on one node starts, restores or merges sandboxes on another
by moving as one bundle (``isolate/kept/bundles.py``: its layer or tree, the
start merge needs, its tmpfs archive; named by the sha256 of its bytes):

- the node that holds it packs it once and puts it in Ray's object store
  (``ray.put`` by that node's actor, which owns the object); the caller hands
  the reference, never the bytes, to the nodes that need it;
- a node fetches it from the object store the first time one of its sandboxes
  needs it, checks its digest, unpacks it as hostile input and keeps it as a
  local snapshot: a second sandbox of that node (or a second fork) uses the
  copy it has, keyed by digest (``received`` counts what came);
- when the node holding it dies before the bytes arrived, the fetch raises
  ``SandboxLostError`` naming that node, and the receiving node keeps nothing
  of it (a bundle is kept whole or not at all).

Fork points (the snapshot ``fork(n)`` takes to start its forks from) are held
by the forks of each node and removed there once its last fork is closed;
every copy this host made is removed with it (``close``).
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from ..kept import bundles
from ..kept.snapshots import Snapshot
from ..model.errors import IsolationError, SandboxLostError

#: What a fetch from another node's object store meets when that node (the object's owner) is gone.
_GONE = (ray.exceptions.ObjectLostError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
         ray.exceptions.NodeDiedError)


class Layers:
    """One node's snapshots by digest (see the module's docstring)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._lock = threading.Lock()
        self._by_digest: dict[str, Snapshot] = {}
        self._sent: dict[str, tuple[str, Any]] = {}  # snapshot name: (digest, object ref)
        self._fetching: dict[str, threading.Lock] = {}
        self._points: dict[str, tuple[Snapshot, set[str]]] = {}  # fork point name: (snapshot, holders)
        self._received: set[str] = set()  # names of the snapshots made here from bundles
        #: Bundles fetched and unpacked on this node (a digest comes once).
        self.received = 0

    def _local(self, snapshot: Snapshot) -> Snapshot:
        """This node's snapshot of that name, the very capture (its id) the caller names."""
        snap = Snapshot.get(snapshot.name)
        if snap.id != snapshot.id:
            raise IsolationError(f"snapshot {snapshot.name!r}: not the one taken (removed, and another made with "
                                 "its name)")
        return snap

    def point(self, snap: Snapshot) -> Snapshot:
        with self._lock:
            self._points[snap.name] = (snap, set())
        return snap

    def export(self, snapshot: Snapshot) -> dict[str, Any]:
        """The snapshot's bundle in the object store (put once): its digest and [ref] (in a list: Ray hands a
        nested ref on as it is, where it would resolve one given as an argument)."""
        snap = self._local(snapshot)
        with self._lock:
            sent = self._sent.get(snap.name)
        if sent is None:
            data, digest = bundles.export(snap)
            sent = (digest, ray.put(data))
            with self._lock:
                self._sent[snap.name] = sent
                self._by_digest.setdefault(digest, snap)
        return {"digest": sent[0], "ref": [sent[1]], "node": self.node_id}

    def here(self, layer: dict[str, Any], hold: str | None) -> Snapshot:
        """The snapshot ``layer`` names, on this node: its own, or fetched once from the node that holds it.
        ``hold``: a sandbox id that keeps a fork point here until it is closed."""
        snap = self._local(layer["snapshot"]) if layer["node"] == self.node_id else self._fetch(layer)
        if hold is not None:
            with self._lock:
                entry = self._points.get(snap.name)
                if entry is None and snap.name in self._received:
                    entry = self._points[snap.name] = (snap, set())
                if entry is not None:
                    entry[1].add(hold)
        return snap

    def _fetch(self, layer: dict[str, Any]) -> Snapshot:
        digest, source = str(layer["digest"]), str(layer["node"])
        with self._lock:
            guard = self._fetching.setdefault(digest, threading.Lock())
        with guard:  # two sandboxes of this node wanting one snapshot: it comes once
            with self._lock:
                found = self._by_digest.get(digest)
            if found is not None:
                return found
            what = f"snapshot {layer['snapshot'].name!r} ({digest[:19]})"
            try:
                data = ray.get(layer["ref"][0])
            except _GONE as exc:
                raise SandboxLostError(f"{what}: node {source} is gone before it reached node {self.node_id} "
                                       f"({type(exc).__name__}); nothing of it is kept here", source) from None
            if not isinstance(data, bytes):
                raise IsolationError(f"{what}: not a snapshot bundle")
            snap = bundles.load(data, digest)
            with self._lock:
                self._by_digest[digest] = snap
                self._received.add(snap.name)
                self.received += 1
            return snap

    def release(self, sid: str) -> None:
        """Sandbox ``sid`` is closed: a fork point it was the last to hold is removed."""
        with self._lock:
            held = [name for name, (_, holders) in self._points.items() if sid in holders]
            for name in held:
                self._points[name][1].discard(sid)
        for name in held:
            self.settle(name)

    def settle(self, name: str) -> None:
        """Remove the fork point ``name`` if no sandbox here holds it."""
        with self._lock:
            entry = self._points.get(name)
            if entry is None or entry[1]:
                return
            del self._points[name]
        self._drop(entry[0])

    def remove(self, snapshot: Snapshot) -> None:
        """Remove a snapshot of this node (taken here, or its copy shipped here)."""
        with self._lock:
            copy = next((s for s in self._by_digest.values() if s.id == snapshot.id), None)
        if copy is not None and copy.name in self._received:
            self._drop(copy)
            return
        self._drop(self._local(snapshot))

    def _drop(self, snap: Snapshot) -> None:
        with self._lock:
            self._sent.pop(snap.name, None)
            for digest in [d for d, s in self._by_digest.items() if s.name == snap.name]:
                del self._by_digest[digest]
            self._received.discard(snap.name)
            self._points.pop(snap.name, None)
        snap.remove()

    def close(self) -> None:
        """Remove the fork points and the copies shipped here (the snapshots the caller took stay theirs)."""
        with self._lock:
            doomed = {s.name: s for s in self._by_digest.values() if s.name in self._received}
            doomed.update({name: snap for name, (snap, _) in self._points.items()})
        for snap in doomed.values():
            try:
                self._drop(snap)
            except (OSError, IsolationError):
                pass
