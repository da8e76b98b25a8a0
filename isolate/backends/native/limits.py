"""Limits over the process tree: which cgroup controllers a policy needs, whether one can be made
here, and the run's own cgroup (with rlimits where there is none, under best effort).
"""

from __future__ import annotations

import resource
from functools import lru_cache
from typing import Any

from ...model.errors import UnsupportedError
from ...model.policy import Policy
from .common import _Refusals


@lru_cache(maxsize=16)
def _cgroup_refusal(needs: frozenset[str]) -> str | None:
    """Why no cgroup with ``needs`` can be made here (None: one can), asked once per process.

    Only the backend choice uses this; each run still creates its own cgroup
    and refuses then if that fails.
    """
    from ...kernel import cgroup

    try:
        cgroup.check_available(set(needs))
    except UnsupportedError as exc:
        return str(exc)
    return None


def _cgroup_needs(policy: Policy) -> set[str]:
    needs = set()
    if policy.limits.memory is not None:
        needs.add("memory")
    if policy.limits.pids is not None:
        needs.add("pids")
    if policy.limits.cpus is not None:
        needs.add("cpu")
    if policy.limits.cpu_seconds is not None:
        needs.add("cpuacct")
    return needs


def _prepare_cgroup(
    policy: Policy,
    needs: set[str],
    plan: Any,
    enforced: dict[str, Any],
    refusals: _Refusals,
    rlimits: list[tuple[int, int, int]],
    for_preexec: bool,
) -> Any:
    limits = policy.limits
    try:
        from ...kernel import cgroup

        run_cgroup = cgroup.RunCgroup.create(limits, need=needs)
    except (ImportError, UnsupportedError) as exc:
        hard = needs - {"cpuacct"}
        if hard:
            refusals.refuse(str(exc) if isinstance(exc, UnsupportedError) else f"cgroups: {exc}")
        memory, pids = limits.value("memory"), limits.value("pids")
        if memory is not None:
            rlimits.append((resource.RLIMIT_AS, int(memory), int(memory)))
            enforced["memory"] = "rlimit-as (per process, best effort)"
        if pids is not None:
            rlimits.append((resource.RLIMIT_NPROC, int(pids), int(pids)))
            enforced["pids"] = "rlimit-nproc (per user, best effort)"
        return None
    if for_preexec:
        # The hook cannot join a cgroup for the process subprocess is about to exec.
        run_cgroup.remove()
        refusals.refuse("memory/pids/cpus limits cover the tree only with isolate.run/Popen, not preexec_fn")
        return None
    fds = run_cgroup.procs_fds()
    for i, fd in enumerate(fds[:8]):
        plan.cgroup_procs_fds[i] = fd
    enforced.update(run_cgroup.enforced())
    return run_cgroup
