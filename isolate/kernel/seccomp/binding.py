"""libseccomp, reached through the ``pyseccomp`` binding (or ctypes): system call names and numbers
for the native architecture, and what this host's kernel and library can do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from typing import Any

from ...model.errors import UnsupportedError
from .abi import _ARCH_NAMES, _AUDIT_ARCH_X86_64, _X86_64_NEWER, INSTALL_HINT

# --------------------------------------------------------------------------
# libseccomp access


def _pyseccomp() -> Any:
    try:
        import pyseccomp
    except ImportError:
        raise UnsupportedError(f"{INSTALL_HINT} (the pyseccomp module is not installed)") from None
    except (RuntimeError, OSError) as exc:
        raise UnsupportedError(f"{INSTALL_HINT} ({exc})") from None
    return pyseccomp


@functools.lru_cache(maxsize=1)
def _libseccomp() -> ctypes.CDLL:
    # The soname first: the dynamic loader finds it in ld.so.cache, where find_library runs `ldconfig -p`
    # (a process of its own: 1.1 ms here, on a cold isolate-run's path and each process's first run).
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        name = ctypes.util.find_library("seccomp")
        try:
            lib = ctypes.CDLL(name or "libseccomp.so.2")
        except OSError as exc:
            raise UnsupportedError(f"{INSTALL_HINT} ({exc})") from None
    lib.seccomp_syscall_resolve_name_arch.argtypes = (ctypes.c_uint32, ctypes.c_char_p)
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    lib.seccomp_arch_native.argtypes = ()
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_version.argtypes = ()
    lib.seccomp_version.restype = ctypes.POINTER(ctypes.c_uint * 3)
    return lib


def _libseccomp_version() -> tuple[int, int, int]:
    major, minor, micro = _libseccomp().seccomp_version().contents
    return int(major), int(minor), int(micro)


def _native_arch() -> int:
    return int(_libseccomp().seccomp_arch_native())


def _resolve(name: str) -> int:
    """The native number of ``name``; -1 unknown; below -1 known but absent on this architecture."""
    nr = int(_libseccomp().seccomp_syscall_resolve_name_arch(0, name.encode()))
    if nr == -1 and _native_arch() == _AUDIT_ARCH_X86_64:
        nr = _X86_64_NEWER.get(name, -1)
    return nr


def syscall_number(name: str) -> int | None:
    """The number of system call ``name`` on this architecture, or None."""
    try:
        nr = _resolve(name)
    except UnsupportedError:
        return None
    return nr if nr >= 0 else None


def syscall_name(nr: int) -> str:
    """The name of system call ``nr`` on this architecture (``"syscall_<nr>"`` when unknown)."""
    try:
        name = _pyseccomp().resolve_syscall(0, nr).decode()
    except (UnsupportedError, ValueError, OSError):
        name = ""
    if not name and _guess_native_arch() == _AUDIT_ARCH_X86_64:
        name = next((k for k, v in _X86_64_NEWER.items() if v == nr), "")
    return name or f"syscall_{nr}"


def _guess_native_arch() -> int:
    """The native AUDIT_ARCH value, from libseccomp when it is there."""
    try:
        return _native_arch()
    except UnsupportedError:
        machines = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "ppc64le": 0xC0000015, "s390x": 0x80000016,
                    "riscv64": 0xC00000F3}
        return machines.get(platform.machine(), 0)


def _native_scmp_name() -> str:
    return _ARCH_NAMES.get(_guess_native_arch(), ("SCMP_ARCH_NATIVE", frozenset()))[0]
