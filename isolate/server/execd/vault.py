"""The egress sidecar's credential vault (``/credential-vault`` on port 18080).

A sandbox created with ``credentialProxy.enabled`` (and an allow-list: its
connections go through isolate's egress mediator) may be given a vault: its
credentials stay in this process (isolate.egress.vault), the mediator adds
them to the sandbox's matching plain-HTTP requests, and every answer here
lists names and revisions only. ``https`` bindings are refused (no TLS
interception); see vault.py for what is matched and how.
"""

from __future__ import annotations

import threading

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...egress.vault import Vault, VaultError
from ..common import api, json_body
from ..models import EGRESS_PORT, ApiError
from ..reach import mediator
from ..state import ManagedSandbox
from .access import sandbox_for

_LOCK = threading.Lock()  # create and delete against each other
_STATUS = {"invalid": (400, "INVALID_REQUEST"), "missing": (404, "CREDENTIAL_VAULT_NOT_FOUND"),
           "conflict": (409, "CREDENTIAL_VAULT_CONFLICT")}


def _error(exc: VaultError) -> ApiError:
    status, code = _STATUS[exc.kind]
    return ApiError(status, code, str(exc))


def _managed(request: Request) -> ManagedSandbox:
    managed = sandbox_for(request, running=False, port=EGRESS_PORT)
    if not managed.credential_proxy:
        raise ApiError(412, "CREDENTIAL_PROXY_NOT_ENABLED", f"sandbox {managed.id} was created without "
                       "credentialProxy.enabled: create it with {\"credentialProxy\": {\"enabled\": true}} and "
                       "networkPolicy defaultAction deny with allow rules for the hosts its bindings name")
    return managed


def _vault(request: Request) -> Vault:
    found: Vault | None = _managed(request).vault
    if found is None:
        raise ApiError(404, "CREDENTIAL_VAULT_NOT_FOUND", "this sandbox has no credential vault yet (POST one)")
    return found


@api
async def create_vault(request: Request) -> Response:
    managed = _managed(request)
    body = await json_body(request)
    if not isinstance(body, dict) or set(body) - {"credentials", "bindings"} or \
            "credentials" not in body or "bindings" not in body:
        raise ApiError(400, "INVALID_REQUEST", "expected {\"credentials\": [...], \"bindings\": [...]}")
    try:
        vault = Vault(body["credentials"], body["bindings"])
    except VaultError as exc:
        raise _error(exc) from None
    with _LOCK:
        if managed.vault is not None:
            raise ApiError(409, "CREDENTIAL_VAULT_CONFLICT", "this sandbox has a credential vault: PATCH it, or "
                           "DELETE it first")
        found = mediator(managed.box)
        if found is None:  # pragma: no cover - credential_proxy is only set on a sandbox with a mediator
            raise ApiError(412, "CREDENTIAL_PROXY_NOT_ENABLED", "this sandbox has no egress mediator")
        managed.vault = found.vault = vault
    managed.event(f"credential vault created (revision 1: {len(vault.credentials())} credential(s), "
                  f"{len(vault.bindings())} binding(s))")
    managed.changed()  # the record counts its credentials (never their values)
    return JSONResponse(vault.state(), status_code=201)


@api
async def get_vault(request: Request) -> Response:
    return JSONResponse(_vault(request).state())


@api
async def patch_vault(request: Request) -> Response:
    managed = _managed(request)
    vault = _vault(request)
    body = await json_body(request)
    try:
        vault.patch(body)
    except VaultError as exc:
        raise _error(exc) from None
    managed.event(f"credential vault now at revision {vault.revision}")
    managed.changed()
    return JSONResponse(vault.state())


@api
async def delete_vault(request: Request) -> Response:
    managed = _managed(request)
    with _LOCK:
        _vault(request)
        found = mediator(managed.box)
        if found is not None:
            found.vault = None
        managed.vault = None
    managed.event("credential vault deleted")
    managed.changed()
    return Response(status_code=204)


def _listed(request: Request, key: str) -> Response:
    """GET .../credentials or .../bindings (key), or one of them by name: names and revisions."""
    vault = _vault(request)
    name = request.path_params.get("name")
    if name is None:
        return JSONResponse({"revision": vault.revision, key: getattr(vault, key)()})
    try:
        return JSONResponse(getattr(vault, key.removesuffix("s"))(name))
    except VaultError as exc:
        raise _error(exc) from None


@api
async def list_credentials(request: Request) -> Response:
    return _listed(request, "credentials")


@api
async def list_bindings(request: Request) -> Response:
    return _listed(request, "bindings")
