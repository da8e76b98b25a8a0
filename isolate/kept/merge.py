"""``isolate.merge``: the changes of several branches against their common start, together in a new sandbox.

    result = isolate.merge([a, b])            # sandboxes or snapshots of one workspace
    result.merged, result.conflicts           # what merged cleanly; [Conflict(path, kind, hunks)]
    result.sandbox.exec("pytest -q")          # a new, started sandbox with the merged files

Each branch's files are compared with the common start, path by path. A
path only one branch changed (or that all changed alike) takes that change.
A text file several changed differently is merged hunk by hunk as ``git
merge-file`` does (a diff3 over lines, ``difflib``; changes in the same or
touching lines conflict, git's default "merge" marker style). Everything
else that several changed differently is a conflict: a deletion against an
edit, binary files, modes, links, a directory against a file.

``on_conflict="markers"`` (the default) still makes the sandbox: a text
conflict is left with ``<<<<<<<``/``=======``/``>>>>>>>`` markers, any other
keeps the first branch's side (an edit over a deletion), and each is listed.
``on_conflict="refuse"`` makes nothing and raises ``MergeConflictError``
(its ``result`` lists the conflicts).

The common start: ``base=`` (a snapshot, a sandbox, or a directory), else the
snapshot every branch started from when they share one (forks of one
sandbox), else the workspace's source (an empty tree for a workspace with
none). Branches of an overlay workspace give a layered result (costs what
changed); of a copy workspace, a copy.

Branches of sandboxes of one image (``image_upper="disk"``) merge their
roots too: the same merge runs over their root layers, each laid over the
image's layers, against the common start's root (the base's root layer, or
the one the forks started from, kept in their snapshots; else the image),
into the result's root layer; root paths are reported absolute
(``/etc/motd``), the sandboxes' mount points left out. Branches of different
images, or of an image and the host's root, are refused. Sandboxes and snapshots of
``isolate.ray``, on any nodes of a cluster, merge on the first branch's node
(``isolate/ray/merging.py``, reached through ``isolate.model.hooks``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kernel import layers
from ..kernel.layers import View
from ..kernel.links import DIR_FLAGS
from ..kernel.tree import Entry, _descend, _open_dir, _remove_tree
from ..model import hooks
from ..model.errors import IsolationError, PolicyError, UnsupportedError
from ..model.policy import Policy
from .sandbox import Sandbox
from .snapshots import Snapshot, _Making, take


@dataclass(frozen=True)
class Hunk:
    """A conflicting region of a text file: lines of the base (1-based start, count) and each side's lines."""

    base_start: int
    base_lines: int
    sides: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Conflict:
    """A path the branches changed in ways that do not go together.

    kind: "text" (hunks), "delete/modify", "binary", "mode", "link", "type" (a directory against a file...).
    """

    path: str
    kind: str
    branches: tuple[int, ...]
    hunks: tuple[Hunk, ...] = ()


@dataclass
class MergeResult:
    """What ``merge`` did: ``merged`` paths changed cleanly (each from one branch or combined), ``conflicts``,
    ``snapshot`` (the merged files) and ``sandbox`` (started from it; None with ``start=False``)."""

    merged: list[str] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    snapshot: Snapshot | None = None
    sandbox: Sandbox | None = None

    @property
    def clean(self) -> bool:
        return not self.conflicts


class MergeConflictError(IsolationError):
    """merge(on_conflict="refuse") met conflicts: ``result.conflicts`` lists them; nothing was made."""

    def __init__(self, result: MergeResult) -> None:
        paths = ", ".join(f"{c.path} ({c.kind})" for c in result.conflicts[:10])
        more = f" and {len(result.conflicts) - 10} more" if len(result.conflicts) > 10 else ""
        super().__init__(f"merge: {len(result.conflicts)} conflict(s): {paths}{more}; nothing merged "
                         "(on_conflict='markers' leaves them marked in the merged sandbox)")
        self.result = result

    def __reduce__(self) -> tuple[type[MergeConflictError], tuple[MergeResult]]:
        # Pickled with its result (a merge on a Ray node raises it on the caller's side): the default gives
        # __init__ the message.
        return (type(self), (self.result,))


# -- diff3 over lines ----------------------------------------------------------------------------------


