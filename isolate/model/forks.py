"""The package's module-level locks, free again in a forked child.

A child forked while another thread of its parent held one of them (a
program that plans or starts sandboxes from threads, and forks: a
pre-forking server, multiprocessing's fork method) inherits it held, by a
thread it does not have: its first run waited on it for ever (135 children
of 200 here, three threads planning while the fourth forked). Each such lock
is registered here when its module is imported, and reinitialised in the
child before anything of the child runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

_L = TypeVar("_L")
_LOCKS: list[Any] = []
_AFTER: list[Callable[[], None]] = []


def fork_safe(lock: _L) -> _L:
    """``lock`` (a threading Lock, RLock or Condition), made free again in every child forked from now on."""
    _LOCKS.append(lock)
    return lock


def in_child(action: Callable[[], None]) -> None:
    """Run ``action`` in every child forked from now on, once its locks are free (state of threads the child
    does not have)."""
    _AFTER.append(action)


def _after_fork_in_child() -> None:
    for lock in _LOCKS:
        lock._at_fork_reinit()
    for action in _AFTER:
        action()


os.register_at_fork(after_in_child=_after_fork_in_child)
