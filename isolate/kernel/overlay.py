"""An overlay workspace: the source as the read-only lower layer of an overlayfs inside the sandbox.

``Workspace(source, mode="overlay")``: the sandbox's init mounts an overlayfs
at the workspace's target, in its own user namespace (unprivileged overlayfs,
Linux 5.11), with ``userxattr``. Its lower layer is the source, mounted
read-only; its upper and work directories lie in the sandbox's private state
directory (``<data>/overlay/upper`` and ``work``, made by the host, 0700 above
them). Whatever the program writes, deletes or renames lands in the upper
layer: the source is never written.

The parent prepares everything (csrc/mounts.c only issues the calls): the
layers are bound at staging points of the child's namespace from paths the
parent resolved and opened (the child checks it bound those very inodes), or,
for a root caller, the lower layer is an idmapped tree the parent cloned from
its descriptor, which shows the source owner's files as the program's.

Where the overlay cannot work this refuses with ``UnsupportedError`` naming
the cause; it never falls back to a copy.

The host reads the program's changes from the upper layer: with
``userxattr`` there are no redirects and no metacopy, so it holds whole
files, whiteouts (0/0 character devices: deleted) and opaque directories
(``user.overlay.opaque``: nothing of the lower directory shows through, as
after ``rm -r d; mkdir d``). The merged view is rebuilt from the two layers;
``diff`` and ``commit`` then run workspace.py's own code over it (links that
lead out refused, no set-id bit, no device, FIFO or socket written).
Renaming a directory of the source inside the sandbox fails with EXDEV (no
redirects): ``mv`` copies and deletes instead, which the diff shows as such.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import platform
import stat
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..model.errors import IsolationError, UnsupportedError
from ..model.workspace import Workspace
from .links import DIR_FLAGS
from .tree import MAX_DEPTH, Changes, Entry, _kind, _open_dir, _open_file, apply, check_target, diff, walk

#: Where the child mounts the layers before it mounts the overlay (in its staging root, gone after pivot_root).
STAGING_LOWER = "/.isolate-overlay-lower"
STAGING_STATE = "/.isolate-overlay-state"
STAGING_BASE = "/.isolate-overlay-base"
OPAQUE_XATTR = "user.overlay.opaque"
REDIRECT_XATTR = "user.overlay.redirect"
WAY_OUT = "use Workspace(mode='copy') (isolate-run sandbox create --mode copy)"


class OverlayRefused(UnsupportedError):
    """The overlay cannot be made here (the file systems, the kernel or the user namespace refuse it)."""


@dataclass(frozen=True)
class Layers:
    """The host side of an overlay workspace: the source and the state directory holding upper and work."""

    source: str
    target: str
    state: str  # <data>/overlay, holding upper/ and work/ (and base/)
    #: A snapshot's layer (isolate/kernel/layers.py) between the source and the upper layer: a sandbox
    #: started from a snapshot. Its descriptor, open on the clone in <data>/overlay/base (-1: none).
    base_fd: int = -1
    #: A descriptor of the lower layer as the host made it (a copy workspace's private copy, in the state
    #: directory): the plan binds the directory the path names only if it is this one (-1: the source).
    source_fd: int = -1

    @property
    def base(self) -> str:
        return os.path.join(self.state, "base")

    @property
    def upper(self) -> str:
        return os.path.join(self.state, "upper")

    @property
    def work(self) -> str:
        return os.path.join(self.state, "work")


def layers_for(workspace: Workspace, data: str) -> Layers:
    """Where the layers of a sandbox whose data directory is data go; refuses early what cannot work."""
    assert workspace.source is not None
    layers = Layers(os.path.realpath(workspace.source), workspace.target, os.path.join(data, "overlay"))
    refusal = host_refusal(layers)
    if refusal:
        raise UnsupportedError(f"workspace mode overlay: {refusal}; {WAY_OUT}")
    return layers


def make_layers(layers: Layers, data_fd: int) -> tuple[int, int]:
    """Make the upper and work directories in the sandbox's fresh data directory (its descriptor: nothing
    on the way is looked up again); the upper directory's (st_dev, st_ino)."""
    flags = DIR_FLAGS
    os.mkdir("overlay", 0o700, dir_fd=data_fd)
    state = os.open("overlay", flags, dir_fd=data_fd)
    try:
        os.mkdir("upper", 0o755, dir_fd=state)
        os.mkdir("work", 0o700, dir_fd=state)
        upper = os.stat("upper", dir_fd=state, follow_symlinks=False)
        work = os.open("work", flags, dir_fd=state)
        try:
            probe = xattr_problem(work, layers.work)
        finally:
            os.close(work)
    finally:
        os.close(state)
    if probe:
        raise OverlayRefused(f"workspace mode overlay: {probe}; {WAY_OUT}")
    return upper.st_dev, upper.st_ino


