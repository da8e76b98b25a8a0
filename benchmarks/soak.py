"""``python -m benchmarks.soak [--seconds S] [--clients N] [--out FILE]``: one server under mixed work for a while.

``isolate-run serve`` on a free loopback port (a state directory of its own,
``--end-on-exit``), and N clients, each a thread speaking the API over plain
HTTP, doing over and over for S seconds: create a sandbox (1 CPU, 512 MiB),
ask its endpoint, run commands (one writes a file), read the file back
(``/files/download``), list its directory, patch its metadata, renew it, take a
snapshot of it one round in four (and delete the snapshot), and delete it.
Every request is timed per operation. Every few seconds the server's resident
memory, its open descriptors and threads, the host's mounts and the server's
kept sandboxes are sampled.

Reported (JSON, and ``--out FILE``): requests and errors (a status of 400 or
more, or no answer) per operation with their p50/p99, and the samples over
time. Bounds checked at the end, once every sandbox is deleted: no error; the
server's descriptors within 64 of the first sample's, the host's mounts
within 16 of the first sample's, no kept sandbox of the server's left, and its
resident memory grown by at most 64 MiB over the first sample taken after the
first minute (or the first sample, in a shorter run); the exit status is 1
when a bound is passed. ``tests/test_soak.py`` runs it for two minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from ._stats import summary_ms
from .opensandbox import KEY, _limits_enforceable, _server

FD_BOUND = 64
MOUNT_BOUND = 16
RSS_BOUND = 64 << 20


class Client:
    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.lock = threading.Lock()
        self.times: dict[str, list[float]] = {}
        self.errors: dict[str, list[str]] = {}

    def call(self, op: str, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://{self.domain}{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        for name, value in (headers if headers is not None else {"OPEN-SANDBOX-API-KEY": KEY}).items():
            request.add_header(name, value)
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status, text = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read()
        except OSError as exc:
            status, text = 0, str(exc).encode()
        elapsed = time.perf_counter() - started
        with self.lock:
            self.times.setdefault(op, []).append(elapsed)
            if status == 0 or status >= 400:
                self.errors.setdefault(op, []).append(f"{status}: {text[:200].decode(errors='replace')}")
        return status, text


def _round(client: Client, rng: random.Random) -> None:
    status, text = client.call("create", "POST", "/v1/sandboxes", {
        "image": {"uri": "bench"}, "timeout": 600, "resourceLimits": {"cpu": "1", "memory": "512Mi"},
        "metadata": {"soak": "yes"}})
    if status != 202:
        return
    sandbox_id = json.loads(text)["id"]
    try:
        status, text = client.call("endpoint", "GET", f"/v1/sandboxes/{sandbox_id}/endpoints/44772")
        if status != 200:
            return
        found = json.loads(text)
        prefix, headers = "/" + found["endpoint"].split("/", 1)[1], found["headers"]
        payload = "x" * rng.randint(1, 4096)
        client.call("command", "POST", prefix + "/command",
                    {"command": f"printf %s {payload} > /workspace/f.txt && echo written"}, headers)
        client.call("command", "POST", prefix + "/command", {"command": "ls -l /workspace; seq 1 200"}, headers)
        status, data = client.call("download", "GET", prefix + "/files/download?path=/workspace/f.txt",
                                   headers=headers)
        if status == 200 and data != payload.encode():
            with client.lock:
                client.errors.setdefault("download", []).append("the file read back is not the file written")
        client.call("list", "GET", prefix + "/directories/list?path=/workspace", headers=headers)
        client.call("metadata", "PATCH", f"/v1/sandboxes/{sandbox_id}/metadata", {"round": str(rng.random())})
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 900))
        client.call("renew", "POST", f"/v1/sandboxes/{sandbox_id}/renew-expiration", {"expiresAt": when})
        if rng.random() < 0.25:
            status, text = client.call("snapshot", "POST", f"/v1/sandboxes/{sandbox_id}/snapshots", {})
            if status in (200, 201, 202):
                client.call("snapshot-delete", "DELETE", f"/v1/snapshots/{json.loads(text)['id']}")
    finally:
        client.call("delete", "DELETE", f"/v1/sandboxes/{sandbox_id}")


def _mounts() -> int:
    with open("/proc/self/mountinfo") as handle:
        return sum(1 for _ in handle)


def _sample(proc_pid: int, started: float, prefix_dir: str) -> dict[str, Any]:
    import psutil

    from isolate.backends.native.named import native_names

    server = psutil.Process(proc_pid)
    with server.oneshot():
        rss, fds, threads = server.memory_info().rss, server.num_fds(), server.num_threads()
    kept = sum(1 for name in native_names() if name.startswith(prefix_dir))
    return {"t": round(time.monotonic() - started, 1), "rss_mb": round(rss / 2**20, 1), "fds": fds,
            "threads": threads, "mounts": _mounts(), "kept_sandboxes": kept}


def run(seconds: float, clients: int, log: Any) -> dict[str, Any]:
    import hashlib

    enforceable = _limits_enforceable()
    proc, domain = _server(not enforceable)
    args = [str(a) for a in proc.args]  # type: ignore[union-attr]
    state_dir = args[args.index("--state-dir") + 1]
    prefix = f"osb-{hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:8]}-"
    client = Client(domain)
    started = time.monotonic()
    samples = [_sample(proc.pid, started, prefix)]
    stop = threading.Event()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            _round(client, rng)

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(clients)]
    try:
        for worker in workers:
            worker.start()
        interval = max(1.0, min(10.0, seconds / 24))
        while time.monotonic() - started < seconds:
            time.sleep(interval)
            samples.append(_sample(proc.pid, started, prefix))
            log(f"t={samples[-1]['t']} s: rss {samples[-1]['rss_mb']} MB, {samples[-1]['fds']} fds, "
                f"{samples[-1]['kept_sandboxes']} sandboxes")
        stop.set()
        for worker in workers:
            worker.join(300)
        time.sleep(1.0)
        final = _sample(proc.pid, started, prefix)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
    ops = {op: {**summary_ms(values), "errors": len(client.errors.get(op, []))}
           for op, values in sorted(client.times.items())}
    baseline = next((s for s in samples if s["t"] >= 60), samples[0]) if seconds > 90 else samples[0]
    problems = []
    errors = {op: found[:5] for op, found in client.errors.items() if found}
    if errors:
        problems.append(f"errors: {json.dumps(errors)[:2000]}")
    if final["fds"] > samples[0]["fds"] + FD_BOUND:
        problems.append(f"descriptors: {samples[0]['fds']} at start, {final['fds']} at the end")
    if final["mounts"] > samples[0]["mounts"] + MOUNT_BOUND:
        problems.append(f"mounts: {samples[0]['mounts']} at start, {final['mounts']} at the end")
    if final["kept_sandboxes"]:
        problems.append(f"{final['kept_sandboxes']} sandboxes left after every delete")
    if final["rss_mb"] * 2**20 > baseline["rss_mb"] * 2**20 + RSS_BOUND:
        problems.append(f"resident memory: {baseline['rss_mb']} MB at t={baseline['t']} s, {final['rss_mb']} MB at "
                        "the end")
    return {"seconds": seconds, "clients": clients, "requests": sum(len(v) for v in client.times.values()),
            "errors": sum(len(v) for v in client.errors.values()), "operations": ops, "samples": samples,
            "final": final, "bounds": {"fds": FD_BOUND, "mounts": MOUNT_BOUND, "rss_mb": RSS_BOUND >> 20},
            "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="how long (default 3600)")
    parser.add_argument("--clients", type=int, default=16, help="clients at once (default 16)")
    parser.add_argument("--out", help="also write the JSON to this file")
    args = parser.parse_args(argv)
    results = run(args.seconds, args.clients, lambda m: print(m, file=sys.stderr, flush=True))
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    for problem in results["problems"]:
        print(f"soak: {problem}", file=sys.stderr)
    return 1 if results["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
