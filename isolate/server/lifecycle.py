"""The lifecycle API (``/v1/sandboxes...``): create, get, list, delete, pause, resume, renew, endpoints."""

from __future__ import annotations

import functools
import math
import secrets
import shlex
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..kept.sandbox import Sandbox
from ..model.errors import IsolationError
from ..model.policy import Egress
from .background import SETTLE_WAIT, KeptCommand
from .common import ACCESS_TOKEN_HEADER, API_KEY_HEADER, api, json_body, query_int, same
from .keep import Record, token_hash
from .models import (
    EGRESS_PORT,
    EXECD_PORT,
    KEEPALIVE_ENTRYPOINT,
    MAX_TIMEOUT,
    ApiError,
    CreateRequest,
    bad_request,
    check_metadata,
    iso,
    parse_create,
    parse_time,
)
from .ports import PORT_TOKEN_HEADER, port_token
from .restore import resume_restored, resume_stopped
from .state import ManagedSandbox, ServerState, disk_upper_possible
from .stopped import request_of
from .volumes import Opened, open_volumes
from .volumes import release as release_volumes
from .volumes import verify as verify_volumes


def check_key(request: Request) -> ServerState:
    state: ServerState = request.app.state.isolate
    if not same(request.headers.get(API_KEY_HEADER), state.api_key):
        raise ApiError(401, "UNAUTHORIZED", f"missing or wrong {API_KEY_HEADER} header")
    return state


def sandbox_json(managed: ManagedSandbox, full: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": managed.id,
        "status": {"state": managed.state, "reason": managed.reason, "message": managed.message,
                   "lastTransitionAt": iso(managed.transition_at)},
        "metadata": dict(managed.metadata),
        "createdAt": iso(managed.created_at),
        "entrypoint": list(managed.entrypoint),
    }
    if managed.expires_at is not None:
        out["expiresAt"] = iso(managed.expires_at)
    if full:
        out["image"] = {"uri": managed.image}
    return out


def _network_text(network: object) -> str:
    return network if isinstance(network, str) else "egress allow-list"


def _start(state: ServerState, req: CreateRequest, body: object = None) -> ManagedSandbox:
    named = [spec.claim for spec in req.volumes if spec.claim is not None]
    if named and state.cluster:
        raise ApiError(400, "UNSUPPORTED", "volumes: this server places sandboxes on the nodes of a Ray cluster "
                       "(serve --ray), and a named volume is a directory of one machine; serve without --ray")
    store = state.volume_store() if named else None
    sandbox_id, token = secrets.token_hex(12), secrets.token_urlsafe(24)
    # Kept past the server (a named sandbox) unless a part of it lives in the server process: a credential
    # vault (its values never leave the server's memory), a Ray node's. An egress allow-list's mediator is
    # then a process of its own, which outlives the server and ends with the sandbox (its control socket
    # takes the allow-list's runtime changes, from this server or the next).
    kept = state.keeper is not None and not state.cluster and not (isinstance(req.policy.network, Egress)
                                                                    and req.credential_proxy)
    keeper = state.keeper

    def starting(volumes: list[tuple[str, bool]], pending: bool) -> None:
        # A record of the start before anything is made: a server killed from here on leaves the next one
        # what to end (the sandbox, half made or whole) and which named volumes to let go.
        if keeper is None:
            return
        try:
            keeper.write(Record(sandbox_id, req.image, list(req.entrypoint), dict(req.metadata), time.time(), None,
                                kept, "Starting", token_hashes=[token_hash(token)], volumes=volumes,
                                pending=pending))
        except OSError as exc:
            raise _not_written(exc) from None

    opened: list[Opened] = []
    try:
        starting([(spec.claim, spec.delete_on_end) for spec in req.volumes if spec.claim is not None], True)
        # The named volumes are held from here (a create still starting uses them too), until the sandbox ends.
        opened = open_volumes(req.volumes, state.volume_roots, store, state.named_volumes)
        # Doomed also when another create made it so: a holder's record carries its volume's end (state.save).
        claims = [(item.spec.claim, (item.made is not None and item.spec.delete_on_end)
                   or state.named_volumes.doomed(item.held))
                  for item in opened if item.spec.claim is not None and item.held is not None]
        starting(claims, False)
        managed = _start_box(state, req, opened, sandbox_id, token, kept)
    except BaseException:
        release_volumes(opened, state.named_volumes, undo=True)
        if keeper is not None:
            keeper.remove(sandbox_id)
        raise
    managed.on_close.append(functools.partial(release_volumes, opened, state.named_volumes))
    managed.volume_claims = claims
    try:
        if managed.kept and state.stopped is not None:
            # What a start over its files after a host reboot needs (isolate.server.stopped).
            state.stopped.keep(managed.id, request_of(body, req.image), managed.box)
        # Recorded whole before the create answers: from here a server started after this one's end serves it.
        state.save(managed)
    except BaseException as exc:
        managed.close()
        state.forget(managed)
        if isinstance(exc, OSError):
            raise _not_written(exc) from None
        raise
    return managed


