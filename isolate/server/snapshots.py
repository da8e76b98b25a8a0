"""Snapshots (``/v1/sandboxes/{id}/snapshots``, ``/v1/snapshots``): a sandbox's files, kept past it.

Each is an ``isolate.Snapshot`` of the sandbox (isolate/kept/snapshots.py):
its workspace and its private tmpfs mounts (``/tmp``, the home), copied
through descriptors into the state directory. The server's sandboxes have an
overlay workspace over an empty directory (isolate.server.state), so a
snapshot is a layer: what the sandbox changed, the rest hard links of the
layer it started from. A sandbox created from one (``snapshotId``) starts
on that layer, under the policy profile of the image the snapshotted
sandbox had.

What the API says about a snapshot (its source sandbox, name, image) is a
small description beside isolate's own, in the caller's private runtime
directory, with the registry's guarantees: a server restart finds every
snapshot again; a reboot empties that directory, and a server whose state
directory is on disk puts both descriptions back from its copies
(isolate.server.snapkeep).
The capture happens before the create call answers: a snapshot is listed
``Ready`` at once, or the call fails and nothing is kept.

A server over a Ray cluster (``serve --ray``) takes a sandbox's snapshot on
its node (``isolate.ray.RemoteSnapshot``); a sandbox created from it starts
on any node (the node that holds it first; another one fetches it once,
verified by its digest). Like that server's sandboxes, such snapshots live
with the server process: it removes them from their nodes when it ends.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import threading
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..kept.snapshots import Snapshot
from ..kernel.places import runtime_subdir, state_key
from ..model.errors import IsolationError
from .common import API_KEY_HEADER, api, json_body, query_int, same
from .models import ApiError, bad_request, iso

#: The ids this server hands out; anything else is not one of its snapshots (and never a file name).
_ID = re.compile(r"^osb-snap-[0-9a-f]{16}$")
#: The longest name a snapshot may be given.
MAX_NAME = 256


def _not_found(snapshot_id: str) -> ApiError:
    return ApiError(404, "SNAPSHOT_NOT_FOUND", f"snapshot {snapshot_id[:80]!r} not found")


class SnapshotStore:
    """The server's snapshots: isolate snapshots named by their API id, and a description of each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Copies of the descriptions in the server's state directory, to outlive a reboot (isolate.server.snapkeep;
        #: None: a server without one).
        self.copies: Any = None
        #: Snapshots kept on the nodes of a Ray cluster (serve --ray): id -> (description, RemoteSnapshot).
        self._remote: dict[str, tuple[dict[str, Any], Any]] = {}
        self._remote_lock = threading.Lock()  # not _lock: remove() holds that one while it calls get()

    def recover(self) -> list[str]:
        """At start: the descriptions a reboot took, put back from the copies, then what a killed server left
        half done finished or undone (a line for each)."""
        lines: list[str] = self.copies.recover(self._dir()) if self.copies is not None else []
        return lines + self._finish_marked()

    @staticmethod
    def _dir() -> str:
        return runtime_subdir(f"opensandbox-snapshots-{state_key()}")

    def get(self, snapshot_id: str) -> dict[str, Any]:
        if not _ID.fullmatch(snapshot_id):
            raise _not_found(snapshot_id)
        with self._remote_lock:
            remote = self._remote.get(snapshot_id)
        if remote is not None:
            return remote[0]
        try:
            fd = os.open(os.path.join(self._dir(), f"{snapshot_id}.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as handle:
                record: dict[str, Any] = json.load(handle)
        except (OSError, ValueError):
            raise _not_found(snapshot_id) from None
        return record

    def all(self) -> list[dict[str, Any]]:
        out = []
        for entry in os.listdir(self._dir()):
            if entry.endswith(".json") and _ID.fullmatch(entry[:-5]):
                try:
                    out.append(self.get(entry[:-5]))
                except ApiError:
                    continue
        with self._remote_lock:
            out.extend(record for record, _ in self._remote.values())
        return sorted(out, key=lambda r: float(r["created"]))

    def snapshot(self, snapshot_id: str) -> Any:
        """isolate's snapshot behind an API id (404 when either is gone): a ``Snapshot``, or on a cluster an
        ``isolate.ray.RemoteSnapshot``."""
        self.get(snapshot_id)
        with self._remote_lock:
            remote = self._remote.get(snapshot_id)
        if remote is not None:
            return remote[1]
        try:
            return Snapshot.get(snapshot_id)
        except IsolationError:
            raise _not_found(snapshot_id) from None

    def _mark(self, snapshot_id: str, step: str) -> str:
        """A marker of a step under way (``take`` or ``remove``) and of the process doing it: a server killed
        in the middle leaves it, and the next start (``recover``) finishes or undoes that step."""
        marker = os.path.join(self._dir(), f".{snapshot_id}.{step}")
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(str(os.getpid()))
        return marker

    def take(self, box: Any, sandbox_id: str, image: str, name: str | None) -> dict[str, Any]:
        """Capture ``box`` (an isolate.Sandbox) and describe it; the capture runs in the caller's thread."""
        snapshot_id = f"osb-snap-{secrets.token_hex(8)}"
        marker = self._mark(snapshot_id, "take")
        try:
            snap = box.snapshot(snapshot_id)
        except BaseException:
            _discard(snapshot_id)
            os.unlink(marker)
            raise
        record = {"id": snapshot_id, "sandboxId": sandbox_id, "name": name, "image": image, "created": snap.created}
        try:
            directory = self._dir()
            temp = os.path.join(directory, f".{snapshot_id}.{secrets.token_hex(4)}")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle)
            os.rename(temp, os.path.join(directory, f"{snapshot_id}.json"))
            if self.copies is not None:
                self.copies.keep(record)  # or no snapshot: one that would not outlive a reboot as said
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._dir(), f"{snapshot_id}.json"))
            snap.remove()
            raise
        finally:
            os.unlink(marker)
        return record

    def take_remote(self, box: Any, sandbox_id: str, image: str, name: str | None) -> dict[str, Any]:
        """Capture ``box`` (an isolate.ray.Sandbox) on its node; the description stays in this process."""
        snapshot_id = f"osb-snap-{secrets.token_hex(8)}"
        snap = box.snapshot(snapshot_id)
        record = {"id": snapshot_id, "sandboxId": sandbox_id, "name": name, "image": image,
                  "created": snap.snapshot.created, "node": snap.node_id}
        with self._remote_lock:
            self._remote[snapshot_id] = (record, snap)
        return record

    def close_remote(self) -> None:
        """At the server's end: its snapshots on the cluster's nodes go (no later server could name them)."""
        with self._remote_lock:
            remote, self._remote = list(self._remote.values()), {}
        for _, snap in remote:
            with contextlib.suppress(Exception):  # a node gone took its snapshots with it
                snap.remove()

    def remove(self, snapshot_id: str) -> None:
        with self._remote_lock:
            remote = self._remote.pop(snapshot_id, None)
        if remote is not None:
            with contextlib.suppress(IsolationError):  # its node is gone, and the snapshot with it
                remote[1].remove()
            return
        with self._lock:
            self.get(snapshot_id)
            marker = self._mark(snapshot_id, "remove")
            if self.copies is not None:
                self.copies.forget(snapshot_id)  # first: a reboot must not bring back one half removed
            # The description first: a snapshot listed is whole; a kill after it leaves the marker to finish.
            try:
                os.unlink(os.path.join(self._dir(), f"{snapshot_id}.json"))
            except FileNotFoundError:
                os.unlink(marker)
                raise _not_found(snapshot_id) from None
            _discard(snapshot_id)
            os.unlink(marker)

    def _finish_marked(self) -> list[str]:
        """Finish what a killed server left half done: a snapshot it was taking (no description: its files go)
        or removing (its files go), and the temporary descriptions it was writing. Only markers of a process
        that no longer runs: another server of this user's may be taking one right now."""
        directory = self._dir()
        lines = []
        for entry in sorted(os.listdir(directory)):
            parts = entry.split(".")
            if len(parts) != 3 or parts[0] or not _ID.fullmatch(parts[1]) or parts[2] not in ("take", "remove"):
                continue
            snapshot_id, path = parts[1], os.path.join(directory, entry)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd) as handle:
                    pid = int(handle.read(16))
            except (OSError, ValueError):
                continue
            if pid == os.getpid() or _running(pid):
                continue
            described = os.path.exists(os.path.join(directory, f"{snapshot_id}.json"))
            if parts[2] == "remove" or not described:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, f"{snapshot_id}.json"))
                _discard(snapshot_id)
                if self.copies is not None:
                    self.copies.forget(snapshot_id)
                doing = "removing" if parts[2] == "remove" else "taking"
                lines.append(f"snapshot {snapshot_id}: the last server was {doing} it when it ended; removed")
            for other in os.listdir(directory):
                if other.startswith(f".{snapshot_id}.") and other != entry:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(directory, other))
            with contextlib.suppress(OSError):
                os.unlink(path)
        return lines


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _discard(snapshot_id: str) -> None:
    """isolate's snapshot of that name, whole or half made (its files without a description yet)."""
    from ..kernel.tree import remove_state_entry

    with contextlib.suppress(IsolationError):
        Snapshot.get(snapshot_id).remove()
        return
    remove_state_entry("snapshots", snapshot_id)


