"""The harness of the kills at random steps (tests/test_server_crashes.py; ``python -m benchmarks.crashes``
runs it for longer): a world (a state directory, a volume store, a server started on them again and again),
clients at work on it, the kills and the check that nothing is left half made after each.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import math
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import test_server as base

#: Kills per mode in CI (each server kill costs a start, about a second); outside CI, more with the variables.
KILLS = int(os.environ.get("ISOLATE_TEST_KILLS", "50"))
SANDBOX_KILLS = int(os.environ.get("ISOLATE_TEST_SANDBOX_KILLS", "12"))
SEED = int(os.environ.get("ISOLATE_TEST_KILL_SEED", "38"))
#: The warm pool's shape (state.start_pool): a create of exactly it takes a pooled sandbox.
POOLED = {"image": {"uri": "default"}, "resourceLimits": {"cpu": "1", "memory": "2Gi"},
          "entrypoint": ["tail", "-f", "/dev/null"]}
SHARED_CLAIMS = ("shared-a", "shared-b")


@dataclass
class World:
    """One server's state directory, volume store and isolate state directory, and what the clients know."""

    root: str
    flags: tuple[str, ...]
    server_pids: set[int] = field(default_factory=set)
    ids: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    prunes: int = 0
    #: Kills followed by a check that passed.
    kills_done: int = 0

    @property
    def state_dir(self) -> str:
        return os.path.join(self.root, "serve")

    @property
    def volume_store(self) -> str:
        return os.path.join(self.root, "volumes")

    @property
    def isolate_state(self) -> str:
        return os.path.join(self.root, "isolate")

    @property
    def prefix(self) -> str:
        return f"osb-{hashlib.sha256(os.fsencode(os.path.realpath(self.state_dir))).hexdigest()[:8]}-"

    def ours(self, name: str) -> bool:
        """A kept sandbox of this server's, or an unnamed one (the warm pool's) one of its servers made."""
        return name.startswith(self.prefix) or any(name.startswith(f"anon-{pid}-") for pid in self.server_pids)

    def start(self) -> base.Server:
        server = base.Server(*self.flags, state_dir=self.state_dir, end_on_exit=False)
        self.server_pids.add(server.proc.pid)
        return server


@contextlib.contextmanager
def world(warm: bool = True) -> Iterator[World]:
    root = tempfile.mkdtemp(prefix="isolate-crashes-")
    os.chmod(root, 0o755)
    for part in ("serve", "volumes", "isolate"):
        os.mkdir(os.path.join(root, part), 0o755 if part == "volumes" else 0o700)
    flags = ("--best-effort",) if not base.limits_enforceable() else ()
    made = World(root, (*flags, "--volume-store", os.path.join(root, "volumes"),
                        *(("--warm", "1") if warm else ())))
    old = os.environ.get("ISOLATE_STATE_DIR")
    os.environ["ISOLATE_STATE_DIR"] = made.isolate_state  # the server's snapshots, data and registry: its own
    try:
        yield made
    finally:
        # Whatever a failure left: a server that ends everything at its stop.
        with contextlib.suppress(Exception):
            base.Server(*made.flags, state_dir=made.state_dir, end_on_exit=True).stop()
        if old is None:
            os.environ.pop("ISOLATE_STATE_DIR", None)
        else:
            os.environ["ISOLATE_STATE_DIR"] = old
        shutil.rmtree(root, ignore_errors=True)


def _pvc(claim: str) -> list[dict[str, Any]]:
    return [{"name": "v", "mountPath": "/mnt/v", "pvc": {"claimName": claim, "deleteOnSandboxTermination": True}}]


_run = base.run_command


