"""What every part of a native plan shares: the program's default ids, whether this caller can
make a user namespace, refusals (raise, or warn under best effort), and the cached static plan.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...model.errors import UnsupportedError

#: The uid a root caller's program runs as, unless the policy names one.
NOBODY = 65534


def _close_all(fds: list[int], _os_close: Callable[[int], None] = os.close) -> None:
    # (The default argument keeps os.close reachable at interpreter shutdown.)
    for fd in fds:
        try:
            _os_close(fd)
        except OSError:
            pass
    fds.clear()


class _Refusals:
    """Collects what cannot be enforced: raises, or warns under best effort."""

    def __init__(self, best_effort: bool) -> None:
        self.best_effort = best_effort
        self.warnings: list[str] = []

    def refuse(self, message: str) -> None:
        if not self.best_effort:
            raise UnsupportedError(message)
        self.warnings.append(f"not enforced: {message}")


def input_bytes(path: str) -> bytes | None:
    """A file the caller named as input (a seccomp profile), as the policy reads it; None where it cannot."""
    from ...model.files import read_input_file

    try:
        return read_input_file(path)
    except (OSError, ValueError):
        return None


@dataclass
class _Static:
    """The part of a plan that depends only on the policy, the directory and the caller: cached."""

    plan: Any
    keep: list[Any]
    enforced: dict[str, Any]
    warnings: list[str]
    rlimits: list[tuple[int, int, int]]
    cgroup_needs: set[str]
    limit_cpu_seconds: float | None
    idmap_steps: list[tuple[int, str]]
    program_uid: int
    program_gid: int
    run_cwd: str
    home: str | None
    observed: dict[str, dict[str, Any]]
    tmpdir: str | None  # TMPDIR of a run without namespaces (no private /tmp there)
    granted: tuple[str, ...]  # what the program can see of the host: granted paths, as named and real
    stamps: list[tuple[str, tuple[int, int]]]
    fds: list[int]
    #: The O_PATH descriptor of each granted or bound host path (real path), which mounts and rules use.
    source_fds: dict[str, int] = field(default_factory=dict)
    #: An image's root: its Env (under the policy's own), and its config (Entrypoint and Cmd).
    image_env: dict[str, str] | None = None
    image_command: Any = None
    #: An image's store (image.Store) and the layer directories its sandboxes stand on (their leases).
    image_store: Any = None
    image_layers: tuple[str, ...] = ()
    #: An image's root (imageroot.ImageRoot): its record's bytes are a premise of the plan, its inode is not.
    image_root: Any = None
    #: Files the plan was compiled from (a seccomp profile), and their bytes then (None: unreadable).
    contents: list[tuple[str, bytes | None]] = field(default_factory=list)
    #: A root caller's image User in isolate's private range (kernel/privateids.py): each run mounts the image's
    #: layers through an idmapped tree of that map (imageroot.idmapped_layers).
    image_private: Any = None

    def fresh(self) -> bool:
        """Whether every granted path is still the inode it was when the plan was made, every file it was
        compiled from holds what it held, and an image's name is still the image it was."""
        for path, stamp in self.stamps:
            try:
                info = os.stat(path)
            except OSError:
                return False
            if (info.st_dev, info.st_ino) != stamp:
                return False
        if any(input_bytes(path) != content for path, content in self.contents):
            return False
        if self.image_root is not None:
            from .imageroot import record_unchanged

            return record_unchanged(self.image_root)
        return True

    def __del__(self, _close: Callable[[list[int]], None] = _close_all) -> None:
        # Only when no run holds this plan any more: a descriptor closed
        # under a child that is adding its Landlock rules could be reused.
        # (The default argument keeps the helper reachable at shutdown.)
        _close(self.fds)