def snapshot_json(record: dict[str, Any]) -> dict[str, Any]:
    created = float(record["created"])
    out: dict[str, Any] = {"id": record["id"], "sandboxId": record["sandboxId"],
                           "status": {"state": "Ready", "reason": "snapshot_ready",
                                      "message": f"the files of sandbox {record['sandboxId']} (image "
                                                 f"{record['image']!r}): workspace and private tmpfs mounts",
                                      "lastTransitionAt": iso(created)},
                           "createdAt": iso(created)}
    if record.get("name"):
        out["name"] = record["name"]
    return out


def _store(request: Request) -> tuple[Any, SnapshotStore]:
    """The server's state and its snapshots, for a caller with the API key (as lifecycle.check_key)."""
    state = request.app.state.isolate
    if not same(request.headers.get(API_KEY_HEADER), state.api_key):
        raise ApiError(401, "UNAUTHORIZED", f"missing or wrong {API_KEY_HEADER} header")
    return state, state.snapshots


@api
async def create_snapshot(request: Request) -> Response:
    state, store = _store(request)
    managed = state.get(request.path_params["sandbox_id"])
    body = await json_body(request, required=False)
    if body is None:
        body = {}
    if not isinstance(body, dict) or set(body) - {"name"}:
        raise bad_request("the body must be {} or {\"name\": TEXT}", "INVALID_REQUEST_BODY")
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME):
        raise bad_request(f"name: expected a text of 1 to {MAX_NAME} characters")
    if managed.state != "Running":
        raise ApiError(409, "INVALID_STATE", f"sandbox {managed.id} is {managed.state}; a snapshot is taken of a "
                       "Running sandbox (resume it first)")
    take = store.take_remote if state.cluster else store.take
    record = await run_in_threadpool(take, managed.box, managed.id, managed.image, name)
    managed.event(f"snapshot {record['id']} taken" + (f" ({name!r})" if name else ""))
    return JSONResponse(snapshot_json(record), status_code=202,
                        headers={"Location": f"/v1/snapshots/{record['id']}"})


