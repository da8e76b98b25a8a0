"""``python -m benchmarks.soak [--seconds S] [--clients N] [--out FILE] [--plot FILE]``: one server under mixed work.

``isolate-run serve`` on a free loopback port (a state directory of its own,
isolate's too: ``ISOLATE_STATE_DIR``; ``--end-on-exit``, a warm pool of two: ``--warm 2``, and an image ``egress``
whose profile allows ``web.test`` on a loopback port this script serves), and N
clients, each a thread speaking the API over plain HTTP, doing over and over
for S seconds: create a sandbox (1 CPU, 512 MiB), ask its endpoint, run commands
(one writes a file), read the file back (``/files/download``), list its
directory, patch its metadata, renew it; one round in two a bash session (a
variable set by one command, read by the next, the session deleted); one in
four a Python code context (a name bound by one run, read by the next, the
context deleted); one in four a snapshot, a fork (a sandbox created from the
snapshot, its file read back) and both deleted; then delete it. One round in
eight also creates a sandbox of the pool's shape (the SDK's default create,
handed out by ``--warm``) and runs a command in it, and one in eight a sandbox of
image ``egress`` whose command fetches ``http://web.test:PORT/`` (allowed) and
fails to resolve ``other.test`` (not allowed). Every request is timed per
operation; an answer that is a stream (session, code) is checked for what it
must say. Every few seconds the server's resident memory, its open descriptors
and threads, its descendant processes, the host's mounts, the run cgroups of
the server's processes, the entries of its state directories (its
``--state-dir``, its ``ISOLATE_STATE_DIR``: sandboxes, snapshots, workspaces,
and the runtime directory's entries of that) and its kept sandboxes are sampled.

Reported (JSON, and ``--out FILE``; ``--plot FILE`` draws memory, descriptors,
mounts, processes and run cgroups over time): requests and errors (a status of 400 or more,
or no answer within 120 s, or a stream without what it must say) per operation
with their p50/p99, and the samples. Bounds checked at the end, once every
sandbox is deleted: no error, no client still waiting; the server's descriptors
within 64 of the first sample's, the host's mounts within 16 (when the server
may mount there, as root: as another user neither it nor its sandboxes can, and
a mount added there is another's; the new mount points are reported), its descendant
processes within 4 and the run cgroups of its processes within 4 (the pool
refills meanwhile), its state directories' entries within 16, no kept sandbox of
the server's left, and its resident memory grown by at most 64 MiB over the
first sample taken after the first minute (or the first sample, in a shorter
run); the exit status is 1 when a bound is passed. ``tests/test_soak.py`` runs
it for two minutes.
"""

from __future__ import annotations

import argparse
import atexit
import http.server
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from ._stats import summary_ms
from .opensandbox import KEY, _limits_enforceable, _server

FD_BOUND = 64
MOUNT_BOUND = 16
PROCESS_BOUND = 4
CGROUP_BOUND = 4
STATE_BOUND = 16
RSS_BOUND = 64 << 20
WARM = 2
POOL_SHAPE = {"image": {"uri": "default"}, "resourceLimits": {"cpu": "1", "memory": "2Gi"},
              "entrypoint": ["tail", "-f", "/dev/null"]}
RUN_CGROUP = re.compile(r"^isolate-([1-9][0-9]*)-[0-9]+$")


class Client:
    def __init__(self, domain: str, web_port: int) -> None:
        self.domain = domain
        self.web_port = web_port
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

    def wrong(self, op: str, what: str, text: bytes = b"") -> None:
        with self.lock:
            self.errors.setdefault(op, []).append(f"{what}: {text[-300:].decode(errors='replace')}")

    def expect(self, op: str, status: int, text: bytes, *needles: bytes) -> None:
        """A stream's answer (200) must say each of ``needles`` and report no error event."""
        if status == 200 and (any(n not in text for n in needles) or b'"type": "error"' in text
                              or b'"type":"error"' in text):
            self.wrong(op, f"the answer does not say {needles!r}", text)


