"""An image of the store with one more layer, or with its config changed: what a commit and a build step keep.

``add_layer`` puts a layer written by export.py (a gzip tar in the store's
``tmp/``) on top of an image, unpacked into the store as a pulled one is;
``with_config`` keeps a record of an image with its config changed (an
image between two build steps, or committed with no name, is
``localhost/isolate-build:ID``). ``Sandbox.commit_image`` (isolate/kept/commit.py,
which a build's RUN step calls too: isolate/kept/imagebuild.py) reads the
sandbox's upper layer, less the mount points ``mount_points`` reads, and
adds it with the config ``policy_config`` gives; build.py adds its other
steps' layers and configs here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..model.errors import IsolationError
from . import Image, ImageConfig
from .export import LayerBlob, remember, write_layer
from .reference import Reference
from .store import INTERMEDIATE, Store


def mount_points(pid: int) -> frozenset[str]:
    """The mount points of the process's mount namespace, relative to its root (no leading slash)."""
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise IsolationError(f"commit_image: the sandbox's mount table cannot be read ({exc.strerror})") from None
    points = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]).strip("/")
            if point:
                points.add(point)
    return frozenset(points)


def add_layer(base: Image, blob: LayerBlob, reference: str | None, config: Mapping[str, Any],
              history: str) -> Image:
    """``base`` with the layer ``blob`` (a gzip tar in the store's ``tmp/``) on top, kept as ``reference``
    (None: ``localhost/isolate-build:ID``); ``config``: what to set in the image config's ``config`` (Env,
    WorkingDir, User, Cmd, ...)."""
    store = base.store
    with store.adding():
        index = store.ensure_layer(blob.digest, lambda: open(blob.path, "rb"), diff_id=blob.diff_id,
                                   what=f"image {reference or 'built'}: its new layer")
        remember(store, blob.digest, blob)
        return with_config(base, reference, config, history, layers=[blob.digest], diff_ids=[blob.diff_id],
                           added_size=index.size)




def with_config(base: Image, reference: str | None, config: Mapping[str, Any], history: str, *,
                layers: list[str] | None = None, diff_ids: list[str] | None = None, added_size: int = 0) -> Image:
    """A record of ``base`` (plus ``layers``) with its config changed: the config blob written, the image kept
    as ``reference`` (None: ``localhost/isolate-build:ID``)."""
    store = base.store
    parsed = json.loads(store.get_blob(base.id, f"image {base.reference}: config"))
    inner = dict(parsed.get("config") or {})
    inner.update({k: v for k, v in config.items() if v is not None})
    parsed["config"] = inner
    rootfs = parsed.get("rootfs") if isinstance(parsed.get("rootfs"), dict) else {"type": "layers", "diff_ids": []}
    parsed["rootfs"] = {"type": "layers", "diff_ids": [*rootfs.get("diff_ids", []), *(diff_ids or [])]}
    entry: dict[str, Any] = {"created_by": history}
    if not layers:
        entry["empty_layer"] = True
    parsed["history"] = [*(parsed.get("history") or []), entry]
    data = json.dumps(parsed, separators=(",", ":"), sort_keys=True).encode()

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    name = str(Reference.parse(reference or f"{INTERMEDIATE}:{digest[7:]}"))
    store.put_blob(data, digest, f"image {name}: config")
    image_config = ImageConfig.from_json(parsed)
    record = {"reference": name, "digest": digest, "config_digest": digest,
              "layers": [*base.layers, *(layers or [])],
              "config": {k: list(v) if isinstance(v, tuple) else v for k, v in image_config.__dict__.items()},
              "size": base.size + added_size, "created": time.time()}
    store.write_record(record)
    return Image._from_record(record, store)


def policy_config(base: Image, policy: Any) -> dict[str, Any]:
    """The config a sandbox's policy gives its image: env over the image's, working directory, user."""
    env = base.config.environment()
    env.update(dict(policy.env))
    out: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in env.items()]}
    if policy.cwd is not None:
        out["WorkingDir"] = policy.cwd
    if policy.uid is not None:
        out["User"] = str(policy.uid) + (f":{policy.gid}" if policy.gid is not None else "")
    return out


def _layer_path(store: Store, kind: str) -> str:
    store._ensure()
    path = os.path.join(store.path, "tmp", f"{kind}-{os.getpid()}-{threading.get_ident()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return path


def snapshot_image(base: Image, root_fd: int, reference: str | None, config: Mapping[str, Any],
                   leave_out: frozenset[str], history: str) -> Image:
    """``base`` plus a snapshot's root layer (``root_fd``: overlayfs's format, as an upper layer) as one more
    layer, kept as ``reference`` (``Snapshot.to_image``: kept/snapshots.py)."""
    path = _layer_path(base.store, "snapshot")
    try:
        # Bounded before a byte is read, as commit_image's (a sparse file claims its size).
        blob = write_layer(root_fd, path, what=f"to_image {reference or 'built'} (at most max_image_size, "
                           f"{base.store.max_image_size} bytes)", leave_out=leave_out,
                           max_size=base.store.max_image_size)
        return add_layer(base, blob, reference, config, history)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