def _operate(server: base.Server, w: World, rng: random.Random) -> None:
    """One client's random step: create (a new or a shared named volume, a pooled shape, limits), delete,
    snapshot, create from a snapshot, delete a snapshot."""
    op = rng.choices(("create", "pooled", "delete", "snapshot", "restore", "unsnap"), (4, 2, 3, 2, 2, 1))[0]
    with w.lock:
        ids, snaps = list(w.ids), list(w.snapshots)
    if op == "create" or (op in ("delete", "snapshot") and not ids) or (op in ("restore", "unsnap") and not snaps):
        claim = rng.choice(SHARED_CLAIMS) if rng.random() < 0.3 else f"v{rng.getrandbits(40):010x}"
        body: dict[str, Any] = {"image": {"uri": "ubuntu"}, "timeout": 600, "volumes": _pvc(claim),
                                "metadata": {"claim": claim}}
        if rng.random() < 0.3:
            body["resourceLimits"] = {"cpu": "1", "memory": "256Mi"}
        status, got = server.call("POST", "/v1/sandboxes", body)
    elif op == "pooled":
        status, got = server.call("POST", "/v1/sandboxes", dict(POOLED, timeout=600, metadata={"pooled": "1"}))
    elif op == "delete":
        server.call("DELETE", f"/v1/sandboxes/{rng.choice(ids)}")
        return
    elif op == "snapshot":
        sandbox_id = rng.choice(ids)
        # Written whole, then renamed: the other client may be snapshotting the same sandbox, and a snapshot
        # holds each file as it is at that moment (docs/kept-sandboxes.md), a truncated one too.
        try:
            _run(server, sandbox_id, "echo snap > /workspace/.mark.$$ && mv -f /workspace/.mark.$$ /workspace/mark")
        except AssertionError:
            # Deleted meanwhile by the other client, or busy with its snapshot: no snapshot without the mark
            # (a sandbox restored from one is checked for it; ci1 took one of a sandbox never marked, as 65534).
            return
        status, got = server.call("POST", f"/v1/sandboxes/{sandbox_id}/snapshots", {})
        if status == 202:
            with w.lock:
                w.snapshots.append(got["id"])
        return
    elif op == "unsnap":
        server.call("DELETE", f"/v1/snapshots/{rng.choice(snaps)}")
        return
    else:
        status, got = server.call("POST", "/v1/sandboxes", {"snapshotId": rng.choice(snaps), "timeout": 600,
                                                            "metadata": {"restored": "1"}})
    if status == 202:
        with w.lock:
            w.ids.append(got["id"])


def _cgroups(w: World) -> list[str]:
    """Run cgroups made by this world's servers (isolate-PID-N) that no process is in."""
    empty = []
    for top in ("/sys/fs/cgroup", *(f"/sys/fs/cgroup/{c}" for c in os.listdir("/sys/fs/cgroup"))):
        parent = os.path.join(top, "isolate")
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                parts = name.split("-")
                if len(parts) == 3 and parts[0] == "isolate" and parts[1].isdigit() \
                        and int(parts[1]) in w.server_pids:
                    with open(os.path.join(parent, name, "cgroup.procs")) as procs:
                        if not procs.read().strip():
                            empty.append(os.path.join(parent, name))
    return empty


def _sandbox_pids(name: str) -> list[int]:
    """A kept (or unnamed) sandbox's processes on the host: its init (as its description says, told apart from a
    reused pid by its start time) and every process under it (the exec server first)."""
    from isolate.kept.sandbox import Sandbox
    from isolate.model.errors import IsolationError

    try:
        return [p.pid for p in Sandbox.attach(name, ping=False).processes()]
    except (IsolationError, psutil.Error):
        return []


