"""isolate: kernel-level process isolation for Python.

    import isolate
    result = isolate.run(["python3", "job.py"], policy=isolate.Policy(), capture_output=True)
    result.returncode, result.stdout, result.report
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__
from .errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    IsolationError,
    PolicyError,
    SetupError,
    UnsupportedError,
)
from .policy import Egress, Limits, Policy
from .report import Report

if TYPE_CHECKING:  # loaded lazily at run time: the policy model does not need the C core
    from .popen import CompletedProcess, Popen, run
    from .sandbox import Sandbox

__all__ = [
    "CommandNotExecutableError",
    "CommandNotFoundError",
    "CompletedProcess",
    "Egress",
    "IsolationError",
    "Limits",
    "Policy",
    "PolicyError",
    "Popen",
    "Report",
    "Sandbox",
    "SetupError",
    "UnsupportedError",
    "__version__",
    "run",
]


def __getattr__(name: str) -> object:
    # The spawning half loads the C core; the policy model does not need it.
    if name in ("run", "Popen", "CompletedProcess"):
        from . import popen

        return getattr(popen, name)
    if name == "Sandbox":
        from .sandbox import Sandbox

        return Sandbox
    raise AttributeError(f"module 'isolate' has no attribute {name!r}")
