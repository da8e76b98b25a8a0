"""The server's sandboxes past a host reboot: kept stopped over their files, and started again on resume.

A reboot ends every process of a sandbox and empties the private runtime
directory (a tmpfs) that held its description (where its files are, their
identities); its files stay in isolate's state directory (on disk). With a
state directory of its own on disk (``serve --state-dir``), the server keeps
what a new start over those files needs in ``<state dir>/stopped/ID.json``:
the create request as checked when it was made (without ``image.auth``;
``snapshotId`` replaced by the image it named), the identities of the
sandbox's data directory and of its upper layers (the workspace's, and the
image root's when on disk). Written whole (a temporary file, renamed)
through the directory's descriptor, never through a link, when the sandbox
starts and again when it is resumed; removed with it.

At the next start, a sandbox whose record says it ran but whose description
is gone (a reboot) is listed under its id, ``Paused`` (reason
``host_reboot``) when its copy reads back (each field checked) and its data
directory is still the one isolate made (its identity): commands are
refused (409) saying to resume it. ``resume`` parses the kept request again
as any create (the image's profile, the volumes walked from their roots),
moves the old data directory aside, starts a new kept sandbox of the same
name whose ``/workspace`` (and image root) starts from one layer made of the
old ones (the old base layer's hard links, then the old upper layer laid
over it, as a snapshot is made), and removes the old directory. Nothing in
the copy becomes a path: the data directory is found by the name the id
gives, each layer in it opened without following a link and compared with
the identity the copy holds. What lived in the sandbox's tmpfs mounts
(``/tmp``, ``/var/tmp``, the home) and its processes are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from typing import Any

from ..kernel.beneath import open_beneath
from ..kernel.links import DIR_FLAGS
from ..model.errors import IsolationError
from ..model.policy import Policy

#: The entry of the server's state directory holding the copies (the record loader skips it).
STOPPED = "stopped"
#: The suffix of an old data directory while a resume starts the new one over its files.
ASIDE = ".resuming"
MAX_COPY = 1 << 20
_ID = re.compile(r"[0-9a-f]{24}")
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def boot_id() -> str:
    """This boot's id (the kernel's random UUID, another at each boot); "" where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            value = handle.read().strip()
    except (OSError, ValueError):
        return ""
    return value if _BOOT_ID.fullmatch(value) else ""


@dataclass(frozen=True)
class Copy:
    """What a resume needs of a sandbox a reboot stopped (see the module's docstring)."""

    request: dict[str, Any]
    #: (st_dev, st_ino) of its data directory, of its workspace's upper layer.
    data: tuple[int, int]
    upper: tuple[int, int]
    #: Of a sandbox of an image with its root's upper layer on disk: the image's id and that layer's identity.
    image: str | None = None
    image_upper: tuple[int, int] | None = None
    #: The boot it was written in: a sandbox is kept stopped only past a reboot (another boot id), never when
    #: its description went otherwise (a delete or a create the last server did not finish).
    boot: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "request": self.request, "data": list(self.data), "upper": list(self.upper),
                "image": self.image, "imageUpper": None if self.image_upper is None else list(self.image_upper),
                "boot": self.boot}


def _pair(value: object, what: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in value)):
        raise ValueError(f"{what}: not an identity")
    return int(value[0]), int(value[1])


def parse_copy(data: object) -> Copy:
    """A copy read back, each field checked (ValueError: not one the server wrote)."""
    if not isinstance(data, dict) \
            or set(data) != {"version", "request", "data", "upper", "image", "imageUpper", "boot"}:
        raise ValueError("not a copy the server wrote")
    if not (isinstance(data["boot"], str) and (data["boot"] == "" or _BOOT_ID.fullmatch(data["boot"]))):
        raise ValueError("boot: not a boot id")
    if data["version"] != 1 or not isinstance(data["request"], dict):
        raise ValueError("unknown version, or no request")
    image, image_upper = data["image"], data["imageUpper"]
    if (image is None) != (image_upper is None) or not (image is None or (isinstance(image, str)
                                                                           and _IMAGE_ID.fullmatch(image))):
        raise ValueError("image: not an image id with its layer")
    return Copy(dict(data["request"]), _pair(data["data"], "data"), _pair(data["upper"], "upper"),
                image, None if image_upper is None else _pair(image_upper, "imageUpper"), data["boot"])


def request_of(body: object, image: str) -> dict[str, Any]:
    """The create request as kept: its image by reference only (``image.auth``, a registry's credentials,
    is never written), a snapshot's sandbox by the image it had (the snapshot's layer is in its files)."""
    kept = {k: v for k, v in body.items() if k not in ("image", "snapshotId")} if isinstance(body, dict) else {}
    kept["image"] = {"uri": image}
    return kept


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _read(name: str, dir_fd: int) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise OSError("not a regular file of the server's user")
        data = handle.read(MAX_COPY + 1)
    if len(data) > MAX_COPY:
        raise OSError("too large")
    return data


