"""Rules compiled into the BPF program the C core installs: libseccomp's tree, then the prologues
and epilogue isolate adds (network sockets, set-id bits, AF_UNIX paths, host reach), cached per
input.
"""

from __future__ import annotations

import errno as errno_mod
import hashlib
import os
import struct
import sys
import threading
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...model.errors import PolicyError, UnsupportedError
from ...model.forks import fork_safe
from .abi import (
    _AF_UNIX,
    _AUDIT_ARCH_X86_64,
    _CACHE_SIZE,
    _LOW32,
    _RET_ACTION_FULL,
    _RET_DATA,
    BUILTIN_PROFILES,
    INSTALL_HINT,
    MAX_INSTRUCTIONS,
    RET_ALLOW,
    RET_ERRNO,
    RET_KILL_PROCESS,
    RET_LOG,
    RET_USER_NOTIF,
)
from .binding import _native_arch, _pyseccomp, _resolve
from .oci import _err, _load_json, _parse, _Parsed, _read_profile_file, _Rule
from .profiles import _masked, oci_profile


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
    #: Why no program could start under it (its profile refuses execveat whatever the arguments), or None: a
    #: run refuses such a filter (backends/native/filters.py); compiling it stays possible, to look at it.
    start_refusal: str | None = None

    @property
    def instructions(self) -> int:
        return len(self.bpf) // 8

    @property
    def notify(self) -> bool:
        return bool(self.notify_errnos) or self.notify_default_errno is not None


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


#: The path system calls denial tracing sends to the init (csrc/why.c looks at the same ones).
TRACED_SYSCALLS = (
    "open", "creat", "openat", "openat2", "execve", "execveat", "truncate", "mkdir", "mkdirat", "mknod",
    "mknodat", "symlink", "symlinkat", "link", "linkat", "unlink", "rmdir", "unlinkat", "rename", "renameat",
    "renameat2",
)

#: Lookups without an access, looked at for a path's absence only (``trace_paths="lookups"``).
TRACED_LOOKUPS = (
    "stat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2", "readlink", "readlinkat", "chdir",
)

#: The sixth argument of the execveat() that starts the program (ISO_EXEC_MARK in csrc/isolate.h).
EXEC_MARK = 0x15A7E0E5


def _traced_numbers(lookups: bool) -> list[int]:
    numbers = []
    for name in TRACED_SYSCALLS + (TRACED_LOOKUPS if lookups else ()):
        try:
            numbers.append(_resolve(name))
        except Exception:  # a call this architecture does not have (open, rename... on arm64)
            continue
    return numbers


def _exit_prologue(native: int) -> bytes:
    """BPF run before the filter: exit() and exit_group() allowed whatever the profile says. Refusing them
    confines nothing (a process can always end by a signal), but a process that cannot end spins in its
    C library's _exit loop (musl's) or waits for ever on a notification no one answers yet."""
    ld, jeq, ret = 0x20, 0x15, 0x06
    code = [(ld, 0, 0, 4), (jeq, 0, 4, native),  # a foreign ABI: to the filter, which kills
            (ld, 0, 0, 0), (jeq, 1, 0, _resolve("exit")), (jeq, 0, 1, _resolve("exit_group")), (ret, 0, 0, RET_ALLOW)]
    return b"".join(struct.pack("=HBBI", c, jt, jf, k) for c, jt, jf, k in code)


