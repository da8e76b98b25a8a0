"""``Sandbox.restore(snapshot, ahead=True)``: the next restore to that snapshot, started now in the background.

A restore ends the sandbox's processes and starts it again over the snapshot's files: a new init, exec
server, namespaces and workspace layer, a few milliseconds of CPU each time. A loop that resets a sandbox to
one snapshot after every episode (reinforcement learning's) pays that on its critical path, while its
sandbox mostly waits for the episode's commands. With ``ahead``, the restore also starts a second sandbox of
the same policy from the snapshot, in the background; the next restore to that snapshot swaps it in (the
old one ended as a restore ends it) instead of starting one. The spare is a sandbox like any, started from
the snapshot's files as a restore would start it (a snapshot's layers never change); it holds its own
processes and a few hundred KiB meanwhile, and it goes at a restore to another snapshot or the sandbox's
close.
"""

from __future__ import annotations

import threading
from typing import Any

from ..backends.kept import KeptBackend


class Ahead:
    """A sandbox being started (or started) from a snapshot, for the next restore to it."""

    def __init__(self, snapshot: Any, impl: KeptBackend) -> None:
        self.snapshot_id, self.identity = snapshot.id, snapshot.identity
        self.impl = impl
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._start, name="isolate-restore-ahead", daemon=True).start()

    def _start(self) -> None:
        try:
            self.impl.start()
        except BaseException as exc:  # the restore that would take it starts one the usual way
            self.error = exc
        finally:
            self._done.set()

    def take(self, snapshot: Any) -> KeptBackend | None:
        """The started sandbox when it is of ``snapshot`` and still runs (waited for if still starting); None
        otherwise (it is then ended)."""
        if (snapshot.id, snapshot.identity) != (self.snapshot_id, self.identity):
            self.discard()
            return None
        self._done.wait()
        if self.error is None:
            try:
                if self.impl.state() == "running":  # an idle end or a process of its may have ended it
                    return self.impl
            except Exception:
                pass
        self.discard()
        return None

    def discard(self) -> None:
        """End it (once it has started: off the caller's path)."""
        threading.Thread(target=self._close, name="isolate-restore-ahead-close", daemon=True).start()

    def _close(self) -> None:
        self._done.wait()
        try:
            self.impl.close()
        except Exception:
            pass
