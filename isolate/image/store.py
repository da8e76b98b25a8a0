"""The content-addressed store of images: blobs, unpacked layers and the images that name them.

Layout (``Store.path``: ``--image-store DIR``, ``$ISOLATE_IMAGE_STORE``, else
``<state dir>/images``; mode 0700, owned by the caller, checked on each use):

- ``blobs/sha256/HEX``: manifests and configs, each verified against its
  digest before it is written, and again when read;
- ``layers/HEX/root``: a layer unpacked (isolate/image/unpack.py), HEX its
  blob's digest; ``layers/HEX/index.json`` what it holds, and
  ``layers/HEX/owners.json`` the owners other than root its archive gives
  (kept on disk in a root's store, and in that of a regular user with
  subordinate ids, through them: mapped.py, which the file then names). A
  layer two images share is unpacked once;
- ``images/KEY.json``: an image: its reference, manifest digest, config and
  layers (KEY: the hash of the reference);
- ``locks/``: a lock file per digest (concurrent pulls of one layer, from
  threads or processes, unpack it once) and ``store`` (prune takes it
  exclusively, whoever adds an image shares it);
- ``leases/``: a file per running sandbox of an image, naming the layers it
  stands on (isolate/image/leases.py): prune keeps them;
- ``tmp/``: work in progress. A layer is unpacked there and renamed into
  ``layers/`` only once its digests are verified: an interrupted or refused
  layer leaves nothing in use, and the next use of the store clears it.

A regular user's store is that user's own (as rootless podman keeps one per
user): owned by them, 0700, never shared with another uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import re
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from ..kernel.subids import SubIds
from ..kernel.way import check_way
from ..model.errors import IsolationError
from ..model.forks import fork_safe, in_child
from . import budget, leases, mapped
from .unpack import BadImageError, LayerIndex, owners_of, remove_tree, unpack

STORE_ENV = "ISOLATE_IMAGE_STORE"
OWNERS_FILE = "owners.json"
#: The default bound on an image's unpacked bytes (and on each layer's decompressed stream).
DEFAULT_MAX_IMAGE_SIZE = 16 << 30
#: A manifest, an index or a config past this is refused, never parsed.
MAX_METADATA_SIZE = 4 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")
#: Where an image between two build steps (or committed with no name) is kept: its tag is its config digest.
INTERMEDIATE = "localhost/isolate-build"
_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = fork_safe(threading.Lock())
in_child(_thread_locks.clear)  # a lock of the parent's threads, held at the fork, would be held for good


def digest_hex(digest: str, what: str) -> str:
    if not isinstance(digest, str) or not digest.startswith("sha256:") or not _HEX.match(digest[7:]):
        raise BadImageError(f"{what}: digest {digest!r} is not sha256: and 64 lowercase hex digits")
    return digest[7:]


def verify(data: bytes, digest: str, what: str) -> bytes:
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise BadImageError(f"{what}: its content does not match its digest {digest}: refused, nothing kept")
    return data


def default_path() -> str:
    explicit = os.environ.get(STORE_ENV)
    if explicit:
        return os.path.abspath(explicit)
    from ..kernel.places import state_path

    return state_path("images")


class _HashingReader(io.RawIOBase):
    """A blob read through, hashed and counted, to be checked against its digest at the end; past ``limit``
    bytes refused (the bound on the decompressed stream does not bound the blob: gzip reads any number of
    zero bytes after its stream as padding, so an endless blob after a small layer was read for ever)."""

    def __init__(self, raw: IO[bytes], limit: int, what: str) -> None:
        super().__init__()
        self.raw, self.limit, self.what = raw, limit, what
        self.sha = hashlib.sha256()
        self.count = 0

    def readinto(self, buffer: Any) -> int:
        data = self.raw.read(len(buffer))
        self.sha.update(data)
        self.count += len(data)
        if self.count > self.limit:
            raise BadImageError(f"{self.what}: its blob is past max_image_size ({self.limit} bytes): refused")
        buffer[:len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        buffer = bytearray(256 << 10)
        while self.readinto(buffer):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


class Store:
    """One user's image store (see the module's docstring)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 max_image_size: int = DEFAULT_MAX_IMAGE_SIZE) -> None:
        self.path = os.path.abspath(os.fspath(path)) if path is not None else default_path()
        self.max_image_size = max_image_size
        self._made = False

    # -- places ---------------------------------------------------------------

    def _ensure(self) -> None:
        """The store checked at each use (cheap: a few lstat), its parts made once.

        The store is used by path (overlay lower directories, the native binary's leases), so the check is on the
        path: the store a private directory of the caller, and nothing on the way to it that another uid could
        change (every directory owned by root or the caller, none writable by group or others unless sticky,
        every symbolic link owned by root or the caller). Checked once on the store alone, a store under a
        directory another user could write was trusted after that user renamed it away and put their own (or a
        link to one) in its place: each later use went there. With the whole way checked, only root or the
        caller can change what the path names, and this check at each use catches the caller's own changes."""
        uid = os.geteuid()
        if not self._made:
            try:
                os.makedirs(self.path, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise IsolationError(f"image store {self.path}: {exc.strerror}; choose another with --image-store "
                                     f"or {STORE_ENV}") from None
        try:
            info = os.lstat(self.path)
        except OSError as exc:
            raise IsolationError(f"image store {self.path}: {exc.strerror}; choose another with --image-store "
                                 f"or {STORE_ENV}") from None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
            raise IsolationError(f"image store {self.path}: not a private directory of uid {uid} (mode 0700, "
                                 "owned by the caller); a store is never shared between users")
        check_way("image store", self.path, f"choose another with --image-store or {STORE_ENV}", uid)
        if self._made:
            return
        for part in ("blobs", "blobs/sha256", "layers", "images", "locks", "tmp"):
            try:
                os.mkdir(os.path.join(self.path, part), 0o700)
            except FileExistsError:
                pass
        self._made = True
        self._clear_tmp()

    def _clear_tmp(self) -> None:
        """Work an interrupted pull or load left behind: that of a process no longer running (each work
        directory's name ends with its process's pid and thread's id; a long unpack is never cut short)."""
        tmp = os.path.join(self.path, "tmp")
        for name in os.listdir(tmp):
            parts = name.split("-")
            try:
                pid = int(parts[-2])
            except (IndexError, ValueError):
                pid = -1
            if pid > 0:
                try:
                    os.kill(pid, 0)
                    continue  # its process still runs
                except ProcessLookupError:
                    pass
                except PermissionError:
                    continue
            try:
                self._remove(os.path.join(tmp, name))
            except (OSError, IsolationError):
                pass

    def layer_dir(self, digest: str) -> str:
        self._ensure()
        return os.path.join(self.path, "layers", digest_hex(digest, "layer"))

    def layer_root(self, digest: str) -> str:
        return os.path.join(self.layer_dir(digest), "root")

    def has_layer(self, digest: str) -> bool:
        return os.path.isfile(os.path.join(self.layer_dir(digest), "index.json"))

    # -- locks ----------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self, name: str, exclusive: bool = True) -> Iterator[None]:
        self._ensure()
        with _thread_locks_guard:
            thread_lock = _thread_locks.setdefault(f"{self.path}\0{name}", threading.Lock())
        # Threads of this process: a lock of their own (flock is per open file, so two threads would both
        # get it on two descriptors anyway, but a shared store lock must not be taken by two threads at
        # once as exclusive). Shared locks need no thread lock.
        with thread_lock if exclusive else contextlib.nullcontext():
            fd = os.open(os.path.join(self.path, "locks", name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
                yield
            finally:
                os.close(fd)

    # -- blobs ----------------------------------------------------------------

    def put_blob(self, data: bytes, digest: str, what: str) -> None:
        hex_ = digest_hex(digest, what)
        verify(data, digest, what)
        self._ensure()
        path = os.path.join(self.path, "blobs", "sha256", hex_)
        if os.path.isfile(path):
            return
        tmp = os.path.join(self.path, "tmp", f"blob-{hex_}-{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)

    def get_blob(self, digest: str, what: str) -> bytes:
        self._ensure()
        path = os.path.join(self.path, "blobs", "sha256", digest_hex(digest, what))
        try:
            with open(path, "rb") as handle:
                data = handle.read(MAX_METADATA_SIZE + 1)
        except FileNotFoundError:
            raise IsolationError(f"{what}: {digest} is not in the image store {self.path}") from None
        return verify(data, digest, what)

    # -- layers ---------------------------------------------------------------

    def ensure_layer(self, digest: str, opener: Callable[[], IO[bytes]], *, diff_id: str | None,
                     what: str) -> LayerIndex:
        """The layer ``digest``, unpacked once: from ``opener()`` unless the store holds it already."""
        hex_ = digest_hex(digest, what)
        with self._lock(hex_):
            if self.has_layer(digest):
                return self.layer_index(digest)
            work = os.path.join(self.path, "tmp", f"layer-{hex_}-{os.getpid()}-{threading.get_ident()}")
            self._remove(work)
            ids, unkept = self.mapping, 0
            os.mkdir(work, 0o700)
            try:
                os.mkdir(os.path.join(work, "root"), 0o755)
                root_fd = os.open(os.path.join(work, "root"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    # One of the process's few layers unpacked at once (budget.py): taken before the blob is
                    # opened, so that no more downloads than unpacks are under way either.
                    with budget.slot() as held, opener() as raw:
                        reader = _HashingReader(raw, self.max_image_size, what)
                        if ids is not None:
                            unpacked, unkept = mapped.unpack(ids, reader, root_fd, what=what,
                                                             max_size=self.max_image_size)
                        else:
                            unpacked = unpack(reader, root_fd, what=what, max_size=self.max_image_size, slot=held)
                        reader.drain()
                finally:
                    os.close(root_fd)
                if reader.digest != digest:
                    raise BadImageError(f"{what}: its content does not match its digest {digest} (read "
                                        f"{reader.digest}): refused, nothing kept")
                if diff_id is not None and unpacked.diff_id != diff_id:
                    raise BadImageError(f"{what}: its uncompressed content does not match the config's diff id "
                                        f"{diff_id}: refused, nothing kept")
                with open(os.path.join(work, "index.json"), "w", encoding="utf-8") as handle:
                    json.dump(unpacked.index.to_json(), handle)
                with open(os.path.join(work, OWNERS_FILE), "w", encoding="utf-8") as handle:
                    # Read alone, without the index; "mapped": the ranges the owners were written through.
                    json.dump({"owners": unpacked.index.owners, **({"mapped": mapped.describe(ids),
                                                                   "unkept": unkept} if ids else {})}, handle)
                os.chmod(work, 0o755)
                os.rename(work, self.layer_dir(digest))
            except BaseException:
                self._remove(work)
                raise
            return unpacked.index

    def _owners_file(self, digest: str) -> Any:
        try:
            with open(os.path.join(self.layer_dir(digest), OWNERS_FILE), encoding="utf-8") as handle:
                return json.load(handle)
        except (OSError, ValueError):
            return None

    def layer_owners(self, digest: str) -> dict[str, int] | None:
        """The entries of a layer the archive gave other owners than root, by "UID:GID" (LayerIndex.owners);
        None where the layer does not say (unpacked by an earlier isolate)."""
        return owners_of(self._owners_file(digest))

    def layer_mapping(self, digest: str) -> tuple[dict[str, list[int]], int] | None:
        """A regular caller's layer unpacked with its owners (mapped.py): the ranges they were written through
        (as mapped.describe gives them) and how many entries' owners were past them; None where it was not."""
        found = self._owners_file(digest)
        ranges = found.get("mapped") if isinstance(found, dict) else None
        if not isinstance(ranges, dict) or not all(
                isinstance(ranges.get(k), list) and len(ranges[k]) == 2 and all(isinstance(n, int) for n in ranges[k])
                for k in ("uids", "gids")):
            return None
        unkept = found.get("unkept")
        return {k: list(ranges[k]) for k in ("uids", "gids")}, unkept if isinstance(unkept, int) else 0

    @functools.cached_property
    def mapping(self) -> SubIds | None:
        """The caller's subordinate ids, where the layers this store unpacks keep their owners through them (a
        regular caller with a range: mapped.py); None where they are all the caller's, or kept as root keeps them.
        Asked once per Store (a layer unpacked holds the ranges it was written through, in its owners.json)."""
        return mapped.ranges()

    def _remove(self, path: str) -> None:
        """rm -r path, from inside the caller's ranges where a subordinate id's directory refuses the caller."""
        try:
            remove_tree(path)
        except PermissionError:
            ids = mapped.ranges(removal=True)
            if ids is None:
                raise IsolationError(f"image store: cannot remove {path}: it holds files of other ids than the "
                                     "caller's (a layer unpacked through subordinate ids the caller no longer has, "
                                     "/etc/subuid): give them back, or have root remove it") from None
            mapped.remove(ids, path)

    @property
    def owners_kept(self) -> bool:
        """Whether the layers' files keep the owners their archives give (a root's store), or are all its user's."""
        self._ensure()
        return os.stat(self.path).st_uid == 0

    def layer_index(self, digest: str) -> LayerIndex:
        with open(os.path.join(self.layer_dir(digest), "index.json"), encoding="utf-8") as handle:
            return LayerIndex.from_json(json.load(handle))

    # -- images ---------------------------------------------------------------

    @contextlib.contextmanager
    def adding(self) -> Iterator[None]:
        """Held while an image's layers are unpacked and its record written: prune waits for it."""
        with self._lock("store", exclusive=False):
            yield

    def _record_path(self, reference: str) -> str:
        return os.path.join(self.path, "images", hashlib.sha256(reference.encode()).hexdigest()[:32] + ".json")

    def write_record(self, record: dict[str, Any]) -> None:
        self._ensure()
        path = self._record_path(record["reference"])
        tmp = path + f".{os.getpid()}-{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1)
        os.replace(tmp, path)

    def records(self) -> list[dict[str, Any]]:
        self._ensure()
        out = []
        directory = os.path.join(self.path, "images")
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as handle:
                    record = json.load(handle)
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and isinstance(record.get("reference"), str):
                out.append(record)
        return out

    def record(self, reference: str) -> dict[str, Any] | None:
        self._ensure()
        try:
            with open(self._record_path(reference), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("reference") == reference else None

    def forget(self, reference: str) -> bool:
        self._ensure()
        try:
            os.unlink(self._record_path(reference))
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def starting(self, layer_dirs: list[str], what: str) -> Iterator[None]:
        """Held while a sandbox of an image starts and writes its lease: prune waits for it (and a layer it
        removed before is refused here, not mounted half gone)."""
        with self._lock("store", exclusive=False):
            for path in layer_dirs:
                if not os.path.isfile(os.path.join(path, "index.json")):
                    raise IsolationError(f"{what}: its layer {os.path.basename(path)[:12]} is no longer in the "
                                         f"image store {self.path} (pruned): load or pull the image again")
            yield

    def prune(self, build_cache: bool = False, stats: PruneStats | None = None) -> list[str]:
        """Remove the layers and blobs neither an image names nor a running sandbox or build stands on, and the
        build steps' cache entries whose layer is gone; the digests of the layers removed.

        ``build_cache``: the build cache too, as ``docker builder prune -a`` does beside ``docker image
        prune``: the images kept between build steps (``localhost/isolate-build:ID``), then the layers only they
        named and the steps' entries of those layers, and the directories of the builds' cache mounts. What a
        running build leases (its images, its cache mounts) stays, and so does an image kept between steps
        since a running build began (it may not have leased it yet). ``stats``: filled with what went."""

        stats = stats if stats is not None else PruneStats()
        with self._lock("store"):
            held = set(leases.live(self.path))  # a running sandbox's layers, a running build's images and caches
            if build_cache:
                started = min(leases.builds_started(self.path), default=None)
                for record in self.records():
                    reference = record["reference"]
                    if (not reference.startswith(INTERMEDIATE + ":")
                            or os.path.basename(self._record_path(reference)) in held
                            or (started is not None and _created(record) >= started - 1)):
                        continue
                    if self.forget(reference):
                        stats.images += 1
            used_layers: set[str] = held | layers_in_use()
            used_blobs: set[str] = set()
            for record in self.records():
                used_layers.update(digest_hex(d, "layer") for d in record.get("layers", []))
                used_blobs.update(digest_hex(d, "blob") for d in (record.get("digest"), record.get("config_digest"))
                                  if isinstance(d, str))
            removed = []
            for name in os.listdir(os.path.join(self.path, "layers")):
                if _HEX.match(name) and name not in used_layers:
                    self._remove(os.path.join(self.path, "layers", name))
                    removed.append("sha256:" + name)
            blobs = os.path.join(self.path, "blobs", "sha256")
            for name in os.listdir(blobs):
                if name not in used_blobs:
                    os.unlink(os.path.join(blobs, name))
            stats.layers += len(removed)
            stats.steps += self._prune_step_cache()
            if build_cache:
                stats.cache_mounts += self._prune_cache_mounts(held)
            return removed

    def _prune_step_cache(self) -> int:
        """Remove the build steps' cache entries whose layer the store no longer holds (isolate/image/build.py)."""
        directory = os.path.join(self.path, "build-cache")
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return 0
        count = 0
        for name in names:
            path = os.path.join(directory, name)
            digest = None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as handle:
                    entry = json.loads(handle.read(1 << 16))
                digest = entry.get("digest") if isinstance(entry, dict) else None
                keep = name.endswith(".json") and isinstance(digest, str) and self.has_layer(digest)
            except (OSError, ValueError, BadImageError):
                keep = False
            if not keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                count += name.endswith(".json")
        return count

    def _prune_cache_mounts(self, held: set[str]) -> int:
        """Remove the directories of this store's build cache mounts (``cache-mounts/KEY`` names each, the
        directory is ``build-caches/KEY`` in isolate's state directory) that no running build has bound."""
        from ..kernel.tree import remove_state_entry

        directory = os.path.join(self.path, CACHE_MOUNTS)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return 0
        count = 0
        for name in names:
            if name in held:
                continue
            if _CACHE_KEY.match(name):  # a name of the store's own making: never a path
                remove_state_entry("build-caches", name)
                count += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        return count


#: The store's list of its builds' cache mount directories (their keys: isolate/image/build.py's CacheMount).
CACHE_MOUNTS = "cache-mounts"
_CACHE_KEY = re.compile(r"^[0-9a-f]{32}$")


@dataclass
class PruneStats:
    """What a prune removed: layers, images kept between build steps, build steps' cache entries, cache
    mount directories."""

    layers: int = 0
    images: int = 0
    steps: int = 0
    cache_mounts: int = 0


def _created(record: dict[str, Any]) -> float:
    value = record.get("created")
    return float(value) if isinstance(value, (int, float)) and value == value else float("inf")


#: How a running sandbox's root names a layer in its mount table (backends/native/imageroot.py's staging).
_MOUNTED_LAYER = re.compile(r"/\.isolate-image/([0-9a-f]{64})/root")


#: ioctl(2) of a namespace's descriptor: the uid that owns a user namespace (linux/nsfs.h).
_NS_GET_OWNER_UID = 0xB704


def _user_namespace_owner(pid: str) -> int | None:
    """The uid owning the user namespace of process ``pid`` (its creator's), or None: gone, or not this caller's to
    open (another user's process outside any namespace this caller owns)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return int.from_bytes(fcntl.ioctl(fd, _NS_GET_OWNER_UID, bytes(4)), sys.byteorder)
    except OSError:
        return None
    finally:
        os.close(fd)


def layers_in_use() -> set[str]:
    """The layers (hex digests) a running sandbox of this caller stands on, read from the mount table of each mount
    namespace whose processes live in a user namespace the caller owns (its sandboxes'): prune keeps them even once
    no image names them (``image rm`` then ``prune`` emptied a running sandbox's root under it). The mount table names
    a layer by its digest alone; another user's sandbox of an image with the same layer (its own store's) is no
    reason to keep this store's, and counting it made a prune keep layers while that sandbox ran."""
    used: set[str] = set()
    namespaces: set[str] = set()
    caller = os.geteuid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or _user_namespace_owner(pid) != caller:
            continue
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            continue  # gone
        if namespace in namespaces:
            continue
        namespaces.add(namespace)
        try:
            with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as handle:
                used.update(_MOUNTED_LAYER.findall(handle.read()))
        except OSError:
            continue  # gone
    return used


def check_stack(indexes: list[LayerIndex], what: str) -> None:
    """Refuse a layer whose entry would be written through a link an earlier layer planted.

    Overlayfs itself would never follow it (a directory of an upper layer hides a lower link), but the
    image means what ``docker`` makes of it, which follows the link: the two differ, and the image is
    refused rather than run as something else than it says.
    """
    links: set[str] = set()
    for number, index in enumerate(indexes, 1):
        own = set(index.dirs) | set(index.others) | set(index.links) | set(index.whiteouts)
        if links:
            for path in (*index.dirs, *index.others, *index.links):
                parts = path.split("/")
                for i in range(1, len(parts)):
                    ancestor = "/".join(parts[:i])
                    if ancestor in links and ancestor not in own:
                        raise BadImageError(f"{what}: layer {number}: entry {path!r} is written through "
                                            f"{ancestor!r}, a link an earlier layer planted: refused")
        for gone in index.whiteouts:
            links = {link for link in links if link != gone and not link.startswith(gone + "/")}
        for directory in index.opaque:
            links = {link for link in links if directory and not link.startswith(directory + "/")}
        replaced = set(index.dirs) | set(index.others)
        links = {link for link in links if link not in replaced}
        links.update(index.links)