def _marked_never_notified(bpf: bytes, table: Mapping[int, int], default_errno: int) -> bytes:
    """The filter with every call marked EXEC_MARK in its sixth argument answered its errno plainly where the
    profile denies it with a notification. The program child marks its own start (execveat) and the report of
    its failure (write): the init that answers notifications is not running until the program has exec'd, so
    a profile that denies either would leave them, and the sandbox's start, waiting for ever. A program that
    marks its own calls only hides their denials from the report. Every other notified call stays notified."""
    ld, jeq, ret, ja = 0x20, 0x15, 0x06, 0x05
    arg5_low = (16 if sys.byteorder == "little" else 20) + 40
    arg5_high = arg5_low + 4 if sys.byteorder == "little" else arg5_low - 4
    count = len(bpf) // 8
    out = []
    for i in range(count):
        code, _jt, _jf, k = struct.unpack_from("=HBBI", bpf, 8 * i)
        if code == ret and k == RET_USER_NOTIF:  # to the block below, which decides
            out.append(struct.pack("=HBBI", ja, 0, 0, count - (i + 1)))
        else:
            out.append(bpf[8 * i:8 * i + 8])
    answers = [(nr, e) for nr, e in sorted(table.items()) if e != default_errno]
    rest = 2 * len(answers) + 2  # from after the mark's high half to the notification
    if rest + 2 > 255:
        raise UnsupportedError(f"seccomp: the profile denies {len(answers)} system calls with errnos other than "
                               "its default; at most 126 can be reported")
    block = [
        (ld, 0, 0, arg5_low),
        (jeq, 0, rest + 2, EXEC_MARK),          # not marked: notify
        (ld, 0, 0, arg5_high),
        (jeq, 0, rest, 0),
        (ld, 0, 0, 0),                          # marked: its errno, plainly
    ]
    for nr, answer in answers:
        block += [(jeq, 0, 1, nr), (ret, 0, 0, RET_ERRNO | answer)]
    block += [(ret, 0, 0, RET_ERRNO | default_errno), (ret, 0, 0, RET_USER_NOTIF)]
    out.extend(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in block)
    return b"".join(out)


def _unix_epilogue(bpf: bytes, native: int, table: dict[int, int], default_errno: int | None,
                   mode: str, trace_paths: bool | str = False) -> bytes:
    """Route the profile's allowed connect()/socket()/socketpair() through an epilogue (see the module doc).

    ``mode`` "" with ``trace_paths``: no connect() supervision, only the path calls to the init.
    With ``trace_paths``, every path call the profile allows goes to the init, which looks at it and
    lets it continue (denial tracing, csrc/why.c), but the execveat() marked as the program's own start
    (the init is not running yet to answer it).
    """
    connect_nr, socket_nr, socketpair_nr = _resolve("connect"), _resolve("socket"), _resolve("socketpair")
    traced = _traced_numbers(trace_paths == "lookups") if trace_paths else []
    execveat_nr = _resolve("execveat") if trace_paths else -1
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
    # A path call the profile denies is answered plainly too: the init lets every traced call continue.
    plain = ([connect_nr] + ([sendto_nr] if sendto_nr is not None else []) + sendmsg_nrs if mode else []) + traced
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
    for nr in traced:
        emit(jeq, nr, "execveat" if nr == execveat_nr else "trace_notify", f"not_traced_{nr}")
        label(f"not_traced_{nr}")
    if mode:
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
    if trace_paths:
        label("execveat")  # the program's own start, marked in its sixth argument: no one to ask yet
        emit(ld, arg0_low + 40)
        emit(jeq, EXEC_MARK, "mark_high", "trace_notify")
        label("mark_high")
        emit(ld, arg0_low + 44 if sys.byteorder == "little" else arg0_low + 36)
        emit(jeq, 0, "ret_allow2", "trace_notify")
        label("trace_notify")
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


def _start_refusal(parsed: _Parsed, source: str) -> str | None:
    """Why no program could start under a profile that refuses execveat() whatever its arguments (None: it may).

    The program's start is that call (csrc/process.c), made under the profile: such a run ended 126, 127 or
    159 (SIGSYS), with nothing said when the profile refused write too. A refusal is enforced, never dropped:
    a run refuses the profile as a whole, the call named (CompiledFilter.start_refusal). The start makes no
    other call under the filter (a failed one is reported by the sandbox's first process, which the filter does
    not confine). A rule on execveat's arguments is the run's to meet: its refusal is reported as the start's."""
    nr = _resolve("execveat")
    rules = [rule for rule in parsed.rules if rule.nr == nr]
    if any(rule.conds for rule in rules):
        return None
    action = rules[-1].action if rules else parsed.default
    if action & _RET_ACTION_FULL in (RET_ALLOW, RET_LOG):
        return None
    return str(_err(source, "", "it refuses execveat, the system call that starts the program (isolate execs it "
                    "with execveat(2)): no program could start under it; allow execveat in the profile"))


