"""Paths inside the sandbox, each reduced to its one canonical form before anything checks it.

``os.path.normpath`` keeps a leading ``//`` (POSIX leaves two leading slashes to the system; Linux
reads them as one), so ``//proc`` would pass a comparison with ``/proc`` and still name it. Every
check of an inside path runs on ``inside_path()``'s result and the policy stores that result, so
that the check and the mount see the same path.
"""

from __future__ import annotations

import posixpath

from .errors import PolicyError

#: Where the sandbox builds its own mounts: nothing of a policy's is mounted at or below them.
BUILT_BY_SANDBOX: tuple[str, ...] = ("/proc", "/dev")


def inside_path(value: object, field: str) -> str:
    """``value`` as one absolute path inside the sandbox: one leading slash, no ``.``, ``..`` or ``//``."""
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise PolicyError(f"{field}: {value!r} must be an absolute path inside the sandbox", field)
    return posixpath.normpath("/" + value.lstrip("/"))


def mount_point(value: object, field: str, what: str) -> str:
    """``inside_path(value)``, refused where the sandbox builds the mount itself (``/``, ``/proc``, ``/dev``)."""
    path = inside_path(value, field)
    if path == "/" or any(path == p or path.startswith(p + "/") for p in BUILT_BY_SANDBOX):
        named = path if value == path else f"{value!r} (that is {path})"
        raise PolicyError(f"{field}: {named} cannot be {what} (the sandbox builds it itself)", field)
    return path