def _create(client: Client, body: dict[str, Any]) -> tuple[str, str, dict[str, str]] | None:
    """A sandbox made and its execd's prefix and headers, or None (the failure counted)."""
    status, text = client.call("create", "POST", "/v1/sandboxes", body)
    if status != 202:
        return None
    sandbox_id = json.loads(text)["id"]
    status, text = client.call("endpoint", "GET", f"/v1/sandboxes/{sandbox_id}/endpoints/44772")
    if status != 200:
        client.call("delete", "DELETE", f"/v1/sandboxes/{sandbox_id}")
        return None
    found = json.loads(text)
    return sandbox_id, "/" + found["endpoint"].split("/", 1)[1], found["headers"]


def _session(client: Client, prefix: str, headers: dict[str, str]) -> None:
    status, text = client.call("session-create", "POST", prefix + "/session", {"cwd": "/workspace"}, headers)
    if status != 200:
        return
    session = json.loads(text)["session_id"]
    client.call("session-run", "POST", f"{prefix}/session/{session}/run", {"command": "KEPT=soak-$((6 * 7))"},
                headers)
    status, text = client.call("session-run", "POST", f"{prefix}/session/{session}/run",
                               {"command": "echo \"$KEPT in $(pwd)\""}, headers)
    client.expect("session-run", status, text, b"soak-42 in /workspace")
    client.call("session-delete", "DELETE", f"{prefix}/session/{session}", headers=headers)


def _code(client: Client, prefix: str, headers: dict[str, str]) -> None:
    status, text = client.call("context-create", "POST", prefix + "/code/context", {"language": "python"}, headers)
    if status != 200:
        return
    context = {"id": json.loads(text)["id"], "language": "python"}
    status, text = client.call("code-run", "POST", prefix + "/code", {"code": "kept = 6 * 7", "context": context},
                               headers)
    client.expect("code-run", status, text)
    status, text = client.call("code-run", "POST", prefix + "/code",
                               {"code": "print('kept', kept + 1000)", "context": context}, headers)
    client.expect("code-run", status, text, b"kept 1042")
    client.call("context-delete", "DELETE", f"{prefix}/code/contexts/{context['id']}", headers=headers)


def _fork(client: Client, sandbox_id: str, payload: str) -> None:
    status, text = client.call("snapshot", "POST", f"/v1/sandboxes/{sandbox_id}/snapshots", {})
    if status not in (200, 201, 202):
        return
    snapshot_id = json.loads(text)["id"]
    try:
        made = _create(client, {"snapshotId": snapshot_id, "timeout": 600})
        if made is None:
            return
        fork_id, prefix, headers = made
        try:
            status, data = client.call("download", "GET", prefix + "/files/download?path=/workspace/f.txt",
                                       headers=headers)
            if status == 200 and data != payload.encode():
                client.wrong("fork", "the fork's file is not its snapshot's", data)
        finally:
            client.call("delete", "DELETE", f"/v1/sandboxes/{fork_id}")
    finally:
        client.call("snapshot-delete", "DELETE", f"/v1/snapshots/{snapshot_id}")


def _other(client: Client, body: dict[str, Any], op: str, command: str, *needles: bytes) -> None:
    """A sandbox of another kind (the pool's, egress): one command whose output must say each of ``needles``."""
    made = _create(client, {**body, "timeout": 600})
    if made is None:
        return
    sandbox_id, prefix, headers = made
    try:
        status, text = client.call(op, "POST", prefix + "/command", {"command": command}, headers)
        client.expect(op, status, text, *needles)
    finally:
        client.call("delete", "DELETE", f"/v1/sandboxes/{sandbox_id}")


EGRESS_PROBE = ("python3 -c 'import socket, sys, urllib.request\n"
                "print(urllib.request.urlopen(\"http://web.test:PORT/\", timeout=30).read().decode())\n"
                "try:\n socket.getaddrinfo(\"other.test\", 80)\n"
                "except OSError as e:\n print(\"refused\", type(e).__name__)'")


