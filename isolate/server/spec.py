"""Every route of OpenSandbox's four API specs, and what this server does with it.

The specs (``specs/sandbox-lifecycle.yml``, ``execd-api.yaml``,
``egress-api.yaml`` and ``diagnostic-api.yml`` in alibaba/OpenSandbox) are
the contract: each of their routes is either served or refused here, and a
refusal is the spec's error shape (``{"code", "message"}``) with a status the
spec lists for that route and a reason that names the way out. The test
suite walks the spec files against this table and the application, and
docs/server.md's table of routes is generated from it (``routes_markdown``):
a route cannot be added, dropped or refused without the table, the docs and
the test agreeing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import EGRESS_PORT, EXECD_PORT

#: Where each spec's paths are served: the lifecycle and diagnostics APIs under /v1, a sandbox's
#: execution API and egress sidecar under its port path (what the endpoints call hands out).
PREFIXES = {
    "lifecycle": "/v1",
    "diagnostic": "/v1",
    "execd": f"/sandboxes/{{sandboxId}}/port/{EXECD_PORT}",
    "egress": f"/sandboxes/{{sandboxId}}/port/{EGRESS_PORT}",
}
#: The spec file of each API, as upstream names it.
SPEC_FILES = {
    "lifecycle": "sandbox-lifecycle.yml",
    "execd": "execd-api.yaml",
    "egress": "egress-api.yaml",
    "diagnostic": "diagnostic-api.yml",
}


@dataclass(frozen=True)
class SpecRoute:
    """One route of a spec: served, or refused with (status, code, reason)."""

    api: str
    method: str
    path: str
    note: str = ""
    refusal: tuple[int, str, str] | None = None
    #: "spec": a route of the four specs; "sdk": one the SDK (1.1.1) calls that no spec has.
    source: str = "spec"

    @property
    def served(self) -> bool:
        return self.refusal is None

    @property
    def server_path(self) -> str:
        return PREFIXES[self.api] + self.path


_TEMPLATES = ("templates (golden images) are not served by this server: an image name selects a policy "
              "profile (--image NAME=FILE)")
_NETWORK_POLICY = ("the SDK uses this for template-backed sandboxes only; this server's sandboxes take their "
                   "egress policy at the egress endpoint (port 18080, /policy)")
_ISOLATED = ("isolated sessions (OSEP-0013) are not served by this server; each sandbox is isolated as a whole: "
             "create another sandbox for another session")


def _refused(api: str, method: str, path: str, status: int, code: str, reason: str) -> SpecRoute:
    return SpecRoute(api, method, path, refusal=(status, code, reason))


def _sdk_refused(api: str, method: str, path: str, reason: str) -> SpecRoute:
    return SpecRoute(api, method, path, refusal=(501, "NOT_IMPLEMENTED", reason), source="sdk")


ROUTES: tuple[SpecRoute, ...] = (
    # -- lifecycle ---------------------------------------------------------------------------
    SpecRoute("lifecycle", "GET", "/sandboxes", "state and metadata filters, pagination"),
    SpecRoute("lifecycle", "POST", "/sandboxes", "image names a policy profile, or with --profile an OCI image "
              "(pulled, image.auth, run natively); snapshotId; host volumes below --volume-root, pvc volumes as "
              "directories of the volume store (ossfs refused); credentialProxy; extensions: "
              "access.renew.extend.seconds"),
    SpecRoute("lifecycle", "GET", "/sandboxes/{sandboxId}"),
    SpecRoute("lifecycle", "DELETE", "/sandboxes/{sandboxId}"),
    SpecRoute("lifecycle", "PATCH", "/sandboxes/{sandboxId}/metadata", "JSON merge patch"),
    SpecRoute("lifecycle", "POST", "/sandboxes/{sandboxId}/pause", "cgroup freezer, else SIGSTOP"),
    SpecRoute("lifecycle", "POST", "/sandboxes/{sandboxId}/resume"),
    SpecRoute("lifecycle", "POST", "/sandboxes/{sandboxId}/renew-expiration"),
    SpecRoute("lifecycle", "GET", "/sandboxes/{sandboxId}/endpoints/{port}",
              "execution API, or any own port forwarded (HTTP, WebSocket) with a per-port token; "
              "use_server_proxy's /proxy/ form; not signed"),
    SpecRoute("lifecycle", "POST", "/sandboxes/{sandboxId}/snapshots",
              "the workspace and private tmpfs mounts (isolate.Snapshot), Ready when answered"),
    SpecRoute("lifecycle", "GET", "/snapshots", "sandboxId and state filters, pagination"),
    SpecRoute("lifecycle", "GET", "/snapshots/{snapshotId}"),
    SpecRoute("lifecycle", "DELETE", "/snapshots/{snapshotId}"),
    # -- diagnostics -------------------------------------------------------------------------
    SpecRoute("diagnostic", "GET", "/sandboxes/{sandboxId}/diagnostics/logs",
              "scopes container (the entrypoint's output), lifecycle, all; inline"),
    SpecRoute("diagnostic", "GET", "/sandboxes/{sandboxId}/diagnostics/events",
              "scopes lifecycle (state changes, metadata, renewals), all; inline"),
    # -- execution (execd) -------------------------------------------------------------------
    SpecRoute("execd", "GET", "/ping"),
    SpecRoute("execd", "GET", "/code/contexts",
              "python, java, typescript, javascript, go and bash contexts (no Jupyter)"),
    SpecRoute("execd", "DELETE", "/code/contexts"),
    SpecRoute("execd", "GET", "/code/contexts/{context_id}"),
    SpecRoute("execd", "DELETE", "/code/contexts/{context_id}"),
    SpecRoute("execd", "POST", "/code/context"),
    SpecRoute("execd", "POST", "/code"),
    SpecRoute("execd", "DELETE", "/code"),
    SpecRoute("execd", "POST", "/session", "a persistent bash per session"),
    SpecRoute("execd", "POST", "/session/{sessionId}/run"),
    SpecRoute("execd", "DELETE", "/session/{sessionId}"),
    SpecRoute("execd", "POST", "/command", "streamed as server-sent events, or in the background"),
    SpecRoute("execd", "DELETE", "/command"),
    SpecRoute("execd", "GET", "/command/status/{id}"),
    SpecRoute("execd", "GET", "/command/{id}/logs"),
    SpecRoute("execd", "GET", "/files/info"),
    SpecRoute("execd", "DELETE", "/files"),
    SpecRoute("execd", "POST", "/files/permissions", "mode only: the owner is the sandbox's user"),
    SpecRoute("execd", "POST", "/files/mv"),
    SpecRoute("execd", "GET", "/files/search"),
    SpecRoute("execd", "POST", "/files/replace"),
    SpecRoute("execd", "POST", "/files/upload"),
    SpecRoute("execd", "GET", "/files/download", "with Range"),
    SpecRoute("execd", "GET", "/directories/list"),
    SpecRoute("execd", "POST", "/directories"),
    SpecRoute("execd", "DELETE", "/directories"),
    SpecRoute("execd", "GET", "/metrics", "the sandbox's cgroup, else its processes (/proc)"),
    SpecRoute("execd", "GET", "/metrics/watch", "the same, every second, as server-sent events"),
    # -- egress sidecar ----------------------------------------------------------------------
    SpecRoute("egress", "GET", "/policy", "the sandbox's network as the sidecar's policy"),
    SpecRoute("egress", "PATCH", "/policy", "the running sandbox's allow-list, through its mediator (open "
              "connections to names no longer allowed are closed); ports of its start only"),
    SpecRoute("egress", "DELETE", "/policy", "likewise"),
    SpecRoute("egress", "POST", "/credential-vault", "with credentialProxy.enabled and an allow-list: the "
              "mediator adds the credentials to matching plain-HTTP requests (https bindings refused: no TLS "
              "interception)"),
    SpecRoute("egress", "GET", "/credential-vault", "names and revisions, never a value"),
    SpecRoute("egress", "PATCH", "/credential-vault", "add, replace, delete at once; expectedRevision"),
    SpecRoute("egress", "DELETE", "/credential-vault"),
    SpecRoute("egress", "GET", "/credential-vault/credentials"),
    SpecRoute("egress", "GET", "/credential-vault/credentials/{credential_name}"),
    SpecRoute("egress", "GET", "/credential-vault/bindings"),
    SpecRoute("egress", "GET", "/credential-vault/bindings/{binding_name}"),
    # -- what the SDK (1.1.1) calls beyond the four specs -------------------------------------
    SpecRoute("lifecycle", "POST", "/metrics/events", "the SDK's create-latency report: accepted, not kept",
              source="sdk"),
    *(_sdk_refused("lifecycle", method, path, _TEMPLATES) for method, path in (
        ("GET", "/templates"), ("POST", "/templates"), ("GET", "/templates/{templateId}"),
        ("DELETE", "/templates/{templateId}"))),
    *(_sdk_refused("lifecycle", method, "/sandboxes/{sandboxId}/networkpolicy", _NETWORK_POLICY)
      for method in ("GET", "PUT", "PATCH", "DELETE")),
    *(_sdk_refused("execd", method, "/v1/isolated" + path, _ISOLATED) for method, path in (
        ("GET", "/capabilities"), ("GET", "/sessions"), ("POST", "/session"), ("GET", "/session/{sessionId}"),
        ("DELETE", "/session/{sessionId}"), ("POST", "/session/{sessionId}/run"),
        ("GET", "/session/{sessionId}/runs/{runId}"), ("GET", "/session/{sessionId}/runs/{runId}/logs"),
        ("GET", "/session/{sessionId}/diff"), ("POST", "/session/{sessionId}/commit"),
        ("GET", "/session/{sessionId}/files/info"), ("DELETE", "/session/{sessionId}/files"),
        ("POST", "/session/{sessionId}/files/mv"), ("POST", "/session/{sessionId}/files/permissions"),
        ("GET", "/session/{sessionId}/files/search"), ("POST", "/session/{sessionId}/files/replace"),
        ("POST", "/session/{sessionId}/files/upload"), ("GET", "/session/{sessionId}/files/download"),
        ("GET", "/session/{sessionId}/directories/list"), ("POST", "/session/{sessionId}/directories"),
        ("DELETE", "/session/{sessionId}/directories"))),
)


def refused_routes() -> list[SpecRoute]:
    return [route for route in ROUTES if not route.served]


_TITLES = {"lifecycle": "lifecycle", "diagnostic": "diagnostics", "execd": "execution", "egress": "egress"}


def routes_markdown() -> str:
    """docs/server.md's table of routes (checked against this table by the tests)."""
    lines = ["| API | Method | Path | Here |", "| --- | --- | --- | --- |"]
    for route in ROUTES:
        if route.refusal is None:
            here = "served" + (f": {route.note}" if route.note else "")
        else:
            status, code, reason = route.refusal
            here = f"refused ({status} `{code}`): {reason}"
        api = _TITLES[route.api] + (" (SDK, no spec)" if route.source == "sdk" else "")
        lines.append(f"| {api} | {route.method} | `{route.path}` | {here} |")
    return "\n".join(lines) + "\n"
