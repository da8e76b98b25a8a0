"""Landlock: which rights the kernel handles, and which each granted path gets.

Mirrors csrc/landlock.c, which only applies what is computed here. Names are
the kernel's (include/uapi/linux/landlock.h).
"""

from __future__ import annotations

from functools import lru_cache

from .._core import lib

LANDLOCK_ACCESS_FS_EXECUTE = 1 << 0
LANDLOCK_ACCESS_FS_WRITE_FILE = 1 << 1
LANDLOCK_ACCESS_FS_READ_FILE = 1 << 2
LANDLOCK_ACCESS_FS_READ_DIR = 1 << 3
LANDLOCK_ACCESS_FS_REMOVE_DIR = 1 << 4
LANDLOCK_ACCESS_FS_REMOVE_FILE = 1 << 5
LANDLOCK_ACCESS_FS_MAKE_CHAR = 1 << 6
LANDLOCK_ACCESS_FS_MAKE_DIR = 1 << 7
LANDLOCK_ACCESS_FS_MAKE_REG = 1 << 8
LANDLOCK_ACCESS_FS_MAKE_SOCK = 1 << 9
LANDLOCK_ACCESS_FS_MAKE_FIFO = 1 << 10
LANDLOCK_ACCESS_FS_MAKE_BLOCK = 1 << 11
LANDLOCK_ACCESS_FS_MAKE_SYM = 1 << 12
LANDLOCK_ACCESS_FS_REFER = 1 << 13  # ABI 2
LANDLOCK_ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
LANDLOCK_ACCESS_FS_IOCTL_DEV = 1 << 15  # ABI 5
#: The lookup of a pathname unix socket by connect() and sendmsg() (ABI 9).
LANDLOCK_ACCESS_FS_RESOLVE_UNIX = 1 << 16

LANDLOCK_ACCESS_NET_BIND_TCP = 1 << 0  # ABI 4
LANDLOCK_ACCESS_NET_CONNECT_TCP = 1 << 1  # ABI 4

LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
LANDLOCK_SCOPE_SIGNAL = 1 << 1  # ABI 6

#: Rights that only make sense on a file (the kernel rejects others on a file rule).
FILE_RIGHTS = (
    LANDLOCK_ACCESS_FS_EXECUTE
    | LANDLOCK_ACCESS_FS_WRITE_FILE
    | LANDLOCK_ACCESS_FS_READ_FILE
    | LANDLOCK_ACCESS_FS_TRUNCATE
    | LANDLOCK_ACCESS_FS_IOCTL_DEV
    | LANDLOCK_ACCESS_FS_RESOLVE_UNIX
)


@lru_cache(maxsize=1)
def abi() -> int:
    """The Landlock ABI of this kernel (0: no Landlock)."""
    return int(lib.iso_landlock_abi())


def handled_fs(version: int, resolve_unix: bool = False) -> int:
    """Every filesystem right the given ABI knows: all of them are denied unless granted.

    ``resolve_unix`` adds, from ABI 9, the lookup of pathname unix sockets
    (handled only when the network is not the host's: see unix_socket_mechanism).
    """
    rights = (1 << 13) - 1
    if version >= 9 and resolve_unix:
        rights |= LANDLOCK_ACCESS_FS_RESOLVE_UNIX
    if version >= 2:
        rights |= LANDLOCK_ACCESS_FS_REFER
    if version >= 3:
        rights |= LANDLOCK_ACCESS_FS_TRUNCATE
    if version >= 5:
        rights |= LANDLOCK_ACCESS_FS_IOCTL_DEV
    return rights if version >= 1 else 0


def read_rights(version: int) -> int:
    """read=: read and execute."""
    return LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR


def write_rights(version: int) -> int:
    """write= and tmpfs=: everything but creating device nodes."""
    return handled_fs(version) & ~(
        LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_BLOCK | LANDLOCK_ACCESS_FS_IOCTL_DEV
    )


def device_rights(version: int) -> int:
    """The sandbox's /dev: read, write and ioctl on the few nodes it holds."""
    rights = LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_READ_DIR
    if version >= 3:
        rights |= LANDLOCK_ACCESS_FS_TRUNCATE
    if version >= 5:
        rights |= LANDLOCK_ACCESS_FS_IOCTL_DEV
    return rights


def proc_rights(version: int) -> int:
    """The sandbox's own /proc: read-only."""
    return LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR


def handled_net(version: int, deny_tcp: bool) -> int:
    """TCP bind and connect, handled (and so denied) when the policy says no network."""
    if version >= 4 and deny_tcp:
        return LANDLOCK_ACCESS_NET_BIND_TCP | LANDLOCK_ACCESS_NET_CONNECT_TCP
    return 0


def scoped(version: int) -> int:
    """ABI 6 scopes: no signals to, and no abstract unix sockets of, processes outside."""
    if version >= 6:
        return LANDLOCK_SCOPE_SIGNAL | LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET
    return 0


def without_namespaces_refusal(version: int) -> str | None:
    """Why a run without namespaces cannot be confined on this kernel, or None.

    Without a mount namespace Landlock is what confines the files; without a
    PID namespace its ABI 6 scoping is what keeps the program's signals to its
    own domain (Landlock governs ptrace and /proc/PID/mem from ABI 1): before
    it, the program could kill or stop every process of the uid it runs as,
    the caller's own for a regular user.
    """
    if version == 0:
        return "filesystem: without namespaces, Landlock is needed and this kernel has none"
    if version < 6:
        return (f"processes: without namespaces, Landlock ABI 6 (Linux 6.12) is what keeps the program's signals "
                f"from every other process of its uid (the caller's own, for a regular user), and this kernel has "
                f"ABI {version}; use namespaces (the default), or best_effort to run without that")
    return None


def resolve_unix_right(version: int) -> int:
    """The right that lets write grants, tmpfs mounts and named sockets be connected to (0 before ABI 9)."""
    return LANDLOCK_ACCESS_FS_RESOLVE_UNIX if version >= 9 else 0


def unix_socket_mechanism(version: int, network: str, namespaces: bool, has_init: bool) -> str:
    """What keeps the program from the host's pathname unix sockets (``enforced["unix_sockets"]``).

    ``host``: nothing (the host's network is granted, its sockets with it);
    ``seccomp-no-sockets``: without namespaces, network none refuses socket();
    ``landlock``: ABI 9's LANDLOCK_ACCESS_FS_RESOLVE_UNIX;
    ``supervisor``: the init performs each connect() (csrc/supervise.c);
    ``seccomp-no-unix-sockets``: no init to supervise (the pre-exec hook), so
    socket(AF_UNIX) is refused.
    """
    if network == "host":
        return "host"
    if not namespaces:
        return "seccomp-no-sockets"
    if version >= 9:
        return "landlock"
    return "supervisor" if has_init else "seccomp-no-unix-sockets"