def _not_written(exc: OSError) -> ApiError:
    return ApiError(500, "STATE_NOT_WRITTEN", f"the sandbox's record could not be written in the server's state "
                    f"directory ({exc.strerror or exc}); not created")


def _start_box(state: ServerState, req: CreateRequest, opened: list[Opened], sandbox_id: str, token: str,
               kept: bool) -> ManagedSandbox:
    snap = state.snapshots.snapshot(req.snapshot_id) if req.snapshot_id is not None else None
    backend = state.backend or (req.policy.backend if req.policy.backend != "auto" else "native")
    if backend != "native":
        raise ApiError(400, "UNSUPPORTED", f"image {req.image!r}: its profile selects the {backend} backend; "
                       "this server streams commands and serves files through the native backend only (the "
                       "Docker backend of Sandbox has no spawn or file methods yet)")
    warm = None
    box: Any
    if req.policy.image is not None and snap is None and not state.cluster:
        _ensure_image(req)  # on a Ray cluster, the node the sandbox is placed on pulls what it lacks
    if state.cluster:
        if req.credential_proxy:
            raise ApiError(400, "UNSUPPORTED", "credentialProxy: this server places sandboxes on the nodes of a Ray "
                           "cluster (serve --ray), whose egress mediators it cannot reach to add credentials; serve "
                           "without --ray for a credential vault")
        from ..image.registry import RegistryError
        from ..image.unpack import BadImageError
        from ..ray import RemoteSnapshot
        from ..ray import Sandbox as ClusterSandbox  # serve --ray: the box lives on a node of the cluster

        if snap is not None and not isinstance(snap, RemoteSnapshot):
            raise ApiError(400, "UNSUPPORTED", f"snapshotId: snapshot {req.snapshot_id} was taken by a server of "
                           "this machine without --ray, and is kept here, not on the cluster's nodes; create "
                           "its sandbox through a server without --ray")

        try:
            # From a snapshot: the node that holds it first, else another one fetches it (once, verified).
            box = ClusterSandbox(req.policy, image_login=req.image_auth, snapshot=snap).start()
        except IsolationError as exc:
            # A node that could not pull the image says why (the registry's answer): the client's error, not
            # the server's, as on one machine (_ensure_image).
            pulls = [e for _, e in getattr(exc, "reasons", []) if isinstance(e, (RegistryError, BadImageError))]
            if pulls:
                raise ApiError(400, "IMAGE_PULL_FAILED", f"image {req.image[:200]!r}: the Ray node could not pull "
                               f"it: {str(pulls[0])[:500]}") from None
            raise
    else:
        warm = state.take_warm(req.policy) if snap is None and not opened else None
        if warm is not None:
            box = warm
            kept = False  # the pool's, unnamed: it ends with the server
        else:
            # A new sandbox's /workspace is the server's overlay (its snapshots are layers: they cost what
            # changed); one from a snapshot has the snapshot's. A kept one has no idle end: the server's
            # expiry is its end.
            assert state.keeper is not None or not kept
            # An image's root with its upper layer on disk, so that the sandbox's snapshots hold its root's
            # changes (a tmpfs upper layer refuses them), where the state directory keeps user.* attributes.
            box = Sandbox(req.policy, backend=backend, mounts=[item.mount for item in opened], snapshot=snap,
                          workspace=None if snap is not None else state.workspace,
                          name=state.keeper.name_for(sandbox_id) if kept and state.keeper else None,
                          idle_timeout=math.inf if kept else None,
                          image_upper="disk" if req.policy.image is not None and disk_upper_possible() else "tmpfs")
            box.start()
    try:
        verify_volumes(box, opened)
    except BaseException:
        box.close()
        raise
    now = time.time()
    managed = ManagedSandbox(sandbox_id, token, box, req.image, req.entrypoint,
                             req.metadata, now, None if req.timeout is None else now + req.timeout, kept=kept)
    managed.message = (f"image {req.image!r}: its root file system, natively, under the server's --profile policy"
                       if req.policy.image is not None else
                       f"image {req.image!r}: the host's system under the policy profile of that name")
    managed.credential_proxy = req.credential_proxy
    managed.renew_on_access = req.renew_on_access
    if state.cluster:
        managed.message += f", on Ray node {box.node_id}"
    source = f"snapshot {req.snapshot_id} (image {req.image!r})" if req.snapshot_id else f"image {req.image!r}"
    managed.event(f"created from {source} (backend {box.backend}, network {_network_text(req.policy.network)})"
                  + (": a fresh sandbox of the server's warm pool" if warm is not None else ""))
    for item in opened:
        managed.event(f"volume {item.spec.name}: {item.mount.source} at {item.mount.target} ({item.mount.mode})")
    asked = [name for name in ("memory", "cpus") if req.policy.limits.value(name) is not None]
    if asked and box.backend == "native":
        enforced = box.enforced
        managed.message += "; " + ", ".join(f"{name}: {enforced.get(name) or 'not enforced (best effort)'}"
                                            for name in asked)
    try:
        if req.entrypoint != KEEPALIVE_ENTRYPOINT:
            # The entry process runs as a background command (its output: GET /command/{id}/logs).
            record = managed.start_command(shlex.join(req.entrypoint), True, None, None, None, None)
            managed.message = f"entrypoint runs as background command {record.id}"
            managed.entry_command = record.id
            if isinstance(record, KeptCommand):
                record.settled.wait(SETTLE_WAIT)  # its wrapper found: the record written before the answer names it
            managed.event(f"entrypoint {shlex.join(req.entrypoint)[:200]} started as background command {record.id}")
    except BaseException:
        box.close()
        raise
    return managed


