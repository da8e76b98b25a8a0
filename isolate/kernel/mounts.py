"""The sandbox's root, planned in the parent (csrc/mounts.c builds it).

Every granted host path is bound at its own path. A path whose components
are symlinks on the host (``/lib -> usr/lib``) gets the same symlinks inside,
and its real directory is bound, so both spellings work in the sandbox.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .._core import lib
from .links import host_symlinks

STAGING = "/tmp"
OLDROOT = "/oldroot"
NEWROOT = "/newroot"

#: A write grant made of an idmapped tree, opened for each run (by the
#: parent, or by the pre-exec hook itself).
IDMAP = -2

#: Device nodes bound from the host into the sandbox's /dev.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


@dataclass(frozen=True)
class MountStep:
    kind: int
    target: str  # inside the sandbox
    source: str = ""  # host path (binds), options (tmpfs), link text (symlinks)
    flags: int = 0
    fd: int = -1
    mode: int = 0o755


@dataclass
class MountPlan:
    steps: list[MountStep] = field(default_factory=list)
    _dirs: set[str] = field(default_factory=set)
    _bound: list[str] = field(default_factory=list)  # targets that show a host tree

    def _covered(self, path: str) -> bool:
        return any(path == b or path.startswith(b.rstrip("/") + "/") for b in self._bound)

    def ensure_dir(self, path: str, mode: int = 0o755) -> None:
        """mkdir -p inside the new root, skipping what a bind already provides.

        A loop, not a recursion: a path of 2,000 components is a valid one (PATH_MAX is 4096), and
        ``dirname`` of a path the policy did not reduce (``//``) is the path itself.
        """
        missing: list[str] = []
        while path != "/" and path not in self._dirs and not self._covered(path) and path not in missing:
            missing.append(path)
            path = os.path.dirname(path)
        for index, where in enumerate(reversed(missing)):
            self._dirs.add(where)
            self.steps.append(MountStep(lib.ISO_MOUNT_DIR, where, mode=mode if index == len(missing) - 1 else 0o755))

    def symlink(self, path: str, text: str) -> None:
        if path in self._dirs or self._covered(path):
            return
        self.ensure_dir(os.path.dirname(path))
        self._dirs.add(path)
        self.steps.append(MountStep(lib.ISO_MOUNT_SYMLINK, path, source=text))

    def bind(self, host_path: str, target: str, *, readonly: bool, keep_dev: bool = False, fd: int = -1,
             source_fd: int = -1) -> None:
        is_dir = os.path.isdir(host_path)
        if is_dir:
            self.ensure_dir(target)
        else:
            self.ensure_dir(os.path.dirname(target))
            if not self._covered(target):
                self.steps.append(MountStep(lib.ISO_MOUNT_FILE, target, mode=0o644))
        flags = (lib.ISO_MOUNT_F_READONLY if readonly else 0) | (lib.ISO_MOUNT_F_KEEP_DEV if keep_dev else 0)
        if fd >= 0:
            self.steps.append(MountStep(lib.ISO_MOUNT_MOVE, target, flags=flags, fd=fd))
        elif fd == IDMAP:
            # The tree is cloned from the inode the parent opened, not from the path.
            self.steps.append(MountStep(lib.ISO_MOUNT_MOVE, target, source=f"/proc/self/fd/{source_fd}",
                                        flags=flags, fd=-1))
        else:
            # With source_fd, the child checks that it bound the inode the
            # parent opened, not a path that was swapped since.
            self.steps.append(MountStep(lib.ISO_MOUNT_BIND, target, source=OLDROOT + host_path, flags=flags,
                                        fd=source_fd))
        self._bound.append(target)

    def tmpfs(self, target: str, options: str) -> None:
        self.ensure_dir(target)
        self.steps.append(MountStep(lib.ISO_MOUNT_TMPFS, target, source=options))

    def add(self, kind: int, target: str, source: str = "") -> None:
        self.steps.append(MountStep(kind, target, source=source))


@dataclass(frozen=True)
class Home:
    """The program's private home: a tmpfs (``options``; empty when a ``tmpfs=`` entry already is
    one there) and host files bound read-only into it, as (host real path, path inside)."""

    path: str
    options: str
    files: list[tuple[str, str]]


def tmpfs_bounds(size: int) -> str:
    """tmpfs options bounding its bytes and its inodes (one per KiB: empty files cost kernel memory too)."""
    return f"size={size},nr_inodes={max(1024, size // 1024)}"


def plan_root(
    read: list[str],
    write: list[tuple[str, int]],
    tmpfs: list[str],
    tmpfs_options: str,
    source_fds: dict[str, int] | None = None,
    home: Home | None = None,
    shm_options: str = "mode=1777",
    binds: list[tuple[str, str, bool, int]] | None = None,
) -> MountPlan:
    """Mount steps for granted paths (write entries carry an idmapped-tree marker or -1).

    ``source_fds`` maps a real path to an O_PATH descriptor of it, opened by
    the parent: binds and idmapped trees are made from those inodes.
    ``binds`` are host paths shown elsewhere: (real source, target, read-only,
    idmapped-tree marker or -1).
    """
    source_fds = source_fds or {}
    plan = MountPlan()
    grants: list[tuple[str, bool, int, str]] = [(p, True, -1, "read") for p in read]
    grants += [(p, False, fd, "write") for p, fd in write]
    resolved = []
    for path, readonly, fd, field_name in grants:
        links, real = host_symlinks(path, field_name)
        for link, text in links:
            plan.symlink(link, text)
        resolved.append((real, readonly, fd))
    # Parents before children, so that a nested grant (a workspace under a
    # private /tmp, a writable dir under a read-only one) lands on top.
    # (target, source, read-only, idmap marker, is a tmpfs)
    entries: list[tuple[str, str, bool, int, bool]] = [(real, real, ro, fd, False) for real, ro, fd in resolved]
    entries += [(target, source, ro, fd, False) for source, target, ro, fd in binds or ()]
    entries += [(path, "", False, -1, True) for path in tmpfs]
    if home is not None and home.options:
        entries.append((home.path, "", False, -1, True))
    for path, source, readonly, fd, is_tmpfs in sorted(
            entries, key=lambda e: (e[0].rstrip("/").count("/"), e[4] is False)):
        if is_tmpfs:
            plan.tmpfs(path, home.options if home is not None and path == home.path else tmpfs_options)
        elif path != "/":
            plan.bind(source, path, readonly=readonly, fd=fd, source_fd=source_fds.get(source, -1))
    if home is not None:
        # After every grant: a file shared into the home lands on the home's tmpfs.
        for real, target in home.files:
            plan.bind(real, target, readonly=True, source_fd=source_fds.get(real, -1))

    # The merged-/usr links (/lib -> usr/lib ...) cost nothing and grant
    # nothing: the dynamic loader's absolute paths need them.
    granted = [r for r, _, _ in resolved]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            real = os.path.realpath(name)
            if any(real == g or real.startswith(g.rstrip("/") + "/") for g in granted):
                plan.symlink(name, os.readlink(name))

    plan.ensure_dir("/proc")
    plan.add(lib.ISO_MOUNT_PROC, "/proc")
    plan.tmpfs("/dev", "mode=0755,size=1m")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            plan.steps.append(MountStep(lib.ISO_MOUNT_FILE, "/dev/" + name, mode=0o644))
            plan.steps.append(
                MountStep(lib.ISO_MOUNT_BIND, "/dev/" + name, source=OLDROOT + "/dev/" + name,
                          flags=lib.ISO_MOUNT_F_KEEP_DEV)
            )
    plan.ensure_dir("/dev/pts")
    plan.add(lib.ISO_MOUNT_DEVPTS, "/dev/pts")
    plan.symlink("/dev/ptmx", "pts/ptmx")
    plan.tmpfs("/dev/shm", shm_options)
    for name, text in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2")):
        plan.symlink("/dev/" + name, text)
    return plan
