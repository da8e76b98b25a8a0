"""A snapshot as one content-addressed archive (a *bundle*), to move it to another machine and keep it there.

    data, digest = bundles.export(snap)       # bytes, and "sha256:<hex of the bytes>"
    snap = bundles.load(data, digest)         # on the other machine: verified, then kept as a local snapshot

A bundle is an uncompressed tar of at most six members, each a regular file:
``snapshot.json`` (its kind, workspace, id, origin and tmpfs mounts, and for a
sandbox of an image that image's id and reference and what ``to_image`` needs),
``data.tar`` (the layer or tree), ``base.tar`` (a layer snapshot's start, for
merge), ``root.tar`` (a sandbox of an image: its root's layer, the changes it
made to the image), ``rootbase.tar`` (the root layer it started from, for
merge) and ``areas.tar`` (the tmpfs mounts' archive, as the
snapshot keeps it). The image itself does not travel: the machine that loads
the bundle has it (a Ray node pulls its policy's image before it starts a
sandbox), and a sandbox starts from the snapshot only over that same image
(its id; ``check_image``).
A layer or tree travels as an image layer does: whiteouts as ``.wh.NAME``,
opaque directories as ``.wh..wh..opq``, links as links, no
device: packed by the image layer writer (``isolate/image/export.py``), through descriptors that follow no
link and never open a FIFO.
A name the program chose that starts with ``.wh.`` would read as a whiteout
on arrival: such a snapshot is refused, naming the path, not altered.

Loading treats the bundle as hostile: its digest is checked before anything
is read; the layers are unpacked by the image store's unpacker
(``isolate/image/unpack.py``: descriptor by descriptor, no device but a
whiteout, no set-id bit, no link followed, no overlayfs attribute forged); a
tree carrying whiteouts is refused; the tmpfs archive is kept as it came and
unpacked, as any snapshot's, only into a sandbox's own tmpfs mounts when one
starts from it (``isolate/kept/unpack.py``). On any failure the half-made
snapshot is removed: a bundle is kept whole or not at all.

The loaded snapshot keeps the snapshot's ``id`` and ``origin``: forks on two
machines of one snapshot still share their start for ``isolate.merge``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import tarfile
from typing import Any

from ..image.export import layer_into
from ..image.tarbound import BoundedTarInfo
from ..image.unpack import unpack
from ..kernel.links import DIR_FLAGS
from ..model.errors import IsolationError
from ..model.workspace import Workspace
from .snapshots import Snapshot, _Making

#: The most a bundle carries (its files' sizes, holes counted: a bundle is made in memory).
MAX_BUNDLE = 1 << 30
#: The members a bundle may hold; anything else in one is refused.
MEMBERS = ("snapshot.json", "data.tar", "base.tar", "root.tar", "rootbase.tar", "areas.tar")
_MAX_META = 1 << 20


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- out ---------------------------------------------------------------------------------------------


def _pack(fd: int, budget: list[int], what: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        layer_into(tar, fd, what=what, budget=budget)
    return buffer.getvalue()


def export(snap: Snapshot) -> tuple[bytes, str]:
    """The snapshot as a bundle, and its digest (see the module's docstring)."""
    budget = [MAX_BUNDLE]
    what = f"snapshot {snap.name!r} (to another node: at most {MAX_BUNDLE} bytes)"
    members: dict[str, bytes] = {}

    def pack_layer(name: str, fd: int | None) -> None:
        if fd is not None:
            try:
                members[name] = _pack(fd, budget, what)
            finally:
                os.close(fd)

    pack_layer("data.tar", snap.open_data())
    pack_layer("base.tar", snap.open_base())
    image: dict[str, Any] | None = None
    if snap.image is not None:
        image = snap._image_meta()
        root = snap.open_root()
        try:
            members["root.tar"] = _pack(root, budget, what)
            top = os.fstat(root)
            image = {**image, "root": [stat.S_IMODE(top.st_mode) & 0o1777, top.st_uid, top.st_gid]}
        finally:
            os.close(root)
        pack_layer("rootbase.tar", snap.open_root_base())
    areas = snap.open_areas()
    if areas is not None:
        with os.fdopen(areas, "rb") as handle:
            members["areas.tar"] = handle.read(MAX_BUNDLE + 1)
        if len(members["areas.tar"]) > MAX_BUNDLE:
            raise IsolationError(f"snapshot {snap.name!r}: its tmpfs archive is larger than {MAX_BUNDLE} bytes")
    ws = snap.workspace
    data = snap.open_data()
    try:
        top = os.fstat(data)
    finally:
        os.close(data)
    meta = {"kind": snap.kind, "root": [stat.S_IMODE(top.st_mode) & 0o1777, top.st_uid, top.st_gid],
            "id": snap.id, "origin": snap.origin, "areas": list(snap.areas),
            "workspace": {"source": ws.source, "target": ws.target, "mode": ws.mode, "exclude": list(ws.exclude)}}
    if image is not None:
        meta["image"] = image
    members["snapshot.json"] = json.dumps(meta, sort_keys=True).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in MEMBERS:
            if name in members:
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(members[name]), 0o600
                archive.addfile(info, io.BytesIO(members[name]))
    out = buffer.getvalue()
    return out, digest_of(out)


# -- in ----------------------------------------------------------------------------------------------


def _members(data: bytes, what: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=BoundedTarInfo) as archive:
            for member in archive:
                if member.name not in MEMBERS or not member.isreg() or member.name in out:
                    raise IsolationError(f"{what}: not a snapshot bundle (member {member.name!r})")
                source = archive.extractfile(member)
                assert source is not None
                out[member.name] = source.read()
    except (tarfile.TarError, ValueError, EOFError) as exc:
        raise IsolationError(f"{what}: not a snapshot bundle ({exc})") from None
    if "snapshot.json" not in out or "data.tar" not in out:
        raise IsolationError(f"{what}: not a snapshot bundle (no snapshot.json or data.tar)")
    return out


def _meta(raw: bytes, what: str) -> dict[str, Any]:
    if len(raw) > _MAX_META:
        raise IsolationError(f"{what}: its description is larger than {_MAX_META} bytes")
    try:
        meta = json.loads(raw)
        ws = meta["workspace"]
        root = meta["root"]
        # A mode and an owner as the kernel takes them: not -1 (fchown's "unchanged"), nothing past 32 bits.
        if not isinstance(root, list) or len(root) != 3 or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 32) - 1 for x in root):
            raise ValueError(f"the root's mode and owner {str(root)[:60]}")
        image = _image_meta(meta.get("image"))
        checked = {"kind": meta["kind"], "root": (root[0] & 0o1777, root[1], root[2]), "id": str(meta["id"]),
                   "image": image,
                   "origin": meta["origin"],
                   "areas": tuple(str(a) for a in meta["areas"]),
                   "workspace": {"source": ws["source"], "target": str(ws["target"]), "mode": str(ws["mode"]),
                                 "exclude": [str(x) for x in ws["exclude"]]}}
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise IsolationError(f"{what}: its description is not one isolate writes ({exc!r})") from None
    origin, source = checked["origin"], ws["source"]
    # The root's owner is given to fchown: 3 numbers, each an id the kernel takes (-1 would mean "unchanged").
    if checked["kind"] not in ("layer", "tree") or not (origin is None or isinstance(origin, str)) \
            or not (source is None or isinstance(source, str)) or len(root) != 3 \
            or not all(0 <= x < (1 << 32) - 1 for x in root[1:]):
        raise IsolationError(f"{what}: its description is not one isolate writes")
    if not all(os.path.isabs(a) and ".." not in a.split("/") for a in checked["areas"]):
        raise IsolationError(f"{what}: its tmpfs mounts are not absolute paths")
    return checked