def _compile(
    label: str, data: object, source: str, notify: bool, deny_inet_sockets: bool, deny_setid: bool = False,
    unix_sockets: str = "", deny_host_reach: bool = False, trace_paths: bool | str = False,
) -> CompiledFilter:
    parsed = _parse(data, source)
    bpf, table, default_errno = _build(parsed, notify, source)
    native = _native_arch()
    if notify:
        bpf = _marked_never_notified(bpf, table, default_errno or errno_mod.EPERM)
    # Before the epilogue, which takes its ALLOW as it takes the profile's: every allow passes the supervisor.
    bpf = _exit_prologue(native) + bpf
    if unix_sockets or trace_paths:
        bpf = _unix_epilogue(bpf, native, table, default_errno, unix_sockets, trace_paths)
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
        start_refusal=_start_refusal(parsed, source),
    )


_cache: dict[tuple[str, str, bool, bool, bool, str, bool, bool | str], CompiledFilter] = {}


_cache_lock = fork_safe(threading.Lock())


def cache_clear() -> None:
    """Forget every compiled filter."""
    with _cache_lock:
        _cache.clear()


def compile_filter(
    mode: str, *, notify: bool = False, deny_inet_sockets: bool = False, deny_setid: bool = False,
    unix_sockets: str = "", deny_host_reach: bool = False, trace_paths: bool | str = False,
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
    limits and priorities (for a run without namespaces, see ``host_reach_denied``);
    ``trace_paths`` sends the path calls (``TRACED_SYSCALLS``, and with "lookups" ``TRACED_LOOKUPS``
    too) to the init, which needs ``notify`` (denial tracing: the init looks and lets each continue).
    Returns None for ``none`` without ``deny_inet_sockets``. Results are cached
    per (mode, file content, flags). Raises ``PolicyError`` for a bad profile
    and ``UnsupportedError`` when libseccomp or the kernel cannot do it.
    """
    if not isinstance(mode, str) or not mode:
        raise PolicyError("seccomp: expected default, strict, none or the path of a JSON profile", "seccomp")
    if (unix_sockets not in ("", "supervise", "supervise-sendto", "deny")
            or ((unix_sockets.startswith("supervise") or trace_paths) and not notify)):
        raise ValueError(f"unix_sockets: {unix_sockets!r}")
    if mode == "none" and not (deny_inet_sockets or deny_setid or unix_sockets or deny_host_reach or trace_paths):
        return None
    content: bytes | None = None
    if mode in BUILTIN_PROFILES:
        label, source, digest = mode, f"<built-in profile {mode}>", ""
    else:
        source, content = _read_profile_file(mode)
        label, digest = f"file:{os.path.abspath(mode)}", hashlib.sha256(content).hexdigest()
    key = (label, digest, bool(notify), bool(deny_inet_sockets), bool(deny_setid), unix_sockets,
           bool(deny_host_reach), trace_paths if trace_paths == "lookups" else bool(trace_paths))
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    data = _load_json(content, source) if content is not None else oci_profile(mode)
    compiled = _compile(label, data, source, bool(notify), bool(deny_inet_sockets), bool(deny_setid), unix_sockets,
                        bool(deny_host_reach), trace_paths if trace_paths == "lookups" else bool(trace_paths))
    with _cache_lock:
        compiled = _cache.setdefault(key, compiled)
        while len(_cache) > _CACHE_SIZE:
            del _cache[next(iter(_cache))]
    return compiled
