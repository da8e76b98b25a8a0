"""``python -m benchmarks.opensandbox_ports [--rounds N]``: a request to a sandbox's own port, forwarded.

``isolate-run serve`` on a free loopback port, one sandbox (networkPolicy
deny: a loopback of its own) whose entrypoint is a small HTTP server on its
port 8000, reached through ``GET /v1/sandboxes/{id}/endpoints/8000``:

- ``forwarded-get``: one GET through the endpoint (the server asks the
  sandbox's connector for a connection, then speaks HTTP on it), a new
  client connection each time (one httpx client, no keep-alive);
- ``host-direct-get``: the same GET to the same kind of server on the host's
  loopback, no sandbox and no forward: what HTTP on loopback costs anyway.

Interleaved in the same rounds; figures printed as JSON (milliseconds), the
latest kept in ``benchmarks/results/opensandbox_ports.json``; nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ._stats import summary_ms
from .opensandbox import KEY, _limits_enforceable, _server

APP = r'''
import http.server
class App(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from the sandbox\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), App).serve_forever()
'''


class _HostApp(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from the host\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def run(rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    import httpx
    from opensandbox import SandboxSync
    from opensandbox.config import ConnectionConfigSync
    from opensandbox.models.sandboxes import NetworkPolicy

    os.environ["OPENSANDBOX_DISABLE_METRICS"] = "1"
    proc, domain = _server(best_effort=not _limits_enforceable())
    host_app = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostApp)
    threading.Thread(target=host_app.serve_forever, daemon=True).start()
    results: dict[str, Any] = {"rounds": rounds}
    try:
        config = ConnectionConfigSync(domain=domain, api_key=KEY)
        box = SandboxSync.create("bench", connection_config=config, entrypoint=["python3", "-c", APP],
                                 network_policy=NetworkPolicy(defaultAction="deny"))
        try:
            endpoint = box.get_endpoint(8000)
            forwarded = f"http://{endpoint.endpoint}/"
            direct = f"http://127.0.0.1:{host_app.server_address[1]}/"
            deadline = time.monotonic() + 30
            while httpx.get(forwarded, headers=endpoint.headers).status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("the app in the sandbox did not start")
                time.sleep(0.05)

            # One client, no keep-alive: every request is a new connection, to the server or to the host's app.
            client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

            def get(url: str, headers: dict[str, str]) -> float:
                started = time.perf_counter()
                r = client.get(url, headers=headers)
                elapsed = time.perf_counter() - started
                if r.status_code != 200:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
                return elapsed

            variants: dict[str, Callable[[], float]] = {
                "forwarded-get": lambda: get(forwarded, endpoint.headers),
                "host-direct-get": lambda: get(direct, {}),
            }
            times: dict[str, list[float]] = {name: [] for name in variants}
            for i in range(rounds):
                names = list(variants)
                for name in names[i % 2:] + names[:i % 2]:
                    times[name].append(variants[name]())
            for name, values in times.items():
                results[name] = summary_ms(values)
                log(f"{name}: median {results[name]['median_ms']} ms")
        finally:
            box.kill()
    finally:
        host_app.shutdown()
        proc.terminate()
        proc.wait(30)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.opensandbox_ports",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="requests of each variant (default 200)")
    args = parser.parse_args(argv)
    results = run(args.rounds, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
