"""The native backend: the C core applies a plan made here, in the parent.

One-shot runs (``isolate.oneshot.runs``, ``isolate.oneshot.preexec``): ``plan`` caches the
static part of a plan, built by ``static`` from ``writes`` (a root caller's
writable paths, idmapped mounts), ``environment`` (the program's environment,
PATH and home), ``filters`` (seccomp), ``limits`` (cgroups, rlimits) and
``observe`` (what the report can say of denials); ``common`` holds what they
share. ``prepare`` adds what is each run's own, ``spawn`` starts it.

Kept sandboxes: an exec server inside one set of namespaces. ``kept`` starts
and ends a sandbox, ``protocol`` speaks to its exec server
(csrc/execserver.c), ``commands`` runs commands and ``files`` performs file
operations through it. They are imported by their users, never here (``kept``
imports ``isolate.oneshot.runs``, which imports this package).
"""

from __future__ import annotations

from ..._core import ffi  # (tests read plans with it)
from ...kernel.hostinfo import userns_error
from .common import NOBODY
from .environment import DEFAULT_PATH, reduced_path, which
from .imageroot import image_refusal
from .observe import audit_state
from .plan import _STATIC_CACHE, Prepared, prepare, spawn, unsupported_reasons
from .writes import _idmap_problem, _idmap_userns

__all__ = [
    "DEFAULT_PATH",
    "NOBODY",
    "_STATIC_CACHE",
    "Prepared",
    "_idmap_problem",
    "_idmap_userns",
    "audit_state",
    "ffi",
    "image_refusal",
    "prepare",
    "reduced_path",
    "spawn",
    "unsupported_reasons",
    "userns_error",
    "which",
]