def _matches(base: list[bytes], other: list[bytes]) -> dict[int, int]:
    out: dict[int, int] = {}
    for i, j, n in difflib.SequenceMatcher(None, base, other, autojunk=False).get_matching_blocks():
        for k in range(n):
            out[i + k] = j + k
    return out


def merge3(base: list[bytes], a: list[bytes], b: list[bytes],
           labels: tuple[str, str] = ("a", "b")) -> tuple[list[bytes], list[Hunk]]:
    """Lines of a and b merged against base, as git merge-file: (lines with markers, conflicting hunks)."""
    ma, mb = _matches(base, a), _matches(base, b)
    out: list[bytes] = []
    hunks: list[Hunk] = []
    i = ja = jb = 0

    def chunk(i_end: int, a_end: int, b_end: int) -> None:
        bc, ac, cc = base[i:i_end], a[ja:a_end], b[jb:b_end]
        if ac == bc:
            out.extend(cc)
        elif cc == bc or ac == cc:
            out.extend(ac)
        else:
            hunks.append(Hunk(i + 1, len(bc), (tuple(x.decode(errors="replace") for x in ac),
                                                tuple(x.decode(errors="replace") for x in cc))))
            out.append(f"<<<<<<< {labels[0]}\n".encode())
            out.extend(_ended(ac))
            out.append(b"=======\n")
            out.extend(_ended(cc))
            out.append(f">>>>>>> {labels[1]}\n".encode())

    while True:
        # The next base line both sides keep, in order (a stable line).
        k = next((k for k in range(i, len(base)) if k in ma and k in mb and ma[k] >= ja and mb[k] >= jb), None)
        if k is None:
            chunk(len(base), len(a), len(b))
            return out, hunks
        if k == i and ma[k] == ja and mb[k] == jb:
            out.append(base[k])
            i, ja, jb = i + 1, ja + 1, jb + 1
            continue
        chunk(k, ma[k], mb[k])
        i, ja, jb = k, ma[k], mb[k]


#: The largest file merged line by line; a larger one that both sides changed is a binary conflict.
MAX_TEXT_MERGE = 64 << 20


def _ended(lines: list[bytes]) -> list[bytes]:
    """A side's lines with the last one ended, so that a marker after it starts a line of its own."""
    if lines and not lines[-1].endswith(b"\n"):
        return [*lines[:-1], lines[-1] + b"\n"]
    return lines


def _text(data: bytes) -> bool:
    return b"\0" not in data[:8192]


# -- branches as views ---------------------------------------------------------------------------------


class _Branch:
    """One branch's files, read from a snapshot (a sandbox is captured first: its files as they are now)."""

    def __init__(self, item: Sandbox | Snapshot, label: str) -> None:
        self.label = label
        self.temporary: Snapshot | None = None
        if isinstance(item, Sandbox):
            self.temporary = take(item, None, item.origin, areas=False, temporary=True)
            self.snapshot = self.temporary
            self.sandbox: Sandbox | None = item
        elif isinstance(item, Snapshot):
            self.snapshot, self.sandbox = item, None
        else:
            raise TypeError(f"merge: a branch is an isolate.Sandbox or isolate.Snapshot, not {type(item).__name__}")
        self.view = _view(self.snapshot)

    def close(self) -> None:
        self.view.close()
        if self.temporary is not None:
            self.temporary.remove()


def _source_fd(snapshot: Snapshot) -> int | None:
    """The tree a layer snapshot lies over: its private copy (a copy workspace), else the source."""
    if snapshot.lower is not None:
        from ..backends.native.copies import open_tree

        return open_tree(snapshot.lower)
    source = snapshot.workspace.source
    return _open_dir(source) if source is not None else None


def _view(snapshot: Snapshot) -> View:
    data = snapshot.open_data()
    if snapshot.kind == "tree":
        return View.of_tree(data)
    try:
        return View.of_layer(_source_fd(snapshot), data)
    except BaseException:
        os.close(data)
        raise


#: What a layer lies over: ("layer", its private copy or None for the source); a tree: ("tree", None).
Ground = tuple[str, str | None]


def _ground(snapshot: Snapshot) -> Ground:
    return (snapshot.kind, snapshot.lower if snapshot.kind == "layer" else None)