def _kernel() -> tuple[int, int]:
    """(major, minor) of the running kernel."""
    try:
        major, minor = platform.release().split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (1 << 16, 0)  # a release this cannot read: let the mount itself tell


def host_refusal(layers: Layers) -> str | None:
    """Why an overlay cannot work here, known before anything is tried (None: try it)."""
    from .hostinfo import filesystem_type as _filesystem_type
    from .hostinfo import userns_advice, userns_error

    if _kernel() < (5, 11):
        return (f"this kernel ({platform.release()}) mounts no overlayfs in a user namespace (Linux 5.11 or "
                "later does)")
    err = userns_error()
    if err:
        return f"this caller cannot create a user namespace ({os.strerror(err)}): {userns_advice(err)}"
    data = os.path.realpath(os.path.dirname(layers.state))
    if data.startswith(layers.source.rstrip("/") + "/") or layers.source.startswith(data + "/"):
        # Overlapping layers: the program would see its own upper layer through the lower one.
        return (f"the sandbox's state directory {data} lies inside the source {layers.source}; set "
                "ISOLATE_STATE_DIR (or XDG_STATE_HOME) to a directory outside it")
    state_fs = _filesystem_type(os.path.dirname(layers.state))
    if state_fs == "overlay":
        return (f"the sandbox's state directory {os.path.dirname(layers.state)} is on an overlayfs, which the "
                "kernel refuses as an overlay's upper layer (as inside a container; XDG_STATE_HOME can move it)")
    return None


def xattr_problem(target: int | str, path: str) -> str | None:
    """None when the file system of ``target`` (a descriptor, or ``path``) keeps user.* xattrs (the upper
    layer's metadata), else why not."""
    try:
        if isinstance(target, int):
            os.setxattr(target, "user.isolate-probe", b"1")
            os.removexattr(target, "user.isolate-probe")
        else:
            os.setxattr(target, "user.isolate-probe", b"1", follow_symlinks=False)
            os.removexattr(target, "user.isolate-probe", follow_symlinks=False)
    except OSError as exc:
        from .hostinfo import filesystem_type as _filesystem_type

        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return (f"the sandbox's state directory ({_filesystem_type(path)}) keeps no user.* extended "
                    f"attributes ({exc.strerror}), which an overlay's upper layer needs (tmpfs has them from "
                    "Linux 6.6; XDG_STATE_HOME can move the state directory)")
        return f"{path}: {exc.strerror}"
    return None


# -- the child's steps, prepared in the parent ------------------------------------


@dataclass(frozen=True)
class Step:
    """One struct iso_mount (plan.py turns it into C)."""

    kind: int
    target: str
    source: str = ""
    flags: int = 0
    fd: int = -1
    mode: int = 0o700
    upper: str = ""
    work: str = ""


@dataclass
class Planned:
    steps: list[Step]
    fds: list[int]  # descriptors the steps use: closed once the child has them
    enforced: dict[str, Any]


@lru_cache(maxsize=8)
def _lower_userns(owner_uid: int, owner_gid: int, uid: int, gid: int) -> int:
    from .._core import ffi, lib

    fd = int(lib.iso_make_idmap_userns_of(owner_uid, owner_gid, uid, gid))
    if fd < 0:
        err = ffi.errno
        raise OverlayRefused(f"workspace mode overlay: the user namespace for the source's idmapped mount "
                               f"cannot be made ({os.strerror(err)}); {WAY_OUT}")
    return fd


