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
errno: they are enforced exactly, but not reported."""

from __future__ import annotations

from .abi import (
    BUILTIN_PROFILES,
    MAX_INSTRUCTIONS,
    RET_ALLOW,
    RET_ERRNO,
    RET_KILL_PROCESS,
    RET_KILL_THREAD,
    RET_LOG,
    RET_TRACE,
    RET_TRAP,
    RET_USER_NOTIF,
)
from .binding import _native_arch as _native_arch
from .binding import syscall_name, syscall_number
from .compiler import CompiledFilter, cache_clear, compile_filter, host_reach_denied, unix_guard_rules
from .compiler import _build as _build
from .compiler import _new_filter as _new_filter
from .oci import _parse as _parse
from .profiles import oci_profile, without_network_sockets
from .support import available

__all__ = [
    "BUILTIN_PROFILES",
    "MAX_INSTRUCTIONS",
    "RET_ALLOW",
    "RET_ERRNO",
    "RET_KILL_PROCESS",
    "RET_KILL_THREAD",
    "RET_LOG",
    "RET_TRACE",
    "RET_TRAP",
    "RET_USER_NOTIF",
    "CompiledFilter",
    "available",
    "cache_clear",
    "compile_filter",
    "host_reach_denied",
    "oci_profile",
    "syscall_name",
    "syscall_number",
    "unix_guard_rules",
    "without_network_sockets",
]