@api
async def list_snapshots(request: Request) -> Response:
    _, store = _store(request)
    source = request.query_params.get("sandboxId")
    states = {s.lower() for s in request.query_params.getlist("state") if s}
    page = query_int(request, "page", 1, 1, 1 << 30)
    size = query_int(request, "pageSize", 20, 1, 1000)
    assert page is not None and size is not None
    records = await run_in_threadpool(store.all)
    items = [r for r in records if (source is None or r["sandboxId"] == source)
             and (not states or "ready" in states)]
    total = len(items)
    pages = math.ceil(total / size) if total else 0
    return JSONResponse({"items": [snapshot_json(r) for r in items[(page - 1) * size:page * size]],
                         "pagination": {"page": page, "pageSize": size, "totalItems": total, "totalPages": pages,
                                        "hasNextPage": page < pages}})


@api
async def get_snapshot(request: Request) -> Response:
    _, store = _store(request)
    return JSONResponse(snapshot_json(store.get(request.path_params["snapshot_id"])))


@api
async def delete_snapshot(request: Request) -> Response:
    _, store = _store(request)
    await run_in_threadpool(store.remove, request.path_params["snapshot_id"])
    return Response(status_code=204)


routes = [
    Route("/sandboxes/{sandbox_id}/snapshots", create_snapshot, methods=["POST"]),
    Route("/snapshots", list_snapshots, methods=["GET"]),
    Route("/snapshots/{snapshot_id}", get_snapshot, methods=["GET"]),
    Route("/snapshots/{snapshot_id}", delete_snapshot, methods=["DELETE"]),
]