class _Start:
    """The common start: its workspace's view, a descriptor of its layer or tree to begin the result with (-1:
    none), what that layer lies over, and (branches of an image) its root layer over the image (-1: the image
    itself)."""

    def __init__(self, view: View, data: int, ground: Ground, root: int = -1) -> None:
        self.view, self.data, self.ground, self.root = view, data, ground, root

    def close(self) -> None:
        self.view.close()
        for fd in (self.data, self.root):
            if fd >= 0:
                os.close(fd)


def _of(snapshot: Snapshot, image: str | None) -> _Start:
    """A snapshot as the common start (its root layer, when it has one over the branches' image)."""
    if snapshot.image is not None and snapshot.image != image:
        raise UnsupportedError(f"merge: the base, snapshot {snapshot.name!r}, is of image {snapshot.image_ref} "
                               f"({snapshot.image[:19]}), and the branches are "
                               + (f"of {image[:19]}" if image else "of the host's root") + ": refused")
    view = _view(snapshot)
    try:
        data = snapshot.open_data()
        try:
            return _Start(view, data, _ground(snapshot), snapshot.open_root() if image is not None and
                          snapshot.image is not None else -1)
        except BaseException:
            os.close(data)
            raise
    except BaseException:
        view.close()
        raise


def _base_view(base: Any, branches: list[_Branch], image: str | None) -> _Start:
    """The common start of the branches (of that image's sandboxes, or None)."""
    first = branches[0].snapshot
    if isinstance(base, (str, os.PathLike)):
        return _Start(View.of_tree(_open_dir(os.fspath(base))), -1, ("tree", None))
    if isinstance(base, Sandbox):
        base = take(base, None, base.origin, areas=False, temporary=True)  # its files now; removed once read
        try:
            return _of(base, image)
        finally:
            base.remove()
    if isinstance(base, Snapshot):
        return _of(base, image)
    if base is not None:
        raise TypeError("merge: base is an isolate.Snapshot, an isolate.Sandbox or a directory")
    origins = {b.snapshot.origin for b in branches}
    root = -1
    if len(origins) == 1 and None not in origins:
        origin = origins.pop()
        for snap in Snapshot.list():
            if snap.id == origin:
                return _of(snap, image)
        # A snapshot of a sandbox of an image started from that snapshot keeps a clone of its root layer.
        for branch in branches if image is not None else []:
            kept = branch.snapshot.open_root_base()
            if kept is not None:
                root = kept
                break
        try:
            for branch in branches:
                # A layer snapshot of a sandbox started from that snapshot keeps a clone of its layer.
                base_fd = branch.snapshot.open_base()
                if base_fd is not None:
                    return _Start(View.of_layer(_source_fd(first), os.dup(base_fd)), base_fd, _ground(first), root)
        except BaseException:
            if root >= 0:
                os.close(root)
            raise
    try:
        lowers = {b.snapshot.lower for b in branches}
        if len(lowers) == 1 and first.lower is not None:
            # Copies kept as layers over one private copy: the copy is where they all started.
            from ..backends.native.copies import open_tree

            return _Start(View.of_tree(open_tree(first.lower)), -1, ("tree", None), root)
        # The workspace's source itself (a layer's files are its nodes where the layer has none).
        source = first.workspace.source
        if source is None:
            return _Start(View({}, _no_file, lambda rel: (-1, 0), []), -1, ("tree", None), root)
        return _Start(View.of_tree(_open_dir(source)), -1, ("tree", None), root)
    except BaseException:
        if root >= 0:
            os.close(root)
        raise


def _no_file(rel: str) -> int:
    raise FileNotFoundError(rel)


# -- the merge -----------------------------------------------------------------------------------------


