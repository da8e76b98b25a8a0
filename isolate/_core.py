"""The compiled C core (csrc/, built by cffi) and the init binary beside it."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from .model.errors import UnsupportedError

try:
    from ._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        f"isolate's C core is not built ({exc}); reinstall with: pip install --force-reinstall isolate "
        "(it needs gcc and the Python headers: apt-get install gcc python3-dev)"
    ) from None

INIT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isolate-init")

__all__ = ["INIT_PATH", "ffi", "init_fd", "lib", "step_name"]


@lru_cache(maxsize=1)
def init_fd() -> int:
    """An O_PATH descriptor of the init binary, opened once per process.

    The sandbox execs it with execveat(fd), so it need not be visible inside
    the sandbox's root.
    """
    try:
        return os.open(INIT_PATH, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsupportedError(
            f"isolate's init binary is missing ({INIT_PATH}: {exc.strerror}); reinstall isolate"
        ) from None


def step_name(step: int) -> str:
    """'mount-bind' for ISO_STEP_MOUNT_BIND, and so on."""
    name: Any = ffi.string(ffi.cast("enum iso_step", step))
    if isinstance(name, str) and name.startswith("ISO_STEP_"):
        return name[len("ISO_STEP_") :].lower().replace("_", "-")
    return f"step {step}"
