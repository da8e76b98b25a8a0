"""Images, natively: kept by layer in a store of the caller's own, loaded from files (and registries).

``Image.load(path)`` takes a ``docker save`` archive or an OCI image layout;
``Image.get(ref)`` an image the store holds; ``Image.list()``,
``image.remove()``, ``Image.prune()`` keep the store. ``Policy(image=REF)``
runs a sandbox whose root is the image's layers (read-only, under a private
upper layer): see docs/images.md.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import functools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from ..model.errors import IsolationError, PolicyError
from .archive import Found, parse_json, read_archive
from .reference import Reference
from .store import DEFAULT_MAX_IMAGE_SIZE, PruneStats, Store, check_stack
from .unpack import BadImageError, LayerIndex

if TYPE_CHECKING:
    from .build import Build

__all__ = ["BadImageError", "Image", "ImageConfig", "PruneStats", "Reference", "Store"]



@dataclass(frozen=True)
class ImageConfig:
    """What a sandbox takes from the image's config."""

    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageConfig:
        config = data.get("config") if isinstance(data.get("config"), dict) else {}
        assert isinstance(config, dict)

        # A value of another type, or with a NUL (which would cut it where the kernel reads it), is refused as
        # Docker refuses it: dropped or cut, the sandbox would run other than the image says.
        def strings(name: str) -> tuple[str, ...]:
            value = config.get(name)
            if value is None:
                return ()
            if not isinstance(value, list) or not all(isinstance(v, str) and "\0" not in v for v in value):
                raise BadImageError(f"the image's config: {name}: expected a list of texts without NUL")
            return tuple(value)

        def text(name: str) -> str:
            value = config.get(name)
            if value is None:
                return ""
            if not isinstance(value, str) or "\0" in value:
                raise BadImageError(f"the image's config: {name}: expected a text without NUL")
            return value

        return cls(strings("Env"), text("WorkingDir"), text("User"), strings("Entrypoint"), strings("Cmd"))

    def environment(self) -> dict[str, str]:
        out = {}
        for item in self.env:
            name, sep, value = item.partition("=")
            if sep and name:
                out[name] = value
        return out

    def command(self, args: Sequence[str] = ()) -> list[str]:
        """The command a sandbox runs: Entrypoint, then the arguments given (or the image's Cmd)."""
        return [*self.entrypoint, *(args if args else self.cmd)]


