"""Images from files: a ``docker save`` archive, an OCI image layout (a directory, or a tar of one).

Every blob is read through its digest: a manifest or config is verified
before it is parsed (and is refused past a few MiB), a layer while it is
unpacked (and thrown away on a mismatch, see store.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import re
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from ..kernel.beneath import open_beneath
from ..model.errors import IsolationError
from .store import MAX_METADATA_SIZE, verify
from .tarbound import BoundedTarInfo
from .unpack import BadImageError, entry_name

MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
INDEX_TYPES = (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST)
REF_ANNOTATION = "org.opencontainers.image.ref.name"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386", "ppc64le": "ppc64le",
         "s390x": "s390x", "riscv64": "riscv64"}


def host_platform() -> tuple[str, str]:
    machine = platform.machine()
    return "linux", _ARCH.get(machine, machine)


def platform_matches(entry: dict[str, Any]) -> bool:
    """Whether an index's entry is for this host (an entry that names no platform is)."""
    wanted = host_platform()
    found = entry.get("platform")
    if not isinstance(found, dict):
        return True
    return (found.get("os"), found.get("architecture")) == wanted


def choose_manifest(index: dict[str, Any], what: str) -> dict[str, Any]:
    """The entry of an image index or manifest list for this host's platform."""
    entries = index.get("manifests")
    if not isinstance(entries, list) or not entries:
        raise BadImageError(f"{what}: an image index with no manifests")
    for entry in entries:
        if isinstance(entry, dict) and platform_matches(entry) and entry.get("platform") is not None:
            return entry
    for entry in entries:
        if isinstance(entry, dict) and platform_matches(entry):
            return entry
    found = sorted({f"{e['platform'].get('os')}/{e['platform'].get('architecture')}" for e in entries
                    if isinstance(e, dict) and isinstance(e.get("platform"), dict)})
    raise BadImageError(f"{what}: no manifest for this host's platform {'/'.join(host_platform())} "
                        f"(the image has {', '.join(found) or 'none named'})")


#: The most layers one image may have: Docker's own storage stacks 127 at most, and overlayfs's options name about 45
#: here. Each layer named is read (a ``docker save`` archive's is hashed whole) before the config says how many it has.
MAX_LAYERS = 256


def check_layer_count(count: int, what: str) -> None:
    """Refuse an image of more than MAX_LAYERS layers (a 4 MiB manifest names 50,000: one layer file named so
    often was hashed as many times, a gigabyte each, before anything else was checked)."""
    if count > MAX_LAYERS:
        raise BadImageError(f"{what}: {count} layers, past the {MAX_LAYERS} an image may have: refused")


