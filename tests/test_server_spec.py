"""OpenSandbox's four API specs, walked against ``isolate-run serve``: every route is served, or refused
with the spec's error shape and a status the spec lists; docs/server.md's table of routes is the server's.

The spec files are upstream's (alibaba/OpenSandbox ``specs/``, Apache-2.0), read where
ISOLATE_OPENSANDBOX_SPECS points or from ``../shared/opensandbox/specs`` beside the checkout; they
are not part of this repository (data fetched from a public repository is kept under shared/ only).
Without them the spec walk is skipped; the walk of the routes the installed SDK calls still runs.
No sandbox is started: an unknown sandbox id and a missing key are enough to reach every route.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the server extra is not installed: pip install 'isolate[server]'")
pytest.importorskip("httpx", reason="starlette's test client needs httpx (the server-test extra)")

from starlette.testclient import TestClient

from isolate.server import create_app
from isolate.server.spec import PREFIXES, ROUTES, SPEC_FILES, routes_markdown

REPO = Path(__file__).resolve().parent.parent
KEY = "spec-walk-key-0123456789"
METHODS = ("get", "post", "put", "patch", "delete", "head", "options")


def spec_dir() -> Path:
    given = os.environ.get("ISOLATE_OPENSANDBOX_SPECS")
    return Path(given) if given else REPO.parent / "shared" / "opensandbox" / "specs"


def load_specs() -> dict[str, Any]:
    directory = spec_dir()
    if not all((directory / name).is_file() for name in SPEC_FILES.values()):
        pytest.skip(f"OpenSandbox's spec files ({', '.join(SPEC_FILES.values())}) are not in {directory}: copy "
                    "alibaba/OpenSandbox's specs/ there, or point ISOLATE_OPENSANDBOX_SPECS at them (the walk of "
                    "the installed SDK's routes runs without them)")
    yaml = pytest.importorskip("yaml")
    return {api: yaml.safe_load((directory / name).read_text()) for api, name in SPEC_FILES.items()}


def spec_routes(specs: dict[str, Any]) -> dict[tuple[str, str, str], set[str]]:
    """(api, METHOD, path) -> the response statuses the spec lists."""
    out = {}
    for api, spec in specs.items():
        for path, operations in spec["paths"].items():
            for method, operation in operations.items():
                if method in METHODS:
                    out[(api, method.upper(), path)] = set(operation.get("responses", {}))
    return out


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", lambda m: "no-such-sandbox" if m.group(0) == "{sandboxId}" else "x", path)


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(KEY))  # no lifespan: no reaper, no sandbox


def test_the_table_is_the_specs_routes() -> None:
    routes = spec_routes(load_specs())
    table = {(r.api, r.method, r.path): r for r in ROUTES if r.source == "spec"}
    assert set(routes) - set(table) == set(), "routes of the specs missing from isolate.server.spec.ROUTES"
    assert set(table) - set(routes) == set(), "routes in isolate.server.spec.ROUTES that the specs do not have"
    for key, route in table.items():
        if route.refusal is not None:
            assert str(route.refusal[0]) in routes[key], f"{key}: status {route.refusal[0]} is not the spec's"
    assert len(routes) == 54


def test_every_route_the_sdk_calls_is_in_the_table() -> None:
    """The installed SDK's generated clients (one module per route, generated from the specs it was built
    with, and a few routes no spec has): each is in the table, as a spec route or as the SDK's own."""
    opensandbox = pytest.importorskip("opensandbox")

    def shape(path: str) -> str:
        return re.sub(r"\{[^}]+\}", "{}", path)

    root = Path(opensandbox.__file__).parent / "api"
    called = set()
    for api in SPEC_FILES:
        for module in (root / api / "api").rglob("*.py"):
            found = re.search(r'"method":\s*"(\w+)",\s*"url":\s*"([^"]+)"', module.read_text())
            if found:
                called.add((api, found.group(1).upper(), shape(found.group(2))))
    assert len(called) > 50, f"the SDK's generated clients were not found under {root}"
    table = {(r.api, r.method, shape(r.path)) for r in ROUTES}
    assert called - table == set(), "routes the SDK calls that isolate.server.spec.ROUTES does not have"
    assert {(r.api, r.method, shape(r.path)) for r in ROUTES if r.source == "sdk"} <= called


def test_every_route_is_answered_with_the_error_shape(client: TestClient) -> None:
    for route in ROUTES:
        url = concrete(route.server_path)
        # Without a key: 401 in the API's shape, which only a route of that path and method answers
        # (an unmatched one would be 404 or 405).
        r = client.request(route.method, url)
        assert r.status_code == 401, (route, r.status_code, r.text)
        assert set(r.json()) == {"code", "message"}
        if route.refusal is not None:
            status, code, reason = route.refusal
            r = client.request(route.method, url, headers={"OPEN-SANDBOX-API-KEY": KEY})
            assert (r.status_code, r.json()) == (status, {"code": code, "message": reason})
            assert r.headers["x-request-id"]
    r = client.get(PREFIXES["lifecycle"] + "/no-such-route", headers={"OPEN-SANDBOX-API-KEY": KEY})
    assert r.status_code == 404 and set(r.json()) == {"code", "message"}


def test_docs_table_is_generated_from_the_server() -> None:
    text = (REPO / "docs" / "server.md").read_text()
    start, end = "<!-- routes:start (generated: isolate.server.spec.routes_markdown) -->\n", "<!-- routes:end -->"
    assert start in text and end in text, "docs/server.md lost its table of routes"
    assert text.split(start, 1)[1].split(end, 1)[0] == routes_markdown(), \
        "docs/server.md's table of routes differs from isolate.server.spec: regenerate it"
