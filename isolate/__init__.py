"""isolate: kernel-level process isolation for Python.

    import isolate
    result = isolate.run(["python3", "job.py"], policy=isolate.Policy(), capture_output=True)
    result.returncode, result.stdout, result.report
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .model import hooks as _hooks
from .model import policy as _policy
from .model.errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    IsolationError,
    PolicyError,
    SandboxEndedError,
    SandboxLostError,
    SetupError,
    UnsupportedError,
)
from .model.policy import Egress, Limits, Mount, Policy
from .model.report import Report
from .model.workspace import Workspace

if TYPE_CHECKING:  # loaded lazily at run time: the policy model does not need the C core
    from .agents import wrap
    from .backends.native.popen import Popen
    from .image import Image
    from .kept.merge import MergeConflictError, MergeResult, merge
    from .kept.pool import SandboxPool
    from .kept.sandbox import AsyncSandbox, Sandbox
    from .kept.snapshots import Snapshot
    from .oneshot.runs import CompletedProcess, run


def _make_preexec_fn(policy: Policy) -> Callable[[], None]:
    from .oneshot.preexec import make_preexec_fn

    return make_preexec_fn(policy)


# The policy model runs nothing itself: policy.preexec_fn asks this package for the hook.
_policy.PREEXEC_FACTORY = _make_preexec_fn


def _run_build_step(*args: Any) -> Any:
    from .kept.imagebuild import run_step

    return run_step(*args)


# The image layer builds images but runs nothing: a build's RUN step asks this package for the kept layer.
_hooks.run_build_step = _run_build_step


def _merge_on_cluster(*args: Any, **kwargs: Any) -> Any:
    from .ray.merging import merge

    return merge(*args, **kwargs)


# The kept layer does not know Ray: a merge of branches on a cluster asks this package for it.
_hooks.merge_on_cluster = _merge_on_cluster


def _code_context(*args: Any) -> Any:
    from .server.code import CodeContext

    return CodeContext(*args)


# The Ray layer runs a node's sandboxes, not the server: serve --ray's code contexts on a node ask this package.
_hooks.code_context = _code_context

__all__ = [
    "AsyncSandbox",
    "CommandNotExecutableError",
    "CommandNotFoundError",
    "CompletedProcess",
    "Egress",
    "Image",
    "IsolationError",
    "Limits",
    "MergeConflictError",
    "MergeResult",
    "Mount",
    "Policy",
    "PolicyError",
    "Popen",
    "Report",
    "Sandbox",
    "SandboxEndedError",
    "SandboxLostError",
    "SandboxPool",
    "SetupError",
    "Snapshot",
    "UnsupportedError",
    "Workspace",
    "__version__",
    "merge",
    "run",
    "wrap",
]


def __getattr__(name: str) -> object:
    # The spawning half loads the C core; the policy model does not need it.
    if name in ("run", "Popen", "CompletedProcess"):
        from .oneshot import runs as popen

        return getattr(popen, name)
    if name in ("Sandbox", "AsyncSandbox"):
        from .kept import sandbox

        return getattr(sandbox, name)
    if name == "SandboxPool":
        from .kept.pool import SandboxPool

        return SandboxPool
    if name == "Snapshot":
        from .kept.snapshots import Snapshot

        return Snapshot
    if name in ("merge", "MergeResult", "MergeConflictError"):
        from .kept import merge

        return getattr(merge, name)
    if name == "wrap":
        from .agents import wrap

        return wrap
    if name == "Image":
        from .image import Image

        return Image
    raise AttributeError(f"module 'isolate' has no attribute {name!r}")
