"""The egress mediator's cost: ``python -m benchmarks.egress [--rounds N] [--size MB] [--out PATH]``.

- latency: a TCP connect, a one-byte request and a one-byte response, then
  close, against a server on 127.0.0.1: direct, through the transparent path
  (the name's fake address and the port), and through the proxy (CONNECT,
  then the same request); medians of interleaved rounds, and the time the
  mediator adds;
- throughput: a download of ``--size`` MB (100 by default) from the same
  server (sendfile from a file in /dev/shm or /tmp), direct and through the
  transparent path, interleaved; medians in MB/s and their ratio, and the
  CPU time the mediator spent per download. On loopback the relay is a third
  party wanting a core (server, mediator, client): with two cores, shared,
  the ratio is bounded by the cores, not by the relay.

The server and the client are processes of their own (as the sandbox's
program and the outside world are); the mediator runs in this process's
threads, as it does in the host process that runs a sandbox. For now the
mediator's listeners are on the host's loopback (127.77.x.y, the plan's
addresses); the sandbox's own namespace changes nothing the mediator does.
Goals (issue 16): under 1 ms added per connection, at least 80% of direct
throughput. Results: ``benchmarks/results/egress.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from ._stats import median, ratio, summary_ms
from .machine import describe

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "egress.json")

SERVER = r"""
import os, socket, sys, threading
path = sys.argv[1]
size = os.path.getsize(path)
server = socket.create_server(("127.0.0.1", 0), backlog=1024)
print(server.getsockname()[1], flush=True)
def serve(conn):
    with conn:
        request = conn.recv(1)
        if request == b"p":
            conn.sendall(b"o")
        elif request == b"d":
            with open(path, "rb") as f:
                conn.sendfile(f, 0, size)
while True:
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

CLIENT = r"""
import json, socket, sys, time
targets = json.loads(sys.argv[1]); mode = sys.argv[2]; rounds = int(sys.argv[3]); size = int(sys.argv[4])
warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 0
buffer = bytearray(1 << 20)
for target in targets.values():
    if target.get("resolve"):  # once: the connections are measured, not the lookups
        target["host"] = socket.gethostbyname(target["host"])
def lookup(target):
    t = time.perf_counter()
    socket.gethostbyname(target["name"])
    return time.perf_counter() - t
def connect(target):
    s = socket.create_connection((target["host"], target["port"]))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if target.get("connect"):
        s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target["connect"], target["connect"])).encode())
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            chunk = s.recv(1)
            if not chunk:
                raise SystemExit("the proxy closed: %r" % head)
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit("the proxy refused: %r" % head)
    return s
def ping(target):
    t = time.perf_counter()
    s = connect(target)
    s.sendall(b"p")
    assert s.recv(1) == b"o"
    s.close()
    return time.perf_counter() - t
def download(target):
    t = time.perf_counter()
    s = connect(target)
    s.sendall(b"d")
    got = 0
    while True:
        n = s.recv_into(buffer)
        if not n:
            break
        got += n
    s.close()
    assert got == size, got
    return time.perf_counter() - t
work = {"latency": ping, "download": download, "dns": lookup}[mode]
samples = {name: [] for name in targets}
names = list(targets)
for name in names:  # a warm-up per target: the first connections of a run start the mediator's threads
    for _ in range(warmup):
        work(targets[name])
for i in range(rounds):
    for name in (names if i % 2 == 0 else names[::-1]):
        samples[name].append(work(targets[name]))
print(json.dumps(samples))
"""


def _dns_query(port: int, name: str) -> str:
    from isolate.egress import dns
    from isolate.model.egress_rules import DNS_ADDRESS

    message = dns.build_query(1, name, dns.TYPE_A)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(message, (DNS_ADDRESS, port))
        answer = dns.parse_response(s.recv(4096), 1, name, dns.TYPE_A)
    return answer.records[0][0]


