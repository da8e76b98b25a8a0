"""The egress sidecar's policy (``/policy`` on port 18080): read it, and change a running sandbox's
allow-list through its egress mediator.

A sandbox created with allow rules (``networkPolicy`` ``deny`` with
``allow`` rules: an ``isolate.Egress``) has a mediator that every
connection leaving it goes through (in the server process, or a process of
its own for a kept sandbox, isolate.server.reach); ``PATCH`` (merge:
the request's rules first, the first rule for a target wins, ``deny``
removes the target) and ``DELETE`` (the targets listed) give it another
allow-list at once, and the connections already open to a name the new list
no longer allows are closed. The listeners inside the sandbox were made for
the ports of its allow-list at start: a rule on another port is refused, as
is any change to a sandbox without allow rules (``none``, ``loopback``,
``host``: no mediator to change; create another sandbox instead).
"""

from __future__ import annotations

import threading
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...model import egress_rules
from ...model.errors import PolicyError, SetupError
from ...model.policy import Egress
from ..common import api, json_body
from ..models import EGRESS_PORT, ApiError, bad_request, egress_with
from ..reach import mediator
from ..state import ManagedSandbox
from .access import sandbox_for

_LOCK = threading.Lock()  # one change at a time (read, merge, apply)


def _current(managed: ManagedSandbox) -> Any:
    return managed.egress if managed.egress is not None else managed.box.policy.network


def _rules(managed: ManagedSandbox) -> list[tuple[str, str]]:
    """The policy's rules as (action, target), in order: as changed at run time, else as created."""
    if managed.egress_rules is not None:
        return list(managed.egress_rules)
    return [("allow", host) for host in getattr(managed.box.policy.network, "hosts", ())]


def _status(managed: ManagedSandbox, reason: str = "") -> Response:
    network = _current(managed)
    if isinstance(network, str):
        policy: dict[str, Any] = {"defaultAction": "allow" if network == "host" else "deny", "egress": []}
        mode = network
    else:
        policy = {"defaultAction": "deny", "egress": [{"action": a, "target": t} for a, t in _rules(managed)]}
        mode = "allow-list"
    out: dict[str, Any] = {"status": "ok", "mode": mode, "enforcementMode": "isolate", "policy": policy}
    if reason:
        out["reason"] = reason
    return JSONResponse(out)


def _name(entry: str) -> str:
    """The target an allow-list entry is for: its name without a port."""
    host, sep, port = entry.rpartition(":")
    return host if sep and port.isdigit() else entry


def _apply(managed: ManagedSandbox, rules: list[tuple[str, str]]) -> int:
    """Enforce ``rules`` (defaultAction deny: the allow rules are the allow-list; a deny rule is listed)."""
    if len(rules) > egress_rules.MAX_ENTRIES:
        raise bad_request(f"policy: {len(rules)} rules; at most {egress_rules.MAX_ENTRIES}")
    hosts = [target for action, target in rules if action == "allow"]
    network = _current(managed)
    found = mediator(managed.box)
    if not isinstance(network, Egress) or found is None:
        raise ApiError(400, "POLICY_IMMUTABLE", f"sandbox {managed.id} has network {network!r}, without allow "
                       "rules: it has no egress mediator whose allow-list could change; create a sandbox with "
                       "networkPolicy {\"defaultAction\": \"deny\", \"egress\": [allow rules]} for that")
    if not hosts:
        raise bad_request("the allow-list cannot become empty here (the mediator keeps at least one name); "
                          "remove the sandbox's network by creating another with defaultAction deny")
    try:
        # The static names come from the sandbox's allow-list at start: one removed can come back.
        updated = egress_with(hosts, managed.box.policy.network)
        closed: int = found.update_rules(updated.rules())
    except PolicyError as exc:
        raise bad_request(f"policy: {exc}") from None
    except SetupError as exc:  # a kept sandbox's mediator process that does not answer
        raise ApiError(503, "EGRESS_MEDIATOR_GONE", str(exc)) from None
    managed.egress, managed.egress_rules = updated, list(rules)
    managed.changed()  # recorded: a restarted server says the rules its mediator process enforces
    managed.event(f"egress allow-list now {', '.join(hosts)}" + (f"; {closed} connection(s) to names no longer "
                                                                   "allowed closed" if closed else ""))
    return closed


def _targets(body: object, what: str) -> list[Any]:
    if not isinstance(body, list) or not body:
        raise bad_request(f"the body must be a non-empty list of {what}", "INVALID_REQUEST_BODY")
    return body


@api
async def get_policy(request: Request) -> Response:
    return _status(sandbox_for(request, running=False, port=EGRESS_PORT))


@api
async def patch_policy(request: Request) -> Response:
    managed = sandbox_for(request, running=False, port=EGRESS_PORT)
    rules = _targets(await json_body(request), "rules {\"action\": allow|deny, \"target\": HOST}")
    wanted: dict[str, str] = {}
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or set(rule) != {"action", "target"} or rule["action"] not in ("allow", "deny") \
                or not isinstance(rule["target"], str) or not rule["target"]:
            raise bad_request(f"[{i}]: expected {{\"action\": allow|deny, \"target\": HOST}}", "INVALID_REQUEST_BODY")
        wanted.setdefault(rule["target"], rule["action"])  # the first rule for a target wins

    denied = {target for target, action in wanted.items() if action == "deny"}

    def work() -> int:
        with _LOCK:
            # The request's rules first; an earlier rule for the same target goes, and a deny also takes
            # the allow rules of its name on any port.
            kept = [(a, t) for a, t in _rules(managed) if t not in wanted and not (a == "allow" and _name(t) in denied)]
            return _apply(managed, [(a, t) for t, a in wanted.items()] + kept)

    closed = await run_in_threadpool(work)
    return _status(managed, f"{closed} open connection(s) closed" if closed else "")


@api
async def delete_policy(request: Request) -> Response:
    managed = sandbox_for(request, running=False, port=EGRESS_PORT)
    targets = _targets(await json_body(request), "targets (host names)")
    if not all(isinstance(t, str) for t in targets):
        raise bad_request("the body must be a list of host names", "INVALID_REQUEST_BODY")

    def work() -> int:
        with _LOCK:
            return _apply(managed, [(a, t) for a, t in _rules(managed) if t not in targets and _name(t) not in targets])

    closed = await run_in_threadpool(work)
    return _status(managed, f"{closed} open connection(s) closed" if closed else "")
