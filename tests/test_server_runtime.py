"""``isolate-run serve``, the routes of OpenSandbox's current specs beyond SDK 1.1: a sandbox's own ports
forwarded, metadata patches, metrics and their watch, diagnostics. Through the real SDK (``opensandbox``)
where it has the method, plain HTTP where it has none; the server runs as in tests/test_server.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import test_server as base
from conftest import egress_profile

httpx = pytest.importorskip("httpx")

from opensandbox import SandboxSync  # noqa: E402
from opensandbox.config import ConnectionConfigSync  # noqa: E402
from opensandbox.exceptions import SandboxException  # noqa: E402
from opensandbox.models.execd import RunCommandOpts  # noqa: E402
from opensandbox.models.sandboxes import NetworkPolicy  # noqa: E402

KEY = base.KEY

# A web app inside the sandbox: answers every request with what it received, as JSON.
ECHO = r'''
import http.server, json
class Echo(http.server.BaseHTTPRequestHandler):
    def answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n).decode() if n else ""
        out = json.dumps({"method": self.command, "path": self.path, "body": body,
                          "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-App", "echo")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = do_PUT = answer
    def log_message(self, *args):
        print("served", self.command, self.path, flush=True)
http.server.HTTPServer(("127.0.0.1", 8000), Echo).serve_forever()
'''


server = base.server  # the suite's server, started once for this module


def config(server: base.Server) -> ConnectionConfigSync:
    return ConnectionConfigSync(domain=server.domain, api_key=KEY)


def until_listening(url: str, headers: dict[str, str]) -> Any:
    deadline = time.monotonic() + 20
    while True:
        r = httpx.post(url, content=b"hello", headers=headers, timeout=30)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_endpoint_forwards_http_to_the_sandboxs_own_port(server: base.Server) -> None:
    sandbox = SandboxSync.create("ubuntu", connection_config=config(server), entrypoint=["python3", "-c", ECHO],
                                 network_policy=NetworkPolicy(defaultAction="deny"))
    try:
        endpoint = sandbox.get_endpoint(8000)
        assert endpoint.endpoint == f"{server.domain}/sandboxes/{sandbox.id}/port/8000"
        url = f"http://{endpoint.endpoint}/echo/a%20b?q=1&r=%2F"
        r = until_listening(url, endpoint.headers)
        assert r.status_code == 201 and r.headers["x-app"] == "echo", r.text
        seen = r.json()
        assert (seen["method"], seen["path"], seen["body"]) == ("POST", "/echo/a%20b?q=1&r=%2F", "hello")
        assert seen["headers"]["host"] == "127.0.0.1:8000"
        assert seen["headers"]["x-forwarded-prefix"] == f"/sandboxes/{sandbox.id}/port/8000"
        # Neither the port's token nor the server's API key (the SDK's server-proxy mode) reaches the app.
        r = httpx.put(url, content=b"x" * 100000, headers={"OPEN-SANDBOX-API-KEY": KEY, "X-Mine": "1"}, timeout=30)
        assert r.status_code == 201 and r.json()["body"] == "x" * 100000
        sent = r.json()["headers"]
        assert sent["x-mine"] == "1"
        assert not {"open-sandbox-api-key", "opensandbox-secure-access", "x-execd-access-token"} & set(sent)
        assert all(KEY not in value for value in sent.values())
        # The token is the port's: none, or another port's, is refused; a port nothing listens on is 502.
        assert httpx.get(url).status_code == 401
        other = sandbox.get_endpoint(8001)
        r = httpx.get(url, headers=other.headers)
        assert r.status_code == 401 and set(r.json()) == {"code", "message"}
        r = httpx.get(f"http://{other.endpoint}/", headers=other.headers)
        assert (r.status_code, r.json()["code"]) == (502, "PORT_NOT_LISTENING")
        # The execution API's token does not open other ports either.
        execd = sandbox.get_endpoint(44772)
        assert httpx.get(url, headers=execd.headers).status_code == 401
        # A connector killed from inside is started again at the next forward.
        killed = sandbox.commands.run(
            "python3 -c 'import os, signal\nfor p in filter(str.isdigit, os.listdir(\"/proc\")):\n"
            "    if b\"send\" + b\"_fds\" in open(\"/proc/%s/cmdline\" % p, \"rb\").read():\n"
            "        os.kill(int(p), signal.SIGKILL); print(\"killed\")'")
        assert [m.text for m in killed.logs.stdout] == ["killed"]
        again = httpx.get(url, headers=endpoint.headers)
        assert again.status_code == 201, again.text
        # The app's own log (its stdout) is the sandbox's container log.
        logs = sandbox.get_diagnostic_logs("container")
        assert "served POST /echo/a%20b?q=1&r=%2F" in (logs.content or "")
    finally:
        sandbox.kill()
    assert httpx.get(url, headers=endpoint.headers).status_code == 401  # gone with its sandbox


# A WebSocket echo inside the sandbox, from the standard library only: text comes back prefixed, bytes reversed.
WS_ECHO = r"""
import base64, hashlib, socket, struct, threading
def serve(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    lines = data.split(b"\r\n\r\n")[0].decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    key = headers["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
    accept = base64.b64encode(hashlib.sha1(key.encode()).digest()).decode()
    proto = headers.get("sec-websocket-protocol", "").split(",")[0].strip()
    conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  "Sec-WebSocket-Accept: " + accept + "\r\n"
                  + ("Sec-WebSocket-Protocol: " + proto + "\r\n" if proto else "") + "\r\n").encode())
    f = conn.makefile("rb")
    def send(op, payload):
        n = len(payload)
        size = bytes([n]) if n < 126 else b"\x7e" + struct.pack("!H", n) if n < 65536 else \
            b"\x7f" + struct.pack("!Q", n)
        conn.sendall(bytes([0x80 | op]) + size + payload)
    send(1, ("path " + lines[0].split()[1]).encode())
    while True:
        b1, b2 = f.read(2)
        n = b2 & 127
        if n == 126:
            n = struct.unpack("!H", f.read(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", f.read(8))[0]
        mask = f.read(4) if b2 & 128 else bytes(4)
        payload = bytes(c ^ mask[i % 4] for i, c in enumerate(f.read(n)))
        op = b1 & 15
        if op == 8:
            send(8, payload[:2])
            return
        if op == 1:
            send(1, b"echo:" + payload)
        elif op == 2:
            send(2, payload[::-1])
server = socket.create_server(("127.0.0.1", 8002))
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""


def ws_connect(domain: str, target: str, headers: dict[str, str]) -> tuple[Any, Any, Any]:
    """A WebSocket client (wsproto over a socket): (socket, connection, the server's first event)."""
    import socket

    from wsproto import ConnectionType, WSConnection
    from wsproto.events import Request

    host, port = domain.split(":")
    sock = socket.create_connection((host, int(port)), 10)
    ws = WSConnection(ConnectionType.CLIENT)
    sock.sendall(ws.send(Request(host=domain, target=target, subprotocols=["chat"],
                                 extra_headers=[(k.encode(), v.encode()) for k, v in headers.items()])))
    return sock, ws, ws_next(sock, ws)


def ws_next(sock: Any, ws: Any) -> Any:
    while True:
        for event in ws.events():
            return event
        data = sock.recv(65536)
        ws.receive_data(data or None)


def test_endpoint_forwards_websocket(server: base.Server) -> None:
    pytest.importorskip("wsproto", reason="the server extra installs wsproto (uvicorn's WebSocket)")
    from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, RejectConnection, TextMessage

    sandbox = SandboxSync.create("ubuntu", connection_config=config(server), entrypoint=["python3", "-c", WS_ECHO],
                                 network_policy=NetworkPolicy(defaultAction="deny"))
    try:
        endpoint = sandbox.get_endpoint(8002)
        target = f"/sandboxes/{sandbox.id}/port/8002/live?x=1"
        deadline = time.monotonic() + 20
        while True:
            sock, ws, event = ws_connect(server.domain, target, endpoint.headers)
            if isinstance(event, AcceptConnection) or time.monotonic() > deadline:
                break
            sock.close()  # the app is not listening yet
            time.sleep(0.05)
        assert isinstance(event, AcceptConnection) and event.subprotocol == "chat"
        first = ws_next(sock, ws)
        assert isinstance(first, TextMessage) and first.data == "path /live?x=1"
        sock.sendall(ws.send(TextMessage(data="hi")))
        reply = ws_next(sock, ws)
        assert isinstance(reply, TextMessage) and reply.data == "echo:hi"
        sock.sendall(ws.send(BytesMessage(data=b"abc" * 30000)))
        got = b""
        while len(got) < 90000:
            part = ws_next(sock, ws)
            assert isinstance(part, BytesMessage)
            got += part.data
        assert got == (b"abc" * 30000)[::-1]
        sock.sendall(ws.send(CloseConnection(code=1000)))
        assert isinstance(ws_next(sock, ws), CloseConnection)
        sock.close()
        # Without the port's token the handshake is refused.
        sock, ws, event = ws_connect(server.domain, target, {})
        assert isinstance(event, RejectConnection) and event.status_code == 403
        sock.close()
    finally:
        sandbox.kill()


def test_endpoint_needs_a_loopback(server: base.Server) -> None:
    """Under network none nothing inside can listen: the endpoint is refused with the way out."""
    sandbox = SandboxSync.create("ubuntu", connection_config=config(server))
    try:
        with pytest.raises(SandboxException, match="networkPolicy"):
            sandbox.get_endpoint(8000)
    finally:
        sandbox.kill()


def test_metadata_metrics_and_diagnostics(server: base.Server) -> None:
    sandbox = SandboxSync.create("ubuntu", connection_config=config(server), metadata={"team": "a", "old": "x"})
    try:
        info = sandbox.patch_metadata({"old": None, "env": "test"})
        assert info.metadata == {"team": "a", "env": "test"}
        assert sandbox.get_info().metadata == {"team": "a", "env": "test"}
        for bad in ({"opensandbox.io/x": "1"}, {"a b": "1"}, {"k": "two words"}, {"k": "x" * 64},
                    {"Not_DNS/k": "1"}, {"-k": "1"}):
            with pytest.raises(SandboxException, match="INVALID_METADATA_LABEL"):
                sandbox.patch_metadata(bad)
        assert sandbox.patch_metadata({"example.com/k": "v-1.2_3", "e": ""}).metadata == \
            {"team": "a", "env": "test", "example.com/k": "v-1.2_3", "e": ""}
        sandbox.patch_metadata({"example.com/k": None, "e": None})

        metrics = sandbox.get_metrics()
        assert metrics.cpu_count > 0 and 0 <= metrics.cpu_used_percentage <= 100
        assert 0 < metrics.memory_used_in_mib <= metrics.memory_total_in_mib
        # A busy loop shows: the percentage is the sandbox's own, over the CPUs it may use.
        # On a loaded host the loop may get little CPU in half a second: readings are taken until one shows
        # it (each reading is the share since the one before), for as long as the loop runs.
        sandbox.commands.run("timeout 10 sh -c 'while :; do :; done'", opts=RunCommandOpts(background=True))
        sandbox.get_metrics()
        deadline, seen = time.monotonic() + 9, 0.0
        while seen <= 20 and time.monotonic() < deadline:
            time.sleep(0.5)
            seen = sandbox.get_metrics().cpu_used_percentage
        assert seen > 20

        # metrics/watch: a reading a second, as server-sent events (the SDK has no method for it).
        url = f"http://{server.domain}/sandboxes/{sandbox.id}/port/44772/metrics/watch"
        readings = []
        with httpx.stream("GET", url, headers={"OPEN-SANDBOX-API-KEY": KEY}, timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    readings.append(json.loads(line[6:]))
                    if len(readings) == 2:
                        break
        assert set(readings[0]) == {"cpu_count", "cpu_used_pct", "mem_total_mib", "mem_used_mib", "timestamp"}
        assert readings[1]["timestamp"] - readings[0]["timestamp"] >= 900

        events = sandbox.get_diagnostic_events("lifecycle")
        assert (events.kind, events.delivery, events.truncated) == ("events", "inline", False)
        text = events.content or ""
        assert "created from image 'ubuntu'" in text and "metadata patched: env='test', old=(deleted)" in text
        logs = sandbox.get_diagnostic_logs("all")
        assert "metadata patched" in (logs.content or "")
        with pytest.raises(SandboxException, match="scope"):
            sandbox.get_diagnostic_events("runtime")
    finally:
        sandbox.kill()


def test_egress_policy_changes_at_run_time(tmp_path: Any, upstream: int) -> None:
    """PATCH /policy allows a name from now on; DELETE removes one and closes the connections open to it."""
    from opensandbox.models.sandboxes import NetworkRule

    port = upstream
    profile = egress_profile(tmp_path, port)
    srv = base.Server("--image", f"egress={profile}", "--best-effort")
    probe = ("python3 -c 'import socket, sys\ntry:\n s = socket.create_connection((sys.argv[1], PORT), 5)\n"
             " print(s.recv(3).decode().strip())\nexcept OSError as e:\n print(type(e).__name__)' ").replace(
                 "PORT", str(port))
    hold = ("python3 -c 'import socket\ns = socket.create_connection((\"web.test\", PORT), 5)\n"
            "print(\"open\", s.recv(3), flush=True)\nprint(\"end\", s.recv(10), flush=True)'").replace(
                "PORT", str(port))
    try:
        sandbox = SandboxSync.create("egress", connection_config=config(srv))
        try:
            def run(cmd: str) -> list[str]:
                return [m.text for m in sandbox.commands.run(cmd).logs.stdout]

            assert run(probe + "web.test") == ["hi"]
            assert run(probe + "late.test") == ["hi"]
            sandbox.delete_egress_rules(["late.test"])
            assert run(probe + "late.test") == ["gaierror"]
            holder = sandbox.commands.run(hold, opts=RunCommandOpts(background=True)).id
            logs = f"http://{srv.domain}/sandboxes/{sandbox.id}/port/44772/command/{holder}/logs"

            def holder_says() -> str:
                return str(httpx.get(logs, headers={"OPEN-SANDBOX-API-KEY": KEY}).text)

            deadline = time.monotonic() + 10
            while "open" not in holder_says() and time.monotonic() < deadline:
                time.sleep(0.05)

            sandbox.patch_egress_rules([NetworkRule(action="allow", target=f"late.test:{port}")])
            assert run(probe + "late.test") == ["hi"]
            policy = sandbox.get_egress_policy()
            assert [(r.action, r.target) for r in policy.egress or []] == [("allow", f"late.test:{port}"),
                                                                            ("allow", f"web.test:{port}")]
            assert "end" not in holder_says()  # still allowed: still open
            # A deny rule (under the default deny) is listed, first, as the egress spec's merge has it.
            sandbox.patch_egress_rules([NetworkRule(action="deny", target="other.test"),
                                        NetworkRule(action="allow", target="other.test")])  # the first wins
            assert [(r.action, r.target) for r in sandbox.get_egress_policy().egress or []] == [
                ("deny", "other.test"), ("allow", f"late.test:{port}"), ("allow", f"web.test:{port}")]

            sandbox.delete_egress_rules(["web.test"])
            deadline = time.monotonic() + 10
            while "end b''" not in holder_says() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "open b'hi\\n'\nend b''" in holder_says()
            assert run(probe + "web.test") == ["gaierror"]
            assert run(probe + "late.test") == ["hi"]
            # A port the sandbox did not listen on at start cannot be added.
            with pytest.raises(SandboxException, match="listens only on the ports"):
                sandbox.patch_egress_rules([NetworkRule(action="allow", target="late.test:1")])
            events = sandbox.get_diagnostic_events("lifecycle").content or ""
            assert "1 connection(s) to names no longer allowed closed" in events
        finally:
            sandbox.kill()
    finally:
        srv.stop()


def test_renew_on_access_through_the_server_proxy(server: base.Server) -> None:
    """extensions["access.renew.extend.seconds"] (OSEP-0009): a request through the server renews the expiry;
    the endpoints' server-proxy form (use_server_proxy) serves the same routes."""
    from datetime import timedelta

    cfg = ConnectionConfigSync(domain=server.domain, api_key=KEY, use_server_proxy=True)
    sandbox = SandboxSync.create("ubuntu", connection_config=cfg, timeout=timedelta(seconds=60),
                                 extensions={"access.renew.extend.seconds": "300"})
    try:
        info = sandbox.get_info()
        assert info.expires_at is not None
        assert f"/sandboxes/{sandbox.id}/proxy/44772" in sandbox.get_endpoint(44772).endpoint
        assert [m.text for m in sandbox.commands.run("echo via-proxy").logs.stdout] == ["via-proxy"]
        # An encoded "proxy" is not the alias: the path as sent and as decoded would name two routes.
        odd = httpx.get(f"http://{server.domain}/sandboxes/{sandbox.id}/prox%79/44772/ping",
                        headers={"OPEN-SANDBOX-API-KEY": KEY})
        assert odd.status_code == 404, odd.text
        renewed = sandbox.get_info().expires_at
        assert renewed is not None and renewed > info.created_at + timedelta(seconds=250), (info, renewed)
        events = sandbox.get_diagnostic_events("lifecycle").content or ""
        assert "renewed on access" in events
    finally:
        sandbox.kill()
    # Out of OSEP-0009's range, not a string, or another key: refused, nothing made.
    for extensions in ({"access.renew.extend.seconds": "299"}, {"access.renew.extend.seconds": 600},
                       {"other.key": "1"}):
        status, body = server.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "entrypoint": ["true"],
                                                              "resourceLimits": {}, "extensions": extensions})
        assert status == 400 and "extensions" in body["message"], body


def test_ports_benchmark_runs() -> None:
    """benchmarks/opensandbox_ports.py runs (two rounds); its figures are not asserted."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from benchmarks import opensandbox_ports as bench
    finally:
        sys.path.pop(0)
    results = bench.run(2, lambda message: None)
    assert results["forwarded-get"]["n"] == 2 and results["host-direct-get"]["n"] == 2


def test_the_container_log_answers_its_tail_of_a_long_entrypoint_output(server: base.Server) -> None:
    # The entrypoint's output, past what an answer holds (1 MiB): its last bytes, marked truncated (the server
    # reads only that tail of the sandbox's log file, never the whole kept output per request).
    box = base._create(server, entrypoint=["/bin/sh", "-c", "head -c 2621440 /dev/zero | tr '\\0' x; echo; "
                                           "echo last; exec tail -f /dev/null"])
    try:
        deadline = time.monotonic() + 60
        while True:
            status, logs = server.call("GET", f"/v1/sandboxes/{box['id']}/diagnostics/logs?scope=container")
            assert status == 200, logs
            if logs["content"].endswith("\nlast\n") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert logs["content"].endswith("x\nlast\n") and logs["truncated"], logs["content"][-40:]
        assert logs["contentLength"] <= 1 << 20 and set(logs["content"][:-6]) == {"x"}
    finally:
        server.call("DELETE", f"/v1/sandboxes/{box['id']}")
