"""The native backend: the C core applies a plan made here, in the parent.

One-shot runs: ``plan`` turns a policy into a ``struct iso_plan`` (``prepare``)
and starts it (``spawn``); ``isolate.popen`` and ``isolate.preexec`` drive it.

Kept sandboxes: an exec server inside one set of namespaces. ``kept`` starts
and ends a sandbox, ``protocol`` speaks to its exec server
(csrc/execserver.c), ``commands`` runs commands and ``files`` performs file
operations through it. They are imported by their users, never here (``kept``
imports ``isolate.popen``, which imports this package).
"""

from __future__ import annotations

from ..._core import ffi  # (tests read plans with it)
from .plan import (
    _STATIC_CACHE,
    DEFAULT_PATH,
    NOBODY,
    Prepared,
    _idmap_problem,
    _idmap_userns,
    audit_state,
    prepare,
    reduced_path,
    spawn,
    unsupported_reasons,
    userns_error,
    which,
)

__all__ = [
    "DEFAULT_PATH",
    "NOBODY",
    "_STATIC_CACHE",
    "Prepared",
    "_idmap_problem",
    "_idmap_userns",
    "audit_state",
    "ffi",
    "prepare",
    "reduced_path",
    "spawn",
    "unsupported_reasons",
    "userns_error",
    "which",
]
