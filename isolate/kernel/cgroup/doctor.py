"""What ``isolate-run doctor`` says about cgroups on this host.
"""

from __future__ import annotations

import os

from .fs import _read_text, _rmdir_quiet, _why
from .hierarchy import _V2_CONTROLLER, FEATURES, PARENT_NAME, delegation_hint, discover
from .run import _counter, _counter_lock
from .v2 import _is_v2_root, _v2_base, _v2_delegated

# -- doctor -------------------------------------------------------------------------


def _probe(parent: str) -> str | None:
    """None when a run cgroup can be created in ``parent``, else why not."""
    created_parent = False
    try:
        if not os.path.isdir(parent):
            os.mkdir(parent)
            created_parent = True
        with _counter_lock:
            path = os.path.join(parent, f"isolate-{os.getpid()}-{next(_counter)}")
        os.mkdir(path)
        os.rmdir(path)
        return None
    except OSError as exc:
        return _why(exc, f"create a cgroup in {parent}")
    finally:
        if created_parent:
            _rmdir_quiet(parent)


def doctor_info() -> dict[str, object]:
    """What this caller can get from cgroups, for ``isolate-run doctor``.

    Keys: ``versions`` (mounted), ``hierarchies`` (one dict each: version,
    name, mount, own_cgroup, directory, parent, writable, delegated, why,
    note), ``features`` (feature -> {"available", "version", "path", "why"},
    from the version ``create`` would use where possible), ``selected`` (the
    version ``RunCgroup.create`` picks for memory+pids+cpu, or None) and
    ``hint`` (how to delegate a cgroup, when a feature is missing).
    Writability is probed by creating and removing one run-named directory.
    """
    hierarchies = discover()
    versions = sorted({h.label for h in hierarchies if h.mountpoint})
    rows: list[dict[str, object]] = []
    sources: dict[str, dict[str, dict[str, object]]] = {"cgroup-v1": {}, "cgroup-v2": {}}
    for hier in hierarchies:
        if hier.version == 1 and not hier.controllers & FEATURES:
            continue
        row: dict[str, object] = {
            "version": hier.label,
            "name": hier.name,
            "mount": hier.mountpoint,
            "own_cgroup": hier.cgroup_path,
            "directory": hier.directory,
            "parent": None,
            "delegated": None,
            "note": None,
        }
        why = hier.problem
        provides: set[str] = set(hier.controllers & FEATURES) if hier.version == 1 else {"cpuacct", "freezer"}
        if hier.directory is not None and hier.version == 1:
            row["parent"] = os.path.join(hier.directory, PARENT_NAME)
            why = _probe(os.path.join(hier.directory, PARENT_NAME))
        elif hier.directory is not None:
            base = _v2_base(hier)
            try:
                available = set(_read_text(os.path.join(base, "cgroup.controllers")).split())
            except OSError as exc:
                available = set()
                why = _why(exc, f"read {base}/cgroup.controllers")
            is_root = _is_v2_root(base)
            delegated = None if is_root else _v2_delegated(base)
            row["controllers"] = sorted(available)
            row["delegated"] = delegated
            home = base
            if not is_root and not delegated and available & set(_V2_CONTROLLER.values()):
                top = hier.root_directory()
                if os.geteuid() == 0 and top is not None:
                    home = top
                    row["note"] = f"{base} is not delegated: run cgroups with controllers go under {top}"
                else:
                    row["note"] = f"{base} is not delegated: no controller can be enabled below it"
                    available = set()
            row["parent"] = os.path.join(home, PARENT_NAME)
            why = why or _probe(os.path.join(home, PARENT_NAME))
            provides |= {f for f, c in _V2_CONTROLLER.items() if c in available}
        row["writable"] = why is None
        row["why"] = why
        rows.append(row)
        for feature in sorted(provides):
            known = sources[hier.label].get(feature)
            if known is None or (not known["available"] and why is None):
                sources[hier.label][feature] = {
                    "available": why is None,
                    "version": hier.label,
                    "path": row["parent"],
                    "why": why,
                }
    has_v1 = any(r["version"] == "cgroup-v1" for r in rows)
    order = ("cgroup-v1", "cgroup-v2") if has_v1 else ("cgroup-v2",)
    selected = None
    for label in order:
        if all(sources[label].get(f, {}).get("available") for f in ("memory", "pids", "cpu")):
            selected = label
            break
    features: dict[str, dict[str, object]] = {}
    for feature in sorted(FEATURES):
        candidates = [sources[label][feature] for label in order if feature in sources[label]]
        if selected and feature in sources[selected] and sources[selected][feature]["available"]:
            features[feature] = sources[selected][feature]
        elif any(c["available"] for c in candidates):
            features[feature] = next(c for c in candidates if c["available"])
        elif candidates:
            features[feature] = candidates[0]
        else:
            features[feature] = {"available": False, "version": None, "path": None, "why": "no hierarchy provides it"}
    missing = [f for f, info in features.items() if not info["available"]]
    return {
        "versions": versions,
        "hierarchies": rows,
        "features": features,
        "selected": selected,
        "hint": delegation_hint(hierarchies, missing) if missing else None,
    }
