"""An image's root as overlayfs will show it, read on the host from its layers (topmost first)."""

from __future__ import annotations

import os
import stat

from .unpack import OPAQUE_XATTR


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def kind(lowers: list[str], rel: str) -> str | None:
    """What the merged root has at ``rel`` ("dir", "link", "file", "other"), None if nothing; a non-directory
    on the way (a link included: never followed) ends the walk with its own kind."""
    return _find(lowers, rel)[0]


def _find(lowers: list[str], rel: str) -> tuple[str | None, str | None]:
    """kind(), and the layer whose entry shows (every directory on its way a directory of that layer)."""
    parts = [p for p in rel.split("/") if p and p != "."]
    if ".." in parts:
        # Joined to a layer's path, ".." walks up out of the store onto the host: the root shows nothing there (an
        # image's WorkingDir or PATH, the image author's, made relative destinations and --explain look at the host).
        return None, None
    active = list(lowers)
    found: str | None = "dir"
    holder: str | None = lowers[0] if lowers else None
    for i, part in enumerate(parts):
        found = None
        holder = None
        below: list[str] = []
        for layer in active:
            path = os.path.join(layer, *parts[:i], part)
            try:
                info = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                break  # a whiteout: nothing below shows
            if stat.S_ISDIR(info.st_mode):
                if found is None:
                    found, holder = "dir", layer
                below.append(layer)
                if _opaque(path):
                    break
                continue
            if found is None:
                found = "link" if stat.S_ISLNK(info.st_mode) else "file" if stat.S_ISREG(info.st_mode) else "other"
                holder = layer
            break
        if found != "dir":
            return (found, holder) if i == len(parts) - 1 or found is None else (found, None)
        active = below
    return found, holder


def top_level(lowers: list[str]) -> dict[str, str]:
    """The root's entries and their kinds."""
    names: set[str] = set()
    for layer in lowers:
        try:
            names.update(os.listdir(layer))
        except OSError:
            pass
    out = {}
    for name in sorted(names):
        found = kind(lowers, name)
        if found is not None:
            out[name] = found
    return out


def read_file(lowers: list[str], rel: str, limit: int = 1 << 20) -> bytes | None:
    """A regular file of the merged root (None: absent, or not a regular file there)."""
    found, layer = _find(lowers, rel)
    if found != "file" or layer is None:
        return None
    try:
        fd = os.open(os.path.join(layer, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read(limit)
