"""Named native sandboxes on this host: which there are, in what state, and removing them.

Used by ``isolate-run sandbox list|rm|prune``, the agent manager and the
inspect_ai provider. A sandbox is known by its files in the runtime
directory (its socket and description), never by what the state directory
says.
"""

from __future__ import annotations

import json
import os
import socket

from ...kernel.places import runtime_dir
from ...model.errors import IsolationError
from ...model.policy import Policy
from ...model.workspace import Workspace
from ..registry import Registry
from .kept import NativeSandbox, Paths


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
    for rec in Registry().all("native"):
        if rec.name not in native_names() and not os.path.exists(os.path.join(runtime_dir(), f"{rec.name}.sock")):
            Registry().forget("native", rec.name)
            done.append((rec.name, "gone"))
    return done
