"""A kept sandbox's workspace, as data: what it starts from and how it is shown.

``Workspace(source, target="/workspace", mode="copy")`` is the directory every
command of a ``Sandbox`` starts in:

- ``copy``: a private copy of ``source`` (or an empty directory), minus the
  names in ``exclude`` (``.git``, ``node_modules`` ...); ``diff()`` compares it
  with the source and ``commit()`` writes it back. On the native backend the
  copy is made once and kept as an overlay's read-only lower layer, so that
  snapshots, forks and restores cost what changed since it
  (isolate/backends/native/copies.py);
- ``overlay``: an overlayfs over ``source`` (isolate/kernel/overlay.py): the
  source is its read-only lower layer, the program's changes land in an upper
  layer in the sandbox's private state directory; ``diff()`` and ``commit()``
  read them from there, with the same guarantees as a copy's;
- ``bind``: the source itself, writable: the program's changes land at once
  and there is nothing to diff or commit.

Copying, comparing and writing back are isolate/kernel/tree.py's.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from .errors import PolicyError
from .paths import mount_point

WORKSPACE_MODES = ("copy", "overlay", "bind")
DEFAULT_TARGET = "/workspace"


@dataclass(frozen=True)
class Workspace:
    """Where a Sandbox's commands work (see the module's docstring)."""

    source: str | None = None
    target: str = DEFAULT_TARGET
    mode: str = "copy"
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in WORKSPACE_MODES:
            raise PolicyError(f"workspace: mode {self.mode!r} is not one of {', '.join(WORKSPACE_MODES)}",
                              "workspace")
        target = mount_point(self.target, "workspace", "the workspace")
        object.__setattr__(self, "target", target)
        if self.source is not None:
            if not os.fspath(self.source):
                # abspath("") is the working directory: a variable left empty made it the workspace (and the
                # target of commit(), which makes it equal to the workspace).
                raise PolicyError("workspace: an empty source; give a directory (\".\" for this one) or None",
                                  "workspace")
            source = os.path.abspath(os.fsdecode(os.fspath(self.source)))
            if not os.path.isdir(source):
                raise PolicyError(f"workspace: {source} is not a directory", "workspace")
            object.__setattr__(self, "source", source)
        elif self.mode in ("bind", "overlay"):
            raise PolicyError(f"workspace: mode {self.mode} needs a source directory", "workspace")
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)
        for pattern in exclude:
            if not isinstance(pattern, str) or not pattern or "/" in pattern.strip("/"):
                raise PolicyError(f"workspace: exclude {pattern!r} must be a file name or a glob of one "
                                  "(matched at any depth)", "workspace")
        if exclude and self.mode == "overlay":
            # An overlay shows the whole source: a name cannot be left out of the view, and leaving it out
            # of diff and commit only would make them lie about what the program saw and changed.
            raise PolicyError("workspace: exclude works with mode copy only (an overlay shows the whole source); "
                              "use mode='copy' to leave names out", "workspace")
        object.__setattr__(self, "exclude", tuple(p.strip("/") for p in exclude))

    def excluded(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude)