def _round(client: Client, rng: random.Random) -> None:
    made = _create(client, {"image": {"uri": "bench"}, "timeout": 600,
                            "resourceLimits": {"cpu": "1", "memory": "512Mi"}, "metadata": {"soak": "yes"}})
    if made is None:
        return
    sandbox_id, prefix, headers = made
    try:
        payload = "x" * rng.randint(1, 4096)
        client.call("command", "POST", prefix + "/command",
                    {"command": f"printf %s {payload} > /workspace/f.txt && echo written"}, headers)
        client.call("command", "POST", prefix + "/command", {"command": "ls -l /workspace; seq 1 200"}, headers)
        status, data = client.call("download", "GET", prefix + "/files/download?path=/workspace/f.txt",
                                   headers=headers)
        if status == 200 and data != payload.encode():
            client.wrong("download", "the file read back is not the file written")
        client.call("list", "GET", prefix + "/directories/list?path=/workspace", headers=headers)
        client.call("metadata", "PATCH", f"/v1/sandboxes/{sandbox_id}/metadata", {"round": str(rng.random())})
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 900))
        client.call("renew", "POST", f"/v1/sandboxes/{sandbox_id}/renew-expiration", {"expiresAt": when})
        if rng.random() < 0.5:
            _session(client, prefix, headers)
        if rng.random() < 0.25:
            _code(client, prefix, headers)
        if rng.random() < 0.25:
            _fork(client, sandbox_id, payload)
    finally:
        client.call("delete", "DELETE", f"/v1/sandboxes/{sandbox_id}")
    if rng.random() < 0.125:
        _other(client, POOL_SHAPE, "pool-command", "echo from-the-pool", b"from-the-pool")
    if rng.random() < 0.125:
        _other(client, {"image": {"uri": "egress"}}, "egress-command",
               EGRESS_PROBE.replace("PORT", str(client.web_port)), b"served to the soak", b"refused")


def _web() -> tuple[http.server.ThreadingHTTPServer, int]:
    """The loopback site the egress sandboxes reach as web.test."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"served to the soak\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    site.daemon_threads = True
    threading.Thread(target=site.serve_forever, daemon=True).start()
    return site, int(site.server_address[1])


def _mounts() -> dict[str, str]:
    """The mounts of this process's mount namespace (the host's): mount id to mount point."""
    with open("/proc/self/mountinfo") as handle:
        return {fields[0]: fields[4] for fields in (line.split() for line in handle) if len(fields) > 4}


def _may_mount() -> bool:
    """Whether the server (started by this process, as its user) may mount in this mount namespace: CAP_SYS_ADMIN
    in its effective set. Without it neither the server nor its sandboxes can add a mount here: theirs are in mount
    namespaces of user namespaces of their own, whose mounts never propagate back to a more privileged one (the
    kernel makes the copies slaves), so a mount added here meanwhile is another's."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 21 & 1)  # CAP_SYS_ADMIN is 21
    return False


def _run_cgroups(pids: set[int], root: str = "/sys/fs/cgroup") -> int:
    """The run cgroups (isolate-PID-N, in every hierarchy under ``root``) made by one of ``pids``: the server
    and its descendants alive now (the server makes them; a pid of a descendant that ended may since be
    another's, with run cgroups of its own: pids wrap within the hour)."""
    found = 0
    for top, dirs, _files in os.walk(root):
        for name in list(dirs):
            match = RUN_CGROUP.match(name)
            if match:
                dirs.remove(name)
                found += int(match.group(1)) in pids
        if top.count("/") > 12:
            dirs.clear()
    return found


def _entries(state_dir: str) -> int:
    """The entries (all the way down) of the server's --state-dir, of isolate's state directory (its own:
    ``ISOLATE_STATE_DIR``) and of the runtime directory's entries named after that."""
    from isolate.kernel.places import runtime_dir, state_key

    key = state_key()
    runtime = [os.path.join(runtime_dir(), name) for name in os.listdir(runtime_dir()) if key in name]
    found = len(runtime)
    for path in [state_dir, os.environ["ISOLATE_STATE_DIR"], *runtime]:
        found += sum(len(dirs) + len(files) for _top, dirs, files in os.walk(path))
    return found


def _sample(proc_pid: int, started: float, prefix_dir: str, state_dir: str) -> dict[str, Any]:
    import psutil

    from isolate.backends.native.named import native_names

    server = psutil.Process(proc_pid)
    with server.oneshot():
        rss, fds, threads = server.memory_info().rss, server.num_fds(), server.num_threads()
    children = server.children(recursive=True)
    kept = sum(1 for name in native_names() if name.startswith(prefix_dir))
    return {"t": round(time.monotonic() - started, 1), "rss_mb": round(rss / 2**20, 1), "fds": fds,
            "threads": threads, "processes": len(children), "mounts": len(_mounts()),
            "cgroups": _run_cgroups({proc_pid, *(child.pid for child in children)}),
            "state_entries": _entries(state_dir), "kept_sandboxes": kept}


