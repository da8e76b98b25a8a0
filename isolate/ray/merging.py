"""``isolate.merge`` of sandboxes and snapshots on the nodes of a Ray cluster.

The merge runs on the node of the first branch: a branch on that node is read
there; a sandbox on another node is snapshotted there and the snapshot
shipped (isolate/ray/layers.py: once, by digest, verified on arrival), as is
a snapshot of another node. Forks of one sandbox share their start wherever
they run (the shipped snapshot keeps its capture's id, and a layer keeps the
start it has), so ``merge`` finds their common start on any node. The merged
sandbox is started on that node; the temporary snapshots are removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..kept.merge import MergeResult
from ..model.errors import PolicyError
from ..model.policy import Policy
from .placement import outcome
from .sandbox import RemoteSnapshot, Sandbox


def merge(branches: Sequence[Sandbox | RemoteSnapshot], base: RemoteSnapshot | None = None, *,
          policy: Policy | None = None, on_conflict: str = "markers", name: str | None = None,
          start: bool = True) -> MergeResult:
    """``isolate.merge`` (the same arguments and result) of branches on any nodes (see the module's docstring).

    ``result.sandbox`` is an ``isolate.ray.Sandbox``, ``result.snapshot`` a ``RemoteSnapshot`` of its node.
    """
    if on_conflict not in ("markers", "refuse"):
        raise PolicyError(f"on_conflict: {on_conflict!r} is not 'markers' or 'refuse'", "on_conflict")
    items = list(branches)
    if len(items) < 2:
        raise PolicyError("merge: give at least two branches", "branches")
    for item in items:
        if not isinstance(item, (Sandbox, RemoteSnapshot)):
            raise TypeError("merge: on a Ray cluster, a branch is an isolate.ray.Sandbox or a snapshot of one "
                            f"(sb.snapshot()), not {type(item).__name__}")
    if base is not None and not isinstance(base, RemoteSnapshot):
        raise TypeError("merge: on a Ray cluster, base is a snapshot of an isolate.ray.Sandbox (sb.snapshot())")
    node = items[0].node_id
    if node is None:
        raise PolicyError("merge: the first branch is not running; start() it first", "branches")
    first = next((x for x in items if isinstance(x, Sandbox)), None)
    template = first if first is not None else items[0]
    assert isinstance(template, (Sandbox, RemoteSnapshot))
    workspace, source, caller_source = (template.workspace, template._source, template._caller_source) \
        if isinstance(template, Sandbox) else template._workspace
    chosen = policy or template.policy
    result_box = Sandbox(chosen, **template._kwargs)
    result_box.workspace, result_box._source, result_box._caller_source = workspace, source, caller_source
    temporary: list[RemoteSnapshot] = []
    try:
        plan: list[tuple[str, Any]] = []
        for item in items:
            if isinstance(item, Sandbox) and item.node_id == node:
                plan.append(("sandbox", item.id))
                continue
            snap = item.snapshot() if isinstance(item, Sandbox) else item
            if snap is not item:
                temporary.append(snap)
            plan.append(("layer", snap.layer_for(node)))
        start_base = base.layer_for(node) if base is not None else None
        hosts = result_box._hosts = (first or template)._hosts
        assert hosts is not None
        actor = hosts.actor(node)
        info = outcome(actor.merge.remote(result_box.id, plan, start_base, chosen, dict(result_box._kwargs),
                                          workspace, source, {"on_conflict": on_conflict, "name": name,
                                                              "start": start}), node, "merge")
    finally:
        for snap in temporary:
            try:
                snap.remove()
            except Exception:  # its node is gone: nothing of it is left to remove
                pass
    result = MergeResult(merged=list(info["merged"]), conflicts=list(info["conflicts"]))
    if start:
        result_box._bind(hosts, node, info)
        result.sandbox = result_box  # type: ignore[assignment]
    made = RemoteSnapshot(result_box, info["snapshot"])
    made.node_id = node
    result.snapshot = made  # type: ignore[assignment]
    return result
