"""``isolate.Sandbox``: a sandbox an agent keeps — a workspace, many commands, files, shells.

    with isolate.Sandbox(policy, workspace=isolate.Workspace("./repo")) as sb:
        sb.exec(["pytest", "-q"], timeout=60)
        sb.write_file("notes.txt", "done\\n")
        sb.commit()

Native by default: one set of namespaces whose exec server (csrc/execserver.c)
starts each command and performs each file operation from inside, as the
program. ``backend="docker"`` keeps a container whose main process is the
same exec server, with the same API. Both implement one interface
(``isolate.backends.kept.KeptBackend``) that this class uses.
``AsyncSandbox`` has the same methods as coroutines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import math
import os
import shlex
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends.kept import KeptBackend, attach_backend, make_backend
from ..backends.native import copies
from ..backends.native import files as native_files
from ..backends.native.commands import DEFAULT_OUTPUT_LIMIT, Command, ExecResult, SandboxProcess, run_collecting
from ..backends.native.files import DirEntry, GrepMatch
from ..backends.native.kept import NativeSandbox, environment_for
from ..backends.native.protocol import Stat
from ..backends.registry import _check_name
from ..kernel.overlay import overlay_commit, overlay_diff
from ..kernel.tree import Changes, diff, entries_of
from ..model.errors import IsolationError, PolicyError, UnsupportedError
from ..model.policy import Mount, Policy
from ..model.units import MIN_SECONDS
from ..model.workspace import Workspace
from .ahead import Ahead, in_background
from .hostfiles import commit_tree, save_download, upload_tree
from .interpreter import Interpreter
from .shell import Shell
from .snapshots import (
    ForkPoint,
    HandedOver,
    Reused,
    Snapshot,
    check_image,
    check_start,
    restore_areas,
    sweep_temporary_snapshots,
    take,
)

if TYPE_CHECKING:
    from ..image import Image

__all__ = ["AsyncSandbox", "Changes", "DirEntry", "ExecResult", "GrepMatch", "Sandbox", "SandboxProcess", "Shell",
           "Snapshot", "Stat", "Workspace"]

#: A named native sandbox ends after this long without a connection or a running command, unless told.
DEFAULT_NAMED_IDLE = 3600.0

T = TypeVar("T")


def _seconds(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise PolicyError(f"{name}: expected a positive number of seconds, got {value!r}", name)
    if value < MIN_SECONDS:
        raise PolicyError(f"{name}: {value!r} is too short (at least {MIN_SECONDS:g} seconds, the millisecond the "
                          "clocks count in)", name)
    return None if math.isinf(value) else float(value)


class Sandbox:
    """A kept sandbox (see the module's docstring).

    ``policy``: what every command may do (``write`` defaults to nothing
    beyond the workspace, ``/tmp`` and the home). ``workspace``: where commands
    start (an empty ``/workspace`` by default). ``mounts``: more host paths at
    paths inside. ``name``: keep it past this process (``Sandbox.attach``).
    ``ttl``: end it after that many seconds whatever happens; ``idle_timeout``:
    after that long with no command and no connection (a named native sandbox
    defaults to an hour; ``math.inf`` keeps it until removed).
    """

    def __init__(self, policy: Policy | None = None, *, workspace: Workspace | str | None = None,
                 mounts: Sequence[Mount] = (), name: str | None = None, backend: str | None = None,
                 ttl: float | None = None, idle_timeout: float | None = None,
                 snapshot: Snapshot | None = None, image_upper: str | None = None) -> None:
        policy = policy if policy is not None else Policy()
        if image_upper not in (None, "tmpfs", "disk"):
            raise PolicyError(f"image_upper: {image_upper!r} is not tmpfs or disk", "image_upper")
        #: Where a sandbox of an image keeps its writes to the image's root: "tmpfs" (private, bounded by the
        #: tmpfs size), or "disk" (its state directory, where commit_image reads them). Not given: the tmpfs
        #: from Linux 6.6 on, the disk before (where a tmpfs cannot take every change to the root); once
        #: started, what it is.
        self.image_upper = image_upper
        if not isinstance(policy, Policy):
            raise TypeError("policy must be an isolate.Policy")
        if isinstance(workspace, (str, os.PathLike)):
            workspace = Workspace(os.fspath(workspace))
        if snapshot is not None:
            workspace = check_start(snapshot, workspace)
            check_image(snapshot, policy)
            if snapshot.image is not None:
                self.image_upper = image_upper = "disk"  # its root layer lies under an upper layer on disk
        #: The snapshot this sandbox's files started from (None: its workspace's source).
        self.origin = snapshot
        self.workspace = workspace if workspace is not None else Workspace()
        self.mounts = tuple(Mount.parse(m, "ro") if isinstance(m, str) else m for m in mounts)
        self.name = _check_name(name) if name is not None else None
        self.backend = backend or (policy.backend if policy.backend != "auto" else "native")
        if self.backend not in ("native", "docker"):
            raise PolicyError(f"backend: {self.backend!r} is not native or docker", "backend")
        self.policy = policy
        ttl = _seconds(ttl, "ttl")
        idle = _seconds(idle_timeout, "idle_timeout")
        if idle_timeout is None and name is not None:
            idle = DEFAULT_NAMED_IDLE
        self._ttl, self._idle = ttl, idle
        self._impl: KeptBackend = make_backend(self.backend, policy, self.workspace, self.mounts, self.name, ttl,
                                               idle, snapshot, image_upper=image_upper)
        self._shells: dict[str, Shell] = {}
        self._interpreters: dict[str, Interpreter] = {}
        self._started = False
        #: Called once the sandbox has ended (a pool's release; see ``isolate.kept.pool``).
        self._on_close: Callable[[Sandbox], None] | None = None
        #: A copy fork's start, kept (for merge) while forks of it are open.
        self._fork_point: ForkPoint | None = None
        #: Files of the snapshot it started from (or was last restored to) that were not restored, each with
        #: why: they would have landed in a host directory it shows, or beneath a link (SnapshotSkipWarning).
        self.restore_skipped: tuple[str, ...] = ()
        #: The next restore, started ahead (``restore(ahead=True)``).
        self._ahead: Ahead | None = None
        #: Held by restore and close, and while the host reads the sandbox's files (``_steady``): one of them at
        #: a time (a close during a restore in another thread would end the old sandbox while the restore started
        #: the new one and its spare, never ended; a commit during a close wrote part of the files, then failed).
        self._lifecycle = threading.RLock()
        #: A close is waiting for the lock (see close).
        self._closing = False

    def __repr__(self) -> str:
        return f"Sandbox(name={self.name!r}, backend={self.backend!r}, workspace={self.workspace.target!r})"

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.name is None:
            self.close()
        else:
            self.detach()

    def start(self) -> Sandbox:
        if self._started:
            return self
        self._impl.start()
        self._started = True
        if self.image_upper is None:
            self.image_upper = "disk" if getattr(self._impl, "image_upper", None) is not None else "tmpfs"
        if self.origin is not None and self.origin.areas:
            try:
                self.restore_skipped = tuple(restore_areas(self, self.origin))
            except BaseException:
                self.close()
                raise
        return self

    @classmethod
    def attach(cls, name: str, ping: bool = True) -> Sandbox:
        """The running named sandbox (native, else Docker), made earlier (maybe by another process of this user).

        ``ping=False``: do not wait for its exec server's answer (needed to resume a paused one).
        """
        return cls._around(attach_backend(_check_name(name), ping), name)

    @classmethod
    def _around(cls, impl: KeptBackend, name: str | None) -> Sandbox:
        """A started Sandbox around a backend's sandbox that is already running (attach; a server's sweep of
        what an earlier server left), with every attribute ``__init__`` gives one."""
        box = cls.__new__(cls)
        box.workspace, box.mounts, box.name, box.backend = impl.workspace, tuple(impl.mounts), name, impl.backend
        box.policy, box._impl, box._shells, box._started = impl.policy, impl, {}, True
        box._interpreters, box.origin, box._ttl, box._idle, box._on_close = {}, None, None, None, None
        box._fork_point, box.restore_skipped, box._ahead, box._closing = None, (), None, False
        box.image_upper = "disk" if getattr(impl, "image_upper", None) is not None else "tmpfs"
        box._lifecycle = threading.RLock()
        return box

    def _close_sessions(self) -> None:
        """End this object's shells and interpreters (their processes and the host's pipes)."""
        for shell in list(self._shells.values()):
            shell.close()
        for interpreter in list(self._interpreters.values()):
            interpreter.close()

    def detach(self) -> None:
        """Let go of a named sandbox without ending it (it stays for attach, rm or prune)."""
        self._close_sessions()
        self._impl.detach()
        self._started = False


    def close(self) -> None:
        """End the sandbox and everything in it (and forget a named one)."""
        # Said before the lock is waited for: a thread restoring in a loop takes the lock again first (a lock is
        # not handed to its waiter), and would keep the close waiting; its next restore refuses instead.
        self._closing = True
        with self._lifecycle:
            try:
                self._close()
            finally:
                self._closing = False  # closed: a restore now finds it not running

    def _close(self) -> None:
        spare, self._ahead = self._ahead, None
        if spare is not None:
            spare.end()  # a spare still starting is waited for: nothing of the sandbox outlives its close
        try:
            self._close_sessions()
            self._impl.close()
        finally:
            self._started = False
            point, self._fork_point = self._fork_point, None
            if point is not None:
                point.release()
            hook, self._on_close = self._on_close, None
            if hook is not None:
                hook(self)

    @classmethod
    def create_many(cls, n: int, policy: Policy | None = None, **kwargs: Any) -> list[Sandbox]:
        """n started sandboxes of the same arguments, started side by side (all, or none and the error)."""
        return create_many(n, policy, **kwargs)

    def pause(self) -> str:
        """Stop every process of the sandbox; returns the mechanism ("cgroup-freezer" or "sigstop")."""
        return self._running("pause").pause()

    def resume(self) -> str:
        return self._running("resume").resume()

    def processes(self) -> list[Any]:
        """psutil.Process objects of the sandbox's processes (its init first)."""
        return self._running("processes").processes()

    @property
    def enforced(self) -> dict[str, Any]:
        return dict(self._running("enforced").report_enforced)

    def _running(self, what: str) -> KeptBackend:
        if not self._started:
            raise IsolationError(f"{what}: the sandbox is not running; start() it first")
        return self._impl

    @contextlib.contextmanager
    def _steady(self, what: str) -> Iterator[KeptBackend]:
        """The sandbox, running, and neither closed nor restored by another thread while the host reads its
        files (a diff, commit, snapshot, fork or image of it): that waits, and a close already waiting refuses
        this one, which would otherwise read files being removed (a commit wrote part of them, then failed)."""
        with self._lifecycle:
            if self._closing:
                raise IsolationError(f"{what}: the sandbox is being closed (by another thread): it is not running "
                                     "any more")
            yield self._running(what)

    # -- commands ------------------------------------------------------------------

    def _argv(self, cmd: str | Sequence[str], shell: bool) -> list[str]:
        if isinstance(cmd, str):
            return ["/bin/sh", "-c", cmd]  # a command line, as the agent frameworks pass them
        argv = [os.fsdecode(a) for a in cmd]
        if not argv:
            raise PolicyError("command: nothing to run; give a command", "command")
        return ["/bin/sh", "-c", shlex.join(argv)] if shell else argv

    def exec(self, cmd: str | Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
             input: str | bytes | None = None, timeout: float | None = None,
             output_limit: int = DEFAULT_OUTPUT_LIMIT, shell: bool = False, text: bool = True) -> ExecResult:
        """Run a command to its end; a timeout ends everything it started. A string is run by /bin/sh -c."""
        timeout = _seconds(timeout, "timeout")
        if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 1:
            raise PolicyError(f"output_limit: expected a positive number of bytes, got {output_limit!r}",
                              "output_limit")
        argv = self._argv(cmd, shell)
        impl = self._running("exec")
        data = input.encode() if isinstance(input, str) else (input or b"")
        in_r, in_w = os.pipe2(os.O_CLOEXEC) if input is not None else (os.open(os.devnull, os.O_RDONLY), -1)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            # Native: the request goes on the file connection with the command's own socketpair (see Command).
            # Docker: a connection of its own, whose listener is checked again to be the container's main
            # process (the program can plant a socket in its place there, not in a native sandbox's).
            native = impl.backend == "native"
            command = Command(None if native else impl.connect(), argv, cwd or "",
                              environment_for(impl.environment, env), timeout, (in_r, out_w, err_w), False,
                              impl.report_enforced, impl.backend, impl, wait_started=False,
                              via=impl.files() if native else None)
        except BaseException:
            for fd in (in_w, out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        try:
            stdout, stderr, truncated = run_collecting(command, in_w if in_w >= 0 else None, data, out_r, err_r,
                                                       output_limit)
        finally:
            command.close()
            os.close(out_r)
            os.close(err_r)
        assert command.returncode is not None
        out: Any = stdout.decode(errors="replace") if text else stdout
        err: Any = stderr.decode(errors="replace") if text else stderr
        return ExecResult(argv, command.returncode, out, err, truncated, command.report())

    def spawn(self, cmd: str | Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
              timeout: float | None = None, shell: bool = False, pty: bool = False,
              fd3: int | None = None, stdin: int | None = None, stderr_to_stdout: bool = False,
              detached: bool = False) -> SandboxProcess:
        """Start a command and return at once: stream its output, write to it, kill it, wait for it.

        ``fd3``: a descriptor of the caller's (a socket, a pipe) that the command gets as its descriptor 3:
        a channel beside its output that no other process of the sandbox holds. ``stdin``: a descriptor of
        the caller's (a file, a sealed memfd) that the command reads as its standard input, instead of a
        pipe that ``write`` feeds (not with ``pty``). ``stderr_to_stdout``: its stderr goes to its stdout's
        pipe, one stream in the order written (as ``subprocess``'s ``stderr=STDOUT``; a terminal always is).
        ``detached``: the command outlives this process (its end does not end the command, as it ends any other),
        and its monitor in the sandbox stays the subreaper of what the command leaves running (double forks and
        sessions of their own included) until all of that has ended: a sandbox with an idle end counts it as a
        running command meanwhile. The caller ends it from the host, as the monitor's descendants.
        """
        impl = self._running("spawn")
        for name, fd in (("fd3", fd3), ("stdin", stdin)):
            if fd is not None and (isinstance(fd, bool) or not isinstance(fd, int) or fd < 0):
                raise PolicyError(f"{name}: expected an open descriptor, got {fd!r}", name)
        if stdin is not None and pty:
            raise PolicyError("stdin: a command with a terminal reads the terminal", "stdin")
        for name, flag in (("pty", pty), ("stderr_to_stdout", stderr_to_stdout), ("detached", detached)):
            if not isinstance(flag, bool):
                raise PolicyError(f"{name}: expected True or False, got {flag!r}", name)
        if detached and pty:
            raise PolicyError("detached: a command with a terminal ends with its host (the terminal's master is "
                              "the host's)", "detached")
        return SandboxProcess(impl, self._argv(cmd, shell), cwd or "", environment_for(impl.environment, env),
                              _seconds(timeout, "timeout"), pty, -1 if fd3 is None else fd3,
                              -1 if stdin is None else stdin, bool(stderr_to_stdout), bool(detached))

    def shell(self, name: str = "default", pty: bool = True) -> Shell:
        """A persistent shell (``cd``, variables and functions persist between ``run`` calls)."""
        existing = self._shells.get(name)
        if existing is not None and existing.alive:
            return existing
        shell = Shell(self, name, pty)
        self._shells[name] = shell
        return shell

    def python(self, name: str = "default", executable: str = "python3") -> Interpreter:
        """A persistent Python interpreter (the sandbox's own ``python3``); see ``isolate.kept.interpreter``."""
        existing = self._interpreters.get(name)
        if existing is not None and not existing._closed:
            return existing
        interpreter = Interpreter(self, name, executable)
        self._interpreters[name] = interpreter
        return interpreter

    # -- files, as the program sees them -------------------------------------------

    def _conn(self) -> Any:
        return self._running("file methods").files()

    def read_file(self, path: str, *, text: bool = True, limit: int = native_files.DEFAULT_READ_LIMIT) -> Any:
        data = native_files.read_bytes(self._conn(), path, limit)
        return data.decode() if text else data

    def write_file(self, path: str, data: str | bytes, *, append: bool = False, make_parents: bool = True,
                   mode: int = 0o644) -> None:
        native_files.write_bytes(self._conn(), path, data.encode() if isinstance(data, str) else data, append,
                                 make_parents, mode)

    def open_file(self, path: str, mode: str = "rb", *, make_parents: bool = True, perms: int = 0o644) -> io.FileIO:
        """The file at path as an unbuffered binary file object, opened inside as the program (as read_file and
        write_file: its uid, its view, a regular file only): ``"rb"``, ``"wb"`` (made, emptied) or ``"ab"``.
        For files too large to hold in memory: read or write it a chunk at a time, then close it."""
        if mode == "rb":
            fd = native_files.open_reader(self._conn(), path)
        elif mode in ("wb", "ab"):
            fd = native_files.open_writer(self._conn(), path, mode == "ab", make_parents, perms)
        else:
            raise ValueError(f"open_file: mode {mode!r} is not 'rb', 'wb' or 'ab'")
        return io.FileIO(fd, mode, closefd=True)

    def replace_text(self, path: str, old: str, new: str, count: int | None = None) -> int:
        """Replace old by new; with count, exactly that many occurrences must exist. Returns how many."""
        if not old:
            raise ValueError("replace_text: old must not be empty")
        text = self.read_file(path)
        found = text.count(old)
        if found == 0:
            raise ValueError(f"replace_text: {old[:60]!r} does not occur in {path}")
        if count is not None and found != count:
            raise ValueError(f"replace_text: {old[:60]!r} occurs {found} times in {path}, not {count}")
        self.write_file(path, text.replace(old, new))
        return int(found)

    def list_dir(self, path: str = ".", depth: int = 1) -> list[DirEntry]:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise PolicyError(f"list_dir: depth must be a positive integer, got {depth!r}", "depth")
        return native_files.list_dir(self._conn(), path, depth)

    def stat(self, path: str, follow_symlinks: bool = True) -> Stat:
        return native_files.stat(self._conn(), path, follow_symlinks)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def mkdir(self, path: str, parents: bool = True, exist_ok: bool = True, mode: int = 0o755) -> None:
        if parents:
            native_files.makedirs(self._conn(), path, mode, exist_ok)
            return
        from .._core import lib

        try:
            self._conn().call(lib.ISO_XS_MKDIR, [path], mode=mode)
        except FileExistsError:
            if not exist_ok:
                raise

    def remove(self, path: str, recursive: bool = False) -> None:
        native_files.remove(self._conn(), path, recursive)

    def move(self, source: str, destination: str, overwrite: bool = True) -> None:
        native_files.move(self._conn(), source, destination, overwrite)

    def glob(self, pattern: str, root: str = ".") -> list[str]:
        return native_files.glob(self._conn(), pattern, root)

    def grep(self, regex: str, glob: str | None = None, *, root: str = ".", max_matches: int = 1000) -> list[GrepMatch]:
        return native_files.grep(self._conn(), regex, glob, root, max_matches)

    def upload(self, host_src: str | os.PathLike[str], dst: str) -> None:
        """Copy a host file (or directory tree) into the sandbox, written as the program.

        Below ``host_src`` every name is opened relative to its directory's
        descriptor without following links: a link is skipped, and a name a
        program swaps for a link meanwhile is skipped too, never followed.
        """
        upload_tree(self, host_src, dst)

    def download(self, src: str, host_dst: str | os.PathLike[str]) -> None:
        """Copy a file of the sandbox to the host, never through a link or onto a FIFO at host_dst."""
        save_download(native_files.read_bytes(self._conn(), src), host_dst)

    # -- the workspace against its source --------------------------------------------

    def diff(self) -> Changes:
        """What the workspace changed against its source (empty for a bind workspace or none)."""
        with self._steady("diff") as impl:
            return self._diff(impl)

    def _diff(self, impl: KeptBackend) -> Changes:
        if self.workspace.mode == "bind":
            return Changes()
        ws_fd = impl.open_workspace()
        try:
            copy = getattr(impl, "copy", None)
            if self.workspace.mode == "overlay" or copy is not None:
                # ws_fd: the upper layer, over the snapshot's layer it started from, over the source (overlay) or
                # the private copy (copy), compared with the source.
                base_fd = _open_base_of(impl)
                copy_fd = copies.open_tree(copy) if copy is not None else -1
                try:
                    return overlay_diff(self.workspace, ws_fd, copy_fd=copy_fd, base_fd=base_fd)
                finally:
                    for fd in (base_fd, copy_fd):
                        if fd >= 0:
                            os.close(fd)
            if self.workspace.source is None:
                return diff(ws_fd, None, self.workspace)
            src_fd, _ = entries_of(self.workspace.source, self.workspace)
            try:
                return diff(ws_fd, src_fd, self.workspace)
            finally:
                os.close(src_fd)
        finally:
            os.close(ws_fd)

    def commit(self, target_dir: str | os.PathLike[str] | None = None) -> Changes:
        """Make target_dir (default: the source) match the workspace; returns what was written.

        Links that lead out of the tree, devices, FIFOs and sockets are not
        written (``Changes.refused`` says why); no set-id bit reaches the host.
        """
        with self._steady("commit") as impl:
            return self._commit(impl, target_dir)

    def _commit(self, impl: KeptBackend, target_dir: str | os.PathLike[str] | None) -> Changes:
        if target_dir is not None and not os.fspath(target_dir):
            # realpath("") is the working directory: made equal to the workspace, its other files deleted.
            raise IsolationError("commit: an empty target directory; give one (or None: the workspace's source)")
        if self.workspace.mode == "bind" and target_dir is None:
            return Changes()  # the source is the workspace
        copy = getattr(impl, "copy", None)
        if self.workspace.mode == "overlay" or copy is not None:
            ws_fd = impl.open_workspace()
            base_fd = copy_fd = -1
            try:
                base_fd = _open_base_of(impl)
                copy_fd = copies.open_tree(copy) if copy is not None else -1
                # Never into the sandbox's own files, nor into its private copy (the lower layer of others).
                forbidden = [impl.data_dir] + ([copies.tree_path(copy)] if copy is not None else [])
                return overlay_commit(self.workspace, ws_fd, target_dir, forbidden, copy_fd=copy_fd, base_fd=base_fd)
            finally:
                for fd in (ws_fd, base_fd, copy_fd):
                    if fd >= 0:
                        os.close(fd)
        target = target_dir if target_dir is not None else self.workspace.source
        if target is None:
            raise IsolationError("commit: this workspace has no source; give a target directory")
        ws_fd = impl.open_workspace()
        try:
            return commit_tree(ws_fd, target, self.workspace, impl.workspace_host)
        finally:
            os.close(ws_fd)

    def commit_image(self, reference: str) -> Image:
        """An image of this sandbox's root: its image's layers, and one more holding what the program wrote,
        deleted or replaced there (whiteouts for what it deleted), kept as ``reference`` in the image store.
        Its config is the image's, with this policy's ``env``, ``cwd`` and ``uid`` over it. A native sandbox
        started from an image (``Policy(image=...)``) with ``image_upper="disk"``; it is paused while its layer
        is read. The workspace, the
        home and ``/tmp`` are the sandbox's own mounts, not its image's: they are not in the layer."""
        from .commit import commit_image

        with self._steady("commit_image"):
            return commit_image(self, reference)

    # -- snapshots and forks (isolate/kept/snapshots.py) -------------------------------------

    def snapshot(self, name: str | None = None) -> Snapshot:
        """A frozen capture of the sandbox's files: the workspace and its private tmpfs mounts (/tmp, the
        home). It costs what changed since the source (overlay) or since the copy (copy); a copy workspace's
        is a whole copy only where the copy cannot be an overlay's lower layer (``enforced["workspace"]``)."""
        return take(self, name, self.origin)  # under _steady

    def restore(self, snapshot: Snapshot, *, ahead: bool = False) -> None:
        """Bring the sandbox's files back to snapshot (taken of this sandbox, or of one with its workspace).

        Its processes end (commands, shells, interpreters): the sandbox starts again from the snapshot's
        files, with the same policy, mounts and name. ``ahead``: also start the next restore to this snapshot
        now, in the background (an unnamed native sandbox: ``isolate.kept.ahead``), so that the next
        ``restore(snapshot)`` swaps that one in instead of starting one (a loop that resets a sandbox after each
        episode); a spare sandbox waits meanwhile, until that restore, a restore to another snapshot or close.
        Refused with a ttl (a spare's would run from its own start). A close in another thread waits for it.
        """
        with self._lifecycle:
            self._restore(snapshot, ahead)

    def _restore(self, snapshot: Snapshot, ahead: bool) -> None:
        self._running("restore")
        if self._closing:
            raise IsolationError("restore: the sandbox is being closed (by another thread): it is not running any "
                                 "more")
        if not isinstance(ahead, bool):
            raise PolicyError(f"ahead: expected True or False, got {ahead!r}", "ahead")
        if ahead and (self.name is not None or self.backend != "native"):
            raise UnsupportedError("restore(ahead=True): the spare it starts is an unnamed native sandbox (a name "
                                   "is one sandbox's); restore without ahead")
        if ahead and self._ttl is not None:
            # The ttl is counted by the init and the exec server from their start: a spare's would run while it
            # waits, and the sandbox swapped in would end that much sooner than a restored one.
            raise UnsupportedError("restore(ahead=True): the sandbox has a ttl, and a spare's ttl would count from "
                                   "the spare's start, not the restore's; restore without ahead, or use "
                                   "idle_timeout")
        workspace = check_start(snapshot, self.workspace)
        check_image(snapshot, self.policy)
        upper = "disk" if snapshot.image is not None else self.image_upper
        spare = self._ahead
        if spare is not None and spare.of(snapshot):
            os.close(snapshot._open())  # a snapshot removed meanwhile is refused, as a restore's start refuses it
        self._ahead = None
        prepared = None
        try:
            prepared = spare.take(snapshot) if spare is not None else None
            if prepared is not None:
                self._swap_in(prepared, snapshot, upper)
        except BaseException:
            if spare is not None and self._impl is not prepared:
                spare.discard()  # taken, and not this sandbox's: ended (a KeyboardInterrupt while it started)
            raise
        if prepared is None:
            self._restart_from(snapshot, workspace, upper)
        if ahead:
            self._ahead = Ahead(snapshot, make_backend(self.backend, self.policy, workspace, self.mounts, None,
                                                       self._ttl, self._idle, snapshot, image_upper=upper))

    def _swap_in(self, prepared: KeptBackend, snapshot: Snapshot, upper: str | None) -> None:
        """Restore by a spare started from the snapshot ahead: the old sandbox ends as a restore ends it."""
        self._close_sessions()
        old = self._impl
        if isinstance(old, NativeSandbox):
            old.end("restored from a snapshot", wait=False)
        in_background(old.close)  # reaped and its files removed off this path
        self._impl, self.origin, self.image_upper = prepared, snapshot, upper
        self.restore_skipped = ()
        if snapshot.areas:
            try:
                self.restore_skipped = tuple(restore_areas(self, snapshot))
            except BaseException:
                self.close()
                raise

    def _restart_from(self, snapshot: Snapshot, workspace: Workspace, upper: str | None) -> None:
        """Restore by starting the sandbox again over the snapshot's files."""
        # The Docker backend refuses here, before anything ends.
        fresh = make_backend(self.backend, self.policy, workspace, self.mounts, self.name, self._ttl, self._idle,
                             snapshot, image_upper=upper)
        self._close_sessions()
        old = self._impl
        started = threading.Event()
        if self.name is None and isinstance(old, NativeSandbox):
            reuse = (snapshot.kind == "layer" and (old.copy_base or workspace.mode == "overlay")) \
                or snapshot.image is not None
            if (reuse and self.origin is not None and self.origin.id == snapshot.id
                    and isinstance(fresh, NativeSandbox)):
                fresh.start_from = Reused(snapshot, old.paths.key)  # the old one's base layer is this one's
            # An unnamed sandbox's paths are its own: the old one is killed now, and reaped and its files
            # removed once the new one has started (its base layers may be moved out of them meanwhile:
            # removed sooner, a layer half emptied would be moved).
            old.end("restored from a snapshot", wait=False)
            threading.Thread(target=_close_after, args=(old, started), name="isolate-restore-cleanup",
                             daemon=True).start()
        else:
            old.close()  # a named one's socket and description are the new one's too
        self._started = False
        self._impl, self.origin, self.image_upper = fresh, snapshot, upper
        try:
            self.start()
        finally:
            started.set()

    def fork(self, n: int = 1, *, processes: bool = False) -> list[Sandbox]:
        """n new sandboxes (started, unnamed) whose files are this one's as they are now, each on its own.

        Files only: no process is carried (``processes=True`` is refused: isolate does not checkpoint
        processes). Forks cost what changed since the source (overlay) or the copy (copy), not its size.
        """
        if processes:
            import shutil

            why = ("CRIU is not installed" if shutil.which("criu") is None else
                   "isolate does not drive CRIU's checkpoint and restore")
            raise UnsupportedError(f"fork(processes=True): carrying processes needs checkpoint/restore, and {why}; "
                                   "fork() carries the files, and the forks start with no process")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PolicyError(f"fork: n must be a positive integer, got {n!r}", "n")
        self._running("fork")  # and take() holds it steady
        sweep_temporary_snapshots()  # those of processes killed while forking or merging
        snap = take(self, None, self.origin, temporary=True)
        layered = snap.kind == "layer"
        # The forks' common start, for merge: an overlay fork keeps it as its base layer, so the snapshot
        # goes now (the last fork even takes its files); a copy keeps no trace of it, so it stays until the
        # last fork is closed.
        point = None if layered else ForkPoint(snap, n)
        boxes: list[Sandbox] = []
        try:
            for i in range(n):
                box = Sandbox(self.policy, mounts=self.mounts, backend=self.backend, ttl=self._ttl,
                              idle_timeout=self._idle, snapshot=snap)
                if layered and i == n - 1 and isinstance(box._impl, NativeSandbox):
                    box._impl.start_from = HandedOver(snap)  # the last fork takes the snapshot's files as they are
                box._fork_point = point
                box.start()
                boxes.append(box)
        except BaseException:
            for box in boxes:
                box.close()
            if point is None:
                snap.remove()
            else:
                point.release_all()
            raise
        if point is None:
            snap.remove()
        return boxes


def _open_base_of(impl: KeptBackend) -> int:
    """A descriptor of the snapshot's layer a layered workspace started from (its base), or -1: none."""
    if not isinstance(impl, NativeSandbox):
        return -1
    from ..backends.native.datadir import open_base

    try:
        return open_base(impl.paths.key)
    except FileNotFoundError:
        return -1


def _close_after(old: KeptBackend, started: threading.Event) -> None:
    started.wait(120)
    old.close()


def whole_number(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PolicyError(f"{name}: expected an integer of at least {minimum}, got {value!r}", name)
    return value


def _starters(n: int) -> int:
    """Threads that start n sandboxes: enough to keep every core busy while most of them wait."""
    return max(1, min(n, 8 * (os.cpu_count() or 1), 64))


def create_many(n: int, policy: Policy | None = None, **sandbox_kwargs: Any) -> list[Sandbox]:
    """n started sandboxes of the same arguments, started side by side; all or none.

    If one cannot start, those that did are ended and its error is raised.
    """
    n = whole_number(n, "n", 0)
    if sandbox_kwargs.get("name") is not None and n > 1:
        raise PolicyError("name: n sandboxes cannot share one name; create named sandboxes one by one", "name")
    boxes = [Sandbox(policy, **sandbox_kwargs) for _ in range(n)]  # bad arguments fail here, before any start
    if n == 0:
        return []
    with ThreadPoolExecutor(_starters(n), thread_name_prefix="isolate-start") as starter:
        outcomes = list(starter.map(_start_quietly, boxes))
    failures = [exc for exc in outcomes if exc is not None]
    if failures:
        for box, exc in zip(boxes, outcomes, strict=True):
            if exc is None:
                box.close()
        raise failures[0]
    return boxes


def _start_quietly(box: Sandbox) -> BaseException | None:
    try:
        box.start()
    except BaseException as exc:  # handed back to the caller's thread
        return exc
    return None


class AsyncSandbox:
    """``Sandbox`` with its methods as coroutines (each runs in a worker thread)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sync = Sandbox(*args, **kwargs)

    @classmethod
    async def attach(cls, name: str) -> AsyncSandbox:
        box = cls.__new__(cls)
        box.sync = await asyncio.to_thread(Sandbox.attach, name)
        return box

    async def __aenter__(self) -> AsyncSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.sync.__exit__, *exc_info)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.sync, name)
        if not callable(method):
            return method  # type: ignore[no-any-return]

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(method, *args, **kwargs)

        return call
