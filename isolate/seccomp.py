"""Seccomp filters: the built-in profiles, Docker/OCI JSON profiles, and their compilation.

The filter is compiled in the parent with libseccomp (through the ``pyseccomp``
binding) and handed to the child as raw ``struct sock_filter[]`` bytes, which
the C core installs with one ``seccomp(SECCOMP_SET_MODE_FILTER)`` call after
``PR_SET_NO_NEW_PRIVS``. Compiled filters are cached per distinct input.

Profiles
    ``default``  everything is allowed except what a sandboxed program has no
                 business calling (modules, kexec, bpf, ptrace, mounts,
                 namespaces, io_uring, keyrings, time setting, TIOCSTI ...);
                 each is refused with EPERM. ``clone3`` gets ENOSYS so that libc
                 falls back to ``clone``, whose flags the filter can see.
    ``strict``   an allow-list for compute jobs: files, memory, time, threads,
                 processes, pipes, AF_UNIX socket pairs; everything else EPERM.
    ``none``     no filter (unless ``deny_inet_sockets`` asks for one).
    a FILE       a Docker/OCI seccomp JSON profile.

Built-in profiles are written as OCI-shaped data (:func:`oci_profile` returns
them for the Docker backend), and built-ins and files are compiled through
the same parser, so the native and Docker backends enforce the same thing.

Choices made here (documented for the README):

* Only the native ABI is filtered. On x86_64 every i386 (``int 0x80``) or x32
  system call kills the process (SIGSYS), whatever the profile says, including
  profiles that list ``SCMP_ARCH_X86``/``SCMP_ARCH_X32``.
* System call names in a profile: a name libseccomp knows but which does not
  exist on this architecture (Docker lists ``socketcall``, ``_llseek`` ...) is
  skipped; a name nobody knows is a ``PolicyError`` naming its place, e.g.
  ``profile.json: syscalls[3].names[1]: unknown system call "foo"``. On x86_64
  the calls newer than the installed libseccomp (``statmount``, ``mseal``,
  ``listns`` ...) are known by number here. Names in entries that do not apply
  (``includes``/``excludes`` not met) are not resolved.
* ``includes``/``excludes``: capabilities are never granted (the sandbox drops
  them all), ``arches`` match only the native architecture, ``minKernel`` is
  compared with the running kernel.
* Rules are combined as libseccomp (and so Docker) combines them; where that
  would silently drop a rule the profile is refused instead: two unconditional
  rules with different actions for one call, or a conditional rule for a call
  that an unconditional rule with another action already decides. Two
  conditions on the same argument in one entry are refused (libseccomp cannot
  AND them; runc turns them into an OR). ``SCMP_ACT_NOTIFY`` and
  ``listenerPath`` are not supported (UnsupportedError); ``flags`` are accepted
  and not applied.
* Argument comparisons are on 64 bits, as in libseccomp. The built-ins compare
  ``int`` arguments (ioctl requests, socket domains, personality) on their low
  32 bits with ``SCMP_CMP_MASKED_EQ`` and mask 0xffffffff, because the kernel
  ignores the high bits (CVE-2019-10063).

``deny_inet_sockets=True`` puts 11 hand-written BPF instructions before
libseccomp's program: socket() of any domain, and socketpair() whose domain
(low 32 bits) is not AF_UNIX, return EPERM before any rule of the profile is
looked at, so no profile rule (an unconditional allow of ``socket``, say) can
undo it. (AF_UNIX sockets are refused too: without a mount namespace Landlock
does not govern connect() on a socket file.) ``deny_setid=True`` adds a
prologue refusing S_ISUID/S_ISGID in chmod-family calls and file creation.

Supervised connect (``unix_sockets="supervise"``, network none or loopback on
kernels whose Landlock cannot govern pathname unix sockets): every ``ret
ALLOW`` (and ``ret LOG``) of the compiled program becomes a jump to an
epilogue, so only calls the profile itself allows are looked at there:
connect() becomes a notification that the init performs itself (see
csrc/supervise.c), socket()/socketpair() of AF_UNIX with a type other than
SOCK_STREAM or SOCK_SEQPACKET (SOCK_DGRAM, and SOCK_RAW which the kernel
turns into SOCK_DGRAM) become notifications the init refuses, and
io_uring_setup is refused (EPERM), since a ring's IORING_OP_CONNECT never
passes through seccomp. A ``ret USER_NOTIF`` of the profile's own (a
reported denial) jumps to a second epilogue that answers connect() (and, under
egress, sendto(), sendmsg() and sendmmsg(), which the init looks at and lets
continue) with its plain errno, so the init never mistakes a denial for a
call to perform or let through; those denials are enforced but not reported.
Under egress, every sendmsg() and sendmmsg() the profile allows goes to the
init (their address lies behind a pointer BPF cannot follow), which records
the UDP destinations the namespace refuses.
``unix_sockets="deny"`` (the pre-exec hook, which has no init to supervise)
refuses socket(AF_UNIX) of every type and AF_UNIX datagram socket pairs with
EACCES instead.

Reporting denials (``notify=True``): every rule that denies with an errno E
becomes ``SECCOMP_RET_USER_NOTIF`` and :attr:`CompiledFilter.notify_errnos`
tells the listener what to answer, so the program sees exactly what the plain
filter would have returned. Rules returning ENOSYS or 0 are not denials (a
"use the fallback" or a fake success) and stay as they are. When one system
call has rules with several errnos, only the rules with the errno that the
listener answers for it become notifications: the default action's errno when
the call can fall through to a notifying default, else the most common errno
among its rules (ties: the lowest errno). The other rules keep their plain
errno: they are enforced exactly, but not reported.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import errno as errno_mod
import functools
import hashlib
import json
import os
import platform
import struct
import sys
import threading
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import PolicyError, UnsupportedError
from .grants import read_input_file

__all__ = [
    "BUILTIN_PROFILES",
    "CompiledFilter",
    "available",
    "cache_clear",
    "compile_filter",
    "oci_profile",
    "syscall_name",
    "syscall_number",
]

BUILTIN_PROFILES = ("default", "strict", "none")

INSTALL_HINT = "seccomp needs libseccomp: apt-get install libseccomp2 (and pip install pyseccomp)"

# Kernel return actions (include/uapi/linux/seccomp.h).
RET_KILL_PROCESS = 0x80000000
RET_KILL_THREAD = 0x00000000
RET_TRAP = 0x00030000
RET_ERRNO = 0x00050000
RET_USER_NOTIF = 0x7FC00000
RET_TRACE = 0x7FF00000
RET_LOG = 0x7FFC0000
RET_ALLOW = 0x7FFF0000
_RET_ACTION_FULL = 0xFFFF0000
_RET_DATA = 0x0000FFFF

#: The kernel's limit on the length of one filter (BPF_MAXINSNS).
MAX_INSTRUCTIONS = 4096
#: The largest errno a filter may return (MAX_ERRNO).
MAX_ERRNO = 4095

# libseccomp comparison operators (enum scmp_compare).
_OPS = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}
_ACTIONS = (
    "SCMP_ACT_KILL",
    "SCMP_ACT_KILL_THREAD",
    "SCMP_ACT_KILL_PROCESS",
    "SCMP_ACT_TRAP",
    "SCMP_ACT_ERRNO",
    "SCMP_ACT_TRACE",
    "SCMP_ACT_LOG",
    "SCMP_ACT_ALLOW",
    "SCMP_ACT_NOTIFY",
)
_SCMP_ARCHES = (
    "SCMP_ARCH_NATIVE", "SCMP_ARCH_X86", "SCMP_ARCH_X86_64", "SCMP_ARCH_X32", "SCMP_ARCH_ARM",
    "SCMP_ARCH_AARCH64", "SCMP_ARCH_LOONGARCH64", "SCMP_ARCH_M68K", "SCMP_ARCH_MIPS", "SCMP_ARCH_MIPS64",
    "SCMP_ARCH_MIPS64N32", "SCMP_ARCH_MIPSEL", "SCMP_ARCH_MIPSEL64", "SCMP_ARCH_MIPSEL64N32", "SCMP_ARCH_PPC",
    "SCMP_ARCH_PPC64", "SCMP_ARCH_PPC64LE", "SCMP_ARCH_S390", "SCMP_ARCH_S390X", "SCMP_ARCH_PARISC",
    "SCMP_ARCH_PARISC64", "SCMP_ARCH_RISCV64", "SCMP_ARCH_SH", "SCMP_ARCH_SHEB",
)
_FLAGS = (
    "SECCOMP_FILTER_FLAG_TSYNC",
    "SECCOMP_FILTER_FLAG_LOG",
    "SECCOMP_FILTER_FLAG_SPEC_ALLOW",
    "SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV",
)
_TOP_KEYS = frozenset(
    {"defaultAction", "defaultErrnoRet", "architectures", "archMap", "syscalls", "flags", "listenerPath",
     "listenerMetadata", "comment"}
)
_ENTRY_KEYS = frozenset({"names", "name", "action", "args", "errnoRet", "comment", "includes", "excludes"})
_ARG_KEYS = frozenset({"index", "value", "valueTwo", "op"})
_FILTER_KEYS = frozenset({"caps", "arches", "minKernel"})

# Native architectures: AUDIT_ARCH value -> (SCMP_ARCH name, names used by Docker's includes/excludes).
_ARCH_NAMES: dict[int, tuple[str, frozenset[str]]] = {
    0xC000003E: ("SCMP_ARCH_X86_64", frozenset({"amd64", "x86_64"})),
    0x40000003: ("SCMP_ARCH_X86", frozenset({"386", "x86", "i386"})),
    0xC00000B7: ("SCMP_ARCH_AARCH64", frozenset({"arm64", "aarch64"})),
    0x40000028: ("SCMP_ARCH_ARM", frozenset({"arm"})),
    0xC0000015: ("SCMP_ARCH_PPC64LE", frozenset({"ppc64le"})),
    0x80000016: ("SCMP_ARCH_S390X", frozenset({"s390x"})),
    0xC00000F3: ("SCMP_ARCH_RISCV64", frozenset({"riscv64"})),
}
_AUDIT_ARCH_X86_64 = 0xC000003E

# x86_64 system calls newer than libseccomp 2.5.4 knows (arch/x86/entry/syscalls/syscall_64.tbl).
_X86_64_NEWER: dict[str, int] = {
    "uretprobe": 335,
    "uprobe": 336,
    "statmount": 457,
    "listmount": 458,
    "lsm_get_self_attr": 459,
    "lsm_set_self_attr": 460,
    "lsm_list_modules": 461,
    "mseal": 462,
    "setxattrat": 463,
    "getxattrat": 464,
    "listxattrat": 465,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "file_getattr": 468,
    "file_setattr": 469,
    "listns": 470,
}

# Constants used by the built-in profiles.
_AF_UNIX = 1
_AF_VSOCK = 40
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
_LOW32 = 0xFFFFFFFF
_CLONE_NEWTIME = 0x00000080
_CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# personality() flags that weaken the process (the kernel's PER_CLEAR_ON_SETID).
_UNSAFE_PERSONA = (0x0040000, 0x0100000, 0x0200000, 0x0400000)  # ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, ...

_CACHE_SIZE = 64


@dataclass(frozen=True)
class CompiledFilter:
    """A compiled seccomp filter, ready for ``seccomp(SECCOMP_SET_MODE_FILTER, flags, &prog)``.

    ``bpf`` is the ``struct sock_filter[]`` array (8 bytes per instruction, host
    byte order). With ``notify=True`` the filter holds ``SECCOMP_RET_USER_NOTIF``
    actions: install it with ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` and answer each
    notification for system call ``nr`` with
    ``-notify_errnos.get(nr, notify_default_errno)``; without a listener the
    kernel fails those calls with ENOSYS.
    """

    bpf: bytes
    notify_errnos: Mapping[int, int] = field(hash=False)
    notify_default_errno: int | None
    profile: str
    arch: int

    @property
    def instructions(self) -> int:
        return len(self.bpf) // 8

    @property
    def notify(self) -> bool:
        return bool(self.notify_errnos) or self.notify_default_errno is not None


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
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name)
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


# --------------------------------------------------------------------------
# the built-in profiles, as Docker/OCI profile data


def _deny(names: list[str], comment: str, err: int = errno_mod.EPERM) -> dict[str, Any]:
    return {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": err, "comment": comment}


def _masked(index: int, mask: int, value: int) -> dict[str, Any]:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _clone_flags_index() -> int:
    # s390 passes clone's flags second; every other architecture first.
    return 1 if platform.machine().startswith("s390") else 0


def _default_profile() -> dict[str, Any]:
    eperm = errno_mod.EPERM
    syscalls: list[dict[str, Any]] = [
        _deny(["init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms"],
              "kernel modules"),
        _deny(["kexec_load", "kexec_file_load", "reboot"], "kexec and reboot"),
        _deny(["bpf", "perf_event_open", "userfaultfd", "fanotify_init", "lookup_dcookie"],
              "kernel attack surface and system-wide observation"),
        _deny(["keyctl", "add_key", "request_key"], "kernel keyrings (not namespaced)"),
        _deny(["ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_getfd",
               "move_pages", "migrate_pages"], "tracing and touching other processes"),
        _deny(["mount", "umount", "umount2", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
               "open_tree_attr", "mount_setattr", "pivot_root", "chroot"], "mounts and the root directory"),
        _deny(["setns"], "joining namespaces"),
        _deny(["open_by_handle_at", "name_to_handle_at"], "file handles bypass path checks"),
        _deny(["io_uring_setup", "io_uring_enter", "io_uring_register"], "io_uring bypasses the system call filter"),
        _deny(["swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "vhangup", "sethostname",
               "setdomainname", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl"], "system administration"),
        _deny(["settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime"], "clock and time setting"),
        _deny(["iopl", "ioperm", "modify_ldt", "vm86", "vm86old"], "raw I/O ports and legacy x86 modes"),
    ]
    for bit in (*_CLONE_NEW_FLAGS, _CLONE_NEWTIME):
        syscalls.append({**_deny(["unshare"], "unshare that creates a namespace"), "args": [_masked(0, bit, bit)]})
    for bit in _CLONE_NEW_FLAGS:
        syscalls.append(
            {**_deny(["clone"], "clone that creates a namespace"), "args": [_masked(_clone_flags_index(), bit, bit)]}
        )
    # personality(): refuse the flags that weaken the process; personality(0xffffffff) (a query) stays allowed.
    # "bit b set and some other bit c clear" covers every value with b set except 0xffffffff.
    for bit in _UNSAFE_PERSONA:
        for shift in range(32):
            other = 1 << shift
            if other != bit:
                syscalls.append({**_deny(["personality"], "personality flags that weaken the process"),
                                 "args": [_masked(0, bit | other, bit)]})
    syscalls.append({**_deny(["socket"], "AF_VSOCK reaches the host"), "args": [_masked(0, _LOW32, _AF_VSOCK)]})
    for request, name in ((_TIOCSTI, "TIOCSTI"), (_TIOCLINUX, "TIOCLINUX")):
        syscalls.append({**_deny(["ioctl"], f"{name} injects input into the terminal (low 32 bits compared)", eperm),
                         "args": [_masked(1, _LOW32, request)]})
    syscalls.append(_deny(["clone3"], "clone3 hides its flags behind a pointer: ENOSYS makes libc use clone",
                          errno_mod.ENOSYS))
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": [_native_scmp_name()], "syscalls": syscalls}


_STRICT_ALLOW = (
    # files and directories
    "read", "write", "open", "openat", "openat2", "creat", "close", "close_range", "lseek", "pread64", "pwrite64",
    "readv", "writev", "preadv", "pwritev", "preadv2", "pwritev2", "stat", "fstat", "lstat", "newfstatat", "statx",
    "statfs", "fstatfs", "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getdents", "getdents64",
    "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat",
    "renameat2", "link", "linkat", "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown",
    "fchown", "lchown", "fchownat", "umask", "truncate", "ftruncate", "fallocate", "fsync", "fdatasync",
    "sync_file_range", "fadvise64", "readahead", "flock", "fcntl", "dup", "dup2", "dup3", "utime", "utimes",
    "utimensat", "futimesat", "getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr",
    "copy_file_range", "sendfile", "splice", "tee", "vmsplice", "cachestat",
    # memory
    "brk", "mmap", "munmap", "mprotect", "mremap", "madvise", "mincore", "msync", "mlock", "mlock2", "munlock",
    "mlockall", "munlockall", "membarrier", "memfd_create", "pkey_alloc", "pkey_free", "pkey_mprotect",
    "map_shadow_stack", "mseal",
    # time
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time", "times", "getitimer",
    "setitimer", "alarm", "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun", "timer_delete",
    "timerfd_create", "timerfd_settime", "timerfd_gettime",
    # threads, signals, scheduling
    "futex", "futex_waitv", "futex_wait", "futex_wake", "futex_requeue", "set_robust_list", "set_tid_address",
    "gettid", "rseq", "arch_prctl", "sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam",
    "sched_getscheduler", "sched_get_priority_max", "sched_get_priority_min", "sched_getattr",
    "sched_rr_get_interval", "getcpu", "getpriority", "setpriority", "kill", "tkill", "tgkill", "rt_sigaction",
    "rt_sigprocmask", "rt_sigreturn", "rt_sigsuspend", "rt_sigpending", "rt_sigtimedwait", "rt_sigqueueinfo",
    "rt_tgsigqueueinfo", "sigaltstack", "signalfd", "signalfd4", "pause", "restart_syscall",
    # processes and identity
    "fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid", "getpid", "getppid", "getpgrp",
    "getpgid", "setpgid", "getsid", "setsid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid",
    "getresgid", "uname", "sysinfo", "getrlimit", "setrlimit", "prlimit64", "getrusage", "capget", "prctl",
    "getrandom",
    # pipes, polling, and sockets that already exist (socketpair below)
    "pipe", "pipe2", "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "sendmsg", "recvmsg", "sendto", "recvfrom",
    "sendmmsg", "recvmmsg", "shutdown", "getsockopt", "setsockopt", "getsockname", "getpeername",
    # a program may confine itself further
    "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self", "seccomp",
)

# ioctl requests allowed by strict: terminal attributes and size, FIONREAD/FIONBIO, close-on-exec.
_STRICT_IOCTLS = (
    0x5401, 0x5402, 0x5403, 0x5404,  # TCGETS, TCSETS, TCSETSW, TCSETSF
    0x802C542A, 0x402C542B, 0x402C542C, 0x402C542D,  # TCGETS2, TCSETS2, TCSETSW2, TCSETSF2
    0x540F, 0x5410, 0x5413,  # TIOCGPGRP, TIOCSPGRP, TIOCGWINSZ
    0x541B, 0x5421, 0x5450, 0x5451,  # FIONREAD, FIONBIO, FIONCLEX, FIOCLEX
)


def _strict_profile() -> dict[str, Any]:
    new_ns = 0
    for bit in _CLONE_NEW_FLAGS:
        new_ns |= bit
    syscalls: list[dict[str, Any]] = [
        {"names": list(_STRICT_ALLOW), "action": "SCMP_ACT_ALLOW", "comment": "compute jobs"},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW", "comment": "threads and processes, no new namespace",
         "args": [_masked(_clone_flags_index(), new_ns, 0)]},
        {"names": ["socketpair"], "action": "SCMP_ACT_ALLOW", "comment": "AF_UNIX socket pairs only",
         "args": [_masked(0, _LOW32, _AF_UNIX)]},
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "comment": "query, or PER_LINUX",
         "args": [_masked(0, _LOW32, _LOW32)]},
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "comment": "query, or PER_LINUX",
         "args": [_masked(0, _LOW32, 0)]},
    ]
    for request in _STRICT_IOCTLS:
        syscalls.append({"names": ["ioctl"], "action": "SCMP_ACT_ALLOW", "comment": "terminal and fd ioctls",
                         "args": [_masked(1, _LOW32, request)]})
    syscalls.append(_deny(["clone3"], "clone3 hides its flags behind a pointer: ENOSYS makes libc use clone",
                          errno_mod.ENOSYS))
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": errno_mod.EPERM,
        "architectures": [_native_scmp_name()],
        "syscalls": syscalls,
    }


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


def oci_profile(mode: str) -> dict[str, Any]:
    """The Docker/OCI seccomp profile for ``mode`` (a fresh dict, safe to change).

    For ``none`` it is a profile that allows everything (Docker's
    ``seccomp=unconfined`` is equivalent); for a FILE, the file's profile,
    validated first (raises ``PolicyError``).
    """
    if mode == "default":
        return _default_profile()
    if mode == "strict":
        return _strict_profile()
    if mode == "none":
        return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}
    source, content = _read_profile_file(mode)
    data = _load_json(content, source)
    try:
        _libseccomp()
        resolve = True
    except UnsupportedError:
        resolve = False  # the engine checks the names itself
    _parse(data, source, resolve)
    assert isinstance(data, dict)  # _parse checked it
    return data


def without_network_sockets(profile: dict[str, Any]) -> dict[str, Any]:
    """``profile`` (OCI/Docker data) changed so that socket() succeeds only for AF_UNIX.

    For a container whose network mode is "none": its lo is up and cannot be
    taken down, so "no network" is kept by refusing every socket family that
    could use it (AF_INET, AF_INET6, AF_PACKET, AF_NETLINK ...), as the native
    backend does without a network namespace. Rules that allowed socket() are
    dropped (a default-deny profile then gets back only AF_UNIX, and only if it
    allowed socket() at all); errno rules stay; an errno rule for every domain
    but AF_UNIX (compared on 64 bits: a domain with high bits set is refused
    too) is added when the default allows. Nothing the profile denied becomes
    allowed.
    """
    out = copy.deepcopy(profile)
    allows_default = out.get("defaultAction") in ("SCMP_ACT_ALLOW", "SCMP_ACT_LOG")
    allowed_unix = False
    rules = []
    for rule in out.get("syscalls") or []:
        names = list(rule.get("names") or ([rule["name"]] if "name" in rule else []))
        if "socket" in names and rule.get("action") in ("SCMP_ACT_ALLOW", "SCMP_ACT_LOG"):
            args = rule.get("args") or []
            unix_only = len(args) == 1 and args[0].get("index") == 0 and (
                (args[0].get("op") == "SCMP_CMP_EQ" and args[0].get("value") == _AF_UNIX)
                or (args[0].get("op") == "SCMP_CMP_MASKED_EQ" and args[0].get("value") == _LOW32
                    and args[0].get("valueTwo") == _AF_UNIX))
            allowed_unix = allowed_unix or not args or unix_only
            names.remove("socket")
            if not names:
                continue
            rule = {**rule, "names": names}
            rule.pop("name", None)
        rules.append(rule)
    if allows_default:
        rules.append({**_deny(["socket"], "network none: no socket but AF_UNIX"),
                      "args": [{"index": 0, "value": _AF_UNIX, "op": "SCMP_CMP_NE"}]})
    elif allowed_unix:
        rules.append({"names": ["socket"], "action": "SCMP_ACT_ALLOW", "comment": "network none: AF_UNIX only",
                      "args": [_masked(0, _LOW32, _AF_UNIX)]})
    out["syscalls"] = rules
    return out


# --------------------------------------------------------------------------
# parsing a profile


@dataclass(frozen=True)
class _Cond:
    index: int
    op: int
    a: int
    b: int


@dataclass(frozen=True)
class _Rule:
    nr: int
    name: str
    action: int
    conds: tuple[_Cond, ...]
    place: str


@dataclass(frozen=True)
class _Parsed:
    default: int
    rules: tuple[_Rule, ...]


def _err(source: str, place: str, message: str) -> PolicyError:
    where = f"{source}: {place}: " if place else f"{source}: "
    return PolicyError(where + message, "seccomp")


def _int(value: object, source: str, place: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _err(source, place, f"expected an integer from {low} to {high}, got {json.dumps(value)}")
    return value


def _str_list(value: object, source: str, place: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _err(source, place, "expected a list of strings")
    return value


def _check_keys(value: object, allowed: frozenset[str], source: str, place: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _err(source, place, f"expected an object, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            raise _err(source, place, f'unknown key "{key}"; known keys are {", ".join(sorted(allowed))}')
    return value


def _action(name: object, errno_ret: object, source: str, place: str, errno_place: str) -> int:
    if name not in _ACTIONS:
        raise _err(source, place, f"unknown action {json.dumps(name)}; known actions are {', '.join(_ACTIONS)}")
    if name == "SCMP_ACT_NOTIFY":
        raise UnsupportedError(
            f"{source}: {place}: SCMP_ACT_NOTIFY needs a listener process, which isolate does not provide; "
            "use SCMP_ACT_ERRNO (isolate reports denied calls itself)"
        )
    if errno_ret is not None and name not in ("SCMP_ACT_ERRNO", "SCMP_ACT_TRACE"):
        raise _err(source, errno_place, f"errnoRet goes with SCMP_ACT_ERRNO or SCMP_ACT_TRACE, not with {name}")
    data = errno_mod.EPERM if errno_ret is None else _int(errno_ret, source, errno_place, 0, MAX_ERRNO)
    if name == "SCMP_ACT_ERRNO":
        return RET_ERRNO | data
    if name == "SCMP_ACT_TRACE":
        return RET_TRACE | data
    return {
        "SCMP_ACT_KILL": RET_KILL_THREAD,
        "SCMP_ACT_KILL_THREAD": RET_KILL_THREAD,
        "SCMP_ACT_KILL_PROCESS": RET_KILL_PROCESS,
        "SCMP_ACT_TRAP": RET_TRAP,
        "SCMP_ACT_LOG": RET_LOG,
        "SCMP_ACT_ALLOW": RET_ALLOW,
    }[str(name)]


def _kernel_version() -> tuple[int, ...]:
    numbers = []
    for part in os.uname().release.split("-")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def _applies(entry: dict[str, Any], source: str, place: str, resolve: bool = True) -> bool:
    """Evaluate Docker's includes/excludes: no capabilities, the native arch, the running kernel."""
    native = _ARCH_NAMES.get(_native_arch() if resolve else _guess_native_arch(), ("", frozenset()))[1]
    applies = True
    for key in ("includes", "excludes"):
        if key not in entry:
            continue
        where = f"{place}.{key}"
        spec = _check_keys(entry[key], _FILTER_KEYS, source, where)
        caps = _str_list(spec.get("caps"), source, f"{where}.caps")
        arches = _str_list(spec.get("arches"), source, f"{where}.arches")
        min_kernel = spec.get("minKernel")
        if min_kernel is not None and key == "excludes":
            raise _err(source, f"{where}.minKernel", "minKernel is only meaningful in includes")
        if key == "includes":
            if caps or (arches and not native & set(arches)):
                applies = False
            if min_kernel is not None:
                parts = min_kernel.split(".") if isinstance(min_kernel, str) else []
                if not parts or len(parts) > 3 or not all(part.isdigit() for part in parts):
                    raise _err(
                        source, f"{where}.minKernel", f'expected a version such as "4.8", got {json.dumps(min_kernel)}'
                    )
                if _kernel_version() < tuple(int(part) for part in parts):
                    applies = False
        elif native & set(arches):
            applies = False
    return applies


def _parse(data: object, source: str, resolve: bool = True) -> _Parsed:
    """Validate a Docker/OCI profile and turn it into rules for the native architecture.

    With ``resolve=False`` (no libseccomp here) only the shape is checked and no rule is returned.
    """
    top = _check_keys(data, _TOP_KEYS, source, "")
    if "defaultAction" not in top:
        raise _err(source, "", "defaultAction is missing (for example \"SCMP_ACT_ERRNO\")")
    default = _action(top["defaultAction"], top.get("defaultErrnoRet"), source, "defaultAction", "defaultErrnoRet")
    for i, arch in enumerate(_str_list(top.get("architectures"), source, "architectures")):
        if arch not in _SCMP_ARCHES:
            raise _err(source, f"architectures[{i}]", f"unknown architecture {json.dumps(arch)}")
    arch_map = top.get("archMap") or []
    if not isinstance(arch_map, list):
        raise _err(source, "archMap", "expected a list")
    for i, item in enumerate(arch_map):
        item = _check_keys(item, frozenset({"architecture", "subArchitectures"}), source, f"archMap[{i}]")
        arches: list[object] = [item.get("architecture")]
        arches += _str_list(item.get("subArchitectures"), source, f"archMap[{i}]")
        for mapped in arches:
            if mapped not in _SCMP_ARCHES:
                raise _err(source, f"archMap[{i}]", f"unknown architecture {json.dumps(mapped)}")
    for i, flag in enumerate(_str_list(top.get("flags"), source, "flags")):
        if flag not in _FLAGS:
            raise _err(source, f"flags[{i}]", f"unknown flag {json.dumps(flag)}")
    if top.get("listenerPath"):
        raise UnsupportedError(
            f"{source}: listenerPath: isolate does not forward seccomp notifications to another agent; "
            "remove listenerPath and SCMP_ACT_NOTIFY"
        )
    entries = top.get("syscalls") or []
    if not isinstance(entries, list):
        raise _err(source, "syscalls", "expected a list")

    rules: list[_Rule] = []
    for i, raw in enumerate(entries):
        place = f"syscalls[{i}]"
        entry = _check_keys(raw, _ENTRY_KEYS, source, place)
        if "action" not in entry:
            raise _err(source, place, "action is missing")
        action = _action(entry["action"], entry.get("errnoRet"), source, f"{place}.action", f"{place}.errnoRet")
        if "names" in entry and "name" in entry:
            raise _err(source, place, "give names or name, not both")
        names: list[str]
        if "name" in entry:
            single = entry["name"]
            if not isinstance(single, str):
                raise _err(source, f"{place}.name", "expected a string")
            names, places = [single], [f"{place}.name"]
        else:
            names = _str_list(entry.get("names"), source, f"{place}.names")
            places = [f"{place}.names[{j}]" for j in range(len(names))]
        if not names:
            raise _err(source, place, "names is missing or empty")
        conds = _parse_args(entry.get("args"), source, f"{place}.args")
        if not _applies(entry, source, place, resolve) or not resolve:
            continue
        for name, where in zip(names, places, strict=True):
            nr = _resolve(name)
            if nr == -1:
                raise _err(source, where, f'unknown system call "{name}"')
            if nr < 0:
                continue  # known, but not a system call of this architecture
            rules.append(_Rule(nr, name, action, conds, where))
    return _Parsed(default, _normalise(rules, default, source))


def _parse_args(raw: object, source: str, place: str) -> tuple[_Cond, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _err(source, place, "expected a list")
    if len(raw) > 6:
        raise _err(source, place, "a system call has at most 6 arguments")
    conds: list[_Cond] = []
    seen: dict[int, int] = {}
    for k, item in enumerate(raw):
        where = f"{place}[{k}]"
        arg = _check_keys(item, _ARG_KEYS, source, where)
        for key in ("index", "value", "op"):
            if key not in arg:
                raise _err(source, where, f"{key} is missing")
        index = _int(arg["index"], source, f"{where}.index", 0, 5)
        value = _int(arg["value"], source, f"{where}.value", 0, 2**64 - 1)
        value_two = _int(arg.get("valueTwo", 0), source, f"{where}.valueTwo", 0, 2**64 - 1)
        op = arg["op"]
        if op not in _OPS:
            known = ", ".join(_OPS)
            raise _err(source, f"{where}.op", f"unknown operator {json.dumps(op)}; known operators are {known}")
        if index in seen:
            raise _err(
                source, where,
                f"a second condition on argument {index} (first in {place}[{seen[index]}]): libseccomp cannot "
                "combine them in one rule; write one entry per condition (conditions of separate entries are ORed)",
            )
        seen[index] = k
        conds.append(_Cond(index, _OPS[str(op)], value, value_two))
    return tuple(conds)


def _normalise(rules: list[_Rule], default: int, source: str) -> tuple[_Rule, ...]:
    """Apply libseccomp's combination rules explicitly, refusing the cases where it would drop a rule."""
    # A rule whose action is the default action changes nothing (libseccomp refuses it, runc skips it).
    rules = [rule for rule in rules if rule.action != default]
    unconditional: dict[int, _Rule] = {}
    for rule in rules:
        if not rule.conds:
            first = unconditional.setdefault(rule.nr, rule)
            if first.action != rule.action:
                raise _err(source, rule.place, f"{rule.name} already has another action at {first.place}; "
                           "a system call can have only one unconditional action")
    out: list[_Rule] = []
    by_conds: dict[tuple[int, tuple[_Cond, ...]], _Rule] = {}
    for rule in rules:
        uncond = unconditional.get(rule.nr)
        if uncond is not None:
            if rule.conds and rule.action != uncond.action:
                raise _err(source, rule.place, f"this conditional rule for {rule.name} would never apply: "
                           f"{uncond.place} decides every {rule.name} call")
            if rule is not uncond:
                continue
        else:
            same = by_conds.setdefault((rule.nr, rule.conds), rule)
            if same is not rule:
                if same.action != rule.action:
                    raise _err(source, rule.place, f"{rule.name} has the same conditions with another action "
                               f"at {same.place}")
                continue
        out.append(rule)
    return tuple(out)


# --------------------------------------------------------------------------
# compiling


def _is_denial(action: int) -> bool:
    """An errno return that reports a denial (not ENOSYS, which means "use the fallback", nor 0)."""
    return action & _RET_ACTION_FULL == RET_ERRNO and (action & _RET_DATA) not in (0, errno_mod.ENOSYS)


def _notify_plan(parsed: _Parsed) -> tuple[int, int | None, dict[_Rule, int], dict[int, int]]:
    """The notify variant: (default action, default errno, action per rule, table nr -> errno)."""
    default_errno = parsed.default & _RET_DATA if _is_denial(parsed.default) else None
    default = RET_USER_NOTIF if default_errno is not None else parsed.default
    actions: dict[_Rule, int] = {}
    table: dict[int, int] = {}
    by_nr: dict[int, list[_Rule]] = {}
    for rule in parsed.rules:
        by_nr.setdefault(rule.nr, []).append(rule)
    for nr, rules in by_nr.items():
        denials = [rule for rule in rules if _is_denial(rule.action)]
        if not denials:
            continue
        if not rules[0].conds:  # one unconditional rule decides every call (see _normalise)
            answer = rules[0].action & _RET_DATA
        elif default_errno is not None:  # calls that match no rule are notified and answered default_errno
            answer = default_errno
        else:
            counts = Counter(rule.action & _RET_DATA for rule in denials)
            answer = min(counts, key=lambda e: (-counts[e], e))
        for rule in denials:
            if rule.action & _RET_DATA == answer:
                actions[rule] = RET_USER_NOTIF
                table[nr] = answer
    return default, default_errno, actions, table


class _Fileno:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


def _export(filt: Any) -> bytes:
    fd = os.memfd_create("isolate-seccomp", os.MFD_CLOEXEC)
    try:
        filt.export_bpf(_Fileno(fd))
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def _new_filter(default: int) -> Any:
    """A libseccomp filter for the native ABI: binary-tree layout, foreign ABIs killed."""
    sc = _pyseccomp()
    filt = sc.SyscallFilter(default)
    filt.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    filt.set_attr(sc.Attr.ACT_BADARCH, RET_KILL_PROCESS)
    return filt


def _build(parsed: _Parsed, notify: bool, source: str) -> tuple[bytes, dict[int, int], int | None]:
    sc = _pyseccomp()
    if notify:
        default, default_errno, actions, table = _notify_plan(parsed)
    else:
        default, default_errno, actions, table = parsed.default, None, {}, {}
    try:
        filt = _new_filter(default)
    except OSError as exc:
        raise UnsupportedError(f"libseccomp cannot create a filter here: {exc.strerror}; {INSTALL_HINT}") from None
    for rule in parsed.rules:
        action = actions.get(rule, rule.action)
        if action == default:
            continue
        args = [sc.Arg(c.index, c.op, c.a, c.b) for c in rule.conds]
        try:
            filt.add_rule(action, rule.nr, *args)
        except OSError as exc:
            if action == RET_USER_NOTIF:
                raise UnsupportedError(
                    f"seccomp user notification is unavailable ({exc.strerror}): it needs Linux 5.0+ and "
                    "libseccomp 2.5+; run without denial reporting"
                ) from None
            raise _err(source, rule.place, f"libseccomp refused the rule for {rule.name}: {exc.strerror}") from None
    return _export(filt), table, default_errno


def _deny_inet_prologue(native: int, notify_for: Mapping[int, bool]) -> bytes:
    """BPF run before the filter: socket() of any domain, socketpair() but AF_UNIX -> EPERM (or notify).

    Without a mount namespace Landlock does not govern connect() on a socket
    file, so socket(AF_UNIX) is refused too; socketpair(AF_UNIX) stays.
    """
    socket_nr, socketpair_nr = _resolve("socket"), _resolve("socketpair")
    arg0_low = 16 if sys.byteorder == "little" else 20  # offsetof(struct seccomp_data, args[0]) + low half

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K

    def deny(nr: int) -> int:
        return RET_USER_NOTIF if notify_for.get(nr) else RET_ERRNO | errno_mod.EPERM

    # 11 instructions; the filter proper starts at index 11.
    return b"".join([
        ins(ld, 4),  # 0: arch
        ins(jeq, native, 0, 9),  # 1: foreign ABI -> the filter proper, which kills it
        ins(ld, 0),  # 2: nr
        ins(jeq, socket_nr, 0, 3),  # 3: not socket -> 7
        ins(ld, arg0_low),  # 4
        ins(jeq, 0xFFFFFFFF, 5, 0),  # 5: no domain is exempt from socket()
        ins(ret, deny(socket_nr)),  # 6
        ins(jeq, socketpair_nr, 0, 3),  # 7: not socketpair -> the filter proper
        ins(ld, arg0_low),  # 8
        ins(jeq, _AF_UNIX, 1, 0),  # 9: AF_UNIX -> the filter proper
        ins(ret, deny(socketpair_nr)),  # 10
    ])


#: Unix socket types whose peer is named only at connect() (the kernel ignores
#: or refuses an address on their sendmsg).
_SOCK_STREAM, _SOCK_SEQPACKET = 1, 5
_X32_SYSCALL_BIT = 0x40000000
_AUDIT_ARCH_X86_64 = 0xC000003E


def _unix_epilogue(bpf: bytes, native: int, table: dict[int, int], default_errno: int | None,
                   mode: str) -> bytes:
    """Route the profile's allowed connect()/socket()/socketpair() through an epilogue (see the module doc)."""
    connect_nr, socket_nr, socketpair_nr = _resolve("connect"), _resolve("socket"), _resolve("socketpair")
    # Egress by name: sendto() naming a destination goes to the init too, which records the refused ones.
    sendto_nr = _resolve("sendto") if mode == "supervise-sendto" else None
    # And so do sendmsg() and sendmmsg(), every call of them: their destination (msg_name) lies behind a
    # pointer BPF cannot follow, and the descriptor's family is not in seccomp_data either. The cost is a
    # round trip to the init for each call, TCP and AF_UNIX (descriptor passing) alike, under egress only.
    sendmsg_nrs = [_resolve("sendmsg"), _resolve("sendmmsg")] if mode == "supervise-sendto" else []
    try:
        uring_nr: int | None = _resolve("io_uring_setup")
    except Exception:  # an architecture or libseccomp without it
        uring_nr = None
    arg0_low = 16 if sys.byteorder == "little" else 20
    arg1_low = arg0_low + 8
    ld, jeq, jge, ret, ja, alu_and = 0x20, 0x15, 0x35, 0x06, 0x05, 0x54
    supervise = mode in ("supervise", "supervise-sendto")
    notify_ret = RET_USER_NOTIF if supervise else RET_ERRNO | errno_mod.EACCES

    # A tiny assembler: (code, k, jt label, jf label) with labels resolved below.
    program: list[tuple[int, int, str | None, str | None]] = []
    labels: dict[str, int] = {}

    def label(name: str) -> None:
        labels[name] = len(program)

    def emit(code: int, k: int, jt: str | None = None, jf: str | None = None) -> None:
        program.append((code, k, jt, jf))

    # The profile's own USER_NOTIF (a denial to report): a call the init would take for one to perform
    # (connect) or to look at and let continue (the sends under egress) gets its errno plainly instead, or the
    # init would let the denied call through. Those denials are enforced but not reported.
    plain = [connect_nr] + ([sendto_nr] if sendto_nr is not None else []) + sendmsg_nrs
    label("notify")
    emit(ld, 0)
    for i, nr in enumerate(plain):
        emit(jeq, nr, f"denied_{i}", f"not_denied_{i}")
        label(f"denied_{i}")
        emit(ret, RET_ERRNO | table.get(nr, default_errno or errno_mod.EPERM))
        label(f"not_denied_{i}")
    label("notify_ret")
    emit(ret, RET_USER_NOTIF)
    label("allow")
    emit(ld, 0)
    if native == _AUDIT_ARCH_X86_64:  # x32 numbers never reach the comparisons below
        emit(jge, _X32_SYSCALL_BIT, "kill", "native_nr")
        label("native_nr")
    emit(jeq, connect_nr, "connect", "not_connect")
    label("not_connect")
    emit(jeq, socket_nr, "socket", "not_socket")
    label("not_socket")
    emit(jeq, socketpair_nr, "socketpair", "not_socketpair")
    label("not_socketpair")
    if sendto_nr is not None:
        emit(jeq, sendto_nr, "sendto", "not_sendto")
        label("not_sendto")
    for nr in sendmsg_nrs:
        emit(jeq, nr, "sendto_notify", f"not_{nr}")
        label(f"not_{nr}")
    if uring_nr is not None:
        emit(jeq, uring_nr, "eperm", "ret_allow")
    label("ret_allow")
    emit(ret, RET_ALLOW)
    label("connect")
    emit(ret, RET_USER_NOTIF if supervise else RET_ALLOW)
    label("socket")  # socket(AF_UNIX, ...): every type refused without a supervisor
    emit(ld, arg0_low)
    emit(jeq, _AF_UNIX, "socket_unix" if supervise else "unix_refused", "ret_allow2")
    label("socketpair")  # and AF_UNIX datagram pairs (their sendmsg names any peer)
    emit(ld, arg0_low)
    emit(jeq, _AF_UNIX, "socket_unix", "ret_allow2")
    label("socket_unix")
    emit(ld, arg1_low)
    emit(alu_and, 0xF)
    emit(jeq, _SOCK_STREAM, "ret_allow2", "not_stream")
    label("not_stream")
    emit(jeq, _SOCK_SEQPACKET, "ret_allow2", "unix_refused")
    if sendto_nr is not None:
        label("sendto")  # sendto(fd, buf, len, flags, addr, addrlen): only a non-NULL addr is looked at
        emit(ld, arg0_low + 32)
        emit(jeq, 0, "sendto_high", "sendto_notify")
        label("sendto_high")
        emit(ld, arg0_low + 36 if sys.byteorder == "little" else arg0_low + 28)
        emit(jeq, 0, "ret_allow2", "sendto_notify")
        label("sendto_notify")
        emit(ret, RET_USER_NOTIF)
    label("unix_refused")
    emit(ret, notify_ret)
    label("ret_allow2")
    emit(ret, RET_ALLOW)
    label("eperm")
    emit(ret, RET_ERRNO | errno_mod.EPERM)
    label("kill")
    emit(ret, RET_KILL_PROCESS)

    count = len(bpf) // 8
    out = []
    for i in range(count):
        code, jt, jf, k = struct.unpack_from("=HBBI", bpf, 8 * i)
        if code == 0x16:  # BPF_RET|BPF_A: a verdict this rewrite cannot see
            raise UnsupportedError("seccomp: the compiled filter returns a computed action; cannot supervise "
                                   "connect() with it")
        if code == ret and (k in (RET_ALLOW, RET_LOG) or k == RET_USER_NOTIF):
            target = count + labels["allow" if k != RET_USER_NOTIF else "notify"]
            out.append(struct.pack("=HBBI", ja, 0, 0, target - (i + 1)))
        else:
            out.append(bpf[8 * i:8 * i + 8])
    for index, (code, k, jt_label, jf_label) in enumerate(program):
        jt = jf = 0
        if jt_label is not None and jf_label is not None:
            jt = labels[jt_label] - (index + 1)
            jf = labels[jf_label] - (index + 1)
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise AssertionError("epilogue jump out of range")
        out.append(struct.pack("=HBBI", code, jt, jf, k))
    for nr in plain:
        table.pop(nr, None)
    return b"".join(out)


def unix_guard_rules() -> list[dict[str, Any]]:
    """OCI rules refusing AF_UNIX sockets, for a backend that cannot supervise connect() (Docker).

    socket(AF_UNIX) of every type and AF_UNIX datagram socket pairs get
    EACCES; stream and seqpacket pairs stay (their peer is fixed at birth).
    """
    comment = "pathname unix sockets of read-only binds are reachable by connect(); no supervisor here"
    rules: list[dict[str, Any]] = [
        {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno_mod.EACCES, "comment": comment,
         "args": [_masked(0, _LOW32, _AF_UNIX)]},
    ]
    for kind in (2, 3):  # SOCK_DGRAM, and SOCK_RAW which AF_UNIX turns into SOCK_DGRAM
        rules.append({"names": ["socketpair"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno_mod.EACCES,
                      "comment": comment, "args": [_masked(0, _LOW32, _AF_UNIX), _masked(1, 0xF, kind)]})
    return rules


#: Calls that can set a file's mode, and the argument holding the mode.
_MODE_ARGUMENTS = (
    ("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2),
    ("open", 2), ("openat", 3), ("creat", 1), ("mknod", 1), ("mknodat", 2),
)
_SETID_BITS = 0o6000


def _deny_setid_prologue(native: int) -> bytes:
    """BPF run before the filter: no set-user-ID or set-group-ID bit on any file.

    What the program creates in its writable paths outlives the run: for a
    root caller (idmapped) it is owned by root on disk, a setuid-root binary
    on the host; for a user it would lend that user's rights to whoever runs
    it later. chmod-family calls and file creation with S_ISUID or
    S_ISGID in the mode get EPERM; openat2 (its mode sits behind a pointer)
    gets ENOSYS, so libc falls back to openat.
    """
    arg_low = [16 + 8 * i + (0 if sys.byteorder == "little" else 4) for i in range(6)]

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06
    blocks: list[tuple[int, int]] = []
    for name, index in _MODE_ARGUMENTS:
        try:
            blocks.append((_resolve(name), index))
        except Exception:  # a call this kernel/libseccomp does not know on this arch
            continue
    try:
        openat2 = _resolve("openat2")
    except Exception:
        openat2 = -1
    # Layout: [arch check][ld nr]([jeq nr][ld arg][jset -> deny][ja end]... )[openat2][deny]
    body: list[tuple[int, int, int, int]] = []
    total_blocks = 4 * len(blocks) + (2 if openat2 >= 0 else 0)
    # Index after "ld nr": block i starts at 4*i.
    for i, (nr, index) in enumerate(blocks):
        start = 4 * i
        to_next = 3  # skip this block's other three instructions
        end = total_blocks  # index of the shared deny
        body.append((jeq, nr, 0, to_next))
        body.append((ld, arg_low[index], 0, 0))
        body.append((jset, _SETID_BITS, end - start - 2, 0))  # -> the deny, at end + 1
        body.append((0x05, end - start - 2, 0, 0))  # BPF_JMP|BPF_JA: allowed -> past the deny, at end + 2
    if openat2 >= 0:
        body.append((jeq, openat2, 0, 1))
        body.append((ret, RET_ERRNO | errno_mod.ENOSYS, 0, 0))
    code = [ins(ld, 4), ins(jeq, native, 0, len(body) + 3), ins(ld, 0)]  # foreign ABI -> the filter, which kills
    code += [ins(c, k, jt, jf) for c, k, jt, jf in body]
    code.append(ins(0x05, 1))  # no match: past the deny
    code.append(ins(ret, RET_ERRNO | errno_mod.EPERM))
    return b"".join(code)


#: What a missing namespace would have kept from the program and no other
#: mechanism governs: (call, condition). None denies the call outright;
#: ("ne0", i) denies it unless argument i is 0 (the caller itself);
#: ("eq", i, v) denies it when argument i is v.
_HOST_REACH_RULES: tuple[tuple[str, tuple[Any, ...] | None], ...] = (
    # SysV IPC: every segment, queue and semaphore set of the host's IPC namespace.
    ("shmget", None), ("shmat", None), ("shmctl", None), ("shmdt", None),
    ("msgget", None), ("msgsnd", None), ("msgrcv", None), ("msgctl", None),
    ("semget", None), ("semop", None), ("semtimedop", None), ("semctl", None),
    # POSIX message queues live in the IPC namespace too (not in /dev/mqueue's mount).
    ("mq_open", None), ("mq_unlink", None), ("mq_timedsend", None), ("mq_timedreceive", None),
    ("mq_notify", None), ("mq_getsetattr", None),
    # The user's and session's keyrings (secrets of the caller's uid).
    ("keyctl", None), ("add_key", None), ("request_key", None),
    # Limits and priorities of other processes of the same uid (Landlock does
    # not govern these; a PID namespace would hide the targets).
    ("prlimit64", ("ne0", 0)),
    ("setpriority", ("ne0", 1)), ("setpriority", ("eq", 0, 2)),  # PRIO_USER: every process of the uid
    ("ioprio_set", ("ne0", 1)), ("ioprio_set", ("eq", 0, 3)),  # IOPRIO_WHO_USER
)


def host_reach_denied() -> list[str]:
    """The calls ``deny_host_reach`` refuses (some only toward other processes)."""
    return sorted({name for name, _ in _HOST_REACH_RULES})


def _deny_host_reach_prologue(native: int) -> bytes:
    """BPF run before the filter: what an IPC/PID/user namespace would have isolated -> EPERM.

    Without namespaces the program shares the host's SysV IPC and POSIX
    message queues, the caller's keyrings, and can change the limits and
    priorities of every process of its uid; these calls are refused whatever
    the profile (``none`` included).
    """
    arg_low = [16 + 8 * i + (0 if sys.byteorder == "little" else 4) for i in range(6)]
    ld, jeq, ret = 0x20, 0x15, 0x06
    blocks: list[list[tuple[int, int, int | str, int | str]]] = []
    for name, cond in _HOST_REACH_RULES:
        try:
            nr = _resolve(name)
        except Exception:  # a call this arch does not have (e.g. the ipc() multiplexer's parts)
            continue
        if cond is None:
            blocks.append([(jeq, nr, "deny", 0)])
        elif cond[0] == "ne0":
            blocks.append([(jeq, nr, 0, 3), (ld, arg_low[cond[1]], 0, 0), (jeq, 0, 0, "deny"), (ld, 0, 0, 0)])
        else:
            blocks.append([(jeq, nr, 0, 3), (ld, arg_low[cond[1]], 0, 0), (jeq, cond[2], "deny", 0),
                           (ld, 0, 0, 0)])
    flat = [ins for block in blocks for ins in block]
    deny_at = 3 + len(flat) + 1  # after [ld arch, jeq arch, ld nr] + body + [ja past the deny]
    code = [struct.pack("=HBBI", ld, 0, 0, 4), struct.pack("=HBBI", jeq, 0, len(flat) + 3, native),
            struct.pack("=HBBI", ld, 0, 0, 0)]  # foreign ABI -> the filter, which kills
    for i, (op, k, jt, jf) in enumerate(flat):
        here = 3 + i
        jt_n = deny_at - here - 1 if jt == "deny" else jt
        jf_n = deny_at - here - 1 if jf == "deny" else jf
        assert isinstance(jt_n, int) and isinstance(jf_n, int) and 0 <= jt_n < 256 and 0 <= jf_n < 256
        code.append(struct.pack("=HBBI", op, jt_n, jf_n, k))
    code.append(struct.pack("=HBBI", 0x05, 0, 0, 1))  # BPF_JMP|BPF_JA: no match -> past the deny
    code.append(struct.pack("=HBBI", ret, 0, 0, RET_ERRNO | errno_mod.EPERM))
    return b"".join(code)


def _compile(
    label: str, data: object, source: str, notify: bool, deny_inet_sockets: bool, deny_setid: bool = False,
    unix_sockets: str = "", deny_host_reach: bool = False,
) -> CompiledFilter:
    parsed = _parse(data, source)
    bpf, table, default_errno = _build(parsed, notify, source)
    native = _native_arch()
    if unix_sockets:
        bpf = _unix_epilogue(bpf, native, table, default_errno, unix_sockets)
    if deny_inet_sockets:
        notify_for: dict[int, bool] = {}
        if notify:
            for name in ("socket", "socketpair"):
                nr = _resolve(name)
                answer = table.get(nr, default_errno)
                if answer in (None, errno_mod.EPERM):
                    notify_for[nr] = True
                    table[nr] = errno_mod.EPERM
        bpf = _deny_inet_prologue(native, notify_for) + bpf
    if deny_setid:
        bpf = _deny_setid_prologue(native) + bpf
    if deny_host_reach:
        bpf = _deny_host_reach_prologue(native) + bpf
    if len(bpf) // 8 > MAX_INSTRUCTIONS:
        raise _err(source, "", f"the compiled filter has {len(bpf) // 8} instructions, more than the kernel's "
                   f"{MAX_INSTRUCTIONS}; use fewer argument conditions")
    return CompiledFilter(
        bpf=bpf,
        notify_errnos=types.MappingProxyType(dict(sorted(table.items()))),
        notify_default_errno=default_errno,
        profile=label,
        arch=native,
    )


_cache: dict[tuple[str, str, bool, bool, bool, str, bool], CompiledFilter] = {}
_cache_lock = threading.Lock()


def cache_clear() -> None:
    """Forget every compiled filter."""
    with _cache_lock:
        _cache.clear()


def compile_filter(
    mode: str, *, notify: bool = False, deny_inet_sockets: bool = False, deny_setid: bool = False,
    unix_sockets: str = "", deny_host_reach: bool = False,
) -> CompiledFilter | None:
    """Compile the filter for ``mode`` (default, strict, none, or the path of a JSON profile).

    ``notify`` turns denials into user notifications (see the module doc);
    ``deny_inet_sockets`` refuses socket() for every domain and socketpair()
    but AF_UNIX, with EPERM (for network "none" without a network namespace);
    ``deny_setid`` refuses setting S_ISUID/S_ISGID on files (for runs with
    writable paths); ``unix_sockets`` is "" (nothing),
    "supervise" (connect() to the init, which needs ``notify``), "supervise-sendto"
    (also sendto() with an address, and every sendmsg() and sendmmsg(): egress by
    name records refused UDP) or "deny"
    (socket(AF_UNIX) refused): see the module doc; ``deny_host_reach`` refuses
    SysV IPC, POSIX message queues, keyrings and changing other processes'
    limits and priorities (for a run without namespaces, see ``host_reach_denied``).
    Returns None for ``none`` without ``deny_inet_sockets``. Results are cached
    per (mode, file content, flags). Raises ``PolicyError`` for a bad profile
    and ``UnsupportedError`` when libseccomp or the kernel cannot do it.
    """
    if not isinstance(mode, str) or not mode:
        raise PolicyError("seccomp: expected default, strict, none or the path of a JSON profile", "seccomp")
    if (unix_sockets not in ("", "supervise", "supervise-sendto", "deny")
            or (unix_sockets.startswith("supervise") and not notify)):
        raise ValueError(f"unix_sockets: {unix_sockets!r}")
    if mode == "none" and not (deny_inet_sockets or deny_setid or unix_sockets or deny_host_reach):
        return None
    content: bytes | None = None
    if mode in BUILTIN_PROFILES:
        label, source, digest = mode, f"<built-in profile {mode}>", ""
    else:
        source, content = _read_profile_file(mode)
        label, digest = f"file:{os.path.abspath(mode)}", hashlib.sha256(content).hexdigest()
    key = (label, digest, bool(notify), bool(deny_inet_sockets), bool(deny_setid), unix_sockets,
           bool(deny_host_reach))
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    data = _load_json(content, source) if content is not None else oci_profile(mode)
    compiled = _compile(label, data, source, bool(notify), bool(deny_inet_sockets), bool(deny_setid), unix_sockets,
                        bool(deny_host_reach))
    with _cache_lock:
        compiled = _cache.setdefault(key, compiled)
        while len(_cache) > _CACHE_SIZE:
            del _cache[next(iter(_cache))]
    return compiled




def _read_profile_file(path: str) -> tuple[str, bytes]:
    try:
        content = read_input_file(path)
    except OSError as exc:
        raise PolicyError(
            f"seccomp: cannot read the profile {path!r}: {exc.strerror}; give default, strict, none or a JSON file",
            "seccomp",
        ) from None
    except ValueError as exc:
        raise PolicyError(f"seccomp: {exc}; not a seccomp profile", "seccomp") from None
    return path, content


def _load_json(content: bytes, source: str) -> object:
    try:
        return json.loads(content.decode("utf-8"))
    except UnicodeDecodeError:
        raise PolicyError(f"{source}: not UTF-8 text; a seccomp profile is JSON", "seccomp") from None
    except json.JSONDecodeError as exc:
        raise PolicyError(
            f"{source}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}", "seccomp"
        ) from None


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
