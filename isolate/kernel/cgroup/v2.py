"""cgroup v2: finding the caller's delegated subtree, moving the caller into a leaf, enabling
controllers.
"""

from __future__ import annotations

import errno
import os

from .fs import _ensure_dir, _mkdir_cgroup, _NotHere, _read_pids, _read_text, _why, _write
from .hierarchy import _V2_CONTROLLER, LEAF_NAME, PARENT_NAME, Hierarchy

# -- cgroup v2 preparation -----------------------------------------------------------


def _v2_base(hier: Hierarchy) -> str:
    assert hier.directory is not None
    directory = hier.directory
    if os.path.basename(directory) == LEAF_NAME and hier.cgroup_path != "/":
        directory = os.path.dirname(directory)  # we moved ourselves into our leaf earlier
    return directory


def _is_v2_root(directory: str) -> bool:
    return not os.path.exists(os.path.join(directory, "cgroup.type"))


def _v2_delegated(directory: str) -> bool:
    """True when ``directory`` is ours to reorganise."""
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(directory, name) == b"1":
                return True
        except OSError:
            pass
    try:
        if os.geteuid() != 0 and os.stat(os.path.join(directory, "cgroup.procs")).st_uid == os.geteuid():
            return True
    except OSError:
        return False
    return set(_read_pids(directory)) <= {os.getpid()}


def _v2_enable(directory: str, controllers: set[str]) -> None:
    current = set(_read_text(os.path.join(directory, "cgroup.subtree_control")).split())
    todo = controllers - current
    if todo:
        _write(os.path.join(directory, "cgroup.subtree_control"), " ".join(f"+{c}" for c in sorted(todo)))


def _v2_move_to_leaf(base: str) -> None:
    leaf = os.path.join(base, LEAF_NAME)
    try:
        _mkdir_cgroup(leaf)
    except FileExistsError:
        pass
    for _ in range(20):
        pids = _read_pids(base)
        if not pids:
            return
        for pid in pids:
            try:
                _write(os.path.join(leaf, "cgroup.procs"), str(pid))
            except ProcessLookupError:
                pass


def _v2_prepare(hier: Hierarchy, required: set[str], wanted: set[str]) -> tuple[str, set[str], dict[str, str]]:
    """(parent directory, enabled controllers, skipped features) for v2 run cgroups."""
    base = _v2_base(hier)
    skipped: dict[str, str] = {}
    req_ctrl = {_V2_CONTROLLER[f] for f in required if f in _V2_CONTROLLER}
    want_ctrl = {_V2_CONTROLLER[f] for f in wanted if f in _V2_CONTROLLER}
    try:
        available = set(_read_text(os.path.join(base, "cgroup.controllers")).split())
    except OSError as exc:
        raise _NotHere(_why(exc, f"read {base}/cgroup.controllers")) from None
    missing = req_ctrl - available
    if missing:
        raise _NotHere(
            f"controller(s) {', '.join(sorted(missing))} not available to {base} "
            f"(its cgroup.controllers lists: {' '.join(sorted(available)) or 'none'})"
        )
    for c in sorted(want_ctrl - available):
        skipped[c] = f"not available in {base}"
    ctrl = (req_ctrl | want_ctrl) & available

    def enable_in_base(controllers: set[str]) -> str:
        if not controllers:
            return base
        try:
            _v2_enable(base, controllers)
            return base
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise _NotHere(_why(exc, f"enable {' '.join(sorted(controllers))} in {base}")) from None
        # "no internal processes": the own cgroup holds processes, so they go to a leaf first
        if not _is_v2_root(base) and _v2_delegated(base):
            try:
                _v2_move_to_leaf(base)
                _v2_enable(base, controllers)
                return base
            except OSError as exc:
                raise _NotHere(_why(exc, f"move the processes of {base} into {LEAF_NAME}")) from None
        top = hier.root_directory()
        if os.geteuid() == 0 and top is not None and _is_v2_root(top):
            try:
                _v2_enable(top, controllers)
            except OSError as exc:
                raise _NotHere(_why(exc, f"enable {' '.join(sorted(controllers))} in {top}")) from None
            return top
        raise _NotHere(
            f"{base} holds other processes and is not delegated to this user, so controllers cannot be enabled below it"
        )

    try:
        home = enable_in_base(ctrl)
    except _NotHere as exc:
        if req_ctrl:
            home = enable_in_base(req_ctrl)
        else:
            home = base
        for c in sorted(ctrl - req_ctrl):
            skipped[c] = str(exc)
        ctrl = set(req_ctrl)
    parent = os.path.join(home, PARENT_NAME)
    _ensure_dir(parent)
    try:
        _v2_enable(parent, ctrl)
    except OSError as exc:
        if req_ctrl:
            raise _NotHere(_why(exc, f"enable {' '.join(sorted(ctrl))} in {parent}")) from None
        for c in sorted(ctrl):
            skipped[c] = _why(exc, f"enable {c} in {parent}")
        ctrl = set()
    return parent, ctrl, skipped