def _leftovers(w: World, listed: list[str], before: list[Any], pid: int) -> dict[str, Any]:
    """Everything of this world that is not a listed sandbox's (or a listed snapshot's)."""
    from isolate.backends.native.named import native_names
    from isolate.kernel.places import runtime_dir
    prefix = w.prefix
    records = sorted(e[:-5] for e in os.listdir(w.state_dir) if e.endswith(".json"))
    data: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        data = sorted(e for e in os.listdir(os.path.join(w.isolate_state, "sandboxes")) if w.ours(e))
    named = sorted(n for n in native_names(unnamed=True) if w.ours(n))
    runtime = sorted(e for e in os.listdir(runtime_dir()) if w.ours(e))
    with open("/proc/net/unix") as table:
        bound = sorted({os.path.basename(f[7])[:-5] for f in (line.split() for line in table)
                        if len(f) >= 8 and w.ours(os.path.basename(f[7]))})
    want = sorted(prefix + i for i in listed)
    # The running server's warm pool's (unnamed: warm, or handed out and listed).
    pooled = [n for n in named if n.startswith(f"anon-{pid}-")]
    claims: set[str] = set()
    for sandbox_id in listed:
        with open(os.path.join(w.state_dir, f"{sandbox_id}.json")) as handle:
            claims |= {claim for claim, _ in json.load(handle)["volumes"]}
    with open("/proc/self/mountinfo") as table:
        mounts = [line for line in table if w.root in line]
    # Processes the killed servers had made: each still running is in a listed (or pooled) sandbox's namespaces.
    live = {pid for name in want + pooled for pid in _sandbox_pids(name)}
    stray = []
    for proc in before:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and proc.pid not in live:
                stray.append(f"{proc.pid} {' '.join(proc.cmdline())[:80]}")
    snaps = sorted(s["id"] for s in _list_snapshots(w))
    from isolate.kept.snapshots import Snapshot

    isolate_snaps = sorted(s.name for s in Snapshot.list() if s.name.startswith("osb-snap-"))
    try:
        isolate_snaps += os.listdir(os.path.join(w.isolate_state, "snapshots"))  # their files, described or not
    except FileNotFoundError:
        pass
    copies: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        copies = os.listdir(os.path.join(w.state_dir, "snapshots"))
    stopped: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        stopped = os.listdir(os.path.join(w.state_dir, "stopped"))
    return {"records": [r for r in records if r not in listed],
            "named": [n for n in named if n not in want + pooled],
            "missing": [n for n in want if n not in named or n not in data or n not in bound],
            "runtime": [e for e in runtime if e.rsplit(".", 1)[0] not in want + pooled],
            "data": [d for d in data if d not in want + pooled],
            "volumes": sorted(set(os.listdir(w.volume_store)) - claims),
            "lost volumes": sorted(claims - set(os.listdir(w.volume_store))),
            "mounts": mounts, "cgroups": _cgroups(w), "processes": stray,
            "snapshots": [s for s in isolate_snaps if s not in snaps],
            # The copies of the snapshots' descriptions (isolate/server/snapkeep.py): of listed snapshots only.
            "snapshot copies": [e for e in copies if e not in [f"{s}.json" for s in snaps]],
            # What a resume after a reboot needs (isolate/server/stopped.py): of listed sandboxes only.
            "stopped copies": [e for e in stopped if e not in [f"{i}.json" for i in listed]],
            "stray files": [e for e in os.listdir(w.state_dir)
                            if e not in (".lock", "snapshots", "stopped") and not e.endswith(".json")]}


_SERVER: dict[str, base.Server] = {}


def _list_snapshots(w: World) -> list[dict[str, Any]]:
    server = _SERVER["now"]
    status, body = server.call("GET", "/v1/snapshots?pageSize=1000")
    assert status == 200, body
    return list(body["items"])


