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
    if mechanism == "dac" or not path or entry.get("cut"):
        return None  # (a cut path names another file: no flag for it)
    if access in ("read", "execute", "lookup"):
        return f"--ro {shlex.quote(path)}"
    if access in ("write", "truncate"):
        return f"--rw {shlex.quote(path)}"
    return f"--rw {shlex.quote(os.path.dirname(path) or '/')}"


def file_hint(entry: dict[str, Any], policy: Policy) -> str:
    """``denied: write /etc/hosts (read-only); grant it with --rw /etc/hosts``."""
    path = _printable(str(entry.get("resolved") or entry.get("path") or "?"))
    reason = _REASONS.get(str(entry.get("mechanism")), str(entry.get("mechanism")))
    if entry.get("cut"):
        return (f"denied: {entry.get('access')} of a path longer than the tracer keeps, beginning {path}... "
                f"({reason}); grant it with --ro/--rw of its real path")
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


def explain_report(path: str) -> list[str]:
    """``isolate-run --explain --report REPORT.json``: one line per refusal of a finished run, with its way out."""
    import json

    from ..model.files import read_input_file

    try:
        data = json.loads(read_input_file(path).decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a report of isolate-run ({exc})") from None
    except RecursionError:  # json descends once per nested array or object
        raise ValueError(f"{path}: not a report of isolate-run (nested too deep)") from None
    if not isinstance(data, dict) or not isinstance(data.get("denied"), list):
        raise ValueError(f"{path}: not a report of isolate-run (no denied list)")
    policy = Policy()
    lines = []
    for entry in data["denied"]:
        if not isinstance(entry, dict):
            continue
        mechanism = entry.get("mechanism")
        count = f" ({entry['count']}x)" if isinstance(entry.get("count"), int) and entry["count"] > 1 else ""
        if entry.get("access") and mechanism in _REASONS:
            lines.append(file_hint(entry, policy) + count)
        elif mechanism == "seccomp":
            lines.append(f"denied: system call {_printable(str(entry.get('syscall')))} (seccomp){count}; allow it "
                         "with --seccomp FILE (an OCI profile that permits it; isolate-run learn writes one)")
        elif mechanism == "unix-socket" and entry.get("path"):
            path = _printable(str(entry["path"]))
            lines.append(f"denied: connect {path} (unix socket){count}; allow it with --unix-socket {path}")
        elif mechanism == "egress":
            where = _printable(str(entry.get("host") or entry.get("address")))
            lines.append(f"denied: egress to {where}:{entry.get('port')}{count}: "
                         f"{_printable(str(entry.get('reason')))}")
        elif mechanism == "network":
            lines.append(f"denied: connect {entry.get('address')}:{entry.get('port')} (network){count}; "
                         "allow it with --net host or --allow-host NAME")
        else:
            lines.append(f"denied: {_printable(json.dumps(entry))}")
    observed = data.get("denials_observed") or {}
    if isinstance(observed, dict) and not (observed.get("landlock") or {}).get("observed"):
        lines.append("note: file accesses were not traced in this run; run it again with --why to name them")
    return lines
