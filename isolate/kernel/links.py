"""Which links on the way to a host path isolate follows: only root's, directly under ``/``.

A program may have written a directory on a path the host later uses (a
grant, the state directory) and left a symbolic link there, to redirect the
host onto anything. Grants (grants.py) and the state directory (places.py)
both walk their paths with this one rule.
"""

from __future__ import annotations

import os
import stat

from ..model.errors import PolicyError


def host_symlinks(path: str, field_name: str = "read") -> tuple[list[tuple[str, str]], str]:
    """The symlinked components of absolute ``path`` (as (link, text) pairs) and its real path.

    Only root's links directly under ``/`` (``/lib -> usr/lib``, ``/home ->
    /data/home``) are followed. A link deeper down could have been planted by
    an earlier sandbox in a directory it could write, to redirect a later
    grant onto something else: such a path is refused, naming its real path.
    """
    links: list[tuple[str, str]] = []
    current = "/"
    parts = [p for p in path.split("/") if p]
    seen = 0
    while parts:
        part = parts.pop(0)
        candidate = os.path.join(current, part)
        try:
            info = os.lstat(candidate)
        except OSError:
            return links, os.path.realpath(path)
        if stat.S_ISLNK(info.st_mode):
            if current != "/" or info.st_uid != 0:
                raise PolicyError(
                    f"{field_name}: {path} goes through the symlink {candidate} -> {os.readlink(candidate)}; "
                    f"grant the real path ({os.path.realpath(path)}) instead (only root's links directly under / "
                    "are followed, so that a program cannot redirect a later grant)",
                    field_name,
                )
            seen += 1
            if seen > 40:
                return links, os.path.realpath(path)
            text = os.readlink(candidate)
            links.append((candidate, text))
            resolved = text if text.startswith("/") else os.path.join(current, text)
            parts = [p for p in os.path.normpath(resolved).split("/") if p] + parts
            current = "/"
        else:
            current = candidate
    return links, current