def _ensure_image(req: CreateRequest) -> None:
    """The request's image in this server's image store: pulled from its registry (with image.auth, else the
    server user's Docker/containers credentials) when the store does not hold it yet."""
    from ..image import Image

    assert req.policy.image is not None
    try:
        if Image.find(req.policy.image) is None:
            Image.pull(req.policy.image, login=req.image_auth)
    except IsolationError as exc:
        raise ApiError(400, "IMAGE_PULL_FAILED", f"image {req.image[:200]!r}: {exc}") from None


@api
async def create_sandbox(request: Request) -> Response:
    state = check_key(request)
    body = await json_body(request)
    req = parse_create(body, state.profiles, state.any_image,
                       lambda snapshot_id: str(state.snapshots.get(snapshot_id)["image"]))
    state.reserve()
    try:
        managed = await run_in_threadpool(_start, state, req, body)
    except BaseException:
        state.release()
        raise
    state.add(managed)
    return JSONResponse(sandbox_json(managed, full=False), status_code=202,
                        headers={"Location": f"/v1/sandboxes/{managed.id}"})


@api
async def get_sandbox(request: Request) -> Response:
    state = check_key(request)
    return JSONResponse(sandbox_json(state.get(request.path_params["sandbox_id"])))


def _metadata_filter(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    # The SDK quotes each key and value, then the query string once more; Starlette undid the outer layer.
    return dict(parse_qsl(raw, keep_blank_values=True))


@api
async def list_sandboxes(request: Request) -> Response:
    state = check_key(request)
    states = {s.lower() for s in request.query_params.getlist("state") if s}
    wanted = _metadata_filter(request.query_params.get("metadata"))
    page = query_int(request, "page", 1, 1, 1 << 30)
    size = query_int(request, "pageSize", 20, 1, 1000)
    assert page is not None and size is not None
    items = [m for m in sorted(state.all(), key=lambda m: m.created_at)
             if (not states or m.state.lower() in states)
             and all(m.metadata.get(k) == v for k, v in wanted.items())]
    total = len(items)
    pages = math.ceil(total / size) if total else 0
    chosen = items[(page - 1) * size:page * size]
    return JSONResponse({"items": [sandbox_json(m) for m in chosen],
                         "pagination": {"page": page, "pageSize": size, "totalItems": total, "totalPages": pages,
                                        "hasNextPage": page < pages}})


@api
async def delete_sandbox(request: Request) -> Response:
    state = check_key(request)
    managed = state.get(request.path_params["sandbox_id"])
    if state.remove(managed.id) is not None:
        await run_in_threadpool(managed.close)
        state.forget(managed)
    return Response(status_code=204)


async def _transition(managed: ManagedSandbox, source: str, passing: str, target: str, reason: str,
                      work: Callable[[], str]) -> None:
    # The check and the move to the passing state happen on the event loop, with no await between them:
    # a second pause (or a command) arriving meanwhile sees Pausing and is refused.
    if managed.state != source:
        raise ApiError(409, "INVALID_STATE", f"sandbox {managed.id} is {managed.state}, not {source}")
    managed.set_state(passing, reason)
    try:
        mechanism = await run_in_threadpool(work)
    except BaseException:
        managed.set_state(source, reason, f"{passing.lower()} failed")
        raise
    managed.set_state(target, reason, f"{target.lower()} ({mechanism})")
    managed.changed()


@api
async def pause_sandbox(request: Request) -> Response:
    state = check_key(request)
    managed = state.get(request.path_params["sandbox_id"])
    await _transition(managed, "Running", "Pausing", "Paused", "user_pause", managed.box.pause)
    return Response(status_code=202)


@api
async def resume_sandbox(request: Request) -> Response:
    state = check_key(request)
    managed = state.get(request.path_params["sandbox_id"])
    work = (functools.partial(resume_stopped, state, managed) if managed.stopped else
            functools.partial(resume_restored, managed) if managed.restored else managed.box.resume)
    await _transition(managed, "Paused", "Resuming", "Running", "user_resume", work)
    return Response(status_code=202)


@api
async def renew_expiration(request: Request) -> Response:
    state = check_key(request)
    managed = state.get(request.path_params["sandbox_id"])
    body = await json_body(request)
    if not isinstance(body, dict) or set(body) != {"expiresAt"}:
        raise bad_request("the body must be {\"expiresAt\": RFC 3339 time}", "INVALID_REQUEST_BODY")
    when = parse_time(body["expiresAt"], "expiresAt")
    now = time.time()
    if not now < when <= now + MAX_TIMEOUT:
        raise bad_request(f"expiresAt: must be in the future and at most {MAX_TIMEOUT} s away")
    managed.expires_at = when
    managed.event(f"expiration renewed to {iso(when)}")
    managed.changed()
    return JSONResponse({"expiresAt": iso(when)})


@api
async def patch_metadata(request: Request) -> Response:
    state = check_key(request)
    managed = state.get(request.path_params["sandbox_id"])
    body = await json_body(request)
    if not isinstance(body, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str))
                                             for k, v in body.items()):
        raise bad_request("the body must be an object of string or null values", "INVALID_REQUEST_BODY")
    check_metadata(body)
    merged = dict(managed.metadata)
    for key, value in body.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    managed.metadata = merged
    managed.changed()
    managed.event("metadata patched: " + ", ".join(f"{k}={'(deleted)' if v is None else repr(v)}"
                                                    for k, v in sorted(body.items()))[:500])
    return JSONResponse(sandbox_json(managed))


