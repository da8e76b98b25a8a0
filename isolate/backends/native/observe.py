"""Whether each mechanism's denials can be seen in the report, and why not."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def audit_state() -> str:
    """The kernel audit subsystem as this caller sees it: "enabled", "disabled" or "unreadable".

    Landlock (ABI 7) reports denials only as audit records (AUDIT_LANDLOCK_ACCESS); reading them
    needs the audit netlink socket, whose status request and log multicast group need
    CAP_AUDIT_CONTROL / CAP_AUDIT_READ: root only.
    """
    import socket
    import struct

    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9) as sock:  # NETLINK_AUDIT
            sock.settimeout(1.0)
            sock.bind((0, 0))
            sock.send(struct.pack("=IHHII", 16, 1000, 1, 1, 0))  # AUDIT_GET, NLM_F_REQUEST
            data = sock.recv(8192)
    except OSError:
        return "unreadable"
    if len(data) < 20:
        return "unreadable"
    kind = struct.unpack_from("=H", data, 4)[0]
    if kind == 2:  # NLMSG_ERROR: refused (EPERM for a caller without CAP_AUDIT_CONTROL)
        return "unreadable"
    if kind != 1000 or len(data) < 24:
        return "unreadable"
    return "enabled" if struct.unpack_from("=I", data, 20)[0] else "disabled"


def denials_observed(use_ns: bool, notify: bool, landlock_abi: int) -> dict[str, dict[str, Any]]:
    """Whether each mechanism's denials can be seen in the report, and why not (never guessed)."""
    out: dict[str, dict[str, Any]] = {}
    if notify:
        out["seccomp"] = {"observed": True, "detail": "each denial is a notification answered by the init"}
    else:
        out["seccomp"] = {"observed": False, "detail": "no init receives notifications in this mode "
                          "(no namespaces, or preexec_fn): denials happen but are not counted"}
    if 0 < landlock_abi < 7:
        out["landlock"] = {"observed": False, "detail": f"this kernel's Landlock (ABI {landlock_abi}) cannot "
                           "log denials (ABI 7 logs them to the audit subsystem); a denied access fails with EACCES"}
    elif landlock_abi:
        state = audit_state()
        why = {"disabled": "the audit subsystem is disabled on this host (no auditd)",
               "unreadable": "reading the audit log needs CAP_AUDIT_READ (root)",
               "enabled": "isolate does not ask Landlock to log after exec nor read the audit log yet"}[state]
        out["landlock"] = {"observed": False, "detail": "Landlock reports denials only to the audit subsystem "
                           f"(ABI 7 and later); {why}; a denied file access fails with EACCES"}
    if use_ns:
        out["mounts"] = {"observed": False, "detail": "a path outside the granted ones does not exist inside "
                         "the sandbox: the program gets ENOENT and the kernel records nothing"}
    return out
