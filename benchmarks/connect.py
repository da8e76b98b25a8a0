"""The cost of supervised connect(): ``python -m benchmarks.connect [N]``.

Under network none/loopback on kernels before Landlock ABI 9 every connect()
is a round trip through the sandbox's init (csrc/supervise.c). This times,
inside a sandbox with network loopback, N blocking and N non-blocking
connects to a TCP server on 127.0.0.1 and to a unix socket in /tmp (both
servers in the sandbox, accepting in a thread), and prints the median of
each in microseconds, with the mean of 20*N send/recv pairs on a connected
socket pair (which never pass through the init). Run it with another checkout's interpreter to
compare before and after.
"""

from __future__ import annotations

import json
import sys

import isolate

PROBE = r"""
import json, os, socket, sys, threading, time
n = int(sys.argv[1])
a, b = socket.socketpair()  # timed before any thread starts
t = time.perf_counter_ns()
for _ in range(n * 20):
    a.send(b"x"); b.recv(1)
send_recv = (time.perf_counter_ns() - t) / (n * 20) / 1000
tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen(4096)
unix = socket.socket(socket.AF_UNIX); unix.bind("/tmp/bench.sock"); unix.listen(4096)
def drain(server):
    while True:
        c, _ = server.accept(); c.close()
for server in (tcp, unix):
    threading.Thread(target=drain, args=(server,), daemon=True).start()
def timed(family, address, blocking):
    samples = []
    for _ in range(n):
        s = socket.socket(family); s.setblocking(blocking)
        t = time.perf_counter_ns()
        try:
            s.connect(address)
        except BlockingIOError:
            pass
        samples.append(time.perf_counter_ns() - t)
        s.close()
    samples.sort()
    return samples[len(samples) // 2] / 1000
out = {
    "tcp_blocking_us": timed(socket.AF_INET, tcp.getsockname(), True),
    "tcp_nonblocking_us": timed(socket.AF_INET, tcp.getsockname(), False),
    "unix_blocking_us": timed(socket.AF_UNIX, "/tmp/bench.sock", True),
    "unix_nonblocking_us": timed(socket.AF_UNIX, "/tmp/bench.sock", False),
    "send_recv_us": send_recv,
}
print(json.dumps(out))
"""


def measure(n: int = 500) -> dict[str, float]:
    policy = isolate.Policy(network="loopback", write=(), cwd="/tmp")
    result = isolate.run(["/usr/bin/python3", "-I", "-S", "-c", PROBE, str(n)], policy=policy,
                         capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip())
    data: dict[str, float] = json.loads(result.stdout)
    data["mechanism"] = result.report.enforced.get("unix_sockets", "none")  # type: ignore[assignment]
    return data


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 500), indent=2))