def _client(targets: dict[str, Any], mode: str, rounds: int, size: int) -> dict[str, list[float]]:
    done = subprocess.run([sys.executable, "-I", "-S", "-c", CLIENT, json.dumps(targets), mode, str(rounds),
                           str(size)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip()[-500:])
    data: dict[str, list[float]] = json.loads(done.stdout)
    return data


@contextlib.contextmanager
def _server(size_mb: int) -> Iterator[int]:
    """The download server (a process of its own) serving ``size_mb`` MB of random bytes; yields its port."""
    directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.NamedTemporaryFile(dir=directory, prefix="isolate-egress-bench-") as blob:
        chunk = os.urandom(1 << 20)
        for _ in range(size_mb):
            blob.write(chunk)
        blob.flush()
        os.chmod(blob.name, 0o644)  # read by the server only, but a sandbox's uid may differ
        server = subprocess.Popen([sys.executable, "-I", "-S", "-c", SERVER, blob.name], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout is not None
            yield int(server.stdout.readline())
        finally:
            server.kill()
            server.wait()


def measure(rounds: int = 300, download_rounds: int = 7, size_mb: int = 100,
            log: Any = lambda text: print(text, file=sys.stderr)) -> dict[str, Any]:
    from isolate.egress import Mediator
    from isolate.model.egress_rules import DNS_ADDRESS, PROXY_ADDRESS, EgressRules, HostRule

    size = size_mb * 1024 * 1024
    with _server(size_mb) as port:
        rules = EgressRules((HostRule("bench.test", (port,)),), (("bench.test", "127.0.0.1"),), None, False)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((DNS_ADDRESS, 0))
        dns_port = int(udp.getsockname()[1])
        proxy = socket.create_server((PROXY_ADDRESS, 0), backlog=1024)
        proxy_port = int(proxy.getsockname()[1])
        name_listener = socket.create_server(("127.77.1.0", port), backlog=1024)
        with Mediator(rules, udp, [proxy, name_listener], dns_port=dns_port, proxy_port=proxy_port) as mediator:
            address = _dns_query(dns_port, "bench.test")
            targets = {
                "direct": {"host": "127.0.0.1", "port": port},
                "transparent": {"host": address, "port": port},
                "proxy": {"host": PROXY_ADDRESS, "port": proxy_port, "connect": f"bench.test:{port}"},
            }
            _client(targets, "latency", 20, size)    # warm-up
            latency = _client(targets, "latency", rounds, size)
            before = resource.getrusage(resource.RUSAGE_SELF)
            downloads = _client({k: targets[k] for k in ("direct", "transparent")}, "download",
                                download_rounds, size)
            after = resource.getrusage(resource.RUSAGE_SELF)
            served = mediator.summary()
    medians = {name: median(samples) for name, samples in latency.items()}
    mb_s = {name: [size / 1e6 / s for s in samples] for name, samples in downloads.items()}
    out: dict[str, Any] = {
        "method": (__doc__ or "").strip().split("\n\n")[0],
        "latency": {name: summary_ms(samples) for name, samples in latency.items()},
        "added_ms": {name: round((medians[name] - medians["direct"]) * 1000, 4)
                     for name in ("transparent", "proxy")},
        "throughput": {"size_mb": size_mb, "rounds": download_rounds,
                       **{f"{name}_mb_s": round(median(values), 1) for name, values in mb_s.items()},
                       "ratio": ratio(median(mb_s["transparent"]), median(mb_s["direct"]))},
        # The CPU the mediator (this process) spent per mediated download: what the relay costs
        # whatever the number of cores (the direct downloads do not touch this process).
        "mediator_cpu_ms_per_download": {
            "user": round((after.ru_utime - before.ru_utime) * 1000 / download_rounds, 1),
            "system": round((after.ru_stime - before.ru_stime) * 1000 / download_rounds, 1)},
        "connections_served": sum(entry["count"] for entry in served["allowed"]),
        "goals": {"added_under_1ms": None, "throughput_at_least_80pct": None},
    }
    out["goals"]["added_under_1ms"] = max(out["added_ms"].values()) < 1.0
    out["goals"]["throughput_at_least_80pct"] = (out["throughput"]["ratio"] or 0) >= 0.8
    log(f"egress: added {out['added_ms']} ms; throughput direct {out['throughput']['direct_mb_s']} MB/s, "
        f"through the mediator {out['throughput']['transparent_mb_s']} MB/s "
        f"(ratio {out['throughput']['ratio']})")
    return out


def _python_in_sandbox() -> tuple[str, tuple[str, ...]]:
    """An interpreter the sandbox can run (the system's, under /usr), and what to grant for it."""
    from isolate.model.policy import DEFAULT_READ

    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3", DEFAULT_READ
    real = os.path.realpath(sys.executable)
    return real, (*DEFAULT_READ, os.path.dirname(os.path.dirname(real)))


def measure_sandboxed(rounds: int = 300, download_rounds: int = 7, size_mb: int = 100, alternations: int = 4,
                      log: Any = lambda text: print(text, file=sys.stderr)) -> dict[str, Any]:
    """The real path: the client inside a sandbox, through its mediator (``Egress``), against the same
    client in a sandbox that shares the host's network (``network="host"``, the direct baseline).

    Sandboxes of both kinds alternate ``alternations`` times, each running its share of the rounds
    after 5 unmeasured connections (the first connections of a run start the mediator's threads);
    ``start`` is a whole ``isolate.run(["true"])`` with an allow-list against one with ``network="none"``,
    interleaved: what starting and ending the mediator costs a run.
    """
    import time

    import isolate

    python, read = _python_in_sandbox()
    size = size_mb * 1024 * 1024
    with _server(size_mb) as port:
        egress = isolate.Egress((f"bench.test:{port}",), add_hosts={"bench.test": "127.0.0.1"})
        policies = {
            "direct": (isolate.Policy(network="host", read=read, write=(), cwd="/tmp"),
                       {"direct": {"host": "127.0.0.1", "port": port}}),
            "mediated": (isolate.Policy(network=egress, read=read, write=(), cwd="/tmp"),
                         {"mediated": {"host": "bench.test", "port": port, "resolve": True,
                                       "name": "bench.test"}}),
        }

        def client(kind: str, mode: str, count: int) -> list[float]:
            policy, targets = policies[kind]
            done = isolate.run([python, "-I", "-S", "-c", CLIENT, json.dumps(targets), mode, str(count),
                                str(size), "5" if mode == "latency" else "0"],
                               policy=policy, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"{kind}: {done.stderr.strip()[-500:]}")
            samples: list[float] = json.loads(done.stdout)[kind]
            return samples

        latency: dict[str, list[float]] = {"direct": [], "mediated": []}
        downloads: dict[str, list[float]] = {"direct": [], "mediated": []}
        client("direct", "latency", 10)
        client("mediated", "latency", 10)  # warm-up
        share = max(1, rounds // alternations)
        for i in range(alternations):
            for kind in (("direct", "mediated") if i % 2 == 0 else ("mediated", "direct")):
                latency[kind] += client(kind, "latency", share)
        for i in range(download_rounds):
            for kind in (("direct", "mediated") if i % 2 == 0 else ("mediated", "direct")):
                downloads[kind] += client(kind, "download", 1)
        lookups = client("mediated", "dns", rounds)
        starts: dict[str, list[float]] = {"none": [], "egress": []}
        start_policies = {"none": isolate.Policy(write=(), cwd="/tmp"),
                          "egress": isolate.Policy(network=egress, write=(), cwd="/tmp")}
        for i in range(max(20, rounds // 5)):
            for kind in (("none", "egress") if i % 2 == 0 else ("egress", "none")):
                started = time.perf_counter()
                isolate.run(["true"], policy=start_policies[kind])
                starts[kind].append(time.perf_counter() - started)
    medians = {name: median(samples) for name, samples in latency.items()}
    mb_s = {name: [size / 1e6 / s for s in samples] for name, samples in downloads.items()}
    out: dict[str, Any] = {
        "method": (measure_sandboxed.__doc__ or "").strip().split("\n\n")[0],
        "latency": {name: summary_ms(samples) for name, samples in latency.items()},
        "added_ms": round((medians["mediated"] - medians["direct"]) * 1000, 4),
        "throughput": {"size_mb": size_mb, "rounds": download_rounds,
                       **{f"{name}_mb_s": round(median(values), 1) for name, values in mb_s.items()},
                       "ratio": ratio(median(mb_s["mediated"]), median(mb_s["direct"]))},
        "dns_lookup": summary_ms(lookups),
        "start": {name: summary_ms(samples) for name, samples in starts.items()},
        "start_added_ms": round((median(starts["egress"]) - median(starts["none"])) * 1000, 3),
    }
    out["goals"] = {"added_under_1ms": out["added_ms"] < 1.0,
                    "throughput_at_least_80pct": (out["throughput"]["ratio"] or 0) >= 0.8}
    log(f"egress (in a sandbox): added {out['added_ms']} ms per connection; throughput host network "
        f"{out['throughput']['direct_mb_s']} MB/s, through the mediator {out['throughput']['mediated_mb_s']} MB/s "
        f"(ratio {out['throughput']['ratio']}); a run with an allow-list starts {out['start_added_ms']} ms later")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.egress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="latency rounds per target")
    parser.add_argument("--downloads", type=int, default=7, help="downloads per target")
    parser.add_argument("--size", type=int, default=100, help="download size in MB")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    results = {"machine": describe(), "egress": measure(args.rounds, args.downloads, args.size),
               "egress_sandboxed": measure_sandboxed(args.rounds, args.downloads, args.size)}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(json.dumps({k: results[k] for k in ("egress", "egress_sandboxed")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