def _owner(value: Any) -> tuple[int, int, int]:
    """A mode and an owner as the kernel takes them: not -1 (fchown's "unchanged"), nothing past 32 bits."""
    if not isinstance(value, list) or len(value) != 3 or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 32) - 1 for x in value):
        raise ValueError(f"a mode and owner {str(value)[:60]}")
    return value[0] & 0o1777, value[1], value[2]


def _image_meta(value: Any) -> dict[str, Any] | None:
    """What a snapshot of a sandbox of an image says of that image, each field checked (ValueError)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"id", "reference", "config", "leave_out", "root"}:
        raise ValueError("the image it lies over is not described as isolate does")
    image_id, reference, config, leave_out = value["id"], value["reference"], value["config"], value["leave_out"]
    if not (isinstance(image_id, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", image_id)) \
            or not (reference is None or (isinstance(reference, str) and 0 < len(reference) <= 4096)):
        raise ValueError("the image's id or reference")
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config) \
            or not isinstance(leave_out, list) or not all(
                isinstance(p, str) and p and not p.startswith("/") and ".." not in p.split("/") for p in leave_out):
        raise ValueError("the image's config or the mount points left out of it")
    return {"id": image_id, "reference": reference, "config": config, "leave_out": list(leave_out),
            "root": _owner(value["root"])}


def load(data: bytes, digest: str, name: str | None = None) -> Snapshot:
    """Keep a bundle as a local snapshot: verified against digest first, whole or not at all (see the module's
    docstring). ``name``: the local snapshot's (default: a new one)."""
    what = f"snapshot bundle {digest[:19]}"
    if digest_of(data) != digest:
        raise IsolationError(f"{what}: its bytes do not match their digest (damaged on the way?): not kept")
    members = _members(data, what)
    meta = _meta(members["snapshot.json"], what)
    ws = meta["workspace"]
    workspace = _shown(ws)
    making = _Making(name, meta["kind"])
    try:
        layer = unpack(_raw(members["data.tar"]), making.data, what=what, max_size=MAX_BUNDLE)
        mode, uid, gid = meta["root"]
        if os.geteuid() == 0:
            os.fchown(making.data, uid, gid)
        os.fchmod(making.data, mode)
        if meta["kind"] == "tree" and (layer.index.whiteouts or layer.index.opaque):
            raise IsolationError(f"{what}: a tree snapshot that carries whiteouts: refused")
        if "base.tar" in members:
            if meta["kind"] != "layer":
                raise IsolationError(f"{what}: a tree snapshot with a base layer: refused")
            os.mkdir("base", 0o755, dir_fd=making.fd)
            base = os.open("base", DIR_FLAGS, dir_fd=making.fd)
            try:
                unpack(_raw(members["base.tar"]), base, what=what, max_size=MAX_BUNDLE)
            finally:
                os.close(base)
        image = meta["image"]
        if ("root.tar" in members) != (image is not None):
            raise IsolationError(f"{what}: an image's root layer without its image, or the reverse: refused")
        if image is not None:
            os.mkdir("root", 0o755, dir_fd=making.fd)
            root = os.open("root", DIR_FLAGS, dir_fd=making.fd)
            try:
                unpack(_raw(members["root.tar"]), root, what=what, max_size=MAX_BUNDLE)
                mode, uid, gid = image.pop("root")
                if os.geteuid() == 0:
                    os.fchown(root, uid, gid)
                os.fchmod(root, mode)
            finally:
                os.close(root)
            if "rootbase.tar" in members:
                os.mkdir("rootbase", 0o755, dir_fd=making.fd)
                root_base = os.open("rootbase", DIR_FLAGS, dir_fd=making.fd)
                try:
                    unpack(_raw(members["rootbase.tar"]), root_base, what=what, max_size=MAX_BUNDLE)
                finally:
                    os.close(root_base)
        elif "rootbase.tar" in members:
            raise IsolationError(f"{what}: the root layer a sandbox started from, without its image: refused")
        if "areas.tar" in members:
            if not meta["areas"]:
                raise IsolationError(f"{what}: a tmpfs archive and no tmpfs mount it is for: refused")
            fd = making.open_areas()
            with os.fdopen(fd, "wb") as handle:
                handle.write(members["areas.tar"])
        elif meta["areas"]:
            raise IsolationError(f"{what}: names tmpfs mounts and carries no archive of them: refused")
        return making.commit(workspace, meta["origin"], meta["areas"], id=meta["id"], image=image)
    except BaseException:
        making.abandon()
        raise


def _raw(data: bytes) -> io.RawIOBase:
    # Read as a raw stream: readinto is all the unpacker needs of it.
    return io.BytesIO(data)  # type: ignore[return-value]


def _shown(ws: dict[str, Any]) -> Workspace:
    """The workspace the bundle names; its source is a path on the machine it came from, which may not be here
    (the caller of ``load`` gives a sandbox's own source instead, see isolate/ray/host.py)."""
    from .snapshots import _workspace

    return _workspace(ws)