def parse_json(data: bytes, what: str) -> dict[str, Any]:
    if len(data) > MAX_METADATA_SIZE:
        raise BadImageError(f"{what}: past {MAX_METADATA_SIZE} bytes: refused")
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # RecursionError: arrays nested deeper than the interpreter's stack (4 MiB of "[" is 4 million deep).
        raise BadImageError(f"{what}: not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise BadImageError(f"{what}: not a JSON object")
    return value


@dataclass
class Found:
    """One image in a file: its name (if the file gives one), manifest, config and layers."""

    reference: str | None
    manifest: bytes | None  # None: a docker save archive has none
    manifest_digest: str | None
    config: bytes
    config_digest: str
    layers: list[tuple[str, str]]  # (digest, path inside the archive)


class _Source:
    """Files of a directory or a tar archive, by their name inside it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tar: tarfile.TarFile | None = None
        self._handle: IO[bytes] | None = None
        self.members: dict[str, tarfile.TarInfo] = {}
        if os.path.isdir(path):
            return
        # Opened without blocking (a FIFO waited for a writer for ever) and only if it is a regular file.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise IsolationError(f"{path!r}: cannot open it: {exc.strerror}") from None
        self._handle = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            self._handle.close()
            raise IsolationError(f"{path}: neither an image archive (a file) nor an OCI layout directory")
        os.set_blocking(fd, True)
        try:
            self.tar = tarfile.open(fileobj=self._handle, mode="r:*", tarinfo=BoundedTarInfo)
        except (OSError, tarfile.TarError, EOFError, ValueError, OverflowError) as exc:
            # Its message lists each compression tried, one line each: only a header past its bound is said.
            self._handle.close()
            bound = re.search(r"HeaderTooLarge\([\'\"](.*?)[\'\"]\)", str(exc))
            raise IsolationError(f"{path}: not an image archive (a tar, compressed or not) nor an OCI layout "
                                 f"directory{f' ({bound.group(1)})' if bound else ''}") from None
        try:
            for member in self.tar:
                name = entry_name(member.name, path)
                if member.isreg() and (member.issparse() or member.type == tarfile.GNUTYPE_SPARSE):
                    # Its size is the sparse map's word: an archive of 20 KB read as a petabyte of zeros (a docker
                    # save archive's layer file is hashed whole). Neither docker nor skopeo writes one.
                    raise BadImageError(f"{path}: {name} is a sparse file in the archive: refused")
                if member.isreg():
                    self.members[name] = member
        except BadImageError:
            self.tar.close()
            self._handle.close()
            raise
        except (OSError, tarfile.TarError, EOFError, ValueError, OverflowError) as exc:
            # A damaged archive, a header's number no tar takes, headers past their bound (tarbound.py): one line.
            self.tar.close()
            self._handle.close()
            raise IsolationError(f"{path}: not an image archive nor an OCI layout directory ({exc})") from None

    def exists(self, name: str) -> bool:
        if self.tar is not None:
            return name in self.members
        try:
            fd = self._open_beneath(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, BadImageError):
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def _open_beneath(self, name: str, flags: int) -> int:
        """The layout's file ``name`` opened with ``flags``, reached from the layout's directory with no link
        followed on the way or at its end (kernel/beneath.py): a ``blobs`` linked elsewhere had the host read, as
        the image's blobs, whatever files lay there that the digests named (a root caller's, any file)."""
        root = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return open_beneath(root, entry_name(name, self.path), flags)
        finally:
            os.close(root)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        name = entry_name(name, self.path)
        if self.tar is not None:
            member = self.members.get(name)
            if member is None:
                raise BadImageError(f"{self.path}: {name} is missing from the archive")
            handle = self.tar.extractfile(member)
            assert handle is not None
            with handle:
                yield handle
            return
        try:
            # Non-blocking, then checked: a FIFO would hang the load, a device (/dev/zero through a linked
            # directory) would be read for ever.
            fd = self._open_beneath(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            why = "a link or no directory on the way" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
            raise BadImageError(f"{self.path}: {name}: {why}: refused") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BadImageError(f"{self.path}: {name} is not a regular file: refused")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as handle:
            yield handle

    def read(self, name: str) -> bytes:
        with self.open(name) as handle:
            data = handle.read(MAX_METADATA_SIZE + 1)
        if len(data) > MAX_METADATA_SIZE:
            raise BadImageError(f"{self.path}: {name}: past {MAX_METADATA_SIZE} bytes: refused")
        return data

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
        if self._handle is not None:
            self._handle.close()


def blob_name(digest: str) -> str:
    from .store import digest_hex

    return f"blobs/sha256/{digest_hex(digest, 'blob')}"


def read_oci(source: _Source) -> list[Found]:
    index = parse_json(source.read("index.json"), f"{source.path}: index.json")
    found: list[Found] = []
    verified: dict[str, bytes] = {}  # each blob read and hashed once, however often the index names it

    def blob(digest: str, what: str) -> bytes:
        if digest not in verified:
            verified[digest] = verify(source.read(blob_name(digest)), digest, what)
        return verified[digest]

    def visit(entry: dict[str, Any], name: str | None, depth: int) -> None:
        digest = entry.get("digest")
        media = entry.get("mediaType")
        if not isinstance(digest, str):
            raise BadImageError(f"{source.path}: an index entry with no digest")
        data = blob(digest, f"{source.path}: {digest}")
        if media in INDEX_TYPES:
            if depth > 4:
                raise BadImageError(f"{source.path}: indexes nested too deep")
            nested = parse_json(data, f"{source.path}: {digest}")
            visit(choose_manifest(nested, f"{source.path}: {digest}"), name, depth + 1)
            return
        manifest = parse_json(data, f"{source.path}: manifest {digest}")
        found.append(found_from_manifest(source, manifest, data, digest, name, blob))

    entries = index.get("manifests")
    if not isinstance(entries, list) or not entries:
        raise BadImageError(f"{source.path}: index.json lists no image")
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        annotations = entry.get("annotations") if isinstance(entry.get("annotations"), dict) else {}
        name = annotations.get(REF_ANNOTATION) if annotations else None
        if entry.get("mediaType") not in INDEX_TYPES and not platform_matches(entry):
            continue
        visit(entry, name if isinstance(name, str) else None, 0)
    return found


def found_from_manifest(source: _Source, manifest: dict[str, Any], data: bytes, digest: str,
                        name: str | None, blob: Callable[[str, str], bytes]) -> Found:
    config = manifest.get("config")
    layers = manifest.get("layers")
    if not isinstance(config, dict) or not isinstance(layers, list):
        raise BadImageError(f"{source.path}: manifest {digest} has no config or no layers")
    check_layer_count(len(layers), f"{source.path}: manifest {digest}")
    config_digest = config.get("digest")
    if not isinstance(config_digest, str):
        raise BadImageError(f"{source.path}: manifest {digest}: a config with no digest")
    config_data = blob(config_digest, f"{source.path}: config")
    out = []
    for layer in layers:
        layer_digest = layer.get("digest") if isinstance(layer, dict) else None
        if not isinstance(layer_digest, str):
            raise BadImageError(f"{source.path}: manifest {digest}: a layer with no digest")
        out.append((layer_digest, blob_name(layer_digest)))
    return Found(name, data, digest, config_data, config_digest, out)


def read_docker(source: _Source, max_size: int) -> list[Found]:
    """A ``docker save`` archive: manifest.json names each image's config and layer files (their digests
    are computed as they are read, and the config's diff ids checked)."""
    import hashlib

    try:
        entries = json.loads(source.read("manifest.json"))
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep (parse_json)
        raise BadImageError(f"{source.path}: manifest.json is not valid JSON ({exc})") from None
    if not isinstance(entries, list) or not entries:
        raise BadImageError(f"{source.path}: manifest.json lists no image")
    found = []
    hashed: dict[str, str] = {}  # each file hashed once, however often the archive names it
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("Config"), str) or \
                not isinstance(entry.get("Layers"), list):
            raise BadImageError(f"{source.path}: manifest.json: an entry with no Config or Layers")
        check_layer_count(len(entry["Layers"]), f"{source.path}: manifest.json")
        config = source.read(entry["Config"])
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        layers = []
        for name in entry["Layers"]:
            if not isinstance(name, str):
                raise BadImageError(f"{source.path}: manifest.json: a layer that is not a file name")
            key = entry_name(name, source.path)
            if key not in hashed:
                sha = hashlib.sha256()
                read = 0
                with source.open(name) as handle:
                    while chunk := handle.read(1 << 20):
                        read += len(chunk)
                        if read > max_size:  # as a layer's blob is bounded when it unpacks (store.py)
                            raise BadImageError(f"{source.path}: {name}: past max_image_size ({max_size} bytes): "
                                                "refused")
                        sha.update(chunk)
                hashed[key] = "sha256:" + sha.hexdigest()
            layers.append((hashed[key], name))
        tags = entry.get("RepoTags") if isinstance(entry.get("RepoTags"), list) else []
        found.append(Found(tags[0] if tags and isinstance(tags[0], str) else None, None, None, config,
                           config_digest, layers))
    return found


def read_archive(path: str, max_size: int) -> tuple[_Source, list[Found]]:
    """The images of the file or directory ``path``; ``max_size``: the most bytes a layer file may hold."""
    source = _Source(path)
    try:
        if source.exists("index.json") and source.exists("oci-layout") and not source.exists("manifest.json"):
            return source, read_oci(source)
        if source.exists("manifest.json"):
            return source, read_docker(source, max_size)
        if source.exists("index.json"):
            return source, read_oci(source)
    except BaseException:
        source.close()
        raise
    source.close()
    raise IsolationError(f"{path}: neither a docker save archive (manifest.json) nor an OCI image layout "
                         "(index.json)")
