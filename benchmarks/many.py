"""Many sandboxes: a warm pool's acquire, n started at once, and the same over a local Ray cluster.

Each figure comes with its baseline, measured in the same run:

- ``pool``: ``SandboxPool.acquire()`` + release (the sandbox ended, a fresh one
  started in the background), against starting a ``Sandbox`` when it is needed
  (goal: acquire <= 1 ms median);
- ``at_once``: ``Sandbox.create_many(n)`` against n sandboxes started one by
  one, and against ``docker run -d`` of n containers where an engine answers
  (n = 200 in the full run; goal: <= 2 s);
- ``ray`` (full run only; a ``ray.cluster_utils.Cluster`` of 3 nodes on this
  machine): an exec of an ``isolate.ray.Sandbox`` (the direct route to its
  node, isolate/ray/direct.py) and the same exec through the node's actor
  against the same exec on a local sandbox (goal, issue 37: <= 0.5 ms added
  on the direct route), and Ray's own round trip to the node's actor (a call
  that does nothing) beside it, 500 sandboxes placed over the 3 nodes (goal:
  <= 10 s), and 1,000 concurrent execs over them (goal, issue 37: >= 1,000
  execs/s; through the actor beside it); a fork to
  another node of a sandbox whose overlay workspace (2,000 files) has a
  100-file episode diff (goal: <= 100 ms median), and a restore of a sandbox
  of another node to a snapshot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._stats import median, summary_ms

GOALS = {"pool_acquire_ms": 1.0, "at_once_s": 2.0, "ray_exec_added_ms": 0.5, "ray_500_s": 10.0,
         "ray_cross_node_fork_ms": 100.0, "ray_execs_per_s": 1000.0}


def _policy() -> Any:
    import isolate

    return isolate.Policy(write=())


def pool(rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    import isolate

    log(f"many: pool acquire, {rounds} rounds")
    acquire, fresh = [], []
    with isolate.SandboxPool(_policy(), size=4) as warm:
        for _ in range(rounds):
            while warm.stats["warm"] < 4:  # the previous release's replacement has started
                time.sleep(0.002)
            t0 = time.perf_counter()
            box = warm.acquire()
            acquire.append(time.perf_counter() - t0)
            box.close()
    for _ in range(rounds):
        t0 = time.perf_counter()
        box = isolate.Sandbox(_policy()).start()
        fresh.append(time.perf_counter() - t0)
        box.close()
    return {"acquire": summary_ms(acquire), "start_when_needed": summary_ms(fresh),
            "ratio": round(median(acquire) / median(fresh), 4)}


def _docker_run_many(n: int, image: str) -> dict[str, Any]:
    from .peers import docker_engine

    why = docker_engine(image)
    if why is not None:
        return {"skipped": why}
    docker = shutil.which("docker") or "docker"
    label = f"isolate-bench-many-{os.getpid()}"

    def run_one(_: int) -> None:
        subprocess.run([docker, "run", "-d", "--label", label, "--network", "none", image, "sleep", "600"],
                       check=True, capture_output=True, timeout=300)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(16) as starter:
            list(starter.map(run_one, range(n)))
        seconds = time.perf_counter() - t0
    finally:
        ids = subprocess.run([docker, "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True)
        if ids.stdout.split():
            subprocess.run([docker, "rm", "-f", *ids.stdout.split()], capture_output=True, timeout=600)
    return {"seconds": round(seconds, 3), "how": "docker run -d from 16 threads"}


def at_once(n: int, image: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    import isolate

    log(f"many: {n} sandboxes at once, one by one, and docker run -d")
    t0 = time.perf_counter()
    boxes = isolate.Sandbox.create_many(n, _policy())
    together = time.perf_counter() - t0
    for box in boxes:
        box.close()
    t0 = time.perf_counter()
    boxes = [isolate.Sandbox(_policy()).start() for _ in range(n)]
    one_by_one = time.perf_counter() - t0
    for box in boxes:
        box.close()
    docker = _docker_run_many(n, image) if image else {"skipped": "--no-docker"}
    out = {"n": n, "create_many_s": round(together, 3), "one_by_one_s": round(one_by_one, 3),
           "ratio_to_one_by_one": round(together / one_by_one, 3), "docker_run": docker}
    if "seconds" in docker:
        out["ratio_to_docker"] = round(together / docker["seconds"], 4)
    return out


def cross_node_fork(rounds: int, files: int, log: Callable[[str], None]) -> dict[str, Any]:
    """On the cluster ray.init joined (two nodes at least): a fork to another node each round after a 100-file
    episode, and a restore of that fork (on its node) to a snapshot of the parent's."""
    import tempfile

    import ray

    import isolate
    import isolate.ray as iray

    log(f"many: cross-node forks ({files}-file overlay source, 100-file episodes)")
    source = tempfile.mkdtemp(prefix="isolate-bench-source-")
    try:
        for i in range(files):
            with open(os.path.join(source, f"f{i}.txt"), "w") as handle:
                handle.write("x" * 100)
        os.chmod(source, 0o755)
        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        workspace = isolate.Workspace(source, mode="overlay")
        away_times, restores = [], []
        with iray.Sandbox(_policy(), workspace=workspace, node_id=nodes[0]) as parent:
            for r in range(rounds):
                parent.exec(f"mkdir -p ep; for i in $(seq 100); do echo {r}-$i > ep/$i; done")
                t0 = time.perf_counter()
                (away,) = parent.fork(1)  # the parent's node holds one more: the fork goes to another
                away_times.append(time.perf_counter() - t0)
                if away.node_id == parent.node_id:
                    raise AssertionError("the fork stayed on its parent's node")
                snap = parent.snapshot()
                away.exec("rm -r ep")
                t0 = time.perf_counter()
                away.restore(snap)
                restores.append(time.perf_counter() - t0)
                if away.read_file(f"ep/{r % 100 + 1}") != f"{r}-{r % 100 + 1}\n":
                    raise AssertionError("the fork's restore lost the episode")
                away.close()
                snap.remove()
        return {"files": files, "fork_to_another_node": summary_ms(away_times),
                "restore_from_another_node": summary_ms(restores)}
    finally:
        shutil.rmtree(source, ignore_errors=True)


