"""The built-in profiles (``default``, ``strict``), written as Docker/OCI profile data so that the
native and Docker backends enforce the same thing.
"""

from __future__ import annotations

import copy
import errno as errno_mod
import platform
from typing import Any

from ...model.errors import UnsupportedError
from .abi import _AF_UNIX, _AF_VSOCK, _CLONE_NEW_FLAGS, _CLONE_NEWTIME, _LOW32, _TIOCLINUX, _TIOCSTI, _UNSAFE_PERSONA
from .binding import _libseccomp, _native_scmp_name
from .oci import _load_json, _parse, _read_profile_file

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
