"""Building images without a daemon: steps over an image, each ``run`` in an isolate sandbox, each cached.

``Image.from_registry("debian:12").run("apt-get install -y git", network=isolate.Egress([...]))
.copy("./repo", "/repo").env(K="v").workdir("/repo").user("app").build("team/app:1")``

- ``run(cmd)``: a kept native sandbox of the image so far (``Policy(image=...)``
  with the step's ``network``, nothing of the host granted: no write, the
  image's env, working directory and user), the command run to its end
  (non-zero: ``BuildError`` with its output's end), its writes committed as
  one layer (isolate/kept/imagebuild.py, reached through model/hooks.py;
  the layer is added by commit.py).
- ``run(cmd, caches=[CacheMount(target)])``: directories kept between builds
  outside the image (in isolate's state directory, one per store and id),
  bound read-write (or read-only) at their targets; where they are is part
  of the step's cache key, what they hold is not (as Docker's).
- ``copy(src, dst)``: host files as one layer (export.write_copy: owned by
  root, times 0, links copied as links, never followed).
- ``env``, ``workdir``, ``user``, ``config``: the image's config, no layer.

Cache: a step whose parent image (its config digest: every layer's diff id and
the whole config) and own inputs (the command and network; the copied files'
names, contents and modes, which the layer's diff id is) are those of a step
built before reuses its layer: nothing runs. ``store/build-cache/KEY.json``
holds the layer; a layer pruned since is built again. Every image between the
steps is kept as ``localhost/isolate-build:ID`` (the next step's sandbox
starts from it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

from ..model import hooks
from ..model.errors import IsolationError
from . import Image, leases
from .commit import add_layer, with_config
from .export import LayerBlob, write_copy
from .store import Store


class BuildError(IsolationError):
    """A build step failed (its command's exit status and the end of its output), or was refused."""


class DockerfileError(BuildError):
    """A Dockerfile refused: the message names the file, the line and the instruction."""


@dataclass(frozen=True)
class CacheMount:
    """A directory a build's ``run`` step sees at ``target``, kept between builds outside the image (a
    Dockerfile's ``RUN --mount=type=cache``): one directory per ``id`` (default: the target), shared by every
    step and build of a store that names it; ``readonly``: the step may not write it."""

    target: str
    id: str = ""
    readonly: bool = False

    def __post_init__(self) -> None:
        if not self.target.startswith("/") or "\0" in self.target or os.path.normpath(self.target) == "/":
            raise BuildError(f"cache mount: target {self.target!r} is not an absolute path below /")
        object.__setattr__(self, "target", os.path.normpath(self.target))
        if "\0" in self.id:
            raise BuildError("cache mount: an id holds a NUL byte")
        object.__setattr__(self, "id", self.id or self.target)

    def key(self, store: Store) -> str:
        return hashlib.sha256(os.fsencode(os.path.realpath(store.path)) + b"\0" + self.id.encode()).hexdigest()[:32]

    def host_path(self, store: Store) -> str:
        """Where host_dir() is (not made)."""
        from ..kernel.places import state_dir

        return os.path.join(state_dir(), "build-caches", self.key(store))

    def host_dir(self, store: Store) -> str:
        """Its directory: ``build-caches/KEY`` in isolate's state directory (made, and reached, without
        following a link: places.state_path), one per store and id. Never in the store, which no sandbox reaches;
        the store names it in ``cache-mounts/KEY``, for prune (Store.prune(build_cache=True))."""
        from ..kernel.places import state_path
        from .store import CACHE_MOUNTS

        store._ensure()
        marks = os.path.join(store.path, CACHE_MOUNTS)
        with contextlib.suppress(FileExistsError):
            os.mkdir(marks, 0o700)
        os.close(os.open(os.path.join(marks, self.key(store)), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))
        return state_path("build-caches", self.key(store))


@dataclass(frozen=True)
class Step:
    kind: str  # run, layer (its args: what writes it), config
    args: Any
    network: Any = None
    what: str = ""
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[CacheMount, ...] = ()


@dataclass(frozen=True)
class Build:
    """An image to build: a base (an Image, or a reference pulled when the store lacks it) and steps."""

    base: Image | str
    steps: tuple[Step, ...] = ()
    store: Store | None = field(default=None, compare=False)
    insecure: bool = False

    # -- steps -------------------------------------------------------------------------

    def run(self, command: str | Sequence[str], *, network: Any = None, env: Mapping[str, str] | None = None,
            shell: Sequence[str] = ("/bin/sh", "-c"), caches: Sequence[CacheMount] = ()) -> Build:
        """Run ``command`` (a string: ``/bin/sh -c``, or ``shell``) in a sandbox of the image so far; its writes
        are a layer. ``env``: variables of this step only (a Dockerfile's ARG), not kept in the image.
        ``caches``: directories kept between builds, outside the image (``CacheMount``)."""
        argv = [*shell, command] if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise BuildError("run: an empty command")
        targets = [c.target for c in caches]
        if len(set(targets)) != len(targets):
            raise BuildError(f"run: two cache mounts at one target ({', '.join(targets)})")
        return self._then(Step("run", tuple(argv), network, f"RUN {command if isinstance(command, str) else argv}",
                               tuple(sorted((env or {}).items())), tuple(caches)))

    def copy(self, source: str | os.PathLike[str], destination: str) -> Build:
        """Host files (a file, or a directory's contents) at ``destination`` in the image (relative: to its
        working directory; ending in ``/``: a file goes into it)."""
        path = os.path.abspath(os.fspath(source))

        def make(image: Image, out: str) -> LayerBlob:
            opened = _open_host(path)
            try:
                return write_copy(opened, _target(image, destination), out, into=destination.endswith("/"),
                                  what=f"copy {source}", existing=functools.partial(_existing, image.lower_dirs()))
            finally:
                for fd, _ in opened:
                    os.close(fd)

        return self.layer(make, f"COPY {source} {destination}")

    def layer(self, make: Callable[[Image, str], LayerBlob], what: str) -> Build:
        """A layer written by ``make(image so far, path)`` (a gzip tar at path: export.py's writers); cached by
        the parent image and the layer's diff id."""
        return self._then(Step("layer", make, what=what))

    def env(self, **values: str) -> Build:
        return self._then(Step("config", (("Env", tuple(f"{k}={v}" for k, v in values.items())),),
                               what=f"ENV {values}"))

    def workdir(self, path: str) -> Build:
        return self._then(Step("config", (("WorkingDir", path),), what=f"WORKDIR {path}"))

    def user(self, user: str) -> Build:
        return self._then(Step("config", (("User", user),), what=f"USER {user}"))

    def config(self, **values: Any) -> Build:
        """Other fields of the image's config as OCI names them (Cmd, Entrypoint, Labels, ExposedPorts ...)."""
        return self._then(Step("config", tuple(values.items()), what=f"CONFIG {sorted(values)}"))

    def _then(self, step: Step) -> Build:
        return replace(self, steps=(*self.steps, step))

    # -- building ----------------------------------------------------------------------

    def build(self, reference: str | None = None, *, progress: IO[str] | None = None,
              stats: Stats | None = None) -> Image:
        """Build the image; kept as ``reference`` (default: ``localhost/isolate-build:ID``). ``stats``: filled
        with the steps' figures (how many were cached, how many ran)."""
        return Builder(self, progress, stats if stats is not None else Stats()).build(reference)


@dataclass
class Stats:
    """A build's figures: its steps, those whose layer came from the cache, the commands run."""

    steps: int = 0
    cached: int = 0
    ran: int = 0


class Builder:
    def __init__(self, build: Build, progress: IO[str] | None, stats: Stats) -> None:
        self.spec, self.progress, self.stats = build, progress, stats

    def say(self, text: str) -> None:
        if self.progress is not None:
            print(text, file=self.progress)

    def base(self) -> Image:
        base = self.spec.base
        if isinstance(base, Image):
            return base
        store = self.spec.store or Store()
        found = Image.find(base, store)
        return found if found is not None else Image.pull(base, store=store, insecure=self.spec.insecure)

    def build(self, reference: str | None) -> Image:
        image = self.base()
        # A lease on what the build stands on while it runs (leases.Holding): prune(build_cache=True) keeps it.
        self.lease = leases.Holding(image.store.path)
        try:
            self.hold(image)
            if image.store.record(image.reference) is None:
                raise BuildError(f"build: {image.reference} was removed from the image store as the build began")
            return self.steps(image, reference)
        finally:
            self.lease.release()

    def hold(self, image: Image, caches: Sequence[CacheMount] = ()) -> None:
        with image.store.adding():  # prune's lock, shared: what prune decides and what is held never cross
            self.lease.add([image.store._record_path(image.reference), *(os.path.dirname(d) for d in
                                                                         image.lower_dirs()),
                            *(c.host_path(image.store) for c in caches)])

    def steps(self, image: Image, reference: str | None) -> Image:
        pending: dict[str, Any] = {}
        for number, step in enumerate(self.spec.steps, 1):
            self.stats.steps += 1
            self.say(f"step {number}: {step.what}")
            if step.kind == "config":
                for key, value in step.args:
                    if key == "Env":
                        env = dict(e.split("=", 1) for e in pending.get("Env", image.config.env) if "=" in e)
                        env.update(dict(e.split("=", 1) for e in value))
                        pending["Env"] = [f"{k}={v}" for k, v in env.items()]
                    else:
                        pending[key] = list(value) if isinstance(value, tuple) else value
                continue
            if pending:
                image = with_config(image, None, pending, "isolate build: " + ", ".join(sorted(pending)))
                self.hold(image)
                pending = {}
            if step.mounts:
                self.hold(image, step.mounts)
            image = self.layer_step(image, step, number)
            self.hold(image)
        if pending:
            image = with_config(image, reference, pending, "isolate build: " + ", ".join(sorted(pending)))
        elif reference is not None:
            image = retag(image, reference)
        self.say(f"built {image.reference} ({image.short_id}): {self.stats.steps} steps, {self.stats.cached} "
                 f"cached, {self.stats.ran} run")
        return image

    def layer_step(self, image: Image, step: Step, number: int) -> Image:
        store = image.store
        blob = None
        if step.kind == "layer":
            blob = self.layer_blob(image, step)
            key_parts: list[Any] = [image.id, "layer", blob.diff_id]
        else:
            key_parts = [image.id, "run", list(step.args), repr(step.network), list(step.env)]
            if step.mounts:  # where the caches are, not what they hold (as Docker's: a cache never busts a step)
                key_parts.append([[m.target, m.id, m.readonly] for m in step.mounts])
        key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()
        cached = _cache_get(store, key)
        if cached is not None:
            if blob is not None:
                os.unlink(blob.path)
            self.stats.cached += 1
            self.say("  cached")
            return with_config(image, None, {}, step.what, layers=[cached["digest"]], diff_ids=[cached["diff_id"]],
                               added_size=int(cached.get("size", 0)))
        if blob is not None:
            try:
                image = add_layer(image, blob, None, {}, step.what)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(blob.path)
        else:
            self.stats.ran += 1
            image = self.run_step(image, step, number)
        layer = image.layers[-1]
        with open(os.path.join(store.layer_dir(layer), "export.json"), encoding="utf-8") as handle:
            diff_id = json.load(handle)["diff_id"]
        _cache_put(store, key, {"digest": layer, "diff_id": diff_id, "size": store.layer_index(layer).size})
        return image

    def run_step(self, image: Image, step: Step, number: int) -> Image:
        # A step runs in a kept sandbox, which this layer does not know (model/hooks.py).
        if hooks.run_build_step is None:
            raise IsolationError("an image build runs its RUN steps in kept sandboxes (isolate.kept.imagebuild)")
        built: Image = hooks.run_build_step(image, step, number, self.progress)
        return built

    def layer_blob(self, image: Image, step: Step) -> LayerBlob:
        store = image.store
        store._ensure()
        path = os.path.join(store.path, "tmp", f"copy-{os.getpid()}-{threading.get_ident()}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        try:
            blob: LayerBlob = step.args(image, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return blob


def _target(image: Image, destination: str) -> str:
    """A destination in the image: relative ones from its working directory."""
    workdir = image.config.working_dir or "/"
    return os.path.normpath(destination if destination.startswith("/") else os.path.join(workdir, destination))


def _existing(lowers: list[str], rel: str) -> os.stat_result | None:
    """The node the image shows at ``rel`` (a directory the copy goes into keeps its owner and mode)."""
    from .view import _find

    found, holder = _find(lowers, rel)
    if found != "dir" or holder is None:
        return None
    try:
        return os.lstat(os.path.join(holder, rel))
    except OSError:
        return None


def _open_host(source: str) -> list[tuple[int, str]]:
    """A host path of the caller's own (Build.copy): its parent opened, its last component never followed."""
    parent, name = os.path.split(source.rstrip("/") or "/")
    fd = os.open(parent or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError as exc:
        os.close(fd)
        raise BuildError(f"copy: {source}: {exc.strerror}") from None
    return [(fd, name)]


def retag(image: Image, reference: str) -> Image:
    """The image kept under another name as well."""
    from .reference import Reference

    record = image.store.record(image.reference)
    if record is None:
        raise BuildError(f"build: {image.reference} vanished from the image store")
    record = dict(record, reference=str(Reference.parse(reference)))
    image.store.write_record(record)
    return Image._from_record(record, image.store)


def _cache_path(store: Store, key: str) -> str:
    return os.path.join(store.path, "build-cache", key + ".json")


def _cache_get(store: Store, key: str) -> dict[str, Any] | None:
    try:
        with open(_cache_path(store, key), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("digest"), str) or not isinstance(
            data.get("diff_id"), str) or not store.has_layer(data["digest"]):
        return None
    return data


def _cache_put(store: Store, key: str, entry: dict[str, Any]) -> None:
    directory = os.path.join(store.path, "build-cache")
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    tmp = _cache_path(store, key) + f".{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(entry, handle)
    os.replace(tmp, _cache_path(store, key))


__all__ = ["Build", "BuildError", "CacheMount", "Stats"]
