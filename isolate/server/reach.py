"""What the server reads of a native kept sandbox beyond ``Sandbox``'s public methods: its cgroup
(for metrics) and its egress mediator (for a runtime change of its allow-list).

Both belong to the sandbox's server process as the native backend started
it; ``Sandbox`` has no public accessor for them yet, so they are looked up
here, in one place, and None stands for "this sandbox has none" (another
backend, no limits, no allow-list).
"""

from __future__ import annotations

from typing import Any

from ..kept.sandbox import Sandbox


def _prepared(box: Sandbox) -> Any:
    process = getattr(getattr(box, "_impl", None), "process", None)
    return getattr(process, "_prepared", None)


def run_cgroup(box: Sandbox) -> Any:
    """The sandbox's own cgroup (isolate.kernel.cgroup.RunCgroup), or None."""
    return getattr(_prepared(box), "cgroup", None)


def mediator(box: Sandbox) -> Any:
    """The sandbox's egress mediator (isolate.egress.Mediator, in this process), or None."""
    return getattr(_prepared(box), "mediator", None)