class StoppedCopies:
    """The copies in one server's state directory (its descriptor: ``Keeper.fd``)."""

    def __init__(self, state_fd: int) -> None:
        self._state_fd = state_fd
        # Creates and deletes run in several worker threads at once, and removing the last copy removes the
        # directory: a copy written meanwhile, through a descriptor of the directory opened before, would fail
        # (ENOENT: a create answered 500). Each write and each removal holds this lock.
        self._lock = threading.Lock()

    def _open(self, create: bool) -> int:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(STOPPED, 0o700, dir_fd=self._state_fd)
        fd = os.open(STOPPED, DIR_FLAGS, dir_fd=self._state_fd)
        if os.fstat(fd).st_uid != os.geteuid():
            os.close(fd)
            raise IsolationError(f"the server's state directory's {STOPPED}/ is not its user's; remove it")
        return fd

    def keep(self, sandbox_id: str, request: dict[str, Any], box: Any) -> None:
        """Copy what a start over the files of the kept sandbox ``box`` (just started) needs; OSError when it
        cannot be written."""
        impl = box._impl
        if impl.data_identity is None or impl.workspace_identity is None or not impl.layered:
            raise OSError(f"sandbox {sandbox_id}: its workspace is not a layer of its data directory")
        image = image_upper = None
        if impl.image_upper is not None:
            shown = impl.report_enforced.get("image")
            image = str(shown["id"]) if isinstance(shown, dict) and shown.get("id") else None
            image_upper = impl.image_upper.identity if image is not None else None
        self.write(sandbox_id, Copy(request, impl.data_identity, impl.workspace_identity, image, image_upper,
                                    boot_id()))

    def write(self, sandbox_id: str, copy: Copy) -> None:
        """The sandbox's copy, whole (a temporary file renamed); OSError when it cannot be written."""
        with self._lock:
            self._write(sandbox_id, copy)

    def _write(self, sandbox_id: str, copy: Copy) -> None:
        fd = self._open(create=True)
        try:
            temp = f".{sandbox_id}.{secrets.token_hex(4)}.tmp"
            out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=fd)
            try:
                with os.fdopen(out, "w") as handle:
                    handle.write(json.dumps(copy.to_json()))
                os.rename(temp, f"{sandbox_id}.json", src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=fd)
                raise
        finally:
            os.close(fd)

    def read(self, sandbox_id: str) -> Copy:
        """The sandbox's copy, checked (OSError, ValueError: none, or not the server's)."""
        if not _ID.fullmatch(sandbox_id):
            raise ValueError("not a sandbox id")
        fd = self._open(create=False)
        try:
            return parse_copy(json.loads(_read(f"{sandbox_id}.json", fd)))
        finally:
            os.close(fd)

    def sweep(self, known: set[str]) -> None:
        """Remove the copies (and the temporary files) of sandboxes that have no record."""
        try:
            fd = self._open(create=False)
        except (OSError, IsolationError):
            return
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        for entry in names:
            sandbox_id = entry[:-5] if entry.endswith(".json") else entry[1:].split(".", 1)[0]
            if sandbox_id in known:
                continue
            if _ID.fullmatch(sandbox_id):
                self.forget(sandbox_id)
            else:
                self._drop(entry)

    def _drop(self, entry: str) -> None:
        with self._lock, contextlib.suppress(OSError, IsolationError):
            fd = self._open(create=False)
            try:
                os.unlink(entry, dir_fd=fd)
            finally:
                os.close(fd)

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._forget(sandbox_id)

    def _forget(self, sandbox_id: str) -> None:
        try:
            fd = self._open(create=False)
        except (OSError, IsolationError):
            return
        try:
            with contextlib.suppress(OSError):
                os.unlink(f"{sandbox_id}.json", dir_fd=fd)
            for entry in os.listdir(fd):  # a copy a killed server was writing
                if entry.startswith(f".{sandbox_id}.") and entry.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry, dir_fd=fd)
            with contextlib.suppress(OSError):  # the last one: the directory goes too
                if not os.listdir(fd):
                    os.rmdir(STOPPED, dir_fd=self._state_fd)
        finally:
            os.close(fd)


def _sandboxes() -> int:
    from ..kernel.places import open_state_dir

    return open_state_dir("sandboxes")


def _open_checked(parent: int, parts: tuple[str, ...], identity: tuple[int, int] | None = None) -> int:
    """parts below parent, each opened without following a link; the last one's identity checked."""
    fd = open_beneath(parent, "/".join(parts), DIR_FLAGS)
    try:
        if identity is not None and _identity(fd) != identity:
            raise IsolationError(f"{'/'.join(parts)}: not the directory isolate made (replaced); not used")
    except BaseException:
        os.close(fd)
        raise
    return fd


