"""``isolate.Snapshot``: a kept sandbox's files, frozen, to start sandboxes from or to restore one to.

    snap = sb.snapshot()                      # the workspace, /tmp, /var/tmp and the home, as they are now
    sb.restore(snap)                          # back to it (the sandbox's processes end)
    a, b = sb.fork(2)                         # two new sandboxes from its files as they are now
    isolate.Sandbox(policy, snapshot=snap)    # a new sandbox from it

What a snapshot holds, by workspace mode (isolate/kernel/layers.py says how):

- ``overlay``: one overlay *layer* over the workspace's source: what the
  sandbox changed since the source, its own files copied from its upper
  layer and the rest hard links of the layer it started from. Taking one,
  and starting or restoring a sandbox from one, costs what changed since
  the source, not the source's size (the source stays the lower layer,
  read live, as for any overlay workspace: it must not change meanwhile);
- ``copy``: on the native backend, one layer over the sandbox's private
  copy of the source, made once (isolate/backends/native/copies.py), as for
  an overlay workspace; it keeps that copy while it exists. Where the copy
  is the workspace itself (no source; the overlay refused here) a whole
  copy of the workspace (a *tree*);
- ``bind``: refused (the workspace is the user's own directory).

A sandbox of an image (``image_upper="disk"``) adds one more layer, the
image root's: the root layer it started from with its upper layer laid over
it (``root``; that start kept too, ``rootbase``, for merge), and the image's
id in its description. A sandbox started
from it lays that layer (hard links) between the image's layers and its own
upper layer; one of another image is refused; ``to_image`` writes it over
the image as an image of the store (isolate/image/commit.py). The default
tmpfs upper layer is refused: no host path reaches it.

Beside the workspace, the contents of the sandbox's private tmpfs mounts
(``/tmp``, ``/var/tmp``, the home and the policy's ``tmpfs``) are kept when
they hold anything, as a tar archive made *inside* the sandbox, by the
program's own ``tar`` as the program: nothing on the host reads them by path.
The archive is the program's word: it is unpacked only into the private
tmpfs mounts of the sandbox it is restored into, by descriptors the host
walks from their roots, never into a host directory that sandbox shows there
(``isolate/kept/unpack.py``): what would land elsewhere is skipped and
reported (``SnapshotSkipWarning``, ``Sandbox.restore_skipped``). Host
directories granted writable (``write=``, ``mounts``) are the host's, not
the sandbox's, and are not captured. Processes are not captured: a sandbox
started or restored from a snapshot starts with none.

Where it is kept: the files in ``<state dir>/snapshots/NAME`` (made and
reached through descriptors that follow no link, as a sandbox's workspace
copy: ``places.open_state_dir``), its description in the caller's private
runtime directory, out of every sandbox's reach (as the registry of kept
sandboxes): nothing planted in the state directory decides what a snapshot
is, where its source lies or which directory is removed with it. Like that
registry, the descriptions do not survive a reboot.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import stat
import tarfile
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends.native import copies
from ..backends.registry import _check_name
from ..image import leases
from ..kernel import layers
from ..kernel.links import DIR_FLAGS
from ..kernel.places import lock_if_left, making_in, open_state_dir, runtime_subdir, state_key
from ..kernel.tree import remove_dir_at as _remove_at
from ..model.errors import IsolationError, PolicyError, UnsupportedError
from ..model.workspace import Workspace

if TYPE_CHECKING:
    from ..image import Image

#: An isolate.Sandbox (not imported: the sandbox module imports this one).
Sandbox = Any

#: The archive of the tmpfs mounts, at most (it moves between the sandbox and its file CHUNK at a time).
AREAS_LIMIT = 1 << 30
CHUNK = 1 << 20


class SnapshotSkipWarning(RuntimeWarning):
    """Files of a snapshot that were not restored: they would have landed outside the sandbox's own tmpfs
    mounts (in a host directory it shows there, or beneath a link); ``Sandbox.restore_skipped`` lists them."""


def _meta_dir() -> str:
    return runtime_subdir(f"snapshots-{state_key()}")


@dataclass(frozen=True)
class Snapshot:
    """A frozen capture of a sandbox's files (see the module's docstring)."""

    name: str
    #: "layer" (changes over the source, or over a copy workspace's private copy) or "tree" (a whole copy).
    kind: str
    workspace: Workspace
    created: float
    #: A token of this capture's files, and of the capture the sandbox it was taken from started from
    #: (merge's common start).
    id: str
    origin: str | None
    #: The tmpfs mounts it holds (an archive of them), e.g. ["/tmp", "/home/sandbox"].
    areas: tuple[str, ...]
    identity: tuple[int, int]
    #: A copy workspace's layer lies over the sandbox's private copy, made once (the token of that copy,
    #: isolate/backends/native/copies.py); None: over the source (overlay), or a whole tree.
    lower: str | None = None
    #: Of a sandbox started from an image: that image's id (its config digest), and the reference it was
    #: named by; the snapshot then holds the image root's layer too (what the program changed there).
    image: str | None = None
    image_ref: str | None = None

    # -- the catalogue ------------------------------------------------------------------------------

    @classmethod
    def list(cls) -> list[Snapshot]:
        """This user's snapshots (of this state directory), oldest first."""
        out = []
        directory = _meta_dir()
        for entry in sorted(os.listdir(directory)):
            if entry.endswith(".json"):
                try:
                    out.append(cls.get(entry[:-5]))
                except IsolationError:
                    continue
        return sorted(out, key=lambda s: s.created)

    @classmethod
    def get(cls, name: str) -> Snapshot:
        """The snapshot of that name."""
        _check_name(name)
        try:
            fd = os.open(os.path.join(_meta_dir(), f"{name}.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as handle:
                meta = json.load(handle)
            image = meta.get("image") or {}
            return cls(name, str(meta["kind"]), _workspace(meta["workspace"]),
                       float(meta["created"]), str(meta["id"]), meta.get("origin"), tuple(meta["areas"]),
                       (int(meta["identity"][0]), int(meta["identity"][1])),
                       meta["lower"] if copies.valid(meta.get("lower")) else None,
                       str(image["id"]) if image else None, str(image["reference"]) if image else None)
        except (OSError, ValueError, KeyError, TypeError):
            raise IsolationError(f"no snapshot named {name!r} (isolate.Snapshot.list())") from None

    def remove(self) -> None:
        """Remove the snapshot's files and description (sandboxes started from it keep their own)."""
        parent = open_state_dir("snapshots")
        try:
            _remove_at(parent, self.name, self.identity)
        finally:
            os.close(parent)
        copies.release(self.lower)
        try:
            os.unlink(os.path.join(_meta_dir(), f"{self.name}.json"))
        except FileNotFoundError:
            pass
        _release(self.name)  # a temporary one's lock, last: a sweep never sees it free before it is gone

    # -- its files ----------------------------------------------------------------------------------

    def _open(self) -> int:
        parent = open_state_dir("snapshots")
        try:
            fd = os.open(self.name, DIR_FLAGS, dir_fd=parent)
        except OSError:
            raise IsolationError(f"snapshot {self.name!r}: its files are gone (removed?)") from None
        finally:
            os.close(parent)
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != self.identity:
            os.close(fd)
            raise IsolationError(f"snapshot {self.name!r}: its directory is not the one isolate made (replaced); "
                                 "not used")
        return fd

    def open_data(self) -> int:
        """A descriptor of its layer or tree (the caller closes it)."""
        fd = self._open()
        try:
            return os.open(self.kind, DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)

    def open_base(self) -> int | None:
        """A descriptor of the layer the captured sandbox started from (its ``origin``), kept with a layer
        snapshot for merge; None when there is none."""
        fd = self._open()
        try:
            return os.open("base", DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def open_root(self) -> int:
        """A descriptor of its image root's layer (a snapshot of a sandbox of an image; the caller closes it)."""
        if self.image is None:
            raise IsolationError(f"snapshot {self.name!r}: it was not taken of a sandbox of an image")
        fd = self._open()
        try:
            return os.open("root", DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)

    def open_root_base(self) -> int | None:
        """A descriptor of the image root's layer the captured sandbox started from, kept for merge beside
        ``open_base``'s; None when there is none (it started from the image itself, or a bundle's)."""
        if self.image is None:
            return None
        fd = self._open()
        try:
            return os.open("rootbase", DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def _image_meta(self) -> dict[str, Any]:
        fd = os.open(os.path.join(_meta_dir(), f"{self.name}.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as handle:
            image = json.load(handle).get("image")
        if not isinstance(image, dict):
            raise UnsupportedError(f"snapshot {self.name!r}: it was not taken of a sandbox of an image "
                                   "(Policy(image=...)), so it holds no root to make an image of")
        return image

    def to_image(self, reference: str | None = None) -> Image:
        """An image in the store: the image the captured sandbox started from, plus one layer, the snapshot's
        root layer (what the program changed there; its workspace, home and /tmp are its own mounts, not the
        image's: not in it). Its config is that image's, with the sandbox's policy's env, working directory
        and user over it (as ``Sandbox.commit_image``); ``isolate.Sandbox(policy, image=reference)`` starts
        from it. ``reference``: None keeps it as ``localhost/isolate-build:ID``. An ``isolate.Image``."""
        from ..image import Image
        from ..image.commit import snapshot_image

        meta = self._image_meta()
        base = Image.find(str(meta["id"]))
        if base is None:
            raise IsolationError(f"snapshot {self.name!r}: the image it lies over ({meta['reference']}, "
                                 f"{meta['id']}) is no longer in the image store")
        root = self.open_root()
        try:
            return snapshot_image(base, root, reference, dict(meta["config"]), frozenset(meta["leave_out"]),
                                  f"isolate snapshot {self.name}")
        finally:
            os.close(root)

    def open_areas(self) -> int | None:
        """A descriptor of its archive of the tmpfs mounts (a regular file; the caller closes it), or None."""
        if not self.areas:
            return None
        fd = self._open()
        try:
            archive = os.open("areas.tar", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(os.fstat(archive).st_mode):
            os.close(archive)
            raise IsolationError(f"snapshot {self.name!r}: its archive is not a regular file")
        os.set_blocking(archive, True)
        return archive


def _workspace(ws: dict[str, Any]) -> Workspace:
    """The workspace a description names, as it was checked when the snapshot was taken: its source may be
    gone since (the snapshot is still listed, and can be removed; starting from it then fails)."""
    try:
        return Workspace(ws["source"], ws["target"], ws["mode"], tuple(ws["exclude"]))
    except PolicyError:
        workspace = Workspace(None, ws["target"], "copy", tuple(ws["exclude"]))
        object.__setattr__(workspace, "source", str(ws["source"]))
        object.__setattr__(workspace, "mode", str(ws["mode"]))
        return workspace


class ForkPoint:
    """The snapshot the forks of a copy workspace started from, kept while one of them is open: merge finds
    their common start by it. Removed when the last is closed, or when this process ends."""

    def __init__(self, snapshot: Snapshot, forks: int) -> None:
        import threading
        import weakref

        self.snapshot = snapshot
        self.open = forks
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_quietly, snapshot, os.getpid())

    def release(self) -> None:
        with self._lock:
            self.open -= 1
            last = self.open == 0
        if last:
            self._finalizer()

    def release_all(self) -> None:
        """The fork failed: the snapshot goes now, whatever forks had started (they were closed)."""
        self._finalizer()


def _remove_quietly(snapshot: Snapshot, maker: int = 0) -> None:
    if maker and maker != os.getpid():
        return  # a child forked since (its exit runs the finalizers it inherited): the snapshot is its parent's
    try:
        snapshot.remove()
    except (OSError, IsolationError):
        pass


#: A snapshot isolate takes for itself (fork's start, merge's branches): ``tmp-PID-START-HEX``, its maker's pid
#: and start time. Its maker holds an exclusive flock on its directory from its making to its removal.
_TEMPORARY = re.compile(r"tmp-([1-9][0-9]{0,9})-([0-9]{1,20})-[0-9a-f]{8}")
#: The locks this process holds on its temporary snapshots: name -> a descriptor of the directory.
_HELD: dict[str, int] = {}


def _temporary_name() -> str:
    pid = os.getpid()
    return f"tmp-{pid}-{leases.start_time(pid) or 0}-{secrets.token_hex(4)}"


def _release(name: str) -> None:
    fd = _HELD.pop(name, -1)
    if fd >= 0:
        os.close(fd)


def _maker_runs(match: re.Match[str]) -> bool:
    return str(leases.start_time(int(match.group(1))) or 0) == match.group(2)


def sweep_temporary_snapshots() -> list[str]:
    """Remove the temporary snapshots of processes killed before they could (SIGKILL, an OOM kill, a Ray
    node's loss): neither their maker (its pid and start time, in this PID namespace) nor anyone (its lock:
    a maker in another PID namespace has a pid meaningless here) holds them. Their description, or the
    temporary one a kill left half written, goes with them."""
    swept: list[str] = []
    try:
        parent = open_state_dir("snapshots")
    except (OSError, IsolationError):
        return swept
    try:
        for name in os.listdir(parent):
            match = _TEMPORARY.fullmatch(name)
            if match is None or _maker_runs(match):
                continue
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=parent)
            except OSError:
                continue  # not a directory: nothing isolate made
            try:
                if not lock_if_left(parent, fd):
                    continue  # its maker runs, in another PID namespace
                info = os.fstat(fd)
                identity = (info.st_dev, info.st_ino)
                try:
                    snapshot: Snapshot | None = Snapshot.get(name)
                except IsolationError:
                    snapshot = None  # killed before its description was written
                if snapshot is not None and snapshot.identity == identity:
                    snapshot.remove()
                else:
                    _remove_at(parent, name, identity)
                swept.append(name)
            finally:
                os.close(fd)
    finally:
        os.close(parent)
    directory = _meta_dir()
    for entry in os.listdir(directory):  # descriptions without files, and temporary ones, of ended makers
        stem = entry[1:].rsplit(".", 1)[0] if entry.startswith(".") else entry.removesuffix(".json")
        match = _TEMPORARY.fullmatch(stem)
        if match is not None and not _maker_runs(match):
            with contextlib.suppress(OSError):
                if entry.startswith(".") or not _exists_in_state(stem):
                    os.unlink(os.path.join(directory, entry))
    return swept


def _exists_in_state(name: str) -> bool:
    try:
        parent = open_state_dir("snapshots")
    except (OSError, IsolationError):
        return False
    try:
        os.stat(name, dir_fd=parent, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(parent)


class HandedOver:
    """A snapshot handed over to the one sandbox about to start from it (fork's last): its files are moved
    into the sandbox's data directory (a rename: nothing copied or linked), the snapshot then removed."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def open_data(self) -> int:
        return self.snapshot.open_data()

    def open_root(self) -> int:
        return self.snapshot.open_root()

    def move_root(self, dir_fd: int, name: str) -> bool:
        return self._move("root", dir_fd, name)

    def move_data(self, dir_fd: int, name: str) -> bool:
        return self._move(self.snapshot.kind, dir_fd, name)

    def _move(self, part: str, dir_fd: int, name: str) -> bool:
        fd = self.snapshot._open()
        try:
            os.rename(part, name, src_dir_fd=fd, dst_dir_fd=dir_fd)
        except OSError:
            return False  # another file system, say: cloned instead
        finally:
            os.close(fd)
        return True


class Reused:
    """A snapshot a sandbox is restored to when it started from that very snapshot: the base layer the old
    sandbox cloned from it (never written, as every lower layer) is moved to the new one (a rename) rather
    than cloned again; the old sandbox, killed, no longer needs it."""

    def __init__(self, snapshot: Snapshot, key: str) -> None:
        self.snapshot, self.key = snapshot, key

    def open_data(self) -> int:
        return self.snapshot.open_data()

    def open_root(self) -> int:
        return self.snapshot.open_root()

    def move_data(self, dir_fd: int, name: str) -> bool:
        return self._move(("overlay",), dir_fd, name)

    def move_root(self, dir_fd: int, name: str) -> bool:
        """The image root's layer the old sandbox cloned (``image/base``), likewise."""
        return self._move(("image",), dir_fd, name)

    def _move(self, parts: tuple[str, ...], dir_fd: int, name: str) -> bool:
        from ..backends.native.datadir import open_base

        try:
            fd = open_base(self.key, parts)
        except OSError:
            return False
        try:
            os.rename("base", name, src_dir_fd=fd, dst_dir_fd=dir_fd)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True


class _Making:
    """A snapshot being made: its directory, removed again unless commit() is reached."""

    def __init__(self, name: str | None, kind: str, temporary: bool = False) -> None:
        """``temporary``: a snapshot isolate takes for itself, locked from its making to its removal."""
        if temporary:
            self.name = _temporary_name()
        else:
            self.name = _check_name(name) if name is not None else f"snap-{secrets.token_hex(6)}"
            if _TEMPORARY.fullmatch(self.name):
                raise PolicyError(f"snapshot name {self.name!r}: tmp-PID-START-HEX names the snapshots isolate "
                                  "takes for itself (removed when their maker is gone); choose another", "name")
        self.kind = kind
        #: The private copy its layer lies over, once linked (use_copy).
        self.lower: str | None = None
        if os.path.lexists(os.path.join(_meta_dir(), f"{self.name}.json")):
            raise IsolationError(f"snapshot {self.name!r} exists already; remove it or choose another name")
        self.parent = open_state_dir("snapshots")
        self.fd = self.data = -1
        try:
            # A temporary one is locked before a sweep (of a maker in another PID namespace, too) can see it.
            with making_in(self.parent) if temporary else contextlib.nullcontext():
                try:
                    os.mkdir(self.name, 0o700, dir_fd=self.parent)
                except FileExistsError:
                    raise IsolationError(f"snapshot {self.name!r}: {self.name} exists in the state directory's "
                                         "snapshots (left over?); remove it or choose another name") from None
                self.fd = os.open(self.name, DIR_FLAGS, dir_fd=self.parent)
                if temporary:
                    fcntl.flock(self.fd, fcntl.LOCK_EX)  # held by a descriptor of its own until its removal
                    _HELD[self.name] = os.dup(self.fd)
            info = os.fstat(self.fd)
            self.identity = (info.st_dev, info.st_ino)
            os.mkdir(kind, 0o755, dir_fd=self.fd)
            self.data = os.open(kind, DIR_FLAGS, dir_fd=self.fd)
        except BaseException:
            self.close()
            _release(self.name)
            raise

    def use_copy(self, token: str) -> None:
        """Its layer lies over that private copy: linked, the copy stays while the snapshot does."""
        copies.add_user(token, self.fd)
        self.lower = token

    def open_areas(self) -> int:
        """A new areas.tar of the snapshot, for writing (the caller closes it)."""
        return os.open("areas.tar", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=self.fd)

    def commit(self, workspace: Workspace, origin: str | None, areas: tuple[str, ...],
               id: str | None = None, image: dict[str, Any] | None = None) -> Snapshot:
        """Describe the snapshot made (``id``: a capture's token kept from another machine, see bundles.py;
        ``image``: the image a root layer lies over, see take())."""
        snap = Snapshot(self.name, self.kind, workspace, time.time(), id or secrets.token_hex(8), origin, areas,
                        self.identity, self.lower, image["id"] if image else None,
                        image["reference"] if image else None)
        meta = {"kind": snap.kind, "created": snap.created, "id": snap.id, "origin": origin, "areas": list(areas),
                "identity": list(self.identity), "lower": self.lower, "image": image,
                "workspace": {"source": workspace.source, "target": workspace.target, "mode": workspace.mode,
                              "exclude": list(workspace.exclude)}}
        directory = _meta_dir()
        temp = os.path.join(directory, f".{self.name}.{secrets.token_hex(4)}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(meta))
        os.rename(temp, os.path.join(directory, f"{self.name}.json"))
        self.close()
        return snap

    def abandon(self) -> None:
        self.close(keep_parent=True)
        try:
            _remove_at(self.parent, self.name, self.identity)
        finally:
            _release(self.name)
        self.close()
        copies.release(self.lower)

    def close(self, keep_parent: bool = False) -> None:
        for fd in (self.data, self.fd) if keep_parent else (self.data, self.fd, self.parent):
            if fd >= 0:
                os.close(fd)
        self.data = self.fd = -1
        if not keep_parent:
            self.parent = -1


def writable_areas(sb: Sandbox) -> list[str]:
    """The sandbox's private tmpfs mounts (the policy's, and the home where it is one), workspace left out."""
    impl = sb._impl
    home = impl.report_enforced.get("home")
    paths = list(sb.policy.tmpfs) + ([home["path"]] if isinstance(home, dict) and home.get("path") else [])
    target = sb.workspace.target.rstrip("/")
    out: list[str] = []
    for path in paths:
        path = os.path.normpath(str(path))
        if path in out or path == target or path.startswith(target + "/") or path == "/":
            continue
        out.append(path)
    return out


def _piped(sb: Sandbox, argv: list[str], source: int | None, sink: int | None, limit: int) -> tuple[int, bytes, bool]:
    """Run argv in sb, its stdin fed from source and its stdout written to sink a chunk at a time (never whole in
    memory): (exit status, the tail of its stderr, whether its stdout passed limit bytes and it was killed)."""
    import selectors

    from ..model.files import write_all

    proc = sb.spawn(argv)
    sel = selectors.DefaultSelector()
    err, total, over = bytearray(), 0, False
    pending = memoryview(b"")
    try:
        for fd in (proc.stdout_fd, proc.stderr_fd):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if source is None:
            proc.close_stdin()
        else:
            os.set_blocking(proc.stdin_fd, False)
            sel.register(proc.stdin_fd, selectors.EVENT_WRITE)
        while any(key.events & selectors.EVENT_READ for key in sel.get_map().values()):
            for key, _ in sel.select():
                fd = int(key.fd)
                if fd == proc.stdin_fd and source is not None:
                    if not pending:
                        pending = memoryview(os.read(source, CHUNK))
                    try:
                        pending = pending[os.write(fd, pending):] if pending else pending
                    except BrokenPipeError:  # it stopped reading: its status says why
                        pending = memoryview(b"")
                        source = None
                    if not pending and (source is None or not _more(source)):
                        sel.unregister(fd)
                        proc.close_stdin()
                    continue
                try:
                    chunk = os.read(fd, CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                elif fd == proc.stderr_fd:
                    err += chunk
                    del err[:max(0, len(err) - 4096)]
                elif not over:
                    total += len(chunk)
                    if total > limit:
                        over = True
                        proc.kill()
                    elif sink is not None:
                        write_all(sink, chunk)
        return proc.wait(), bytes(err), over
    finally:
        sel.close()
        proc.close()


def _more(fd: int) -> bool:
    """Whether a regular file's descriptor is short of its end."""
    return os.lseek(fd, 0, os.SEEK_CUR) < os.fstat(fd).st_size


def capture_areas(sb: Sandbox, making: _Making) -> tuple[str, ...]:
    """The non-empty tmpfs mounts, archived into the snapshot being made by the program's own tar, inside."""
    conn = sb._conn()
    full, members = [], []
    for path in writable_areas(sb):
        try:
            names = [name for name, _ in conn.readdir(path)]
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        if names:
            full.append(path)
            # The mounts' contents, not the mount points themselves (the program may not change those).
            members += [os.path.join(path, name).lstrip("/") for name in sorted(names)]
    if not full:
        return ()
    # Host paths shown inside those mounts (mounts, binds, write grants at /tmp/x) are the host's: left out,
    # by their literal paths.
    hosts, _ = host_paths(sb)
    excluded = [os.path.normpath(h).lstrip("/") for h in hosts
                if any(os.path.normpath(h).startswith(area.rstrip("/") + "/") for area in full)]
    sink = making.open_areas()
    try:
        rc, err, over = _piped(sb, ["tar", "-C", "/", "--sparse", "--no-wildcards", "--anchored",
                                    *(f"--exclude={path}" for path in excluded), "-cf", "-", "--", *members],
                               None, sink, AREAS_LIMIT)
    finally:
        os.close(sink)
    if rc == 127:
        raise UnsupportedError(f"snapshot: {', '.join(full)} hold files, which a snapshot keeps with the "
                               "sandbox's own tar, and the sandbox has none on its PATH")
    if rc != 0 or over:
        why = "larger than 1 GiB" if over else err.decode(errors="replace").strip()[-300:]
        raise IsolationError(f"snapshot: could not archive {', '.join(full)}: {why}")
    return tuple(full)


def host_paths(sb: Sandbox) -> tuple[list[str], list[str]]:
    """The host directories and files the sandbox shows: (where it shows them, what they are on the host)."""
    shown = [*sb.mounts, *sb.policy.binds]
    grants = [str(p) for p in sb.policy.write if os.path.isabs(str(p))]
    return [m.target for m in shown] + grants, [m.source for m in shown] + grants


def restore_areas(sb: Sandbox, snap: Snapshot) -> list[str]:
    """Unpack a snapshot's tmpfs mounts in a fresh sandbox, only into its own private tmpfs mounts (by
    descriptors from inside, no program run: see isolate/kept/unpack.py), read from its file a member at a
    time; the members skipped, each with why."""
    from .unpack import unpack

    source = snap.open_areas()
    if source is None:
        return []
    targets, sources = host_paths(sb)
    targets = [os.path.normpath(t) for t in targets]
    # An area that is itself a host directory (or lies in one) is not the sandbox's own.
    areas = [a for a in writable_areas(sb)
             if not any(a == t or a.startswith(t.rstrip("/") + "/") for t in targets)]
    user = sb._impl.report_enforced.get("user")
    owner = (int(user["uid"]), int(user["gid"])) if os.geteuid() == 0 and isinstance(user, dict) else None
    try:
        with os.fdopen(source, "rb") as archive:  # read a member at a time: memory stays bounded
            skipped = unpack(sb._conn(), archive, areas, sources, owner)
    except (OSError, tarfile.TarError) as exc:
        raise IsolationError(f"snapshot {snap.name!r}: could not unpack {', '.join(snap.areas)}: {exc}") from None
    if skipped:
        shown = "; ".join(skipped[:5]) + (f"; and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        warnings.warn(f"snapshot {snap.name!r}: {len(skipped)} of its files were not restored, as they would not "
                      f"land in this sandbox's own tmpfs mounts: {shown}", SnapshotSkipWarning, stacklevel=4)
    return skipped


def _has_base(key: str) -> bool:
    """Whether sandbox key's overlay has a base layer (it started from a snapshot), looked up without
    following a link (the state directory may be a sandbox's to write)."""
    from ..backends.native.datadir import open_base

    try:
        os.close(open_base(key))
    except (OSError, IsolationError):
        return False
    return True


def take(sb: Sandbox, name: str | None, origin: Snapshot | None, areas: bool = True,
         temporary: bool = False) -> Snapshot:
    """Capture a running native sandbox's files (see the module's docstring); ``temporary``: one isolate takes
    for itself and removes (fork's start, merge's branches), swept if its maker is killed first. A close or a
    restore in another thread waits for it (Sandbox._steady)."""
    with sb._steady("snapshot"):
        return _take(sb, name, origin, areas, temporary)


def _take(sb: Sandbox, name: str | None, origin: Snapshot | None, areas: bool, temporary: bool) -> Snapshot:
    from ..backends.native.datadir import open_base
    from ..backends.native.kept import NativeSandbox
    impl = sb._impl
    if not isinstance(impl, NativeSandbox):
        raise UnsupportedError("snapshot: the Docker backend keeps no snapshots (docker commit captures a "
                               "container's image layers, not its bound workspace); use backend='native'")
    if sb.policy.image is not None and impl.image_upper is None:
        # Its writes to the image's root are in a tmpfs of its own mount namespace: no host path reaches them,
        # and the program's view (tar inside, as for /tmp) is the image and its changes merged, with no trace
        # of what it deleted. A snapshot, or a fork, would silently lose them.
        raise UnsupportedError("snapshot: this sandbox of an image keeps its writes to the image's root in a "
                               "private tmpfs, which no snapshot or fork can read; start it with "
                               "isolate.Sandbox(..., image_upper='disk') (the root's upper layer in the state "
                               "directory: a snapshot then costs what changed there)")
    mode = sb.workspace.mode
    if mode == "bind":
        raise UnsupportedError("snapshot: a bind workspace is the user's own directory, which isolate does not "
                               "freeze; use Workspace(mode='overlay') (layers: costs what changed) or 'copy'")
    making = _Making(name, "layer" if impl.layered else "tree", temporary)
    try:
        if impl.copy is not None:
            making.use_copy(impl.copy)  # its layer lies over the sandbox's private copy
        captured = capture_areas(sb, making) if areas else ()
        ws_fd = impl.open_workspace()
        try:
            if impl.layered:
                # A sandbox started from a snapshot stands on its base layer, whether or not this object
                # knows that snapshot (one attached by its name does not, and the snapshot may be gone); a
                # copy workspace's sandbox says so itself.
                if (origin is not None or _has_base(impl.paths.key)) if impl.copy is None else impl.copy_base:
                    base = open_base(impl.paths.key)
                    try:
                        layers.clone(base, making.data)
                        # The start it shares with its sibling branches, for merge (hard links again).
                        os.mkdir("base", 0o755, dir_fd=making.fd)
                        kept = os.open("base", DIR_FLAGS, dir_fd=making.fd)
                        try:
                            layers.clone(base, kept)
                        finally:
                            os.close(kept)
                    finally:
                        os.close(base)
                os.fchmod(making.data, stat.S_IMODE(os.fstat(ws_fd).st_mode))
                if os.geteuid() == 0:
                    info = os.fstat(ws_fd)
                    os.fchown(making.data, info.st_uid, info.st_gid)
                layers.flatten(ws_fd, making.data)
            else:
                # Every node as it is (a link as a link, whatever it names: stored, never followed).
                layers.clone(ws_fd, making.data, hard_links=False)
        finally:
            os.close(ws_fd)
        image = capture_root(sb, making) if sb.policy.image is not None else None
        return making.commit(sb.workspace, origin.id if origin is not None else None, captured, image=image)
    except BaseException as exc:
        making.abandon()
        if isinstance(exc, OSError):
            # A file the program made unreadable to its owner (chmod 000, as the caller who is not root), or
            # one it swapped while it was copied: refused, in the error every caller expects.
            raise IsolationError(f"snapshot: could not copy the sandbox's files: {exc.strerror or exc}"
                                 + (f": {exc.filename}" if exc.filename else "")) from None
        raise


def capture_root(sb: Sandbox, making: _Making) -> dict[str, Any]:
    """The image root's layer of a sandbox of an image (its upper layer on disk) into the snapshot being made,
    as an overlay workspace's: the root layer it started from (a clone, hard links) with its upper layer laid
    over it; what the snapshot says of the image (its id, the config a to_image gives it, the mount points
    the sandbox made there, which to_image leaves out)."""
    from ..backends.native.datadir import fd_identity, open_base
    from ..image import Image
    from ..image.commit import mount_points, policy_config

    impl = sb._impl
    host = impl.image_upper
    pid = impl._init_pid()
    if pid is None:
        raise IsolationError("snapshot: the sandbox is no longer running")
    leave_out = mount_points(pid)
    shown = impl.report_enforced.get("image")
    image = Image.get(str(shown["id"]) if isinstance(shown, dict) and shown.get("id") else sb.policy.image)
    upper = os.open(host.upper, DIR_FLAGS)
    try:
        if fd_identity(upper) != host.identity:
            raise IsolationError(f"snapshot: {host.upper}: replaced since the sandbox was made: refused")
        os.mkdir("root", 0o755, dir_fd=making.fd)
        root = os.open("root", DIR_FLAGS, dir_fd=making.fd)
        try:
            base = open_base(impl.paths.key, ("image", "base")) if host.base else None
            try:
                layers.flatten_over(base, upper, root)
                if base is not None:
                    # The root layer the sandbox started from, for merge (hard links again), as the workspace's.
                    os.mkdir("rootbase", 0o755, dir_fd=making.fd)
                    kept = os.open("rootbase", DIR_FLAGS, dir_fd=making.fd)
                    try:
                        layers.clone(base, kept)
                    finally:
                        os.close(kept)
            finally:
                if base is not None:
                    os.close(base)
        finally:
            os.close(root)
    finally:
        os.close(upper)
    return {"id": image.id, "reference": image.reference, "config": policy_config(image, sb.policy),
            "leave_out": sorted(leave_out)}


def check_image(snapshot: Snapshot, policy: Any) -> None:
    """Refuse to start or restore a sandbox whose image is not the one the snapshot's root layer lies over."""
    if snapshot.image is None:
        return  # the workspace and tmpfs mounts only: any root takes them
    if policy.image is None:
        raise PolicyError(f"snapshot {snapshot.name!r} holds the root of a sandbox of image {snapshot.image_ref} "
                          "(the changes over it); a sandbox started from it runs that image (Policy(image=...))",
                          "image")
    from ..image import Image

    found = Image.get(policy.image)
    if found.id != snapshot.image:
        raise PolicyError(f"snapshot {snapshot.name!r} was taken of a sandbox of image {snapshot.image_ref} "
                          f"({snapshot.image[:19]}), and its root layer holds changes over that image only; this "
                          f"sandbox's image {policy.image} is {found.id[:19]}: refused", "image")


def check_start(snapshot: Any, workspace: Workspace | None) -> Workspace:
    """The workspace a sandbox started from snapshot has (the snapshot's; one given must agree)."""
    if not isinstance(snapshot, Snapshot):
        raise TypeError("snapshot must be an isolate.Snapshot")
    if workspace is not None and (workspace.source, workspace.mode, workspace.target) != (
            snapshot.workspace.source, snapshot.workspace.mode, snapshot.workspace.target):
        raise PolicyError(f"workspace: snapshot {snapshot.name!r} was taken of {snapshot.workspace}; a sandbox "
                          "started from it has that workspace (leave workspace= out)", "workspace")
    return snapshot.workspace
