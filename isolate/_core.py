"""The compiled C core (csrc/, built by cffi) and the init binary beside it."""

from __future__ import annotations

import os
import threading
from typing import Any

from .model.errors import UnsupportedError
from .model.forks import fork_safe

try:
    from ._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        f"isolate's C core is not built ({exc}); reinstall with: pip install --force-reinstall isolate "
        "(it needs gcc and the Python headers: apt-get install gcc python3-dev)"
    ) from None

INIT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isolate-init")

__all__ = ["INIT_PATH", "ffi", "init_fd", "lib", "step_name"]


_INIT_FD: list[int] = []
_INIT_FD_LOCK = fork_safe(threading.Lock())


def init_fd() -> int:
    """An O_PATH descriptor of the init binary, opened once per process.

    The sandbox execs it with execveat(fd), so it need not be visible inside
    the sandbox's root. Opened under a lock: threads that start their first
    sandboxes together (``create_many``) must share one descriptor, not each
    open its own (lru_cache would let them), since a plan made by one names
    the descriptor the other's child keeps.
    """
    with _INIT_FD_LOCK:
        if not _INIT_FD:
            try:
                _INIT_FD.append(os.open(INIT_PATH, os.O_PATH | os.O_CLOEXEC))
            except OSError as exc:
                raise UnsupportedError(
                    f"isolate's init binary is missing ({INIT_PATH}: {exc.strerror}); reinstall isolate"
                ) from None
        return _INIT_FD[0]


def step_name(step: int) -> str:
    """'mount-bind' for ISO_STEP_MOUNT_BIND, and so on."""
    name: Any = ffi.string(ffi.cast("enum iso_step", step))
    if isinstance(name, str) and name.startswith("ISO_STEP_"):
        return name[len("ISO_STEP_") :].lower().replace("_", "-")
    return f"step {step}"