def files_left(name: str, copy: Copy) -> bool:
    """Whether the data directory of the sandbox ``name`` is there as the copy names it (after a resume the
    server was killed in, the old one set aside is put back first)."""
    parent = _sandboxes()
    try:
        if not _exists(parent, name) and _exists(parent, name + ASIDE):
            os.rename(name + ASIDE, name, src_dir_fd=parent, dst_dir_fd=parent)
        for parts, identity in (((name,), copy.data), ((name, "overlay", "upper"), copy.upper),
                                ((name, "image", "upper"), copy.image_upper)):
            if identity is not None:
                os.close(_open_checked(parent, parts, identity))
        return True
    except (OSError, IsolationError):
        return False
    finally:
        os.close(parent)


def _exists(parent: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def remove_files(name: str, identity: tuple[int, int] | None) -> None:
    """The data directory of a stopped sandbox (and one set aside by a resume), if it is still the one the
    copy names (``identity``; None: whichever directory is there), through the state directory's descriptor."""
    from ..kernel.tree import remove_dir_at

    parent = _sandboxes()
    try:
        for entry in (name, name + ASIDE):
            try:
                info = os.stat(entry, dir_fd=parent, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and (identity is None or (info.st_dev, info.st_ino) == identity):
                remove_dir_at(parent, entry, (info.st_dev, info.st_ino))
    finally:
        os.close(parent)


class StoppedBox:
    """What the server holds of a sandbox a reboot stopped, in place of an ``isolate.Sandbox``: its name and
    policy; no process. Its close removes its files."""

    backend = "native"

    def __init__(self, name: str, policy: Policy, copy: Copy) -> None:
        self.name, self.policy, self.copy = name, policy, copy
        self.enforced: dict[str, Any] = {}
        self.mounts = ()

    def processes(self) -> list[Any]:
        return []

    def detach(self) -> None:
        pass

    def resume(self) -> str:
        return "stopped"

    def close(self) -> None:
        with contextlib.suppress(OSError, IsolationError):
            remove_files(self.name, self.copy.data)


class FromStopped:
    """What a resumed sandbox's start fills its new data directory from (as a snapshot handed over): the old
    data directory, set aside; each layer is the old base layer cloned (hard links) with the old upper layer
    laid over it."""

    def __init__(self, aside: str, copy: Copy) -> None:
        self.aside, self.copy = aside, copy
        #: The image the old root layer lies over (a start lays the root layer only where this is set).
        self.image = copy.image

    def move_data(self, dir_fd: int, name: str) -> bool:
        self._layer(("overlay",), self.copy.upper, dir_fd, name)
        return True

    def move_root(self, dir_fd: int, name: str) -> bool:
        assert self.copy.image_upper is not None
        self._layer(("image",), self.copy.image_upper, dir_fd, name)
        return True

    def _layer(self, where: tuple[str, ...], upper_identity: tuple[int, int], dir_fd: int, name: str) -> None:
        from ..kernel import layers

        parent = _sandboxes()
        try:
            old = _open_checked(parent, (self.aside,), self.copy.data)
        finally:
            os.close(parent)
        try:
            state = _open_checked(old, where)
            try:
                upper = _open_checked(state, ("upper",), upper_identity)
                try:
                    os.mkdir(name, 0o755, dir_fd=dir_fd)
                    out = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
                    try:
                        try:
                            base: int | None = os.open("base", DIR_FLAGS, dir_fd=state)
                        except FileNotFoundError:
                            base = None
                        try:
                            layers.flatten_over(base, upper, out)
                        finally:
                            if base is not None:
                                os.close(base)
                    finally:
                        os.close(out)
                finally:
                    os.close(upper)
            finally:
                os.close(state)
        finally:
            os.close(old)


def set_aside(name: str, identity: tuple[int, int]) -> None:
    """The old data directory renamed NAME.resuming (its name is the new sandbox's), if it is the one the copy
    names."""
    parent = _sandboxes()
    try:
        os.close(_open_checked(parent, (name,), identity))
        os.rename(name, name + ASIDE, src_dir_fd=parent, dst_dir_fd=parent)
    finally:
        os.close(parent)


def put_back(name: str) -> None:
    """A resume that failed: the old data directory named NAME again (a new one half made there removed)."""
    parent = _sandboxes()
    try:
        if _exists(parent, name + ASIDE):
            with contextlib.suppress(OSError):
                os.rename(name + ASIDE, name, src_dir_fd=parent, dst_dir_fd=parent)
    finally:
        os.close(parent)


def remove_aside(name: str, identity: tuple[int, int]) -> None:
    from ..kernel.tree import remove_dir_at

    parent = _sandboxes()
    try:
        remove_dir_at(parent, name + ASIDE, identity)
    finally:
        os.close(parent)
