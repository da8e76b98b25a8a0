"""Named native sandboxes on this host: which there are, in what state, and removing them.

Used by ``isolate-run sandbox list|rm|prune``, the agent manager and the
inspect_ai provider. A sandbox is known by its files in the runtime
directory (its socket and description), never by what the state directory
says.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat

from ...kernel.places import open_state_dir, runtime_dir
from ...kernel.tree import remove_dir_at as _remove_at
from ...model.errors import IsolationError
from ...model.policy import Policy
from ...model.workspace import Workspace
from ..registry import Registry
from .kept import NativeSandbox, Paths, _remove_files


def native_names(unnamed: bool = False) -> list[str]:
    """Named native sandboxes this user has (running or ended but not removed); with unnamed, the others too."""
    try:
        entries = os.listdir(runtime_dir())
    except (OSError, IsolationError):
        return []
    # A description (.json) names a sandbox that started; a socket alone, one that is starting or whose
    # maker died before describing it (prune tells them apart by whether the socket is held).
    names = {e.rsplit(".", 1)[0] for e in entries if e.endswith((".json", ".sock"))}
    return sorted(n for n in names if unnamed or not n.startswith("anon-"))


def _native_state(name: str) -> tuple[str, float]:

    paths = Paths.of(name)
    created = 0.0
    try:
        fd = os.open(paths.meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd) as handle:
            created = float(json.load(handle).get("created") or 0)
    except (OSError, ValueError, TypeError):
        pass
    try:
        box = NativeSandbox.attach(name, ping=False)
    except IsolationError:
        # No description yet: it may be starting (its maker writes the description once the server
        # answers, after copying the workspace). The socket is bound and listening from the start, so a
        # connection that is accepted into its backlog means someone holds it: not ended.
        return ("starting" if _listening(paths.socket) else "ended"), created
    return box.state(), created


def _listening(path: str) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(1.0)
        sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        sock.close()


def remove_native(name: str) -> bool:
    """End and remove the named native sandbox; False when there was none."""

    paths = Paths.of(name)
    if not os.path.exists(paths.meta) and not os.path.exists(paths.socket):
        return False
    try:
        box = NativeSandbox.attach(name, ping=False)  # a paused one does not answer, and need not
    except IsolationError:
        # Ended already: only its files are left.
        box = NativeSandbox(Policy(), Workspace(), (), name, None, None)
    box.close()
    Registry().forget("native", name)
    return True


def prune_native() -> list[tuple[str, str]]:
    """Remove the named native sandboxes that have ended (ttl, idle timeout, killed, reboot)."""
    done = []
    for name in native_names(unnamed=True):  # an unnamed one whose creator died leaves its files
        if _native_state(name)[0] == "ended":
            remove_native(name)
            done.append((name, "ended"))
    done += [(name, "creator gone") for name in sweep_unnamed()]
    for rec in Registry().all("native"):
        if rec.name not in native_names() and not os.path.exists(os.path.join(runtime_dir(), f"{rec.name}.sock")):
            Registry().forget("native", rec.name)
            done.append((rec.name, "gone"))
    return done


#: An unnamed sandbox's name, as NativeSandbox makes it: its creator's pid, then 12 hex digits.
_UNNAMED = re.compile(r"anon-([1-9][0-9]{0,9})-[0-9a-f]{12}")
#: The kernel's largest pid (PID_MAX_LIMIT): a name past it names no process, and os.kill could not take it.
_PID_LIMIT = 1 << 22


def _creator_gone(name: str) -> bool:
    """Whether the process that made the unnamed sandbox ``name`` (anon-PID-HEX) no longer runs; False for
    a name not made so (the state directory may be writable by a sandbox granted the home: a name with a
    pid past a C long ended every prune and every Ray host's start with an OverflowError)."""
    match = _UNNAMED.fullmatch(name)
    if match is None or int(match.group(1)) > _PID_LIMIT:
        return False
    pid = int(match.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # someone's: running
    return False


def sweep_unnamed() -> list[str]:
    """Remove what unnamed sandboxes left when their creator was killed (no close() ran): the socket, the
    description and the data directory. Only where the creator's pid no longer runs and no one holds the
    socket (a creator in another PID namespace may look gone by its pid; its sandbox still listens).
    The data directory is removed through the state directory's descriptor, as the one found there, never
    through a link."""
    try:
        data_fd = open_state_dir("sandboxes")
    except (OSError, IsolationError):
        return []
    swept = []
    try:
        names = {n for n in os.listdir(data_fd) if n.startswith("anon-")}
        names |= {n for n in native_names(unnamed=True) if n.startswith("anon-")}
        for name in sorted(names):
            paths = Paths.of(name)
            if not _creator_gone(name) or _listening(paths.socket):
                continue
            _remove_files(paths, None)
            try:
                info = os.stat(name, dir_fd=data_fd, follow_symlinks=False)
            except FileNotFoundError:
                info = None
            if info is not None and stat.S_ISDIR(info.st_mode):
                _remove_at(data_fd, name, (info.st_dev, info.st_ino))
            swept.append(name)
        # A description being written when the creator was killed: its temporary file (NAME.json.TOKEN).
        with_temps = [e for e in os.listdir(runtime_dir()) if e.startswith("anon-") and ".json." in e]
        for entry in with_temps:
            name = entry.split(".json.", 1)[0]
            if _creator_gone(name) and not _listening(Paths.of(name).socket):
                try:
                    os.unlink(os.path.join(runtime_dir(), entry))  # the entry itself, never what it names
                except OSError:
                    pass
    finally:
        os.close(data_fd)
    if swept:
        from .copies import sweep

        sweep()  # the private copies only those sandboxes used
    return swept
