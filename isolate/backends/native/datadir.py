"""A kept sandbox's data directory on the host: ``state_dir()/sandboxes/KEY``.

It holds what the sandbox's files are made of: a copied workspace (a tree,
or the overlay's layers over a private copy, see copies.py), an overlay
workspace's upper and work directories and its base layer, and an image
root's upper layer. Everything here is made and removed through descriptors
that follow no link a program planted (the state directory may lie under a
sandbox's writable home: see places.open_state_dir), and a directory is
removed only while it still is the one that was made (its identity, the
``(st_dev, st_ino)`` pair).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ...kernel.beneath import open_beneath
from ...kernel.layers import clone
from ...kernel.links import DIR_FLAGS
from ...kernel.overlay import Layers, host_refusal, make_layers
from ...kernel.places import open_state_dir, state_dir
from ...kernel.tree import copy_tree
from ...kernel.tree import remove_dir_at as _remove_at
from ...model.errors import IsolationError
from ...model.workspace import Workspace
from . import copies

#: Why a copy workspace cannot be kept as layers over its private copy, by state directory, once the kernel
#: said so (a refusal known before anything is made is not kept: host_refusal tells it each time).
COPY_LAYERS_REFUSED: dict[str, str] = {}


def copy_layers_refused() -> str | None:
    """Why a copy workspace's private copy cannot be an overlay's lower layer here (None: it can)."""
    known = COPY_LAYERS_REFUSED.get(state_dir())
    if known is not None:
        return known
    # The layers' places as they will be: the copy under copies/, the upper layer under sandboxes/.
    try:
        base = state_dir()
        probe = Layers(os.path.join(base, copies.KIND), "/", os.path.join(base, "sandboxes", "probe", "overlay"))
        return host_refusal(probe)
    except OSError as exc:  # a directory on the way swapped meanwhile (a program that can write there)
        raise IsolationError(f"state directory {state_dir()}: {exc.strerror}") from None


def make_copy_layers(key: str, workspace: Workspace, layers: Layers,
                     fill_from: Any) -> tuple[tuple[int, int], tuple[int, int], str, bool]:
    """Make a copy workspace's data directory ``state_dir()/sandboxes/key`` as layers: the overlay's upper and
    work directories and the private copy it lies over (copies.py): a new copy of the source, or of a
    snapshot's tree (hard links: neither is ever written), or the copy a layer snapshot lies over, with the
    snapshot's layer as the base. (data identity, upper layer's identity, the copy's token, with a base?)"""
    snapshot = getattr(fill_from, "snapshot", fill_from)
    parent = open_state_dir("sandboxes")
    try:
        os.mkdir(key, 0o700, dir_fd=parent)
        data_fd = os.open(key, DIR_FLAGS, dir_fd=parent)
        data = fd_identity(data_fd)
        token: str | None = None
        try:
            upper = make_layers(layers, data_fd)
            if snapshot is not None and snapshot.kind == "layer":
                token = snapshot.lower
                if token is None:
                    raise IsolationError(f"snapshot {snapshot.name!r}: its layer lies over no private copy")
                copies.add_user(token, data_fd)
                state = os.open("overlay", DIR_FLAGS, dir_fd=data_fd)
                try:
                    fill(fill_from, state, "base", hard_links=True)
                finally:
                    os.close(state)
                return data, upper, token, True
            token, tree = copies.create(data_fd)
            try:
                if snapshot is not None:
                    source = snapshot.open_data()
                    try:
                        _copy_owner(source, tree)
                        clone(source, tree, hard_links=True)
                    finally:
                        os.close(source)
                elif workspace.source is not None:
                    copy_tree(workspace.source, tree, workspace)
            finally:
                os.close(tree)
            return data, upper, token, False
        except BaseException:
            _remove_at(parent, key, data)
            copies.release(token)
            raise
        finally:
            os.close(data_fd)
    finally:
        os.close(parent)


def close_layer_fds(layers: Layers | None) -> Layers | None:
    """The layers with the descriptors start() opened for the plan closed."""
    if layers is None:
        return None
    for fd in (layers.base_fd, layers.source_fd):
        if fd >= 0:
            os.close(fd)
    return dataclasses.replace(layers, base_fd=-1, source_fd=-1)


def dir_identity(path: str) -> tuple[int, int]:
    info = os.stat(path, follow_symlinks=False)
    return info.st_dev, info.st_ino


