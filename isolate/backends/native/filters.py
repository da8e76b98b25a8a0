"""The seccomp filter of a plan, and the report of how a run without namespaces keeps the host out."""

from __future__ import annotations

from typing import Any

from ..._core import ffi
from ...model.errors import PolicyError, UnsupportedError
from ...model.policy import Policy
from .common import _Refusals


def _apply_seccomp(
    policy: Policy,
    plan: Any,
    keep: list[Any],
    enforced: dict[str, Any],
    refusals: _Refusals,
    deny_sockets: bool,
    deny_setid: bool,
    notify: bool,
    unix_sockets: str = "",
    deny_host_reach: bool = False,
) -> None:
    if policy.seccomp == "none" and not (deny_sockets or deny_setid or unix_sockets or deny_host_reach
                                         or (policy.trace_denials and notify)):
        enforced["seccomp"] = None
        return
    # Compiled in this process (and kept in seccomp's in-memory cache), never
    # read back from disk: any file of the caller's may have been written by
    # an earlier sandbox granted that directory, and a filter loaded from it
    # would be whatever that sandbox wanted.
    try:
        from ...kernel import seccomp

        compiled: Any = seccomp.compile_filter(policy.seccomp, notify=notify, deny_inet_sockets=deny_sockets,
                                               deny_setid=deny_setid, unix_sockets=unix_sockets,
                                               deny_host_reach=deny_host_reach,
                                               trace_paths=policy.trace_denials if notify else False)
    except UnsupportedError as exc:
        if deny_setid:
            raise UnsupportedError(
                f"writable paths need seccomp to forbid set-user-ID files, and it is not available: {exc}; "
                "grant no writable path, or run where seccomp works"
            ) from None
        if unix_sockets:
            # Nothing else keeps the program from the host's unix sockets.
            plan.supervise = ffi.NULL
            enforced["unix_sockets"] = None
            refusals.refuse(f"unix_sockets: keeping the program from host daemons' unix sockets under network "
                            f"none/loopback needs seccomp here, and it is not available: {exc}")
        refusals.refuse(str(exc))
        enforced["seccomp"] = None
        return
    if compiled is None:
        enforced["seccomp"] = None
        return
    if compiled.start_refusal:
        raise PolicyError(compiled.start_refusal, "seccomp")
    buffer = ffi.from_buffer(compiled.bpf)
    keep.extend([compiled, buffer])
    plan.seccomp_filter = buffer
    plan.seccomp_len = len(compiled.bpf) // 8
    plan.seccomp_notify = 1 if notify and (compiled.notify or unix_sockets.startswith("supervise")
                                          or policy.trace_denials) else 0
    if plan.seccomp_notify:
        # The init answers each notification with the errno the plain filter
        # would have returned; "-1" carries the profile's default errno.
        entries = sorted(compiled.notify_errnos.items())
        if compiled.notify_default_errno is not None:
            entries.append((-1, compiled.notify_default_errno))
        table = ",".join(f"{nr}:{err}" for nr, err in entries)
        text = ffi.new("char[]", table.encode())
        keep.append(text)
        plan.seccomp_errnos = text
    enforced["seccomp"] = compiled.profile
    if deny_sockets:
        enforced["seccomp_sockets"] = "socket() refused (socketpair(AF_UNIX) allowed)"
    if deny_setid:
        enforced["setid_files"] = "refused (seccomp)"
    if deny_host_reach:
        enforced["host_ipc"] = "refused (seccomp): SysV IPC, POSIX message queues, keyrings"
        enforced["other_processes"] = "limits and priorities refused (seccomp)"


def _report_host_reach(plan: Any, enforced: dict[str, Any], refusals: _Refusals, network: str) -> None:
    """Without namespaces: say how signals and abstract unix sockets toward the host are kept back.

    Landlock scoping (ABI 6) confines both; below it a program can signal
    every process of its uid, and reach abstract sockets when the network is
    the host's. The caller gave up the PID namespace explicitly (namespaces=
    false), so this is reported and warned about, not refused.
    """
    if "host_ipc" not in enforced:  # seccomp refused under best effort: the warning is there already
        enforced["host_ipc"] = None
    if plan.landlock_scoped:
        enforced["signals"] = enforced["abstract_unix_sockets"] = "landlock-scope"
        return
    enforced["abstract_unix_sockets"] = (
        "socket() refused (seccomp)" if network == "none" and "seccomp_sockets" in enforced
        else "reachable (no network namespace, Landlock below ABI 6)"
    )
    enforced["signals"] = "host processes of the same uid (no PID namespace, Landlock below ABI 6)"
    refusals.warnings.append(
        "namespaces=false: this kernel's Landlock cannot scope signals (ABI 6, Linux 6.12): the program can "
        "signal every process of its uid; use namespaces to prevent it"
    )