def check(server: base.Server, w: World, before: list[Any], prune: bool) -> list[str]:
    """The invariant: every listed sandbox whole, nothing of any other left; the ids listed."""
    _SERVER["now"] = server
    items = server.call("GET", "/v1/sandboxes?pageSize=1000")[1]["items"]
    listed = sorted(item["id"] for item in items)
    left = _leftovers(w, listed, before, server.proc.pid)
    assert all(not v for v in left.values()), {k: v for k, v in left.items() if v}
    for item in items:
        expect = []
        if "claim" in item["metadata"]:
            expect.append("test -d /mnt/v")
        if "restored" in item["metadata"]:
            expect.append("grep -q snap /workspace/mark")
        assert _run(server, item["id"], " && ".join([*expect, "echo whole"])) == "whole", item
    for snap in _list_snapshots(w):
        from isolate.kept.snapshots import Snapshot

        Snapshot.get(snap["id"])  # its files are there
    if prune:
        w.prunes += 1
        done = subprocess.run([os.path.join(os.path.dirname(base.ISOLATE_RUN), "isolate-run"), "sandbox", "prune"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        ours = [line for line in done.stdout.splitlines() if any(w.ours(word) for word in line.split())]
        assert ours == [], done.stdout
    with w.lock:
        w.ids[:] = listed
        w.snapshots[:] = [s["id"] for s in _list_snapshots(w)]
    return listed


def _clients(server: base.Server, w: World, rng: random.Random, stop: threading.Event) -> list[threading.Thread]:
    def work(seed: float) -> None:
        own = random.Random(seed)
        while not stop.is_set():
            try:
                _operate(server, w, own)
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                if server.proc.poll() is not None:
                    return  # the server is gone
    workers = [threading.Thread(target=work, args=(rng.random(),), daemon=True) for _ in range(2)]
    for worker in workers:
        worker.start()
    return workers


def _trim(server: base.Server, w: World, keep: int) -> None:
    """Keep the live sandboxes and snapshots few: each costs the checks a command."""
    for sandbox_id in w.ids[keep:]:
        assert server.call("DELETE", f"/v1/sandboxes/{sandbox_id}")[0] == 204
    for snapshot_id in w.snapshots[keep:]:
        assert server.call("DELETE", f"/v1/snapshots/{snapshot_id}")[0] == 204
    del w.ids[keep:], w.snapshots[keep:]


def run_kills(w: World, kills: int, seed: int, prune_every: int = 10,
              deadline: float = math.inf) -> dict[str, float]:
    """SIGKILL the server ``kills`` times at random points of the clients' work; after each start, check.
    ``deadline`` (time.monotonic()): stop there, with the kills done."""
    rng = random.Random(seed)
    server = w.start()
    starts: list[float] = []
    try:
        for round_no in range(kills):
            if time.monotonic() > deadline:
                break
            stop = threading.Event()
            workers = _clients(server, w, rng, stop)
            time.sleep(rng.uniform(0.02, 0.5))
            before = psutil.Process(server.proc.pid).children(recursive=True)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
            stop.set()
            server.stop()
            for worker in workers:
                worker.join(60)
            started = time.monotonic()
            server = w.start()
            starts.append(time.monotonic() - started)
            check(server, w, before, prune=(round_no + 1) % prune_every == 0 or round_no == kills - 1)
            w.kills_done += 1
            _trim(server, w, 2)
        _end_all(server, w)
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
        server.stop()
    return {"starts": len(starts), "start_s_mean": sum(starts) / max(1, len(starts)), "prunes": w.prunes}


def _end_all(server: base.Server, w: World) -> None:
    for item in server.call("GET", "/v1/sandboxes?pageSize=1000")[1]["items"]:
        server.call("DELETE", f"/v1/sandboxes/{item['id']}")
    for snap in _list_snapshots(w):
        server.call("DELETE", f"/v1/snapshots/{snap['id']}")
    assert check(server, w, [], prune=True) == []
    assert os.listdir(w.volume_store) == [], os.listdir(w.volume_store)


def _host_processes(w: World, sandbox_id: str) -> list[int]:
    """A kept sandbox's host-side processes: its init and its exec server."""
    return _sandbox_pids(w.prefix + sandbox_id)[:2]


def run_sandbox_kills(w: World, kills: int, seed: int, deadline: float = math.inf) -> dict[str, float]:
    """SIGKILL one kept sandbox's host-side process (its init or its exec server) ``kills`` times at random
    points of the clients' work; the server lets that sandbox go whole (unlisted, nothing left) by itself."""
    rng = random.Random(seed)
    server = w.start()
    waits: list[float] = []
    try:
        for done in range(kills):
            if time.monotonic() > deadline:
                kills = done
                break
            stop = threading.Event()
            workers = _clients(server, w, rng, stop)
            time.sleep(rng.uniform(0.05, 0.6))
            with w.lock:
                kept = {i: pids for i in w.ids if (pids := _host_processes(w, i))}
            victim = rng.choice(sorted(kept)) if kept else None
            if victim is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rng.choice(kept[victim]), signal.SIGKILL)
            stop.set()
            for worker in workers:
                worker.join(60)
            if victim is not None:
                started = time.monotonic()
                # Unlisted at once; its record goes once it is cleaned up (the record last: a crash meanwhile
                # leaves the next server what to end).
                while server.call("GET", f"/v1/sandboxes/{victim}")[0] != 404 \
                        or os.path.exists(os.path.join(w.state_dir, f"{victim}.json")):
                    assert time.monotonic() - started < 15, f"sandbox {victim}: still served after its end"
                    time.sleep(0.1)
                waits.append(time.monotonic() - started)
            check(server, w, [], prune=False)
            w.kills_done += 1
            _trim(server, w, 3)
        _end_all(server, w)
        assert len(waits) * 2 >= kills, f"only {len(waits)} of {kills} kills found a sandbox to kill"
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
        server.stop()
    return {"kills": kills, "victims": len(waits), "let_go_s_max": max(waits, default=0.0)}


