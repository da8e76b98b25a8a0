"""The registry of kept sandboxes (both backends).

The SQLite registry lists kept sandboxes of both backends for ``list``,
``rm`` and ``prune``: (engine, name) -> ids, hashes, created, last used.
It lives in the runtime directory (isolate/kernel/places.py), one file per
state directory: SQLite follows links at its file and its journal's, and a
sandbox granted the home could plant one in the state directory (the
registry's rows and journal would then be written into any file the caller
may write). After a reboot the registry starts empty: kept Docker containers
are then listed from their labels (``registered`` False).
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass

from ..kernel.places import runtime_dir, state_key
from ..model.errors import IsolationError, PolicyError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class SandboxRecord:
    """One kept sandbox as the registry knows it."""

    engine: str
    name: str
    container_id: str
    config_hash: str
    spec_hash: str
    image: str
    created: float
    last_used: float


class Registry:
    """The SQLite file of kept sandboxes, keyed by (engine address, name)."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            # Out of every grant's reach (see the module's docstring), named after the state directory
            # whose sandboxes it lists.
            path = os.path.join(runtime_dir(), f"registry-{state_key()}.sqlite3")
        self.path = path

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            # A writer waits up to a minute for another's lock: on a loaded host (a soak's creates beside two test
            # suites and a VM) ten seconds ran out, and a create failed with "database is locked".
            conn = sqlite3.connect(self.path, timeout=60.0)
        except (OSError, sqlite3.Error) as exc:
            raise IsolationError(
                f"sandbox registry {self.path}: cannot open it ({exc}); set ISOLATE_STATE_DIR to a writable directory"
            ) from None
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":  # a change of mode locks the file
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS sandboxes ("
                " engine TEXT NOT NULL, name TEXT NOT NULL, container_id TEXT NOT NULL,"
                " config_hash TEXT NOT NULL, spec_hash TEXT NOT NULL, image TEXT NOT NULL,"
                " created REAL NOT NULL, last_used REAL NOT NULL, PRIMARY KEY (engine, name))"
            )
            with conn:
                yield conn
        except sqlite3.Error as exc:
            raise IsolationError(
                f"sandbox registry {self.path}: {exc}; remove the file to start afresh (kept containers stay)"
            ) from None
        finally:
            conn.close()

    def record(self, rec: SandboxRecord) -> None:
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rec.engine, rec.name, rec.container_id, rec.config_hash, rec.spec_hash, rec.image,
                    rec.created, rec.last_used,
                ),
            )  # fmt: skip

    def touch(self, engine: str, name: str, when: float) -> None:
        with self._db() as db:
            db.execute("UPDATE sandboxes SET last_used = ? WHERE engine = ? AND name = ?", (when, engine, name))

    def get(self, engine: str, name: str) -> SandboxRecord | None:
        with self._db() as db:
            row = db.execute("SELECT * FROM sandboxes WHERE engine = ? AND name = ?", (engine, name)).fetchone()
        return SandboxRecord(*row) if row and _valid_row(row) else None

    def all(self, engine: str | None = None) -> list[SandboxRecord]:
        with self._db() as db:
            if engine is None:
                rows = db.execute("SELECT * FROM sandboxes ORDER BY engine, name").fetchall()
            else:
                rows = db.execute("SELECT * FROM sandboxes WHERE engine = ? ORDER BY name", (engine,)).fetchall()
        return [SandboxRecord(*row) for row in rows if _valid_row(row)]

    def forget(self, engine: str, name: str) -> bool:
        with self._db() as db:
            cursor = db.execute("DELETE FROM sandboxes WHERE engine = ? AND name = ?", (engine, name))
        return cursor.rowcount > 0


def _valid_row(row: tuple[object, ...]) -> bool:
    """A record's name becomes paths (sockets, descriptions, data to remove): one that is not a valid
    name was not written by isolate (the file lies in the state directory, which a sandbox granted it
    can write) and is skipped, never used."""
    return len(row) == 8 and isinstance(row[1], str) and bool(_NAME.fullmatch(row[1]))


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PolicyError(
            f"sandbox name {name!r}: use 1 to 63 letters, digits, '_', '.' or '-', starting with a letter or digit",
            "name",
        )
    return name