def _settled(proc_pid: int, started: float, prefix: str, state_dir: str) -> dict[str, Any]:
    """A sample once the pool has its sandboxes again (up to 60 s): the counts at rest."""
    deadline = time.monotonic() + 60
    sample = _sample(proc_pid, started, prefix, state_dir)
    while sample["processes"] > 0 and time.monotonic() < deadline:
        time.sleep(2.0)
        last, sample = sample, _sample(proc_pid, started, prefix, state_dir)
        if all(last[key] == sample[key] for key in ("processes", "cgroups", "state_entries")):
            break
    return sample


def _counts_passed(first: dict[str, Any], final: dict[str, Any], new_mounts: list[str], may_mount: bool) -> list[str]:
    """The counts of the final sample past their bounds over the first's. The host's mounts are bounded only when
    the server may add to them (``may_mount``): as another user whatever changes there is another's (CI's root
    suite beside the unprivileged one: its Docker containers, its overlay mounts)."""
    problems = []
    for key, bound, what in (("fds", FD_BOUND, "descriptors"),
                             *((("mounts", MOUNT_BOUND, "mounts"),) if may_mount else ()),
                             ("processes", PROCESS_BOUND, "processes under the server"),
                             ("cgroups", CGROUP_BOUND, "run cgroups of the server's processes"),
                             ("state_entries", STATE_BOUND, "entries of the state directories")):
        if final[key] > first[key] + bound:
            problems.append(f"{what}: {first[key]} at start, {final[key]} at the end"
                            + (f" (new mount points: {json.dumps(new_mounts[:20])})" if key == "mounts" else ""))
    return problems


def run(seconds: float, clients: int, log: Any) -> dict[str, Any]:
    # isolate's state directory of its own (the server's sandboxes, snapshots, workspaces), for the server and
    # for this process (its look at the kept sandboxes): what is left in it is this server's.
    before = os.environ.get("ISOLATE_STATE_DIR")
    os.environ["ISOLATE_STATE_DIR"] = tempfile.mkdtemp(prefix="isolate-soak-state-")
    atexit.register(shutil.rmtree, os.environ["ISOLATE_STATE_DIR"], True)
    try:
        return _run(seconds, clients, log)
    finally:
        from isolate.kernel.places import runtime_dir, state_key

        key = state_key()  # the runtime directory's files about that state directory go with it
        for name in os.listdir(runtime_dir()):
            if key in name:
                path = os.path.join(runtime_dir(), name)
                if os.path.isdir(path):
                    shutil.rmtree(path, True)
                else:
                    os.unlink(path)
        if before is None:
            del os.environ["ISOLATE_STATE_DIR"]
        else:
            os.environ["ISOLATE_STATE_DIR"] = before


