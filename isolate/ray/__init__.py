"""isolate on a Ray cluster: the same sandboxes, placed on the cluster's nodes (extra ``isolate[ray]``).

    import isolate.ray
    sb = isolate.ray.Sandbox(policy).start()       # every isolate.Sandbox method, remotely
    sb.node_id
    pool = isolate.ray.SandboxPool(policy, size=64)
    boxes = isolate.ray.Sandbox.create_many(500, policy)

``host`` (the actor each node runs for this client: its sandboxes and warm
pools, native isolate sandboxes confined exactly as locally), ``placement``
(which node: eligibility, spread, refusals with every node's reason, a lost
node as ``isolate.SandboxLostError``), ``sandbox`` (the caller's side of one
sandbox), ``pool`` (warm pools spread over the nodes), ``layers`` (snapshots
moving between nodes by digest) and ``merging`` (``isolate.merge`` across
nodes).

Connects to the cluster Ray is told of (``ray.init`` before, or
``RAY_ADDRESS``). May import: the kept sandbox and everything it does.
"""

from __future__ import annotations

from .placement import Hosts
from .pool import SandboxPool
from .sandbox import RemoteProcess, RemoteSnapshot, Sandbox

__all__ = ["RemoteProcess", "RemoteSnapshot", "Sandbox", "SandboxPool", "connect", "shutdown"]


def connect(address: str) -> int:
    """Join the Ray cluster at ``address`` (its head's HOST:PORT, or "auto"); how many nodes are alive."""
    import logging

    import ray

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def shutdown() -> None:
    """End every sandbox and pool this client holds on the cluster, and its host actors."""
    if Hosts._instance is not None:
        Hosts._instance.shutdown()