def plan(layers: Layers, newroot: str, oldroot: str, program_uid: int, program_gid: int, index: int = 0) -> Planned:
    """The mount steps of the overlay, its descriptors opened and checked here (the caller closes them).

    ``index``: which of the run's overlays this is (each has staging points of its own: learn mode
    mounts one per learned write grant)."""
    from .._core import ffi, lib

    fds: list[int] = []
    try:
        return _plan(layers, newroot, oldroot, program_uid, program_gid, fds, ffi, lib, f"-{index}" if index else "")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _plan(layers: Layers, newroot: str, oldroot: str, program_uid: int, program_gid: int, fds: list[int],
          ffi: Any, lib: Any, suffix: str) -> Planned:
    staging_lower, staging_state, staging_base = (STAGING_LOWER + suffix, STAGING_STATE + suffix,
                                                   STAGING_BASE + suffix)

    def opened(path: str, flags: int) -> int:
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY)
        except OSError as exc:
            raise IsolationError(f"workspace mode overlay: {path}: {exc.strerror}") from None
        fds.append(fd)
        return fd

    source_fd = opened(layers.source, os.O_PATH)
    if layers.source_fd >= 0 and _identity(source_fd) != _identity(layers.source_fd):
        raise IsolationError(f"workspace: {layers.source}: replaced while the sandbox was made")
    state_fd = opened(layers.state, os.O_PATH)
    upper_fd = opened(layers.upper, os.O_RDONLY)
    root_caller = os.geteuid() == 0
    enforced: dict[str, Any] = {"mode": "overlay", "mechanism": "overlayfs (userxattr) in the sandbox's user "
                                "namespace", "lower": f"{layers.source} (read-only)", "upper": layers.upper}
    steps = [Step(lib.ISO_MOUNT_DIR, staging_lower), Step(lib.ISO_MOUNT_DIR, staging_state)]
    owner = os.fstat(source_fd)
    if root_caller and (owner.st_uid, owner.st_gid) != (program_uid, program_gid):
        # The program (uid program_uid) must own what the source's owner owns, or it could change nothing:
        # the lower layer is an idmapped clone of the source, and the upper layer belongs to the program
        # (what overlayfs copies up keeps the owner it shows).
        userns = _lower_userns(owner.st_uid, owner.st_gid, program_uid, program_gid)
        tree = int(lib.iso_open_idmapped_tree(f"/proc/self/fd/{source_fd}".encode(), userns))
        if tree < 0:
            err = ffi.errno
            from .hostinfo import filesystem_type as _filesystem_type

            raise OverlayRefused(
                f"workspace mode overlay: a root caller's program (uid {program_uid}) owns the source's files "
                f"through an idmapped mount, and the source's file system ({_filesystem_type(layers.source)}) "
                f"takes none ({os.strerror(err)}); {WAY_OUT}"
                + (f", or pass uid={owner.st_uid} (the source's owner)" if owner.st_uid else ""))
        fds.append(tree)
        steps.append(Step(lib.ISO_MOUNT_MOVE, staging_lower, flags=lib.ISO_MOUNT_F_READONLY, fd=tree))
        enforced["lower"] += f", idmapped: uid {owner.st_uid} shown as {program_uid}"
    else:
        steps.append(Step(lib.ISO_MOUNT_BIND, staging_lower, source=oldroot + layers.source,
                          flags=lib.ISO_MOUNT_F_READONLY, fd=source_fd))
    if root_caller:
        os.fchown(upper_fd, program_uid, program_gid)
    steps.append(Step(lib.ISO_MOUNT_BIND, staging_state, source=oldroot + os.path.realpath(layers.state),
                      fd=state_fd))
    lowerdir = staging_lower
    if layers.base_fd >= 0:
        # A snapshot's layer above the source: bound read-only from the very directory the host cloned.
        base_fd = opened(layers.base, os.O_PATH)
        if (os.fstat(base_fd).st_dev, os.fstat(base_fd).st_ino) != (os.fstat(layers.base_fd).st_dev,
                                                                      os.fstat(layers.base_fd).st_ino):
            raise IsolationError(f"workspace: {layers.base}: replaced while the sandbox was made")
        steps.insert(0, Step(lib.ISO_MOUNT_DIR, staging_base))
        steps.append(Step(lib.ISO_MOUNT_BIND, staging_base, source=oldroot + os.path.realpath(layers.base),
                          flags=lib.ISO_MOUNT_F_READONLY, fd=base_fd))
        lowerdir = f"{staging_base}:{staging_lower}"
        enforced["base"] = f"{layers.base} (a snapshot's layer, read-only)"
    steps.append(Step(lib.ISO_MOUNT_OVERLAY, newroot + layers.target, source=lowerdir, fd=upper_fd,
                      upper=staging_state + "/upper", work=staging_state + "/work"))
    return Planned(steps, fds, enforced)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def failure(err: int, layers: Layers, step: str = "mount-overlay") -> UnsupportedError:
    """The kernel refused the overlay in the child: why, as far as can be told, and the way out."""
    from .hostinfo import filesystem_type as _filesystem_type

    lower_fs = _filesystem_type(layers.source)
    upper_fs = _filesystem_type(layers.state)
    below = _mounts_below(layers.source)
    if err == errno.ESTALE:
        cause = "a layer's directory was replaced while the sandbox was being made"
    elif err == errno.EINVAL and below and os.geteuid() != 0:
        cause = (f"the source has other file systems mounted inside it ({below[0]}"
                 + (f" and {len(below) - 1} more" if len(below) > 1 else "") + "), and the kernel takes no lower "
                 "layer whose mounts a user namespace may not uncover (they are locked to it)")
    elif err == errno.EINVAL and lower_fs == "overlay":
        cause = ("the source is on an overlayfs, and another overlay over it may exceed the kernel's stacking "
                 "depth (2)")
    elif err == errno.ENODEV:
        cause = "this kernel has no overlayfs (module overlay not loaded or not built)"
    elif err in (errno.EPERM, errno.EACCES):
        cause = (f"the kernel does not let this user namespace mount an overlayfs ({os.strerror(err)}; "
                 "unprivileged overlayfs needs Linux 5.11, and some distributions disable it)")
    else:
        cause = (f"the kernel refused it ({os.strerror(err)}): its layers' file systems (source on {lower_fs}, "
                 f"upper layer on {upper_fs}) may not serve as lower and upper layers (the kernel log says which)")
    # A layer swapped meanwhile is a race (or an attack), not this host refusing overlays.
    kind = UnsupportedError if err == errno.ESTALE else OverlayRefused
    return kind(f"workspace mode overlay: cannot mount the overlay (at {step}): {cause}; {WAY_OUT}")


