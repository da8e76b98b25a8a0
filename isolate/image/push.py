"""Pushing an image of the store to a registry (OCI distribution API), with the client pull uses (registry.py).

The store keeps layers unpacked, not their blobs: each layer is written again
as a canonical gzip tar (export.py), whose digest is kept beside the layer
(``layers/HEX/export.json``) so that a later push asks the registry first and
writes nothing the registry holds. The image's config is its own with the
diff ids of those tars; the manifest is an OCI image manifest.

For each layer: ``HEAD /v2/REPO/blobs/DIGEST`` (200: the registry has it,
nothing sent), else ``POST /v2/REPO/blobs/uploads/`` and one ``PUT`` of the
whole blob to the location given (the monolithic upload every registry
takes). The config likewise, then ``PUT /v2/REPO/manifests/TAG``. The same
rules as pull: HTTPS, plain HTTP only to loopback or a registry named
insecure; the credentials docker and podman keep (or ``login``), asked with
the scope ``pull,push``; never sent to another host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kernel.links import DIR_FLAGS
from ..model.errors import IsolationError
from . import mapped
from .export import GZIP_LAYER, LayerBlob, remember, write_layer
from .reference import Reference
from .registry import Client, RegistryError
from .store import digest_hex

if TYPE_CHECKING:
    from . import Image

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"


@dataclass(frozen=True)
class Pushed:
    """What a push did: the reference, the manifest's digest, and how many blobs went up or were there."""

    reference: str
    digest: str
    uploaded: int
    present: int
    bytes_sent: int


def _exported(image: Image, digest: str) -> dict[str, Any] | None:
    """The digests a layer's export had (None: never exported)."""
    path = os.path.join(image.store.layer_dir(digest), "export.json")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and all(isinstance(data.get(k), str) for k in ("digest", "diff_id")) \
            and isinstance(data.get("size"), int):
        return data
    return None


def export_layer(image: Image, digest: str) -> LayerBlob:
    """A layer of the store written as a blob in the store's ``tmp/`` (the caller removes it)."""
    store = image.store
    store._ensure()
    hex_ = digest_hex(digest, "layer")
    path = os.path.join(store.path, "tmp", f"export-{hex_[:16]}-{os.getpid()}-{threading.get_ident()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    what = f"image {image.reference}: layer {digest[:19]}"
    kept = store.layer_mapping(digest)
    if kept is not None:  # its files are subordinate ids': read, and their owners written, inside the ranges
        ids = store.mapping
        if ids is None or mapped.describe(ids) != kept[0]:
            raise IsolationError(f"{what}: its files keep their owners through subordinate ids the caller no longer "
                                 "has as they were (/etc/subuid, /etc/subgid): give them back to export it")
        try:
            blob = mapped.export(ids, store.layer_root(digest), path, what)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        remember(store, digest, blob)
        return blob
    root_fd = os.open(store.layer_root(digest), DIR_FLAGS)
    try:
        blob = write_layer(root_fd, path, what=what)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    finally:
        os.close(root_fd)
    remember(store, digest, blob)
    return blob


class _Uploader:
    def __init__(self, client: Client, repository: str) -> None:
        self.client, self.repository = client, repository
        self.scope = f"repository:{repository}:pull,push"
        self.uploaded = self.present = self.bytes_sent = 0

    def has(self, digest: str) -> bool:
        response = self.client.send("HEAD", f"/v2/{self.repository}/blobs/{digest}", scope=self.scope)
        response.close()
        if response.status in (200, 404):
            return response.status == 200
        raise RegistryError(f"registry {self.client.registry}: HEAD of blob {digest[:19]}: HTTP {response.status}")

    def upload(self, digest: str, body: Any, size: int) -> None:
        """POST for an upload's location, then one PUT of the whole blob (``body``: bytes or a file)."""
        response = self.client.send("POST", f"/v2/{self.repository}/blobs/uploads/", {"Content-Length": "0"},
                                    b"", self.scope)
        location = response.headers.get("Location", "")
        response.read_all(1 << 16, "upload")
        response.close()
        if response.status != 202 or not location:
            raise RegistryError(f"registry {self.client.registry}: starting an upload to {self.repository}: "
                                f"HTTP {response.status}")
        separator = "&" if "?" in location else "?"
        url = f"{location}{separator}digest={urllib.parse.quote(digest)}"
        response = self.client.send("PUT", url, {"Content-Type": "application/octet-stream",
                                                 "Content-Length": str(size)}, body, self.scope)
        answer = response.read_all(1 << 16, "upload")
        response.close()
        if response.status != 201:
            raise RegistryError(f"registry {self.client.registry}: upload of blob {digest[:19]}: HTTP "
                                f"{response.status} {answer[:200].decode(errors='replace')}")
        self.uploaded += 1
        self.bytes_sent += size

    def blob(self, digest: str, data: bytes) -> None:
        if self.has(digest):
            self.present += 1
        else:
            self.upload(digest, data, len(data))


def push(image: Image, reference: str | None = None, *, insecure: bool = False,
         login: tuple[str, str] | None = None, cert_dir: str | None = None) -> Pushed:
    """Push ``image`` to ``reference`` (default: its own name)."""
    ref = Reference.parse(reference or image.reference)
    if ref.tag is None:
        raise RegistryError(f"push {ref}: name a tag to push to (a digest is what the registry gives back)")
    client = Client(ref.registry, insecure=insecure, login=login, cert_dir=cert_dir)
    up = _Uploader(client, ref.repository)
    descriptors: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    for digest in image.layers:
        known = _exported(image, digest)
        if known is not None and up.has(known["digest"]):
            up.present += 1
            descriptors.append({"mediaType": GZIP_LAYER, "digest": known["digest"], "size": known["size"]})
            diff_ids.append(known["diff_id"])
            continue
        blob = export_layer(image, digest)
        try:
            if up.has(blob.digest):
                up.present += 1
            else:
                with open(blob.path, "rb") as handle:
                    up.upload(blob.digest, handle, blob.size)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(blob.path)
        descriptors.append({"mediaType": blob.media_type, "digest": blob.digest, "size": blob.size})
        diff_ids.append(blob.diff_id)
    config = config_with(image, diff_ids)
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    up.blob(config_digest, config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                           "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config)},
                           "layers": descriptors}, separators=(",", ":")).encode()
    response = client.send("PUT", f"/v2/{ref.repository}/manifests/{ref.tag}",
                           {"Content-Type": MANIFEST_TYPE, "Content-Length": str(len(manifest))}, manifest, up.scope)
    answer = response.read_all(1 << 16, "manifest")
    response.close()
    if response.status != 201:
        raise RegistryError(f"registry {ref.registry}: the manifest of {ref}: HTTP {response.status} "
                            f"{answer[:200].decode(errors='replace')}")
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    return Pushed(str(ref), digest, up.uploaded, up.present, up.bytes_sent + len(manifest))


def config_with(image: Image, diff_ids: list[str]) -> bytes:
    """The image's config (as the store keeps it) with the layers' diff ids as pushed; bytes unchanged when they
    are the same."""
    data = image.store.get_blob(image.id, f"image {image.reference}: config")
    parsed = json.loads(data)
    rootfs = parsed.get("rootfs") if isinstance(parsed, dict) else None
    if isinstance(rootfs, dict) and rootfs.get("diff_ids") == diff_ids:
        return data
    parsed["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
    return json.dumps(parsed, separators=(",", ":"), sort_keys=True).encode()
