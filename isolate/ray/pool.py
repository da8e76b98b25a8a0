"""``isolate.ray.SandboxPool``: warm sandboxes kept on the nodes of a Ray cluster.

    pool = isolate.ray.SandboxPool(policy, size=64)
    with pool.acquire() as sb:        # an isolate.ray.Sandbox, started already on some node
        sb.exec(["pytest", "-q"])

``size`` is spread over the eligible nodes; each node keeps its share warm
with a local ``isolate.SandboxPool`` in its host actor, so an acquire costs
one call to a node and a released sandbox is ended and replaced there, never
handed out again. A node that refuses the policy takes no share; a node that
dies is dropped, and its share moves to the survivors.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from ..model.errors import IsolationError, PolicyError, SandboxLostError
from ..model.policy import Mount, Policy
from ..model.workspace import Workspace
from .host import LARGE
from .placement import Hosts, Placement, outcome
from .sandbox import Sandbox, _check_kwargs, _workspace

__all__ = ["SandboxPool"]


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class SandboxPool:
    """Warm sandboxes over the cluster (see the module's docstring). The arguments are
    ``isolate.SandboxPool``'s and ``isolate.ray.Sandbox``'s placement options; ``max_size``
    bounds each node's share (spread as ``size`` is)."""

    def __init__(self, policy: Policy | None = None, *, size: int, max_size: int | None = None,
                 workspace: Workspace | str | None = None, mounts: Sequence[Mount] = (),
                 node_id: str | None = None, resources: Mapping[str, float] | None = None,
                 labels: Mapping[str, str] | None = None, workspace_on: str = "caller", **kwargs: Any) -> None:
        _check_kwargs(kwargs)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PolicyError(f"size: expected an integer of at least 0, got {size!r}", "size")
        if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int)
                                     or max_size < max(size, 1)):
            raise PolicyError(f"max_size: expected an integer of at least size ({size}), got {max_size!r}",
                              "max_size")
        self.policy = policy if policy is not None else Policy()
        self.size, self.max_size = size, max_size
        self.placement = Placement(node_id, resources, labels)
        self._workspace, source = _workspace(workspace, workspace_on)
        self._source: Any = ray.put(source) if source is not None and len(source) > LARGE else source
        self._kwargs = {"mounts": tuple(mounts), **kwargs}
        self.id = uuid.uuid4().hex[:16]
        self._hosts = Hosts.get()
        self._lock = threading.Lock()
        self._nodes: list[str] = []  # the nodes that keep a share, in the order acquires visit them
        self._next = 0
        self._closed = False
        self._open(self._hosts.candidates(self.placement), size)

    def __repr__(self) -> str:
        return f"isolate.ray.SandboxPool(size={self.size}, nodes={len(self._nodes)})"

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _node_max(self, nodes: int) -> int | None:
        return None if self.max_size is None else math.ceil(self.max_size / nodes)

    def _open(self, nodes: list[str], size: int) -> None:
        """Open the pool on each of ``nodes`` with its share of ``size``; the refusing nodes' shares go to
        those that accepted. Every node refusing raises with each reason."""
        reasons: list[str] = []
        accepted: list[str] = []
        node_max = self._node_max(len(nodes))
        refs = [(node, self._hosts.actor(node).pool_open.remote(
            self.id, self.policy, share, {**self._kwargs, "max_size": node_max}, self._workspace, self._source))
            for node, share in zip(nodes, _shares(size, len(nodes)), strict=True)]
        for node, ref in refs:
            try:
                outcome(ref, node, f"pool {self.id}")
                accepted.append(node)
            except PolicyError:
                self._close_on(accepted)
                raise
            except IsolationError as exc:
                reasons.append(f"node {node}: {exc}")
        if not accepted:
            raise IsolationError(f"pool: no node of the Ray cluster would host it: {'; '.join(reasons)}")
        with self._lock:
            self._nodes = accepted
        if len(accepted) < len(nodes):
            self._rebalance()

    def _rebalance(self) -> None:
        """Give each node that keeps a share its part of ``size`` again (after a node refused or died)."""
        with self._lock:
            nodes = list(self._nodes)
        for node, share in zip(nodes, _shares(self.size, len(nodes)), strict=True):
            try:
                outcome(self._hosts.actor(node).pool_resize.remote(self.id, share), node, f"pool {self.id}")
            except SandboxLostError:
                self._drop(node)

    def _drop(self, node: str) -> None:
        with self._lock:
            if node in self._nodes:
                self._nodes.remove(node)
        self._hosts.forget(node)

    def _close_on(self, nodes: list[str]) -> None:
        for node in nodes:
            try:
                outcome(self._hosts.actor(node).pool_close.remote(self.id), node, f"pool {self.id}")
            except SandboxLostError:
                pass

    @property
    def nodes(self) -> list[str]:
        """The nodes that keep a share of the pool."""
        with self._lock:
            return list(self._nodes)

    @property
    def stats(self) -> dict[str, int]:
        """Warm, handed out and starting, summed over the nodes."""
        total = {"warm": 0, "in_use": 0, "starting": 0}
        for node in self.nodes:
            try:
                counts = outcome(self._hosts.actor(node).pool_stats.remote(self.id), node, "pool stats")
            except SandboxLostError:
                continue
            for key in total:
                total[key] += counts[key]
        return total

    def acquire(self, timeout: float | None = None) -> Sandbox:
        """A started sandbox no one used before, on the next node in turn; a node found dead is dropped,
        its share moved to the others, and the next node asked."""
        while True:
            with self._lock:
                if self._closed:
                    raise IsolationError("the pool is closed")
                if not self._nodes:
                    raise SandboxLostError("pool: every node that kept a share of it is gone")
                node = self._nodes[self._next % len(self._nodes)]
                self._next += 1
            box = Sandbox(self.policy, **self._kwargs)
            # Its workspace as the node has it: a fork of it on another node is given the same source.
            box.workspace, box._source = self._workspace, self._source
            try:
                info = outcome(self._hosts.actor(node).pool_acquire.remote(self.id, box.id, timeout), node,
                               f"pool {self.id}")
            except SandboxLostError:
                self._drop(node)
                self._rebalance()
                continue
            box._bind(self._hosts, node, info)
            return box

    def acquire_many(self, n: int, timeout: float | None = None) -> list[Sandbox]:
        """n sandboxes, taken across the nodes in turn."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PolicyError(f"n: expected an integer of at least 1, got {n!r}", "n")
        taken: list[Sandbox] = []
        try:
            for _ in range(n):
                taken.append(self.acquire(timeout))
        except BaseException:
            for box in taken:
                box.close()
            raise
        return taken

    def close(self) -> None:
        """End the warm sandboxes on every node; those handed out end at their release. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            nodes, self._nodes = list(self._nodes), []
        self._close_on(nodes)