def _mounts_below(path: str) -> list[str]:
    """Mount points strictly inside path (from /proc/self/mountinfo)."""
    out = []
    prefix = path.rstrip("/") + "/"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) > 4:
                    point = fields[4].replace("\\040", " ")
                    if point.startswith(prefix):
                        out.append(point)
    except OSError:
        pass
    return out


# -- reading the changes back ------------------------------------------------------


@dataclass
class Merged:
    """The view the program has, rebuilt on the host from the two layers."""

    entries: dict[str, Entry]
    upper: set[str]  # paths whose node is the upper layer's (the others are the source's own)


def _walk_upper(upper_fd: int) -> tuple[dict[str, Entry], set[str], set[str]]:
    """The upper layer's nodes (whiteouts left out), its whiteouts, and its opaque directories."""
    entries: dict[str, Entry] = {}
    whiteouts: set[str] = set()
    opaque: set[str] = set()

    def visit(dir_fd: int, prefix: str, depth: int) -> None:
        for name in sorted(os.listdir(dir_fd)):
            rel = prefix + name
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                whiteouts.add(rel)  # the program deleted what the source has here
                continue
            kind = _kind(info.st_mode)
            if kind == "dir" and depth >= MAX_DEPTH:
                kind = "deep"
            link = os.readlink(name, dir_fd=dir_fd) if kind == "link" else ""
            # Inode numbers of the upper layer are told apart from the source's (hard-link detection).
            entries[rel] = Entry(kind, stat.S_IMODE(info.st_mode), info.st_size, link, -1 - info.st_ino,
                                 info.st_nlink)
            if kind != "dir":
                continue
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                if _xattr(child, REDIRECT_XATTR) is not None:
                    raise IsolationError(f"workspace: {rel}: a redirected directory in the overlay's upper layer "
                                         "(not made with userxattr); cannot tell its changes")
                if _xattr(child, OPAQUE_XATTR) == b"y":
                    opaque.add(rel)
                visit(child, rel + "/", depth + 1)
            finally:
                os.close(child)

    visit(upper_fd, "", 1)
    return entries, whiteouts, opaque


def _xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def merged_view(source_fd: int, upper_fd: int, workspace: Workspace,
                lower: dict[str, Entry] | None = None) -> Merged:
    """The program's view: the source's nodes, hidden or replaced by the upper layer's as overlayfs does."""
    if lower is None:
        lower = walk(source_fd, workspace)
    upper, whiteouts, opaque = _walk_upper(upper_fd)
    # A lower node stays visible unless the upper layer has a node at its path, or a whiteout, an opaque
    # directory or a non-directory at one of its ancestors (a directory merges only with a directory).
    hiding = whiteouts | opaque | {rel for rel, entry in upper.items() if entry.kind != "dir"}
    entries: dict[str, Entry] = {}
    for rel, entry in lower.items():
        if rel in upper or rel in whiteouts:
            continue
        parts = rel.split("/")
        if any("/".join(parts[:i]) in hiding for i in range(1, len(parts))):
            continue
        # The source's own hard links are the user's, not the program's: each name is a file of its own here
        # (the one-name-per-file rule of diff is against links a program makes to multiply a file).
        entries[rel] = dataclasses.replace(entry, nlink=1) if entry.nlink > 1 else entry
    entries.update(upper)
    return Merged(dict(sorted(entries.items())), set(upper))


