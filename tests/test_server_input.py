"""Bad input to the server is a 400 with the API's shape (never a 500, never taken), and what a sandbox's
ports answer cannot act on the API's origin (docs/threat-model.md, "A sandbox's ports and the API's origin")."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import test_server as base

httpx = pytest.importorskip("httpx")

KEY = base.KEY
server = base.server  # the suite's server, started once for this module

HUGE = 10 ** 400  # json.dumps writes it as 401 digits; float() of it is OverflowError


def _raw(server: base.Server, method: str, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    """A call whose body is JSON as json.dumps writes it (a huge integer stays an integer)."""
    return server.call(method, path, raw=json.dumps(body).encode(), headers=headers)


def _refused(answer: tuple[int, Any], field: str) -> None:
    status, body = answer
    assert status == 400 and set(body) == {"code", "message"} and field in body["message"], answer


def test_numbers_names_and_paths_of_a_request_are_checked(server: base.Server) -> None:
    create = {"image": {"uri": "ubuntu"}}
    for timeout in (HUGE, -HUGE, 0, -1, True, 1e308, 31 * 24 * 3600):
        _refused(_raw(server, "POST", "/v1/sandboxes", {**create, "timeout": timeout}), "timeout")
    _refused(server.call("POST", "/v1/sandboxes", raw=b'{"image": {"uri": "ubuntu"}, "timeout": NaN}'), "timeout")
    # A name is matched whole: a trailing newline is not a DNS label or a label key.
    pvc = {"name": "v", "pvc": {"claimName": "abc\n"}, "mountPath": "/mnt/v"}
    _refused(server.call("POST", "/v1/sandboxes", {**create, "volumes": [pvc]}), "claimName")
    _refused(server.call("POST", "/v1/sandboxes", {**create, "volumes": [{**pvc, "name": "v\n",
                                                                           "pvc": {"claimName": "abc"}}]}), "name")
    _refused(server.call("POST", "/v1/sandboxes", {**create, "metadata": {"team\n": "a"}}), "metadata")
    _refused(server.call("POST", "/v1/sandboxes", {**create, "metadata": {"team": "a\n"}}), "metadata")
    _refused(server.call("POST", "/v1/sandboxes", {**create, "entrypoint": ["", "x"]}), "entrypoint")
    # Query integers are ASCII digits (int() would take "٣" as 3).
    status, body = server.call("GET", "/v1/sandboxes?page=%D9%A3")
    assert (status, body["code"]) == (400, "INVALID_QUERY"), body

    box = base._create(server)
    try:
        prefix, headers = base._endpoint(server, box["id"])
        _refused(_raw(server, "POST", f"{prefix}/command", {"command": "true", "timeout": HUGE}, headers), "timeout")
        _refused(_raw(server, "POST", f"{prefix}/command", {"command": "true", "timeout": 1.5}, headers), "timeout")
        _refused(server.call("POST", f"{prefix}/command", {"command": "true", "cwd": ""}, headers=headers), "cwd")
        # An empty path is the workspace to the file methods: never taken for one named.
        _refused(server.call("POST", f"{prefix}/directories", {"": {"mode": 755}}, headers=headers), "path")
        _refused(server.call("POST", f"{prefix}/files/permissions", {"": {"mode": 755}}, headers=headers), "path")
        _refused(server.call("POST", f"{prefix}/files/mv", [{"src": "", "dest": "x"}], headers=headers), "src")
        _refused(server.call("POST", f"{prefix}/files/replace", {"": {"old": "a", "new": "b"}}, headers=headers),
                 "path")
        _refused(server.call("POST", f"{prefix}/directories", {"d": {"owner": 0}}, headers=headers), "owner")
        status, _ = server.call("POST", f"{prefix}/session", {"cwd": ""}, headers=headers)
        assert status == 400
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


# A web app that tries to act on the API's origin: a cookie for /, a service worker for the whole origin.
APP = r'''
import http.server
class App(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        out = b"<script>fetch('/v1/sandboxes')</script>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Set-Cookie", "session=stolen; Path=/; Domain=127.0.0.1; HttpOnly")
        self.send_header("Set-Cookie", "plain=1")
        self.send_header("Service-Worker-Allowed", "/")
        self.send_header("Clear-Site-Data", "\"*\"")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", 8000), App).serve_forever()
'''


def test_what_a_port_answers_cannot_act_on_the_apis_origin(server: base.Server) -> None:
    status, box = server.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"},
                                                       "entrypoint": ["python3", "-c", APP],
                                                       "networkPolicy": {"defaultAction": "deny"}})
    assert status == 202, box
    try:
        status, endpoint = server.call("GET", f"/v1/sandboxes/{box['id']}/endpoints/8000")
        assert status == 200, endpoint
        deadline = time.monotonic() + 20
        while True:
            r = httpx.get(f"http://{endpoint['endpoint']}/page", headers=endpoint["headers"], timeout=30)
            if r.status_code != 502 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
        policy = r.headers["content-security-policy"]
        assert policy.startswith("sandbox ") and "allow-scripts" in policy and "allow-same-origin" not in policy
        assert "service-worker-allowed" not in r.headers and "clear-site-data" not in r.headers
        prefix = f"/sandboxes/{box['id']}/port/8000"
        cookies = r.headers.get_list("set-cookie")
        assert cookies == [f"session=stolen; HttpOnly; Path={prefix}", f"plain=1; Path={prefix}"], cookies
        # The server-proxy form scopes them to the path the client used.
        r = httpx.get(f"http://{server.domain}/sandboxes/{box['id']}/proxy/8000/",
                      headers={"OPEN-SANDBOX-API-KEY": KEY}, timeout=30)
        assert r.headers.get_list("set-cookie")[1] == f"plain=1; Path=/sandboxes/{box['id']}/proxy/8000", r.headers
        # The API never takes a cookie for its key.
        status, _ = server.call("GET", "/v1/sandboxes", key=None, headers={"Cookie": f"OPEN-SANDBOX-API-KEY={KEY}"})
        assert status == 401
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")


def test_names_and_counts_elsewhere_are_matched_whole() -> None:
    from isolate.backends.registry import _check_name
    from isolate.model.errors import PolicyError
    from isolate.model.units import parse_count

    for bad in ("abc\n", "abc\n\n"):
        with pytest.raises(PolicyError):
            _check_name(bad)  # a kept sandbox's name becomes paths of the state directory
    with pytest.raises(PolicyError):
        parse_count("\u00b2", "pids")  # isdigit() says yes to a superscript two; int() does not
