"""The egress mediator: isolate's DNS server, HTTP proxy and transparent relay for ``network=Egress(...)``.

The sandbox's side (listening sockets inside its network namespace, the
address plan) is described in :mod:`isolate.model.egress_rules`; this package is
the host's side, in pure Python. ``Mediator`` runs in the host process's
threads; ``python -m isolate.egress`` runs one as a process of its own (for
kept sandboxes).
"""

from __future__ import annotations

import json
from typing import Any

from ..model.egress_rules import EgressRules, HostRule, parse_address, parse_host_rule
from ..model.errors import PolicyError
from .mediator import Mediator

__all__ = ["Mediator", "rules_from_json", "rules_to_json"]


def rules_to_json(rules: EgressRules) -> str:
    """The rules as JSON, for ``python -m isolate.egress --rules-fd``."""
    data: dict[str, Any] = {
        "rules": [[rule.pattern, list(rule.ports)] for rule in rules.rules],
        "static_hosts": [list(pair) for pair in rules.static_hosts],
        "resolver": list(rules.resolver) if rules.resolver else None,
        "allow_private": rules.allow_private,
    }
    return json.dumps(data)


def rules_from_json(text: str) -> EgressRules:
    """The inverse of rules_to_json; every field checked again (PolicyError)."""
    try:
        data = json.loads(text)
        rules = []
        for pattern, ports in data["rules"]:
            parsed = parse_host_rule(pattern if len(ports) != 1 else f"{pattern}:{ports[0]}")
            if not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
                raise PolicyError(f"egress rules: bad ports {ports!r}", "network")
            rules.append(HostRule(parsed.pattern, tuple(ports)))
        static = tuple((parse_host_rule(name).pattern, parse_address(address, "add_hosts"))
                       for name, address in data["static_hosts"])
        resolver = data["resolver"]
        if resolver is not None:
            address, port = resolver
            if not isinstance(port, int) or not 0 < port < 65536:
                raise PolicyError(f"egress rules: bad resolver port {port!r}", "network")
            resolver = (parse_address(address, "resolver"), port)
        allow_private = data["allow_private"]
        if not isinstance(allow_private, bool):
            raise PolicyError("egress rules: allow_private must be a boolean", "network")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PolicyError):
            raise
        raise PolicyError(f"egress rules: not the JSON rules_to_json writes ({exc})", "network") from None
    return EgressRules(tuple(rules), static, resolver, allow_private)