@contextlib.contextmanager
def local_cluster(num_cpus: int, nodes: int = 3) -> Iterator[Any]:
    """A Ray cluster of ``nodes`` on this machine (``ray.cluster_utils.Cluster``), joined by ``ray.init``, ended
    after the block. Ray's address file and sessions lie in this run's own directory, not the machine's shared
    /tmp/ray (another user's, or another run's): the nodes inherit RAY_TMPDIR, and the driver reads it where it
    writes the file (which it does not make)."""
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    import isolate.ray as iray

    temp = tempfile.mkdtemp(prefix="isolate-bench-ray-")
    os.mkdir(os.path.join(temp, "ray"), 0o700)
    outer_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "temp_dir": temp})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=num_cpus)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        iray.shutdown()
        ray.shutdown()
        cluster.shutdown()
        if outer_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = outer_tmpdir
        shutil.rmtree(temp, ignore_errors=True)


def on_ray(rounds: int, n: int, execs: int, log: Callable[[str], None]) -> dict[str, Any]:
    import ray

    import isolate
    import isolate.ray as iray
    from isolate.ray.placement import outcome

    def through_actor(box: Any) -> int:
        """An exec through the node's actor (the route a sandbox takes where the direct one does not open)."""
        return int(outcome(box._actor.call.remote(box.id, "exec", (["true"],), {}), box.node_id, "bench").returncode)

    log("many: a 3-node Ray cluster on this machine")
    with local_cluster(num_cpus=1):
        local = isolate.Sandbox(_policy()).start()
        remote = iray.Sandbox(_policy()).start()
        local_times, remote_times, actor_times, ray_times = [], [], [], []
        host = remote._actor  # the node's SandboxHost: a call that does nothing is Ray's own round trip
        for _ in range(rounds):  # interleaved: the same load on each
            t0 = time.perf_counter()
            local.exec(["true"])
            local_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            remote.exec(["true"])
            remote_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            through_actor(remote)
            actor_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get(host.node.remote())
            ray_times.append(time.perf_counter() - t0)
        route = remote.stats["route"]
        local.close()
        remote.close()
        log(f"many: {n} sandboxes over the cluster")
        t0 = time.perf_counter()
        boxes = iray.Sandbox.create_many(n, _policy())
        placed = time.perf_counter() - t0
        per_node: dict[str, int] = {}
        for box in boxes:
            per_node[box.node_id or "?"] = per_node.get(box.node_id or "?", 0) + 1
        log(f"many: {execs} concurrent execs over them")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(64) as callers:
            codes = list(callers.map(lambda i: boxes[i % len(boxes)].exec(["true"]).returncode, range(execs)))
        burst = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(64) as callers:
            list(callers.map(lambda i: through_actor(boxes[i % len(boxes)]), range(execs)))
        burst_actor = time.perf_counter() - t0
        for box in boxes:
            box.close()
        forks = cross_node_fork(20, 2000, log)
        return {
            "forks": forks,
            "route": route, "exec_local": summary_ms(local_times), "exec_through_ray": summary_ms(remote_times),
            "exec_added_ms": round((median(remote_times) - median(local_times)) * 1000, 3),
            "exec_through_actor": summary_ms(actor_times),
            "exec_added_through_actor_ms": round((median(actor_times) - median(local_times)) * 1000, 3),
            "ray_call": summary_ms(ray_times),
            "exec_added_beyond_ray_ms": round((median(remote_times) - median(local_times) - median(ray_times))
                                              * 1000, 3),
            "sandboxes": n, "placed_s": round(placed, 3), "per_node": sorted(per_node.values()),
            "execs": execs, "execs_s": round(burst, 3), "execs_per_s": round(execs / burst, 1),
            "execs_per_s_through_actor": round(execs / burst_actor, 1),
            "execs_failed": sum(1 for c in codes if c != 0),
        }


