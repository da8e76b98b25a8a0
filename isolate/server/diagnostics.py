"""The diagnostics API (``/v1/sandboxes/{id}/diagnostics/logs`` and ``/events``): plain text, inline.

Logs: the ``container`` scope is what the create request's entrypoint wrote
(its stdout and stderr, as the background command that runs it keeps them;
the SDK's keep-alive entrypoint writes nothing); ``lifecycle`` is the
sandbox's events; ``all`` is both. Events: ``lifecycle`` (and ``all``) are
what happened to the sandbox as the server saw it: its creation, each state
change with its reason, metadata patches, renewals. Other scopes are refused
(400) with the list of those served.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .common import api
from .lifecycle import check_key
from .models import bad_request, iso
from .state import ManagedSandbox

#: The most text one answer carries inline; beyond it, the newest part is kept and truncated is true.
MAX_INLINE = 1 << 20

LOG_SCOPES = ("container", "lifecycle", "all")
EVENT_SCOPES = ("lifecycle", "all")


def _scope(request: Request, served: tuple[str, ...]) -> str:
    scope = request.query_params.get("scope", "")
    if scope not in served:
        raise bad_request(f"scope: {scope[:40]!r} is not served here; this server serves {', '.join(served)}",
                          "INVALID_SCOPE")
    return scope


def _events_text(managed: ManagedSandbox) -> str:
    return "".join(f"{iso(when)} lifecycle {text}\n" for when, text in list(managed.events))


def _container_text(managed: ManagedSandbox) -> tuple[str, list[str]]:
    if managed.entry_command is None:
        return "", ["the entrypoint is the SDK's keep-alive: it writes nothing; commands' output is in their logs"]
    record = managed.commands.get(managed.entry_command)
    if record is None:
        return "", ["the entrypoint's output is no longer kept (too many commands finished since)"]
    # Only the tail an answer can hold (and a character's worth before it): never the whole kept output,
    # up to 16 MiB a command, decoded and encoded again per request.
    _, end = record.read_from(1 << 62)
    data, _ = record.read_from(max(0, end - MAX_INLINE - 3))
    warnings = [] if record.output_base == 0 else [f"the first {record.output_base} bytes are no longer kept"]
    return data.decode(errors="replace"), warnings


def _answer(managed: ManagedSandbox, kind: str, scope: str, text: str, warnings: list[str]) -> Response:
    data = text.encode()
    truncated = len(data) > MAX_INLINE
    if truncated:
        text = data[-MAX_INLINE:].decode(errors="ignore")
    out: dict[str, Any] = {"sandboxId": managed.id, "kind": kind, "scope": scope, "delivery": "inline",
                           "contentType": "text/plain; charset=utf-8", "content": text,
                           "contentLength": len(text.encode()), "truncated": truncated}
    if warnings:
        out["warnings"] = warnings
    return JSONResponse(out)


@api
async def diagnostic_logs(request: Request) -> Response:
    managed = check_key(request).get(request.path_params["sandbox_id"])
    scope = _scope(request, LOG_SCOPES)
    # A kept command's output is read from its file in the sandbox: off the event loop.
    text, warnings = ("", []) if scope == "lifecycle" else await run_in_threadpool(_container_text, managed)
    if scope in ("lifecycle", "all"):
        text += _events_text(managed)
    return _answer(managed, "logs", scope, text, warnings)


@api
async def diagnostic_events(request: Request) -> Response:
    managed = check_key(request).get(request.path_params["sandbox_id"])
    scope = _scope(request, EVENT_SCOPES)
    return _answer(managed, "events", scope, _events_text(managed), [])


routes = [
    Route("/sandboxes/{sandbox_id}/diagnostics/logs", diagnostic_logs, methods=["GET"]),
    Route("/sandboxes/{sandbox_id}/diagnostics/events", diagnostic_events, methods=["GET"]),
]
