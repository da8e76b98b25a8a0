"""What this host can do with seccomp: libseccomp's version, the kernel's actions, a default filter
that compiles.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from ...model.errors import PolicyError, UnsupportedError
from .abi import RET_KILL_PROCESS, RET_USER_NOTIF
from .binding import _libseccomp_version, _pyseccomp, syscall_number
from .compiler import compile_filter

# --------------------------------------------------------------------------
# what this host can do


def _kernel_action_available(action: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_uint32(action)
    nr_seccomp = syscall_number("seccomp")
    if nr_seccomp is None:
        return False
    # seccomp(SECCOMP_GET_ACTION_AVAIL, 0, &action)
    return int(libc.syscall(ctypes.c_long(nr_seccomp), ctypes.c_uint(2), ctypes.c_uint(0), ctypes.byref(value))) == 0


def available() -> tuple[bool, str]:
    """Can seccomp filters be compiled and installed here? (ok, one line saying why or why not)."""
    try:
        _pyseccomp()
        version = _libseccomp_version()
    except UnsupportedError as exc:
        return False, str(exc)
    text = "libseccomp {}.{}.{}".format(*version)
    if version < (2, 5, 0):
        return False, f"{text} is too old: seccomp needs libseccomp 2.5 or newer (apt-get install libseccomp2)"
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            status = handle.read()
    except OSError:
        status = ""
    if "Seccomp:" not in status:
        return False, f"{text}, but this kernel has no seccomp (CONFIG_SECCOMP_FILTER)"
    if not _kernel_action_available(RET_KILL_PROCESS):
        return False, f"{text}, but this kernel lacks SECCOMP_RET_KILL_PROCESS (Linux 4.14+ needed)"
    try:
        compile_filter("default")
    except (UnsupportedError, PolicyError) as exc:
        return False, f"{text}: {exc}"
    notify = "with" if _kernel_action_available(RET_USER_NOTIF) else "without"
    return True, f"{text}, kernel filters {notify} user notification (denial reports)"