@api
async def get_endpoint(request: Request) -> Response:
    state = check_key(request)
    managed = state.get(request.path_params["sandbox_id"])
    raw = request.path_params["port"]
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 5) or not 1 <= int(raw) <= 65535:
        raise bad_request(f"port: {raw[:16]!r} is not a port number (1-65535)", "INVALID_PORT")
    port = int(raw)
    if request.query_params.get("expires"):
        raise bad_request("expires: signed endpoints are not supported by this server (the endpoint's token "
                          "header is the access control)")
    host = request.url.netloc
    # The server-proxy form (use_server_proxy=true, OSEP-0009) names the same routes under /proxy/.
    kind = "proxy" if request.query_params.get("use_server_proxy", "").lower() == "true" else "port"
    url = f"{host}/sandboxes/{managed.id}/{kind}/{port}"
    token, new = managed.current_token()
    if port in (EXECD_PORT, EGRESS_PORT):
        if new:
            managed.changed()
        return JSONResponse({"endpoint": url, "headers": {ACCESS_TOKEN_HEADER: token}})
    if managed.box.policy.network == "none":
        raise bad_request(f"port {port}: sandbox {managed.id} has network none, where nothing can listen (not even "
                          "on loopback); create it with networkPolicy {\"defaultAction\": \"deny\"} (a loopback of "
                          "its own, no way out) or under a profile whose network is loopback", "ENDPOINT_NOT_AVAILABLE")
    given = port_token(managed, port)
    if managed.port_token_given(port, given) or new:
        managed.changed()  # its hash is recorded: the token stays good past a restart
    return JSONResponse({"endpoint": url, "headers": {PORT_TOKEN_HEADER: given}})


@api
async def metrics_event(request: Request) -> Response:
    check_key(request)
    await json_body(request, required=False)  # the SDK's create-latency report: accepted, not kept
    return Response(status_code=204)


routes = [
    Route("/sandboxes", create_sandbox, methods=["POST"]),
    Route("/sandboxes", list_sandboxes, methods=["GET"]),
    Route("/sandboxes/{sandbox_id}", get_sandbox, methods=["GET"]),
    Route("/sandboxes/{sandbox_id}", delete_sandbox, methods=["DELETE"]),
    Route("/sandboxes/{sandbox_id}/pause", pause_sandbox, methods=["POST"]),
    Route("/sandboxes/{sandbox_id}/resume", resume_sandbox, methods=["POST"]),
    Route("/sandboxes/{sandbox_id}/renew-expiration", renew_expiration, methods=["POST"]),
    Route("/sandboxes/{sandbox_id}/metadata", patch_metadata, methods=["PATCH"]),
    Route("/sandboxes/{sandbox_id}/endpoints/{port}", get_endpoint, methods=["GET"]),
    Route("/metrics/events", metrics_event, methods=["POST"]),
]