def measure(quick: bool, image: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"pool": pool(20 if quick else 200, log), "at_once": at_once(20 if quick else 200,
                                                                                       image, log)}
    try:
        import ray  # noqa: F401
    except ImportError:
        out["ray"] = {"skipped": "ray is not installed (pip install 'isolate[ray]')"}
    else:
        out["ray"] = {"skipped": "--quick"} if quick else on_ray(200, 500, 1000, log)
    out["goals"] = goals(out)
    return out


def goals(figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {"pool acquire (median, ms)": (figures["pool"]["acquire"].get("median_ms"), GOALS["pool_acquire_ms"])}
    if figures["at_once"]["n"] >= 200:
        found["200 sandboxes at once (s)"] = (figures["at_once"]["create_many_s"], GOALS["at_once_s"])
    ray_figures = figures.get("ray", {})
    if "exec_added_ms" in ray_figures:
        found["an exec on a Ray node adds (ms)"] = (ray_figures["exec_added_ms"], GOALS["ray_exec_added_ms"])
        found["concurrent execs over 3 nodes (per s, at least)"] = (ray_figures["execs_per_s"],
                                                                     GOALS["ray_execs_per_s"])
        found["500 sandboxes over 3 nodes (s)"] = (ray_figures["placed_s"], GOALS["ray_500_s"])
    if "forks" in ray_figures:
        found["a fork to another node, 100-file diff (median, ms)"] = (
            ray_figures["forks"]["fork_to_another_node"]["median_ms"], GOALS["ray_cross_node_fork_ms"])
    return {text: {"value": value, "goal": goal,
                   "met": value is not None and (value >= goal if "at least" in text else value <= goal)}
            for text, (value, goal) in found.items()}


def markdown(figures: dict[str, Any]) -> list[str]:
    pool_f, once = figures["pool"], figures["at_once"]
    lines = ["## Many sandboxes", "",
             f"- pool acquire: {pool_f['acquire']['median_ms']} ms median (p99 {pool_f['acquire']['p99_ms']}), "
             f"against a start when needed: {pool_f['start_when_needed']['median_ms']} ms "
             f"(ratio {pool_f['ratio']})",
             f"- {once['n']} at once: create_many {once['create_many_s']} s, one by one {once['one_by_one_s']} s, "
             f"docker run -d: {once['docker_run'].get('seconds', once['docker_run'].get('skipped'))}"]
    ray_f = figures.get("ray", {})
    if "skipped" in ray_f:
        lines.append(f"- Ray: skipped ({ray_f['skipped']})")
    elif ray_f:
        lines += [f"- exec on a Ray node ({ray_f['route']} route): {ray_f['exec_through_ray']['median_ms']} ms "
                  f"median, locally {ray_f['exec_local']['median_ms']} ms: {ray_f['exec_added_ms']} ms added; "
                  f"through the actor {ray_f['exec_through_actor']['median_ms']} ms: "
                  f"{ray_f['exec_added_through_actor_ms']} ms added",
                  f"- Ray's own round trip (a call to the node's host actor that does nothing): "
                  f"{ray_f['ray_call']['median_ms']} ms median; what isolate adds beyond it: "
                  f"{ray_f['exec_added_beyond_ray_ms']} ms",
                  f"- {ray_f['sandboxes']} sandboxes over 3 nodes: {ray_f['placed_s']} s "
                  f"(per node: {ray_f['per_node']})",
                  f"- {ray_f['execs']} concurrent execs over them: {ray_f['execs_s']} s, "
                  f"{ray_f['execs_per_s']} execs/s ({ray_f['execs_failed']} failed); through the actor "
                  f"{ray_f['execs_per_s_through_actor']} execs/s"]
        if "forks" in ray_f:
            forks = ray_f["forks"]
            lines.append(f"- a fork with a 100-file diff ({forks['files']}-file overlay source): to another node "
                         f"{forks['fork_to_another_node']['median_ms']} ms median; a restore of a sandbox on "
                         "another node "
                         f"{forks['restore_from_another_node']['median_ms']} ms")
    lines.append("")
    for text, goal in figures.get("goals", {}).items():
        sign = ">=" if "at least" in text else "<="
        lines.append(f"- goal: {text} {sign} {goal['goal']}: {goal['value']} ({'met' if goal['met'] else 'NOT met'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.many [--quick] [--no-docker] [--out DIR]``: this section alone, written to
    ``results/many.json`` and ``many.md``."""
    import argparse
    import json
    import sys

    from . import machine
    from .peers import docker_image

    parser = argparse.ArgumentParser(prog="python -m benchmarks.many", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 rounds and 20 sandboxes, no Ray cluster")
    parser.add_argument("--no-docker", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    load_start = machine.load_average()
    figures = measure(args.quick, None if args.no_docker else docker_image(), log)
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine.describe(),
               "load_average_start": load_start, "load_average_end": machine.load_average(), "many": figures}
    os.makedirs(args.out, exist_ok=True)
    stem = "many-quick" if args.quick else "many"
    with open(os.path.join(args.out, f"{stem}.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
    text = "\n".join([f"# Many sandboxes ({results['date']}; load average {load_start} at the start, "
                      f"{results['load_average_end']} at the end)", "", *markdown(figures)])
    with open(os.path.join(args.out, f"{stem}.md"), "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