class _View:
    """An overlay workspace's layers opened on the host for one diff or commit.

    ``copy_fd``: the lower layer is that private copy of the source (a copy workspace kept as layers,
    isolate/backends/native/copies.py; the caller keeps the descriptor), not the source: its nodes are not
    the source's."""

    def __init__(self, workspace: Workspace, upper_fd: int, copy_fd: int = -1, base_fd: int = -1) -> None:
        assert workspace.source is not None
        self.workspace = workspace
        self.upper_fd = upper_fd
        self.base_fd = base_fd
        self.below: set[str] = set()  # paths whose node is the base layer's
        self.copied = copy_fd >= 0
        self.lower_fd = os.dup(copy_fd) if copy_fd >= 0 else _open_dir(workspace.source)
        try:
            self.source_fd = _open_dir(workspace.source) if self.copied else os.dup(self.lower_fd)
        except BaseException:
            os.close(self.lower_fd)
            raise
        try:
            self.lower = walk(self.lower_fd, workspace)
            below = self.lower
            if base_fd >= 0:
                # A sandbox started from a snapshot: the snapshot's layer lies between the lower and upper layers.
                based = merged_view(self.lower_fd, base_fd, workspace, self.lower)
                below, self.below = based.entries, based.upper
            self.merged = merged_view(self.lower_fd, upper_fd, workspace, below)
            if workspace.exclude:
                # A copy's excluded names are left alone, as a walk of its tree leaves them (the layers the
                # program wrote may hold them: it made them there).
                self.merged.entries = {rel: e for rel, e in self.merged.entries.items()
                                       if not any(workspace.excluded(part) for part in rel.split("/"))}
        except BaseException:
            self.close()
            raise

    def open(self, rel: str) -> int:
        if rel in self.merged.upper:
            return _open_file(self.upper_fd, rel)
        return _open_file(self.base_fd if rel in self.below else self.lower_fd, rel)

    def same_as_source(self) -> set[str]:
        """Paths whose node is the source's own (unchanged by definition; none over a copy)."""
        if self.copied:
            return set()
        return {rel for rel in self.merged.entries if rel not in self.merged.upper and rel not in self.below}

    def close(self) -> None:
        os.close(self.lower_fd)
        os.close(self.source_fd)


def overlay_diff(workspace: Workspace, upper_fd: int, copy_fd: int = -1, base_fd: int = -1) -> Changes:
    """What the program changed against the source (added, modified, deleted, and what commit refuses).
    ``copy_fd``: the private copy the upper layer lies over (a copy workspace; -1: the source); ``base_fd``:
    the snapshot's layer between them (a sandbox started from a snapshot), or -1."""
    view = _View(workspace, upper_fd, copy_fd, base_fd)
    try:
        return diff(-1, view.source_fd, workspace, mine=view.merged.entries, open_mine=view.open,
                    theirs=None if view.copied else view.lower, same=view.same_as_source())
    finally:
        view.close()


def overlay_commit(workspace: Workspace, upper_fd: int, target: str | os.PathLike[str] | None,
                   forbidden: list[str], copy_fd: int = -1, base_fd: int = -1) -> Changes:
    """Make target (default: the source) equal to the program's view, as a copy workspace's commit does."""
    assert workspace.source is not None
    real = check_target(os.fspath(target if target is not None else workspace.source), forbidden)
    view = _View(workspace, upper_fd, copy_fd, base_fd)
    try:
        target_fd = _open_dir(real)
        try:
            source_info, target_info = os.fstat(view.source_fd), os.fstat(target_fd)
            into_source = (source_info.st_dev, source_info.st_ino) == (target_info.st_dev, target_info.st_ino)
            changes = diff(-1, target_fd, workspace, mine=view.merged.entries, open_mine=view.open,
                           same=view.same_as_source() if into_source else ())
            apply(-1, target_fd, changes, view.merged.entries, open_file=view.open)
            return changes
        finally:
            os.close(target_fd)
    finally:
        view.close()