def _run(seconds: float, clients: int, log: Any) -> dict[str, Any]:
    import hashlib

    site, web_port = _web()
    profile_dir = tempfile.mkdtemp(prefix="isolate-soak-")
    atexit.register(shutil.rmtree, profile_dir, True)
    os.chmod(profile_dir, 0o755)
    profile = os.path.join(profile_dir, "egress.toml")
    with open(profile, "w") as handle:
        handle.write(f'[network]\negress = ["web.test:{web_port}"]\n'
                     'add_hosts = {"web.test" = "127.0.0.1"}\n')
    os.chmod(profile, 0o644)
    enforceable = _limits_enforceable()
    server_log = tempfile.TemporaryFile()  # read back when a request failed: what the server said about it
    proc, domain = _server(not enforceable, "--warm", str(WARM), "--image", f"egress={profile}", log=server_log)
    args = [str(a) for a in proc.args]  # type: ignore[union-attr]
    state_dir = args[args.index("--state-dir") + 1]
    prefix = f"osb-{hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:8]}-"
    client = Client(domain, web_port)
    started = time.monotonic()
    first = _settled(proc.pid, started, prefix, state_dir)
    first_mounts = _mounts()
    samples = [first]
    stop = threading.Event()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            _round(client, rng)

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(clients)]
    hung = 0
    try:
        for worker in workers:
            worker.start()
        interval = max(1.0, min(10.0, seconds / 24))
        while time.monotonic() - started < seconds:
            time.sleep(interval)
            samples.append(_sample(proc.pid, started, prefix, state_dir))
            s = samples[-1]
            log(f"t={s['t']} s: rss {s['rss_mb']} MB, {s['fds']} fds, {s['processes']} processes, "
                f"{s['mounts']} mounts, {s['cgroups']} cgroups, {s['kept_sandboxes']} sandboxes, "
                f"{sum(len(v) for v in client.times.values())} requests")
        stop.set()
        for worker in workers:
            worker.join(300)
        hung = sum(worker.is_alive() for worker in workers)
        time.sleep(1.0)
        final = _settled(proc.pid, started, prefix, state_dir)
        final_mounts = _mounts()
        samples.append(final)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
        site.shutdown()
    ops = {op: {**summary_ms(values), "errors": len(client.errors.get(op, []))}
           for op, values in sorted(client.times.items())}
    baseline = next((s for s in samples if s["t"] >= 60), samples[0]) if seconds > 90 else samples[0]
    problems = []
    errors = {op: found[:5] for op, found in client.errors.items() if found}
    said = ""
    if errors:
        problems.append(f"errors: {json.dumps(errors)[:2000]}")
        server_log.seek(0)
        said = "the server's log ends: " + server_log.read().decode(errors="replace")[-4000:]
    server_log.close()
    if hung:
        problems.append(f"{hung} clients still waiting 300 s after the end")
    new_mounts = sorted({point for key, point in final_mounts.items() if key not in first_mounts})
    may_mount = _may_mount()
    problems += _counts_passed(first, final, new_mounts, may_mount)
    if final["kept_sandboxes"]:
        problems.append(f"{final['kept_sandboxes']} sandboxes left after every delete")
    if final["rss_mb"] * 2**20 > baseline["rss_mb"] * 2**20 + RSS_BOUND:
        problems.append(f"resident memory: {baseline['rss_mb']} MB at t={baseline['t']} s, {final['rss_mb']} MB at "
                        "the end")
    if said:  # last, as the longest: a tail of the output cut short still shows the problems before it
        problems.append(said)
    return {"seconds": seconds, "clients": clients, "requests": sum(len(v) for v in client.times.values()),
            "errors": sum(len(v) for v in client.errors.values()), "operations": ops, "samples": samples,
            "first": first, "final": final, "new_mounts": new_mounts[:100],
            "bounds": {"fds": FD_BOUND, "mounts": MOUNT_BOUND if may_mount else None, "processes": PROCESS_BOUND,
                       "cgroups": CGROUP_BOUND,
                       "state_entries": STATE_BOUND, "rss_mb": RSS_BOUND >> 20},
            "problems": problems}


def plot(results: dict[str, Any], path: str) -> None:
    """Memory, descriptors, mounts, processes and run cgroups over time (matplotlib, the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = results["samples"]
    minutes = [s["t"] / 60 for s in samples]
    panels = (("rss_mb", "server RSS (MiB)"), ("fds", "server descriptors"), ("mounts", "host mounts"),
              ("processes", "server's processes"), ("cgroups", "run cgroups"))
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 11), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.plot(minutes, [s[key] for s in samples], marker=".", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("minutes")
    axes[0].set_title(f"soak: {results['clients']} clients, {results['requests']} requests, "
                      f"{results['errors']} errors")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="how long (default 3600)")
    parser.add_argument("--clients", type=int, default=16, help="clients at once (default 16)")
    parser.add_argument("--out", help="also write the JSON to this file")
    parser.add_argument("--plot", help="draw the samples over time to this file (.png, .svg)")
    args = parser.parse_args(argv)
    results = run(args.seconds, args.clients, lambda m: print(m, file=sys.stderr, flush=True))
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.plot:
        plot(results, args.plot)
    for problem in results["problems"]:
        print(f"soak: {problem}", file=sys.stderr)
    return 1 if results["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
