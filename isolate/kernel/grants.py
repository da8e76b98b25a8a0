"""Host paths handed to a sandbox: resolved and checked one way, for every backend.

A grant names a host path that a backend binds (or a Landlock rule opens).
The sandboxed program may have written a directory on that path in an
earlier run and left a symbolic link there, to redirect a later grant onto
anything on the host. So a grant is resolved here, following only root's
own links directly under ``/`` (``/lib -> usr/lib``), its inode noted, and
checked again just before the backend uses it. This module runs nothing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..model.errors import PolicyError
from .links import host_symlinks as host_symlinks  # the rule every grant follows (used as grants.host_symlinks)


def runtime_dir_below(real: str, path: str, field_name: str) -> str | None:
    """Where isolate's runtime directory (``registry.runtime_dir``) lies below a grant, or None.

    The host trusts what lies there: kept sandboxes' sockets and their
    descriptions (a sandbox's workspace source is where ``commit()``
    writes), and the CLI's cached plans. A program that could write there
    could make the host talk to a listener of its own, or commit another
    sandbox's workspace over any directory the caller may write; one that
    could only read there could still read the plans (their options and
    environments) and connect() to a kept sandbox's exec server, which a
    read-only mount does not prevent. Typical case: a caller without
    ``XDG_RUNTIME_DIR`` (the directory is then ``/tmp/isolate-UID``) granting
    ``/tmp``. Returns the directory's path relative to ``real`` (the grant's
    real path) when the grant holds it, for the caller to hide it (a mount
    namespace puts an empty tmpfs over it) or refuse; a grant that is the
    directory or lies inside it is refused here.
    """
    from .places import runtime_dir

    private = os.path.realpath(runtime_dir(create=False))
    if private == real or real.startswith(private + "/"):
        raise PolicyError(
            f"{field_name}: {path} lies in isolate's runtime directory {private} (kept sandboxes' sockets and "
            "descriptions, the CLI's cached plans); grant only the directories the program needs",
            field_name,
        )
    if private.startswith(real.rstrip("/") + "/"):
        return os.path.relpath(private, real)
    return None


def refuse_runtime_dir(real: str, path: str, field_name: str) -> None:
    """Refuse a grant that holds, or lies in, isolate's runtime directory (where nothing can hide it)."""
    if runtime_dir_below(real, path, field_name) is not None:
        from .places import runtime_dir

        private = os.path.realpath(runtime_dir(create=False))
        raise PolicyError(
            f"{field_name}: {path} holds isolate's runtime directory {private} (kept sandboxes' sockets and "
            "descriptions, the CLI's cached plans), and this sandbox has no mount namespace to hide "
            "it in; grant only the directories the program needs, none that holds it"
            + (", or set XDG_RUNTIME_DIR to a private directory outside it" if os.geteuid() != 0 else ""),
            field_name,
        )


@dataclass(frozen=True)
class Grant:
    """A host path as asked for (absolute), its real path and the inode found there."""

    path: str
    real: str
    device: int
    inode: int


def resolve_grant(path: str, field_name: str) -> Grant:
    """Resolve absolute ``path`` as ``host_symlinks`` does and note its inode.

    Raises ``PolicyError`` naming ``field_name`` for a missing path or one that
    goes through a link that is not root's, directly under ``/``.
    """
    real = host_symlinks(path, field_name)[1]
    try:
        info = os.stat(real, follow_symlinks=False)
    except FileNotFoundError:
        raise PolicyError(f"{field_name}: {path} does not exist; create it or drop it from the policy",
                          field_name) from None
    except OSError as exc:
        raise PolicyError(f"{field_name}: {path}: cannot check it: {exc.strerror}", field_name) from None
    if stat.S_ISLNK(info.st_mode):
        raise PolicyError(f"{field_name}: {path} resolves to the symlink {real}; grant its target instead", field_name)
    return Grant(path, real, info.st_dev, info.st_ino)


def check_unchanged(grant: Grant, field_name: str) -> None:
    """Refuse a grant whose path now leads elsewhere than when it was resolved (a swap since)."""
    again = resolve_grant(grant.path, field_name)
    if (again.real, again.device, again.inode) != (grant.real, grant.device, grant.inode):
        raise PolicyError(
            f"{field_name}: {grant.path} changed since it was checked (it now leads to {again.real}, another "
            "file); refusing to bind it",
            field_name,
        )