class _Roots:
    """Branches of sandboxes of one image: each branch's root layer over the image's layers, and the common
    start's root (its root layer over them, or the image itself), as views (paths absolute in the result)."""

    def __init__(self, image: str, ref: str | None, made: list[_Branch], start: _Start) -> None:
        from ..image import Image

        found = Image.find(image)
        if found is None:
            raise IsolationError(f"merge: the branches' image {ref} ({image[:19]}) is no longer in the image store: "
                                 "their roots' changes lie over it")
        self.lowers = list(reversed(found.lower_dirs()))  # lowest first
        #: The branches' mount points (a snapshot's description names them): the plans', not the programs'.
        self.leave_out = frozenset(str(p) for b in made for p in b.snapshot._image_meta().get("leave_out") or [])
        self.views: list[View] = []
        self.base = self._stack(lambda: os.dup(start.root) if start.root >= 0 else -1)
        try:
            for branch in made:
                self.views.append(self._stack(branch.snapshot.open_root))
        except BaseException:
            self.close()
            raise

    def _stack(self, top: Any) -> View:
        fds: list[int] = []
        try:
            for path in self.lowers:
                fds.append(_open_dir(path))
            fd = top()
            if fd >= 0:
                fds.append(fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return View.of_layers(fds)

    def close(self) -> None:
        for view in [self.base, *self.views]:
            view.close()


def _image_of(made: list[_Branch]) -> tuple[str | None, str | None]:
    """The image the branches' sandboxes ran (its id and reference; None: the host's root), refused unless one."""
    images = {b.snapshot.image for b in made}
    if len(images) > 1:
        raise UnsupportedError("merge: the branches run different roots, whose changes do not go together: "
                               + "; ".join(f"{b.label}: " + (f"image {b.snapshot.image_ref} ({b.snapshot.image[:19]})"
                                                             if b.snapshot.image else "the host's root")
                                           for b in made) + "; nothing merged")
    return made[0].snapshot.image, made[0].snapshot.image_ref


def merge(branches: Sequence[Sandbox | Snapshot], base: Snapshot | Sandbox | str | os.PathLike[str] | None = None,
          *, policy: Policy | None = None, on_conflict: str = "markers", name: str | None = None,
          start: bool = True) -> MergeResult:
    """Merge the branches' changes against their common start into a new sandbox (see the module's docstring).

    ``policy``: the new sandbox's (default: the first sandbox branch's, else ``Policy()``, of the branches'
    image if they ran one); ``name``: its snapshot's; ``start=False``: make the snapshot only.
    """
    if any(getattr(item, "_on_cluster", False) for item in [*branches, base]) and hooks.merge_on_cluster:
        # Sandboxes or snapshots on the nodes of a Ray cluster: merged on one of them, by the layer that knows
        # the cluster (isolate/ray/merging.py, through model/hooks.py: this layer does not import it).
        result: MergeResult = hooks.merge_on_cluster(branches, base, policy=policy, on_conflict=on_conflict,
                                                     name=name, start=start)
        return result
    if on_conflict not in ("markers", "refuse"):
        raise PolicyError(f"on_conflict: {on_conflict!r} is not 'markers' or 'refuse'", "on_conflict")
    items = list(branches)
    if len(items) < 2:
        raise PolicyError("merge: give at least two branches", "branches")
    made: list[_Branch] = []
    try:
        for index, item in enumerate(items):
            made.append(_Branch(item, f"branch {index}" if not isinstance(item, Sandbox) or item.name is None
                                else item.name))
        kinds = {(b.snapshot.workspace.mode, b.snapshot.workspace.source, b.snapshot.workspace.target)
                 for b in made}
        if len(kinds) != 1 or len({b.snapshot.kind for b in made if b.snapshot.lower is None}) > 1:
            raise UnsupportedError("merge: the branches have different workspaces (source, target or mode): "
                                   + "; ".join(str(b.snapshot.workspace) for b in made))
        image, ref = _image_of(made)
        common = _base_view(base, made, image)
        roots: _Roots | None = None
        try:
            if image is not None:
                roots = _Roots(image, ref, made, common)
            # A layer over the branches' common ground when they and the base share one; else (copies made
            # apart, or some kept whole) a whole tree, as copy workspaces' merges were.
            grounds = {_ground(b.snapshot) for b in made}
            ground = grounds.pop() if len(grounds) == 1 else ("tree", None)
            if common.data >= 0 and common.ground != ground:
                ground = ("tree", None)
            return _merge(made, common, ground, roots, policy, on_conflict, name, start, items)
        finally:
            if roots is not None:
                roots.close()
            common.close()
    finally:
        for branch in made:
            branch.close()


Decision = tuple[str, int, Entry | None, bytes | None]  # path, branch, entry (None: gone), data


def _decide(base: View, views: list[View], labels: list[str], result: MergeResult, shown: str = "",
            leave_out: frozenset[str] = frozenset()) -> list[Decision]:
    """What the result holds at each path a branch changed against the base; the merged paths and conflicts
    go to result, each path as ``shown`` + its relative path. ``leave_out``: paths not merged, nor what they
    hold, nor the directories made on their way that hold nothing else (a sandbox's mount points, which its
    plan made in its root's upper layer)."""
    decisions: list[Decision] = []
    paths = sorted(set(base.entries).union(*(v.entries for v in views)))
    on_the_way = {"/".join(p.split("/")[:i]) for p in leave_out for i in range(1, p.count("/") + 1)}
    if leave_out:
        needed = {"/".join(p.split("/")[:i]) for p in paths if not _left_out(p, leave_out) and p not in on_the_way
                  for i in range(1, p.count("/") + 1)}
        paths = [p for p in paths if not _left_out(p, leave_out) and (p not in on_the_way or p in needed)]
    for rel in paths:
        changed = [i for i, v in enumerate(views) if not v.same(rel, base)]
        if not changed:
            continue
        distinct: list[int] = []
        for i in changed:
            if not any(views[i].same(rel, views[j]) for j in distinct):
                distinct.append(i)
        if len(distinct) == 1:
            i = distinct[0]
            decisions.append((rel, i, views[i].entries.get(rel), None))
            result.merged.append(shown + rel)
            continue
        entries = [views[i].entries.get(rel) for i in distinct]
        old = base.entries.get(rel)
        if any(e is None for e in entries):
            kind = "delete/modify"
        elif len({e.kind for e in entries if e is not None}) > 1:
            kind = "type"
        elif entries[0] is not None and entries[0].kind == "dir":
            kind = "mode"
        elif entries[0] is not None and entries[0].kind == "link":
            kind = "link"
        elif entries[0] is not None and entries[0].kind == "file":
            kind = "text"
        else:
            kind = "type"
        if kind == "text":
            merged, hunks, mode_clash = _merge_text(rel, base if old is not None and old.kind == "file" else None,
                                                    [views[i] for i in distinct], [labels[i] for i in distinct])
            if merged is None:
                kind = "binary"
            elif mode_clash:
                kind = "mode"
            else:
                entry = views[distinct[0]].entries[rel]
                # The one side's change of mode, if one changed it (the sides' modes do not clash).
                changed_modes = {views[i].entries[rel].mode & 0o7777 for i in distinct} - {
                    old.mode & 0o7777 if old is not None else None}
                if changed_modes:
                    entry = dataclasses.replace(entry, mode=changed_modes.pop())
                decisions.append((rel, distinct[0], entry, merged))
                if hunks:
                    result.conflicts.append(Conflict(shown + rel, "text", tuple(distinct), tuple(hunks)))
                else:
                    result.merged.append(shown + rel)
                continue
        result.conflicts.append(Conflict(shown + rel, kind, tuple(distinct)))
        # Marked: the first side that keeps something (an edit over a deletion), as git keeps the edit.
        keep = next((i for i in distinct if views[i].entries.get(rel) is not None), distinct[0])
        decisions.append((rel, keep, views[keep].entries.get(rel), None))
    return decisions


def _left_out(rel: str, leave_out: frozenset[str]) -> bool:
    return any("/".join(rel.split("/")[:i]) in leave_out for i in range(1, rel.count("/") + 2))


def _merge(made: list[_Branch], common: _Start, ground: Ground, roots: _Roots | None, policy: Policy | None,
           on_conflict: str, name: str | None, start: bool, items: list[Any]) -> MergeResult:
    result = MergeResult()
    layered = ground[0] == "layer"
    views = [b.view for b in made]
    labels = [b.label for b in made]
    decisions = _decide(common.view, views, labels, result)
    # The roots' changes, merged alike; their paths are the sandbox's, absolute.
    root_decisions = _decide(roots.base, roots.views, labels, result, "/",
                             roots.leave_out) if roots is not None else []
    if result.conflicts and on_conflict == "refuse":
        raise MergeConflictError(result)
    base_layered = common.ground[0] == "layer"
    making = _Making(name, "layer" if layered else "tree")
    try:
        if ground[1] is not None:
            making.use_copy(ground[1])  # the result's layer lies over the branches' private copy
        _write(making.data, common.view, -1 if base_layered and not layered else common.data, views, decisions,
               layered, base_layered)
        image = None
        if roots is not None:
            image = _write_root(making, made, common, roots, root_decisions)
        first = made[0].snapshot
        origin = made[0].snapshot.origin if len({b.snapshot.origin for b in made}) == 1 else None
        result.snapshot = making.commit(first.workspace, origin, (), image=image)
    except BaseException:
        making.abandon()
        raise
    if start:
        sandbox_policy = policy or next((x.policy for x in items if isinstance(x, Sandbox)), None) or Policy(
            image=result.snapshot.image)
        mounts = next((x.mounts for x in items if isinstance(x, Sandbox)), ())
        result.sandbox = Sandbox(sandbox_policy, mounts=mounts, snapshot=result.snapshot).start()
    return result


def _write_root(making: _Making, made: list[_Branch], common: _Start, roots: _Roots,
                decisions: list[Decision]) -> dict[str, Any]:
    """The merged root layer (``root``, as a snapshot of an image's sandbox keeps it): the common start's root
    layer, and over it each decided path; what the description says of the image (the first branch's, with
    every branch's mount points left out of an image made of it)."""
    os.mkdir("root", 0o755, dir_fd=making.fd)
    out = os.open("root", DIR_FLAGS, dir_fd=making.fd)
    try:
        top = made[0].snapshot.open_root()
        try:
            info = os.fstat(top)
        finally:
            os.close(top)
        if os.geteuid() == 0:
            os.fchown(out, info.st_uid, info.st_gid)
        os.fchmod(out, stat.S_IMODE(info.st_mode))
        _write(out, roots.base, common.root, roots.views, decisions, True, True)
    finally:
        os.close(out)
    return {**made[0].snapshot._image_meta(), "leave_out": sorted(roots.leave_out)}


def _merge_text(rel: str, base: View | None, sides: list[View],
                labels: list[str]) -> tuple[bytes | None, list[Hunk], bool]:
    """Several sides' versions of a file merged in turn against the base's: (data or None when one is not
    text, the conflicting hunks, whether the sides' modes clash)."""
    # Merged in memory, line by line: a file past MAX_TEXT_MERGE (a program's sparse file of a terabyte
    # costs its disk nothing) is a binary conflict, never read whole.
    if any(view.entries[rel].size > MAX_TEXT_MERGE for view in ([base] if base is not None else []) + sides):
        return None, [], False
    old = base.read(rel) if base is not None else b""
    datas = [side.read(rel) for side in sides]
    if not all(_text(d) for d in [old, *datas]):
        return None, [], False
    modes = {side.entries[rel].mode & 0o7777 for side in sides}
    base_mode = base.entries[rel].mode & 0o7777 if base is not None else None
    if len(modes - {base_mode}) > 1:
        return b"", [], True
    base_lines = old.splitlines(keepends=True)
    merged = datas[0].splitlines(keepends=True)
    hunks: list[Hunk] = []
    for side, label in zip(datas[1:], labels[1:], strict=True):
        merged, found = merge3(base_lines, merged, side.splitlines(keepends=True), (labels[0], label))
        hunks += found
    return b"".join(merged), hunks, False


def _write(out: int, base: View, base_data: int, views: list[View], decisions: list[Decision], layered: bool,
           base_layered: bool = False) -> None:
    """The result: the base's layer or tree, and over it each decided path."""
    if base_data >= 0:
        layers.clone(base_data, out)
    elif not layered and base.entries and base_layered:
        layers.materialize(base, out)  # a layer base's files, as one tree
    elif not layered and base.entries:
        from ..kernel.tree import copy_tree

        copy_tree(base._fds[0], out, _plain())
    deleted: list[str] = []
    made: list[tuple[str, int]] = []
    written: dict[tuple[int, int], tuple[str, tuple[int, int]]] = {}  # a source file: its first copy, its node
    for rel, index, entry, data in decisions:
        old = base.entries.get(rel)
        if entry is not None and entry.kind == "other":
            # A FIFO, socket or device node is not kept (nothing is read from it): in a layer that must hide what
            # lies below, or the image's or source's node it replaced would show again.
            entry = None
        if entry is None:
            # Under a deleted directory, the directory's deletion says it all.
            if (old is not None or not layered) and not any(rel.startswith(d + "/") for d in deleted):
                if layered:
                    _parents_like(out, rel, (views[index], base), made)
                layers.delete(out, rel, layered)
                deleted.append(rel)
            continue
        if layered:
            _parents_like(out, rel, (views[index], base), made)
        # A file of several names (hard links) is written once and linked under its other names: a program's
        # thousand names of one big file cost the host one copy, as they cost the program (and as a snapshot).
        shared = views[index].key(rel) if entry.kind == "file" and data is None and entry.nlink > 1 else None
        if shared is not None and shared in written and _link(out, written[shared], rel, layered):
            continue
        src_fd = -1
        owner = None
        if entry.kind == "file":
            src_fd = views[index].open(rel)
            owner = os.fstat(src_fd)
        try:
            layers.put(out, rel, entry, layered, data=data, src_fd=src_fd, owner=owner,
                       replaced_kind=old.kind if old is not None else None)
        finally:
            if src_fd >= 0:
                os.close(src_fd)
        if shared is not None:
            node = _node(out, rel)
            if node is not None:
                written[shared] = (rel, node)
    for rel, mode in sorted(made, key=lambda m: -m[0].count("/")):  # filled: their own modes, deepest first
        try:
            fd = _descend(out, rel)
        except (FileNotFoundError, NotADirectoryError):
            continue  # replaced by a later decision
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def _node(root: int, rel: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the regular file rel under root, reached without following a link."""
    try:
        parent = _descend(root, os.path.dirname(rel))
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        info = os.stat(os.path.basename(rel), dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        if parent != root:
            os.close(parent)
    return (info.st_dev, info.st_ino) if stat.S_ISREG(info.st_mode) else None


def _link(root: int, first: tuple[str, tuple[int, int]], rel: str, layered: bool) -> bool:
    """rel made a hard link of the file the merge wrote first at first's path (still that very file, reached
    without following a link); False when it cannot be (then it is copied)."""
    path, node = first
    if _node(root, path) != node:
        return False
    source = _descend(root, os.path.dirname(path))
    try:
        parent = layers._parent(root, rel, layered)
        try:
            name = os.path.basename(rel)
            _remove_tree(parent, name)
            os.link(os.path.basename(path), name, src_dir_fd=source, dst_dir_fd=parent, follow_symlinks=False)
        except OSError:
            return False
        finally:
            if parent != root:
                os.close(parent)
    finally:
        if source != root:
            os.close(source)
    return True


def _parents_like(out: int, rel: str, sources: tuple[View, ...], made: list[tuple[str, int]]) -> None:
    """The directories on the way to rel in a layer being written, each one missing made as the views show it
    (mode and owner: overlayfs shows the layer's directory, not the one below it; an image's 1777 or a user's
    0700 directory must not become the writer's 0755), writable to its maker until ``made``'s modes are set.
    Where one holds another node (a deletion's whiteout) it is replaced by an opaque directory, as put's."""
    # Not beneath.make_beneath: each step decides what to make (a view's mode and owner) or to replace.
    fd = out
    try:
        parts = rel.split("/")[:-1]
        for depth, part in enumerate(parts):
            sub = "/".join(parts[:depth + 1])
            try:
                found: os.stat_result | None = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                found = None
            if found is not None and stat.S_ISDIR(found.st_mode):
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            else:
                like = next((n for n in (v.node(sub) for v in sources) if n is not None and stat.S_ISDIR(n.st_mode)),
                            None)
                if like is None:
                    return  # made by put, as it makes any
                nxt = layers._mkdir_like(fd, part, like, found is not None, filling=True)
                made.append((sub, stat.S_IMODE(like.st_mode) & 0o7777))
            if fd != out:
                os.close(fd)
            fd = nxt
    finally:
        if fd != out:
            os.close(fd)


def _plain() -> Any:
    from ..model.workspace import Workspace

    return Workspace()