@dataclass(frozen=True)
class Image:
    """An image in a store: its name, manifest digest, config digest (its id), layers and config."""

    reference: str
    digest: str
    id: str
    layers: tuple[str, ...]
    config: ImageConfig
    size: int
    created: float
    store: Store = field(compare=False, repr=False)

    # -- finding ----------------------------------------------------------------

    @classmethod
    def _from_record(cls, record: dict[str, Any], store: Store) -> Image:
        config = record["config"]
        return cls(record["reference"], record["digest"], record["config_digest"], tuple(record["layers"]),
                   ImageConfig(tuple(config["env"]), str(config["working_dir"]), str(config["user"]),
                               tuple(config["entrypoint"]), tuple(config["cmd"])),
                   int(record["size"]), float(record["created"]), store)

    @classmethod
    def list(cls, store: Store | None = None) -> builtins.list[Image]:
        store = store or Store()
        return [cls._from_record(r, store) for r in store.records()]

    @classmethod
    def get(cls, ref: str, store: Store | None = None) -> Image:
        """The image the store holds under ``ref`` (a reference, or an id or digest, or its first 12 digits)."""
        store = store or Store()
        image = cls.find(ref, store)
        if image is None:
            raise IsolationError(f"image {ref!r} is not in the image store {store.path}: "
                                 f"`isolate-run image load FILE` (or pull) it first")
        return image

    @classmethod
    def find(cls, ref: str, store: Store | None = None) -> Image | None:
        store = store or Store()
        try:
            normalized = str(Reference.parse(ref))
        except IsolationError:
            normalized = ref
        record = store.record(normalized) or store.record(ref)
        if record is not None:
            return cls._from_record(record, store)
        wanted = ref.removeprefix("sha256:")
        if len(wanted) >= 12:
            for rec in store.records():
                if any(str(rec.get(k, "")).removeprefix("sha256:").startswith(wanted)
                       for k in ("digest", "config_digest")):
                    return cls._from_record(rec, store)
        return None

    # -- adding -----------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, reference: str | None = None, store: Store | None = None,
             max_image_size: int | None = None) -> Image:
        """Load a ``docker save`` archive or an OCI image layout (directory or tar); the image named
        ``reference`` in it, else its only (or first) one. Every image in the file is kept."""
        store = store or Store(max_image_size=max_image_size or DEFAULT_MAX_IMAGE_SIZE)
        if max_image_size is not None:
            store.max_image_size = max_image_size
        path = os.fspath(path)
        source, found = read_archive(path, store.max_image_size)
        try:
            if not found:
                raise BadImageError(f"{path}: holds no image for this host's platform")
            images = [cls._add(store, item, source, reference if len(found) == 1 else None, path)
                      for item in found]
        finally:
            source.close()
        if reference is not None and len(images) > 1:
            wanted = str(Reference.parse(reference))
            for image in images:
                if image.reference == wanted:
                    return image
        return images[0]

    @classmethod
    def from_docker(cls, reference: str, *, engine: str | None = None, store: Store | None = None) -> Image:
        """The image ``reference`` of a running local Docker or Podman (``engine``: "docker" or "podman";
        by default the first of them that answers), by its ``save`` stream, kept as ``Image.load`` keeps it.
        The stream is spooled into the store's ``tmp/`` (bounded by ``max_image_size``) and loaded from there."""
        import shutil
        import subprocess
        import threading

        if not isinstance(reference, str) or not reference or reference.startswith("-") or "\0" in reference:
            # Given to the engine's command line: "-o/etc/passwd" would be `docker save`'s output file.
            raise PolicyError(f"image reference {str(reference)[:200]!r}: expected an image's name or id (not "
                              "empty, not starting with '-')", "reference")
        store = store or Store()
        engines = [engine] if engine else ["docker", "podman"]
        found = [name for name in engines if shutil.which(name)]
        if not found:
            raise IsolationError(f"image {reference}: no {' or '.join(engines)} command on this host: "
                                 "load a `docker save` archive with Image.load instead")
        errors = []
        for name in found:
            probe = subprocess.run([name, "image", "inspect", "--format", "{{.Id}}", "--", reference],
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
            if probe.returncode != 0:
                errors.append(f"{name}: {(probe.stderr.strip().splitlines() or ['no answer'])[-1][:200]}")
                continue
            store._ensure()
            spool = os.path.join(store.path, "tmp", f"save-{os.getpid()}-{threading.get_ident()}")
            try:
                fd = os.open(spool, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as out, subprocess.Popen(
                        [name, "save", "--", reference], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE) as saving:
                    assert saving.stdout is not None and saving.stderr is not None
                    written = 0
                    while chunk := saving.stdout.read(1 << 20):
                        written += len(chunk)
                        if written > store.max_image_size:
                            saving.kill()
                            raise BadImageError(f"image {reference}: `{name} save` gives more than max_image_size "
                                                f"({store.max_image_size} bytes): refused")
                        out.write(chunk)
                    message = saving.stderr.read().decode(errors="replace").strip()
                if saving.returncode != 0:
                    raise IsolationError(f"image {reference}: `{name} save` failed: "
                                         f"{(message.splitlines() or ['exit ' + str(saving.returncode)])[-1][:200]}")
                return cls.load(spool, reference=reference, store=store)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(spool)
        raise IsolationError(f"image {reference}: not found in a running local engine ({'; '.join(errors)})")

    @classmethod
    def _add(cls, store: Store, found: Found, source: Any, reference: str | None, what: str) -> Image:
        name = reference or found.reference
        if name is not None:
            try:
                name = str(Reference.parse(name))
            except IsolationError:
                name = None
        config_json = parse_json(found.config, f"{what}: config")
        rootfs = config_json.get("rootfs") if isinstance(config_json.get("rootfs"), dict) else {}
        assert isinstance(rootfs, dict)
        diff_ids = rootfs.get("diff_ids")
        if not isinstance(diff_ids, list) or len(diff_ids) != len(found.layers):
            raise BadImageError(f"{what}: the config's rootfs.diff_ids do not match its {len(found.layers)} layers")
        with store.adding():
            def one(number: int, digest: str, inside: str, diff_id: object) -> LayerIndex:
                return store.ensure_layer(digest, functools.partial(source.open, inside),
                                          diff_id=diff_id if isinstance(diff_id, str) else None,
                                          what=f"{what}: layer {number} ({digest[:19]})")

            jobs = [(number, digest, inside, diff_id) for number, ((digest, inside), diff_id)
                    in enumerate(zip(found.layers, diff_ids, strict=True), 1)]
            workers = min(getattr(source, "parallel", 1), len(jobs))
            if workers > 1:
                # A registry's layers download side by side, each streamed into its unpacking.
                with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                    indexes = list(pool.map(lambda job: one(*job), jobs))
            else:
                indexes = [one(*job) for job in jobs]
            check_stack(indexes, what)
            size = sum(index.size for index in indexes)
            if size > store.max_image_size:
                raise BadImageError(f"{what}: {size} bytes unpacked, past max_image_size ({store.max_image_size} "
                                    "bytes): refused")
            store.put_blob(found.config, found.config_digest, f"{what}: config")
            digest = found.manifest_digest or found.config_digest
            if found.manifest is not None and found.manifest_digest is not None:
                store.put_blob(found.manifest, found.manifest_digest, f"{what}: manifest")
            config = ImageConfig.from_json(config_json)
            record = {"reference": name or found.config_digest, "digest": digest,
                      "config_digest": found.config_digest, "layers": [d for d, _ in found.layers],
                      "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.__dict__.items()},
                      "size": size, "created": time.time()}
            store.write_record(record)
        return cls._from_record(record, store)

    @classmethod
    def pull(cls, reference: str, *, store: Store | None = None, insecure: bool = False,
             progress: TextIO | None = None, login: tuple[str, str] | None = None,
             cert_dir: str | None = None) -> Image:
        """Pull ``reference`` from its registry (OCI distribution API) into the store (see registry.py);
        ``progress``: where a line of figures goes at the end (on a terminal, a bar shows the pull
        until then); ``login``: (user, secret) for the registry
        instead of those of the Docker/containers auth files; ``cert_dir``: a directory of the registry's CAs
        (``*.crt``) and client certificate, instead of its certs.d directory's."""
        from .progress import PullProgress
        from .registry import resolve

        store = store or Store()
        started = time.monotonic()
        found, source = resolve(reference, insecure=insecure, login=login, cert_dir=cert_dir)
        if progress is None:
            return cls._add(store, found, source, found.reference, f"image {found.reference}")
        missing = {digest for digest, _ in found.layers if not _held(store, digest)}
        shown = PullProgress(progress, found.reference or reference, layers=len(missing),
                             total=sum(source.sizes.get(d, 0) for d in missing), fetched=lambda: source.fetched,
                             done=lambda: source.done)
        shown.started = started
        with shown:
            image = cls._add(store, found, source, found.reference, f"image {found.reference}")
        print(shown.figures(len(image.layers)), file=progress)
        return image

    def push(self, reference: str | None = None, *, insecure: bool = False, login: tuple[str, str] | None = None,
             cert_dir: str | None = None, progress: TextIO | None = None) -> str:
        """Push this image to ``reference`` (default: its own name) over the OCI distribution API, with the rules
        and credentials of ``pull``; the manifest's digest there. Blobs the registry holds are not sent."""
        from .push import push

        started = time.monotonic()
        pushed = push(self, reference, insecure=insecure, login=login, cert_dir=cert_dir)
        if progress is not None:
            print(f"push {pushed.reference}: {pushed.uploaded} blobs sent, {pushed.present} already there, "
                  f"{pushed.bytes_sent / 1e6:.1f} MB in {time.monotonic() - started:.2f} s", file=progress)
        return pushed.digest

    # -- building (build.py) -----------------------------------------------------

    @classmethod
    def from_registry(cls, reference: str, *, store: Store | None = None, insecure: bool = False) -> Build:
        """A build starting from ``reference`` (pulled when the store lacks it): add steps, then ``.build()``."""
        from .build import Build

        return Build(reference, store=store, insecure=insecure)

    @classmethod
    def from_dockerfile(cls, path: str | os.PathLike[str], context: str | os.PathLike[str] = ".", *,
                        reference: str | None = None, build_args: dict[str, str] | None = None,
                        target: str | None = None, store: Store | None = None, progress: TextIO | None = None,
                        stats: Any = None, network: Any = None) -> Image:
        """Build the Dockerfile at ``path`` over the directory ``context`` (dockerfile.py); kept as
        ``reference`` (default: ``localhost/isolate-build:ID``). ``stats``: a ``build.Stats`` to fill;
        ``network``: every RUN's (none by default, "host", or an ``isolate.Egress``)."""
        from .dockerfile import from_dockerfile

        return from_dockerfile(path, context, build_args=build_args, target=target, reference=reference,
                               store=store, progress=progress, stats=stats, network=network)

    def _build(self) -> Build:
        from .build import Build

        return Build(self, store=self.store)

    def run(self, command: str | Sequence[str], *, network: Any = None, env: Mapping[str, str] | None = None,
            shell: Sequence[str] = ("/bin/sh", "-c"), caches: Sequence[Any] = ()) -> Build:
        """A build step: ``command`` run in a sandbox of this image (see build.py's ``Build.run``)."""
        return self._build().run(command, network=network, env=env, shell=shell, caches=caches)

    def copy(self, source: str | os.PathLike[str], destination: str) -> Build:
        return self._build().copy(source, destination)

    def env(self, **values: str) -> Build:
        return self._build().env(**values)

    def workdir(self, path: str) -> Build:
        return self._build().workdir(path)

    def user(self, user: str) -> Build:
        return self._build().user(user)

    # -- keeping ----------------------------------------------------------------

    def remove(self) -> None:
        """Forget this image (its layers stay until ``Image.prune()``, as other images may share them)."""
        if not self.store.forget(self.reference):
            raise IsolationError(f"image {self.reference}: not in the image store {self.store.path}")

    @classmethod
    def prune(cls, store: Store | None = None, *, build_cache: bool = False,
              stats: PruneStats | None = None) -> builtins.list[str]:
        """Remove the layers no image names (and the build steps' cache entries of layers gone); their digests.
        ``build_cache``: the build cache too (images kept between build steps, cache mounts' directories), as
        ``docker builder prune -a``; what a running sandbox or build stands on stays. ``stats``: what went."""
        return (store or Store()).prune(build_cache, stats)

    def foreign_owners(self) -> dict[str, int] | None:
        """The entries of the image's layers their archives give other owners than root, by "UID:GID"; None
        where a layer does not say (unpacked by an earlier isolate). A regular user's store keeps none of them
        (``store.owners_kept``) unless through its subordinate ids (``owners_mapped``): else every file is that
        user's."""
        total: dict[str, int] = {}
        for digest in dict.fromkeys(self.layers):
            found = self.store.layer_owners(digest)
            if found is None:
                return None
            for key, count in found.items():
                total[key] = total.get(key, 0) + count
        return total

    def owners_mapped(self) -> bool:
        """Whether a regular caller's store keeps this image's owners through its subordinate ids (every layer
        unpacked so, through the same ranges: isolate/image/mapped.py)."""
        found = [self.store.layer_mapping(digest) for digest in dict.fromkeys(self.layers)]
        first = found[0] if found else None
        return first is not None and all(m is not None and m[0] == first[0] for m in found)

    def lower_dirs(self) -> builtins.list[str]:
        """The layers' directories, topmost first (overlayfs's lowerdir order). A layer the image names twice
        (buildkit's empty layer often is) is laid once, where it is topmost: overlayfs refuses one directory twice
        (ELOOP), and the lower copy shows nothing the upper one does not hide, nor deletes anything it keeps."""
        return [self.store.layer_root(digest) for digest in dict.fromkeys(reversed(self.layers))]

    @property
    def short_id(self) -> str:
        return self.id.removeprefix("sha256:")[:12]


def _held(store: Store, digest: str) -> bool:
    """Whether the store holds the layer (a digest it cannot name is refused later, by the unpacking)."""
    try:
        return store.has_layer(digest)
    except BadImageError:
        return False
