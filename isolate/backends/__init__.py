"""Backends that run a sandboxed program.

``isolate.backends.docker`` runs it in a Docker container through the Engine
API. Backends are imported lazily by their users: importing this package costs
nothing and does not import the Docker SDK.
"""

from __future__ import annotations

#: The backends a policy may name besides "auto".
NAMES: tuple[str, ...] = ("native", "docker")
