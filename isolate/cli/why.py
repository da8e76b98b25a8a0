"""What ``isolate-run`` says of a refused file access (denial tracing, ``--why``)."""

from __future__ import annotations

import os
import shlex
from typing import Any

from ..model.policy import Policy

#: How each mechanism is named on the hint line.
_REASONS = {"read-only": "read-only", "absent": "not in the sandbox", "landlock": "not granted (Landlock)",
            "dac": "file modes"}


def _printable(text: str) -> str:
    """What the program chose, with nothing in it that reaches the terminal as a control sequence."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def grant_flag(entry: dict[str, Any]) -> str | None:
    """The isolate-run flag that would grant a refused access, or None (file modes: no flag grants it).

    Reading, executing or looking a path up takes --ro of the path; writing or truncating a file --rw of it; creating,
    removing or renaming an entry --rw of its directory.
    """
    mechanism, access, path = entry.get("mechanism"), entry.get("access"), entry.get("resolved") or ""
    if mechanism == "dac" or not path:
        return None
    if access in ("read", "execute", "lookup"):
        return f"--ro {shlex.quote(path)}"
    if access in ("write", "truncate"):
        return f"--rw {shlex.quote(path)}"
    return f"--rw {shlex.quote(os.path.dirname(path) or '/')}"


def file_hint(entry: dict[str, Any], policy: Policy) -> str:
    """``denied: write /etc/hosts (read-only); grant it with --rw /etc/hosts``."""
    path = _printable(str(entry.get("resolved") or entry.get("path") or "?"))
    reason = _REASONS.get(str(entry.get("mechanism")), str(entry.get("mechanism")))
    line = f"denied: {entry.get('access')} {path} ({reason})"
    flag = grant_flag(entry)
    if flag is not None:
        return f"{line}; grant it with {_printable(flag)}"
    uid = policy.uid if policy.uid is not None else (65534 if os.geteuid() == 0 else os.geteuid())
    return f"{line}; the program runs as uid {uid}, whose file modes refuse it: no flag grants it"


def first_file_denial(denied: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The denial a hint names: the first one a flag grants, else the first."""
    files = [e for e in denied if e.get("access") and e.get("mechanism") in _REASONS]
    for entry in files:
        if grant_flag(entry) is not None:
            return entry
    return files[0] if files else None
