"""A cluster-wide RL-shaped round on a local 3-node Ray cluster (issue 36), and a cross-node fork.

- ``round``: 64 sandboxes forked from one snapshot over the 3 nodes of a
  ``ray.cluster_utils.Cluster`` on this machine; each round runs one command in
  each (all dispatched at once), then restores each to the snapshot (all at
  once); 10 rounds, then 10 more with ``restore(snap, ahead=True)`` (the next
  restore's sandbox starts while the commands run, and the restore swaps it
  in). Goal: the whole round <= 2x the slowest command (its own duration,
  measured inside the sandbox) + 50 ms. The round's two halves are given
  apart (dispatch, restore) to show where the time goes.
- ``forks``: a fork to another node of a sandbox whose overlay workspace (2,000
  files) has a 100-file episode diff (goal: <= 100 ms median), the measurement
  of ``benchmarks.many.cross_node_fork``, here on this cluster.

``python -m benchmarks.ray_round [--rounds N] [--sandboxes N] [--out DIR]`` writes
``results/ray_round.json`` and ``ray_round.md``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._stats import median, summary_ms
from .many import GOALS, _policy, cross_node_fork, local_cluster

#: One command of an episode step: it reports its own duration (ns) inside the sandbox.
STEP = ("s=$(date +%s%N); sleep {sleep}; echo step-$s > obs; e=$(date +%s%N); echo $((e - s))")


def rl_round(n: int, rounds: int, sleep: float, log: Callable[[str], None], ahead: bool = False) -> dict[str, Any]:
    """The round; ``ahead``: each restore with ``ahead=True`` (the next restore's sandbox started while the
    commands run)."""
    import ray

    import isolate.ray as iray

    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    log(f"ray_round: {n} sandboxes from one snapshot over {len(nodes)} nodes (restores ahead: {ahead})")
    with iray.Sandbox(_policy(), workspace=None, node_id=nodes[0]) as parent:
        parent.exec("echo start > obs")
        snap = parent.snapshot()
        t0 = time.perf_counter()
        boxes = parent.fork(n)
        forked = time.perf_counter() - t0
        per_node: dict[str, int] = {}
        for box in boxes:
            per_node[box.node_id or "?"] = per_node.get(box.node_id or "?", 0) + 1
        command = STEP.format(sleep=sleep)
        whole, dispatch, restore, slowest, ratio = [], [], [], [], []
        try:
            with ThreadPoolExecutor(n) as callers:
                list(callers.map(lambda b: b.restore(snap, ahead=ahead), boxes))  # the snapshot shipped once
                for r in range(rounds):
                    t0 = time.perf_counter()
                    results = list(callers.map(lambda b: b.exec(command), boxes))
                    t1 = time.perf_counter()
                    list(callers.map(lambda b: b.restore(snap, ahead=ahead), boxes))
                    t2 = time.perf_counter()
                    if any(res.returncode != 0 for res in results):
                        raise AssertionError(f"round {r}: a command failed")
                    own = max(int(res.stdout.split()[-1]) for res in results) / 1e9
                    whole.append(t2 - t0)
                    dispatch.append(t1 - t0)
                    restore.append(t2 - t1)
                    slowest.append(own)
                    ratio.append((t2 - t0) / own)
                    log(f"ray_round: round {r}: {(t2 - t0) * 1000:.0f} ms (commands {(t1 - t0) * 1000:.0f}, "
                        f"restores {(t2 - t1) * 1000:.0f}; slowest command {own * 1000:.0f} ms)")
            if boxes[0].read_file("obs") != "start\n":
                raise AssertionError("the restore did not bring the snapshot back")
        finally:
            for box in boxes:
                box.close()
            snap.remove()
    goal = [2 * s + 0.05 for s in slowest]
    return {"sandboxes": n, "rounds": rounds, "per_node": sorted(per_node.values()), "fork_s": round(forked, 3),
            "command_sleep_s": sleep, "round": summary_ms(whole), "commands": summary_ms(dispatch),
            "restores": summary_ms(restore), "slowest_command": summary_ms(slowest),
            "goal_ms": round(median(goal) * 1000, 1),
            "rounds_within_goal": sum(1 for w, g in zip(whole, goal, strict=True) if w <= g)}


def measure(n: int, rounds: int, sleep: float, log: Callable[[str], None]) -> dict[str, Any]:
    log("ray_round: a 3-node Ray cluster on this machine")
    # Sandboxes ask for no CPU of Ray (the host actor takes num_cpus=0); a node's CPUs are what Ray schedules on.
    with local_cluster(num_cpus=2):
        out = {"round": rl_round(n, rounds, sleep, log), "round_ahead": rl_round(n, rounds, sleep, log, ahead=True),
               "forks": cross_node_fork(20, 2000, log)}
    rnd, early, fork = out["round"], out["round_ahead"], out["forks"]["fork_to_another_node"]["median_ms"]
    out["goals"] = {
        "RL round, 64 sandboxes over 3 nodes (median, ms; goal 2x the slowest command + 50 ms)": {
            "value": rnd["round"]["median_ms"], "goal": rnd["goal_ms"],
            "met": rnd["round"]["median_ms"] <= rnd["goal_ms"]},
        "RL round, restores ahead (median, ms; the same goal)": {
            "value": early["round"]["median_ms"], "goal": early["goal_ms"],
            "met": early["round"]["median_ms"] <= early["goal_ms"]},
        "a fork to another node, 100-file diff (median, ms)": {
            "value": fork, "goal": GOALS["ray_cross_node_fork_ms"], "met": fork <= GOALS["ray_cross_node_fork_ms"]}}
    return out


def markdown(figures: dict[str, Any]) -> list[str]:
    rnd, forks = figures["round"], figures["forks"]
    lines = ["## An RL-shaped round on a 3-node Ray cluster", "",
             f"- {rnd['sandboxes']} sandboxes forked from one snapshot in {rnd['fork_s']} s (per node "
             f"{rnd['per_node']}); one command each (sleep {rnd['command_sleep_s']} s inside), then each restored to "
             f"the snapshot; {rnd['rounds']} rounds"]
    for key, how in (("round", "round"), ("round_ahead", "round, restores ahead (`restore(snap, ahead=True)`)")):
        one = figures.get(key)
        if one is not None:
            lines.append(f"- {how}: {one['round']['median_ms']} ms median (p99 {one['round']['p99_ms']}): the "
                         f"commands {one['commands']['median_ms']} ms, the restores {one['restores']['median_ms']} ms; "
                         f"the slowest command {one['slowest_command']['median_ms']} ms; {one['rounds_within_goal']} "
                         f"of {one['rounds']} rounds within the goal")
    lines += [
             f"- a fork with a 100-file diff ({forks['files']}-file overlay source): to another node "
             f"{forks['fork_to_another_node']['median_ms']} ms median; a restore of a sandbox on another node "
             f"{forks['restore_from_another_node']['median_ms']} ms", ""]
    for text, goal in figures["goals"].items():
        lines.append(f"- goal: {text} <= {goal['goal']}: {goal['value']} ({'met' if goal['met'] else 'NOT met'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from . import machine

    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_round", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sandboxes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.2, help="each command's own duration (s)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    load_start = machine.load_average()
    figures = measure(args.sandboxes, args.rounds, args.sleep, log)
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine.describe(),
               "load_average_start": load_start, "load_average_end": machine.load_average(), "ray_round": figures}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ray_round.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
    text = "\n".join([f"# Ray round ({results['date']}; load average {load_start} at the start, "
                      f"{results['load_average_end']} at the end)", "", *markdown(figures)])
    with open(os.path.join(args.out, "ray_round.md"), "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