def fd_identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def make_data_dir(kind: str, key: str, workspace: Workspace, layers: Layers | None = None,
                  fill_from: Any = None) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """Make a kept sandbox's data directory ``state_dir()/kind/key`` and in it, for a copied workspace,
    ``workspace`` filled from the source, or an overlay's layers; the identities of the data directory
    and of the workspace as the host reads it (the copy, or the upper layer; None for a bound one).

    Made through descriptors that follow no link a program planted in the state directory (see
    places.open_state_dir): the workspace is copied where isolate means, nowhere else. On failure what
    was made is removed, through the same descriptors. ``fill_from``: a snapshot (isolate.Snapshot, or
    what fork hands over) whose files are the copy, or the overlay's base layer, instead of the source's.
    """
    parent = open_state_dir(kind)
    try:
        os.mkdir(key, 0o700, dir_fd=parent)
        data_fd = os.open(key, DIR_FLAGS, dir_fd=parent)
        data = fd_identity(data_fd)
        try:
            if layers is not None:
                upper = make_layers(layers, data_fd)
                if fill_from is not None:
                    state = os.open("overlay", DIR_FLAGS, dir_fd=data_fd)
                    try:
                        fill(fill_from, state, "base", hard_links=True)
                    finally:
                        os.close(state)
                return data, upper
            if workspace.mode != "copy":
                return data, None
            if fill_from is not None and getattr(fill_from, "snapshot", fill_from).kind == "layer":
                _fill_from_layer(getattr(fill_from, "snapshot", fill_from), data_fd)  # a copy kept as layers
            elif fill_from is not None:
                fill(fill_from, data_fd, "workspace", hard_links=False)  # a snapshot's tree, as it was
            else:
                os.mkdir("workspace", 0o755, dir_fd=data_fd)
            copy_fd = os.open("workspace", DIR_FLAGS, dir_fd=data_fd)
            try:
                copied = fd_identity(copy_fd)
                if fill_from is None and workspace.source is not None:
                    copy_tree(workspace.source, copy_fd, workspace)
            finally:
                os.close(copy_fd)
            return data, copied
        except BaseException:
            _remove_at(parent, key, data)
            raise
        finally:
            os.close(data_fd)
    finally:
        os.close(parent)


def root_source(start_from: Any) -> Any:
    """What a sandbox starts from (a snapshot, or what fork or restore hands over) when it holds an image
    root's layer; None otherwise."""
    snapshot = getattr(start_from, "snapshot", start_from)
    return start_from if getattr(snapshot, "image", None) is not None else None


def make_image_upper(data: str, identity: tuple[int, int] | None, as_owner: bool, root_from: Any = None) -> Any:
    """A kept image sandbox's upper layer in its data directory (imageroot.make_host_upper), the directory
    opened without following a link and checked to be the one start() made; ``root_from``: a snapshot whose
    root layer becomes ``image/base``, between the image and the upper layer."""
    from .imageroot import make_host_upper

    data_fd = os.open(data, DIR_FLAGS)
    try:
        if fd_identity(data_fd) != identity:
            raise IsolationError(f"{data}: replaced while the sandbox was made")
        host = make_host_upper(data_fd, data, as_owner)
        if root_from is None:
            return host
        state = os.open("image", DIR_FLAGS, dir_fd=data_fd)
        try:
            fill(root_from, state, "base", hard_links=True, part="root")
        finally:
            os.close(state)
        return dataclasses.replace(host, base=True)
    finally:
        os.close(data_fd)


def fill(snapshot: Any, dir_fd: int, name: str, hard_links: bool, part: str = "data") -> None:
    """name under dir_fd made of a snapshot's files (``part``: "data", its workspace's layer or tree; "root",
    its image root's layer): its directory moved there when the snapshot is handed over for this sandbox
    alone (fork's last), else a clone (hard links for a layer, whose files are never written; copies for a
    workspace, which the program writes)."""
    mover = getattr(snapshot, f"move_{part}", None)
    if mover is not None and mover(dir_fd, name):
        return
    source = getattr(snapshot, f"open_{part}")()
    try:
        os.mkdir(name, 0o755, dir_fd=dir_fd)
        made = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        try:
            _copy_owner(source, made)
            clone(source, made, hard_links=hard_links)
        finally:
            os.close(made)
    finally:
        os.close(source)


def _fill_from_layer(snapshot: Any, dir_fd: int) -> None:
    """``workspace`` under dir_fd made of the files a layer snapshot of a copy workspace means (its private
    copy with its layer over it), as one tree: where that copy cannot be an overlay's lower layer."""
    from ...kernel.layers import View, materialize

    if snapshot.lower is None:
        raise IsolationError(f"snapshot {snapshot.name!r}: its layer lies over no private copy")
    os.mkdir("workspace", 0o755, dir_fd=dir_fd)
    made = os.open("workspace", DIR_FLAGS, dir_fd=dir_fd)
    try:
        lower = copies.open_tree(snapshot.lower)
        try:
            _copy_owner(lower, made)
            view = View.of_layer(os.dup(lower), snapshot.open_data())
            try:
                materialize(view, made)
            finally:
                view.close()
        finally:
            os.close(lower)
    finally:
        os.close(made)


def _copy_owner(src_fd: int, dst_fd: int) -> None:
    info = os.fstat(src_fd)
    os.fchmod(dst_fd, info.st_mode & 0o7777)
    if os.geteuid() == 0:
        os.fchown(dst_fd, info.st_uid, info.st_gid)


def open_base(key: str, parts: tuple[str, ...] = ("overlay", "base")) -> int:
    """A descriptor of the base layer make_data_dir cloned for sandbox key (``parts``: or another directory
    of its data), reached without following a link (the overlay's plan binds the directory its path names
    only if it is this one)."""
    fd = open_state_dir("sandboxes")
    try:
        return open_beneath(fd, "/".join((key, *parts)), DIR_FLAGS)
    finally:
        os.close(fd)


def remove_dir(path: str, identity: tuple[int, int]) -> None:
    """Remove a sandbox's data directory without following anything planted in it or on the way to it.

    The state directory may be writable by a sandbox (one granted the home):
    a planted link on the way could lead to another directory of the same
    name, so only the directory that still is the one start() made goes.
    """
    try:
        parent = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _remove_at(parent, os.path.basename(path), identity)
    finally:
        os.close(parent)
