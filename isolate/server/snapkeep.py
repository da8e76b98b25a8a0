"""The server's snapshots past a reboot: a copy of their descriptions in the server's state directory.

A snapshot's files lie in isolate's state directory (on disk); its
descriptions (the server's: source sandbox, name, image; isolate's own:
kind, identity, workspace) lie in the private runtime directory, which a
reboot empties. With a state directory (``serve --state-dir``), the server
keeps a copy of both in ``<state dir>/snapshots/ID.json``, written whole
(temporary file, rename) through the directory's descriptor, never through
a link, and removed with the snapshot. At start, a copy whose description
the runtime directory lacks (a reboot emptied it) puts both back, and the
snapshot is used again only if its files are still the directory isolate
made (their identity, checked by ``isolate.Snapshot``): else the copy goes
and the start says so. A state directory in the runtime directory (the
default) is emptied with it: nothing then outlives a reboot.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import stat
import threading
from typing import Any

from ..kept.snapshots import Snapshot, _meta_dir
from ..model.errors import IsolationError

_ID = re.compile(r"osb-snap-[0-9a-f]{16}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The largest copy read back (two small descriptions).
MAX_COPY = 1 << 20
#: The entry of the server's state directory that holds the copies (the record loader skips it).
SNAPSHOTS = "snapshots"


def _read(path: str, dir_fd: int | None = None) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError("not a regular file")
        data = handle.read(MAX_COPY + 1)
    if len(data) > MAX_COPY:
        raise OSError("too large")
    return data


def _write_whole(dir_fd: int | None, directory: str, name: str, data: bytes) -> None:
    """``data`` as ``name`` in the directory (its descriptor, else its path): a temporary file, renamed."""
    temp = f".{name}.{secrets.token_hex(4)}.tmp"
    where = (lambda entry: entry) if dir_fd is not None else (lambda entry: os.path.join(directory, entry))
    fd = os.open(where(temp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.rename(where(temp), where(name), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(where(temp), dir_fd=dir_fd)
        raise


def _server_record(data: object, snapshot_id: str) -> dict[str, Any]:
    """The server's description of a snapshot, each field checked (ValueError otherwise)."""
    if not isinstance(data, dict) or set(data) != {"id", "sandboxId", "name", "image", "created"}:
        raise ValueError("not the server's description")
    created = data["created"]
    if data["id"] != snapshot_id or not isinstance(data["sandboxId"], str) or len(data["sandboxId"]) > 64 \
            or not (data["name"] is None or (isinstance(data["name"], str) and len(data["name"]) <= 256)) \
            or not isinstance(data["image"], str) or len(data["image"]) > 4096 \
            or not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created):
        raise ValueError("a field is not the server's")
    return dict(data)


class SnapshotCopies:
    """The copies in one server's state directory (its descriptor: ``Keeper.fd``).

    Snapshots are taken and removed in the server's worker threads at once; the last copy's removal takes the
    directory (and closes its descriptor) with it. One lock makes each method whole: a copy is never written
    through a descriptor another thread closed (a number the kernel may already have given to another file),
    nor into a directory another thread removed."""

    def __init__(self, state_fd: int) -> None:
        self._state_fd = state_fd
        self._lock = threading.Lock()
        self.fd = -1  # snapshots/, made at the first copy

    def _open(self, create: bool) -> bool:
        if self.fd >= 0:
            return True
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(SNAPSHOTS, 0o700, dir_fd=self._state_fd)
        try:
            fd = os.open(SNAPSHOTS, _DIR_FLAGS, dir_fd=self._state_fd)
        except FileNotFoundError:
            return False
        if os.fstat(fd).st_uid != os.geteuid():
            os.close(fd)
            raise IsolationError(f"the server's state directory's {SNAPSHOTS}/ is not its user's; remove it")
        self.fd = fd
        return True

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def keep(self, record: dict[str, Any]) -> None:
        """Copy the descriptions of the snapshot just taken (the server's ``record``, and isolate's)."""
        with self._lock:
            self._keep(record)

    def _keep(self, record: dict[str, Any]) -> None:
        self._open(create=True)
        snapshot_id = str(record["id"])
        theirs = json.loads(_read(os.path.join(_meta_dir(), f"{snapshot_id}.json")))
        _write_whole(self.fd, "", f"{snapshot_id}.json", json.dumps({"server": record, "isolate": theirs}).encode())

    def forget(self, snapshot_id: str) -> None:
        with self._lock:
            self._forget(snapshot_id)

    def _forget(self, snapshot_id: str) -> None:
        if not self._open(create=False):
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{snapshot_id}.json", dir_fd=self.fd)
        with contextlib.suppress(OSError):  # the last one: the directory goes too (made again when needed)
            if not os.listdir(self.fd):
                os.rmdir(SNAPSHOTS, dir_fd=self._state_fd)
                self._close()

    def recover(self, server_dir: str) -> list[str]:
        """Put back the descriptions a reboot took (those missing from the runtime directory); a line for each
        snapshot recovered or let go."""
        with self._lock:
            return self._recover(server_dir)

    def _recover(self, server_dir: str) -> list[str]:
        lines: list[str] = []
        if not self._open(create=False):
            return lines
        for entry in sorted(os.listdir(self.fd)):
            if entry.startswith(".") and entry.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=self.fd)  # a copy the last server did not finish
                continue
            snapshot_id = entry[:-5] if entry.endswith(".json") else ""
            if not _ID.fullmatch(snapshot_id) or os.path.lexists(os.path.join(server_dir, entry)):
                continue  # not a copy of ours, or its description is there (no reboot since)
            try:
                data = json.loads(_read(entry, self.fd))
                if not isinstance(data, dict) or set(data) != {"server", "isolate"} \
                        or not isinstance(data["isolate"], dict):
                    raise ValueError("not a copy the server wrote")
                record = _server_record(data["server"], snapshot_id)
                self._put_back(snapshot_id, data["isolate"])
            except (OSError, ValueError, RecursionError, IsolationError) as exc:
                self._forget(snapshot_id)
                lines.append(f"snapshot {snapshot_id}: its description could not be put back after a reboot "
                             f"({exc}); let go")
                continue
            _write_whole(None, server_dir, entry, json.dumps(record).encode())
            lines.append(f"snapshot {snapshot_id}: its description put back (a reboot had emptied the runtime "
                         "directory); served again")
        return lines

    @staticmethod
    def _put_back(snapshot_id: str, theirs: dict[str, Any]) -> None:
        """isolate's description, back in its runtime directory, then checked by isolate against the files."""
        directory = _meta_dir()
        path = os.path.join(directory, f"{snapshot_id}.json")
        if not os.path.lexists(path):
            _write_whole(None, directory, f"{snapshot_id}.json", json.dumps(theirs).encode())
        try:
            os.close(Snapshot.get(snapshot_id)._open())  # its files: still the directory isolate made
        except IsolationError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
