"""Where sandboxes go: this client's ``SandboxHost`` actors, one per node, and the choice of a node.

The client starts a host actor on a node the first time it places a sandbox
there (pinned to that node, no CPU reserved: a sandbox's limits are the
node's business, not Ray's). The actors belong to this client: when it
exits, Ray ends them and every sandbox they hold.

A node is eligible when it is alive and has what was asked (``node_id``,
custom ``resources``, ``labels``); among the eligible, the one holding the
fewest of this client's sandboxes comes first (spread); a node that already
holds what the sandbox starts from (a snapshot's layers) is counted as
holding ``HOLDER_CREDIT`` fewer, so it wins a tie and one more, but many
sandboxes from one snapshot do not all pile up on its node: past that, the
layers move once to a less used node. A node that refuses
(it cannot enforce the policy, or cannot start sandboxes at all) is skipped
with its reason; when every node refused, the error names each.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..model.errors import IsolationError, PolicyError, SandboxLostError, UnsupportedError
from .channel import ray_uses_tls, tls_context
from .direct import RETRY_AFTER, Failure, Route
from .host import SandboxHost

#: Concurrent calls one host actor serves (each exec waits in a thread of the actor).
HOST_CONCURRENCY = 512
#: Sandboxes a node holding the starting layers may have beyond the least used eligible node and still come
#: first: moving the layers once costs less than sandboxes sharing a node's CPUs for their whole lives.
HOLDER_CREDIT = 1
#: Hosts started together once a placement's first node refused (see ``place``).
HOSTS_AHEAD = 4

_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.NodeDiedError)


class Placement:
    """Where a sandbox may run (see the module's docstring)."""

    def __init__(self, node_id: str | None = None, resources: Mapping[str, float] | None = None,
                 labels: Mapping[str, str] | None = None) -> None:
        if node_id is not None and (not isinstance(node_id, str) or not node_id):
            raise PolicyError(f"node_id: expected a node id (ray.nodes()), got {node_id!r}", "node_id")
        for name, amount in dict(resources or {}).items():
            if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                    or not amount >= 0:
                raise PolicyError(f"resources: {name!r}: expected an amount of 0 or more, got {amount!r}",
                                  "resources")
        self.node_id = node_id
        self.resources = dict(resources or {})
        self.labels = {str(k): str(v) for k, v in dict(labels or {}).items()}

    def admits(self, node: dict[str, Any]) -> bool:
        if not node.get("Alive"):
            return False
        if self.node_id is not None and node["NodeID"] != self.node_id:
            return False
        have = node.get("Resources", {})
        if any(have.get(name, 0) < amount for name, amount in self.resources.items()):
            return False
        labels = node.get("Labels", {})
        return all(labels.get(key) == value for key, value in self.labels.items())


class Hosts:
    """This client's host actors, by node id, and how many sandboxes each holds for it."""

    _instance: Hosts | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._actors: dict[str, Any] = {}
        self.placed: dict[str, int] = {}
        # The direct route to each node (isolate/ray/direct.py): its address, the open route, the call that
        # ends with the node's actor, and when a route that did not open may be tried again (and why).
        self._addresses: dict[str, tuple[str, int]] = {}
        self._tls: dict[str, bool] = {}  # whether the node's host speaks TLS on its route
        self._routes: dict[str, Route] = {}
        self._watches: dict[str, Any] = {}
        self._unreachable: dict[str, tuple[float, str]] = {}
        self._connecting = threading.Lock()

    @classmethod
    def get(cls) -> Hosts:
        with cls._instance_lock:
            if cls._instance is None:
                if not ray.is_initialized():
                    ray.init()  # the cluster at RAY_ADDRESS, or a local one, as Ray does everywhere
                cls._instance = cls()
            return cls._instance

    def actor(self, node_id: str) -> Any:
        with self._lock:
            actor = self._actors.get(node_id)
            if actor is None:
                remote = ray.remote(SandboxHost)
                actor = remote.options(
                    num_cpus=0, max_concurrency=HOST_CONCURRENCY, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
                self._actors[node_id] = actor
            return actor

    def existing(self, node_id: str) -> Any:
        """The host actor of that node, if this client has one (None: never placed there, or the node is lost)."""
        with self._lock:
            return self._actors.get(node_id)

    def forget(self, node_id: str) -> None:
        with self._lock:
            self._actors.pop(node_id, None)
            self.placed.pop(node_id, None)
            self._addresses.pop(node_id, None)
            self._tls.pop(node_id, None)
            self._watches.pop(node_id, None)
            route = self._routes.pop(node_id, None)
        if route is not None:
            route.close()

    # -- the direct route ---------------------------------------------------------------------------

    def learn(self, node_id: str, address: Any, tls: bool = False) -> None:
        """The address of that node's direct route, and whether it speaks TLS, as its host said when it started
        a sandbox."""
        if address is not None:
            with self._lock:
                self._addresses[node_id] = (str(address[0]), int(address[1]))
                self._tls[node_id] = bool(tls)

    def address(self, node_id: str) -> tuple[tuple[str, int], ssl.SSLContext | None] | None:
        """The address of that node's direct route, if its host offers one, and the TLS context a connection of
        its own to it takes (a forwarded port's: ``open_port``); UnsupportedError when Ray's TLS files do not
        load here."""
        with self._lock:
            address = self._addresses.get(node_id)
            tls = self._tls.get(node_id, False) or ray_uses_tls()  # as ``route`` chooses
        if address is None:
            return None
        return address, tls_context(server_side=False) if tls else None

    def route(self, node_id: str) -> Route | str:
        """The open direct route to that node (opened on first use), or why calls go through its actor."""
        with self._lock:
            route = self._routes.get(node_id)
        if route is not None and not route.stale():
            return route
        with self._connecting:
            with self._lock:
                route = self._routes.get(node_id)
                if route is not None and not route.stale():
                    return route
                address = self._addresses.get(node_id)
                # TLS when the node's host speaks it or this client's Ray uses it: never plain bytes under
                # Ray's TLS (a host that listens in the clear then fails the handshake: calls take the actor).
                tls = self._tls.get(node_id, False) or ray_uses_tls()
                refused = self._unreachable.get(node_id)
                actor = self._actors.get(node_id)
            if address is None or actor is None:
                return "the node's host offers no direct route"
            if refused is not None and time.monotonic() < refused[0]:
                return refused[1]
            with self._lock:
                watch = self._watches.get(node_id)
                if watch is None:
                    watch = self._watches[node_id] = actor.watch.remote()

            def ended() -> bool:
                done, _ = ray.wait([watch], timeout=0)
                return bool(done)

            try:
                route = Route(address, ended, tls_context(server_side=False) if tls else None)
            except UnsupportedError as exc:  # Ray's TLS files do not load here
                return str(exc)
            except OSError as exc:
                why = f"{address[0]}:{address[1]} did not open ({type(exc).__name__}: {exc})"
                with self._lock:
                    self._unreachable[node_id] = (time.monotonic() + RETRY_AFTER, why)
                return why
            with self._lock:
                self._unreachable.pop(node_id, None)
                self._routes[node_id] = route
            return route

    def count(self, node_id: str, delta: int) -> None:
        with self._lock:
            self.placed[node_id] = max(0, self.placed.get(node_id, 0) + delta)

    def candidates(self, placement: Placement, prefer: Sequence[str] = ()) -> list[str]:
        """The eligible alive nodes, the first to try first (``rank``); ``prefer``: those that hold what the
        sandbox starts from."""
        nodes = [node for node in ray.nodes() if placement.admits(node)]
        if not nodes:
            wanted = placement.node_id or ", ".join(f"{k}={v}" for k, v in
                                                    {**placement.resources, **placement.labels}.items())
            raise UnsupportedError(f"no alive node of the Ray cluster matches the placement ({wanted or 'any'})")
        with self._lock:
            return rank([node["NodeID"] for node in nodes], self.placed, prefer)

    def shutdown(self) -> None:
        with self._lock:
            actors, self._actors = list(self._actors.values()), {}
            self.placed.clear()
            routes, self._routes = list(self._routes.values()), {}
            self._addresses.clear()
            self._tls.clear()
            self._watches.clear()
            self._unreachable.clear()
        for route in routes:
            route.close()
        refs = [actor.shutdown.remote() for actor in actors]
        try:
            ray.get(refs, timeout=30)
        except Exception:  # a host already gone has ended its sandboxes with it
            pass
        for actor in actors:
            ray.kill(actor)


def rank(nodes: Sequence[str], placed: Mapping[str, int], prefer: Sequence[str] = ()) -> list[str]:
    """``nodes`` in the order to try them: the least used by this client first, a node in ``prefer`` counted
    as holding ``HOLDER_CREDIT`` fewer sandboxes (and first on a tie)."""
    def key(node: str) -> tuple[int, bool]:
        held = placed.get(node, 0) - (HOLDER_CREDIT if node in prefer else 0)
        return held, node not in prefer
    return sorted(nodes, key=key)


def outcome(ref: Any, node_id: str, what: str) -> Any:
    """The result of a host call: raises the node's exception as itself, a lost node as SandboxLostError."""
    try:
        value = ray.get(ref)
    except _LOST as exc:
        raise SandboxLostError(f"{what}: node {node_id} is gone ({type(exc).__name__}); its sandboxes ended "
                               "with it", node_id) from None
    return settle(value, node_id, what)


def settle(value: Any, node_id: str, what: str) -> Any:
    """A host's answer (through Ray or the direct route): its Failure raised as itself, a ref fetched."""
    if isinstance(value, Failure):
        if hasattr(value.error, "add_note"):  # Python 3.11+: say where it was raised
            value.error.add_note(f"(raised on Ray node {node_id})")
        raise value.error
    if isinstance(value, ray.ObjectRef):
        return outcome(value, node_id, what)
    return value


def place(placement: Placement, attempt: Callable[[Any, str], Any], what: str, hosts: Hosts | None = None,
          prefer: Sequence[str] = ()) -> Any:
    """Run ``attempt(actor, node_id)`` (a host call's ref) on the eligible nodes in turn until one accepts.

    Returns (node_id, result). Bad input (PolicyError) fails at once; a refusal or a lost node moves on;
    when every node refused, the error names each node's reason.
    """
    hosts = hosts or Hosts.get()
    reasons: list[tuple[str, BaseException]] = []
    candidates = hosts.candidates(placement, prefer)
    for index, node_id in enumerate(candidates):
        if index == 1:
            # The first node refused: the hosts of the next few start now, together. A host's start is a Ray
            # worker's (seconds on a busy node); started one after another's refusal, a create every node
            # refuses (an image the registry will not give) took the sum of them.
            for later in candidates[1:1 + HOSTS_AHEAD]:
                hosts.actor(later)
        try:
            return node_id, outcome(attempt(hosts.actor(node_id), node_id), node_id, what)
        except PolicyError:
            raise
        except SandboxLostError as exc:
            hosts.forget(node_id)
            reasons.append((node_id, exc))
        except IsolationError as exc:
            reasons.append((node_id, exc))
    every = "; ".join(f"node {node_id}: {exc}" for node_id, exc in reasons)
    # The class every node's refusal shares (an image no node could pull: RegistryError), as a caller catches
    # it on one machine; else UnsupportedError when each is one, else IsolationError.
    kinds = {type(e) for _, e in reasons}
    shared = next(iter(kinds)) if len(kinds) == 1 else None
    kind: type[IsolationError] = IsolationError
    if shared is not None and issubclass(shared, IsolationError) and shared.__init__ is IsolationError.__init__:
        kind = shared
    elif all(isinstance(e, UnsupportedError) for _, e in reasons):
        kind = UnsupportedError
    error = kind(f"{what}: no node of the Ray cluster would host it: {every}")
    error.reasons = reasons  # type: ignore[attr-defined]  # each node's own refusal, as itself
    raise error
