"""``python -m benchmarks [--quick] [--sections ...] [--no-docker] [--out DIR]``.

Installs nothing: peers that are missing are listed as skipped, with the
reason (``bash benchmarks/setup-peers.sh`` installs them). A full run writes
``results/latest.json``, ``results/latest.md`` and ``results/spawn.png``;
``--quick`` (fewer iterations, for CI; figures are never asserted) writes
``results/quick.json``, ``quick.md`` and ``quick.png`` instead, so it never
overwrites the committed full results.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

from . import machine, output, peers, spawn

SECTIONS = ("spawn", "overhead", "throughput", "memory", "kept", "egress", "cli", "branches", "why", "many", "images",
            "build")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class Settings:
    rounds: int
    docker_runs: int
    syscall_loops: int
    syscall_runs: int
    workload_runs: int
    throughput_seconds: float
    memory_n: int
    memory_reps: int
    docker_memory_n: int
    kept_rounds: int
    kept_idle_n: int
    kept_many_n: int
    egress_rounds: int
    egress_downloads: int
    egress_size_mb: int
    branches_files: int
    branches_mb: int
    branches_rounds: int
    branches_copy_rounds: int
    why_runs: int
    images_rounds: int
    build_rounds: int


FULL = Settings(rounds=250, docker_runs=200, syscall_loops=200_000, syscall_runs=15, workload_runs=15,
                throughput_seconds=4.0, memory_n=30, memory_reps=3, docker_memory_n=10,
                kept_rounds=60, kept_idle_n=20, kept_many_n=50, egress_rounds=300, egress_downloads=7,
                egress_size_mb=100, branches_files=10_000, branches_mb=500, branches_rounds=20,
                branches_copy_rounds=3, why_runs=30, images_rounds=30, build_rounds=10)
QUICK = Settings(rounds=20, docker_runs=4, syscall_loops=50_000, syscall_runs=3, workload_runs=3,
                 throughput_seconds=1.0, memory_n=5, memory_reps=1, docker_memory_n=0,
                 kept_rounds=5, kept_idle_n=3, kept_many_n=5, egress_rounds=20, egress_downloads=1,
                 egress_size_mb=10, branches_files=500, branches_mb=5, branches_rounds=3, branches_copy_rounds=1,
                 why_runs=3, images_rounds=3, build_rounds=1)


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    description = __doc__.split("\n\n")[0] if __doc__ else ""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=description)
    parser.add_argument("--quick", action="store_true", help="few iterations (under two minutes); writes quick.*")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--no-docker", action="store_true", help="leave the Docker variants out")
    parser.add_argument("--rounds", type=int, help="spawn rounds per parent (default: 250; quick: 20)")
    parser.add_argument("--docker-runs", type=int, help="runs of each Docker variant per parent (default: 200)")
    parser.add_argument("--out", default=RESULTS, help="directory for the results (default: benchmarks/results)")
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.sections = wanted
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = QUICK if args.quick else FULL
    rounds = args.rounds or settings.rounds
    docker_runs = args.docker_runs if args.docker_runs is not None else settings.docker_runs
    started = time.monotonic()
    results: dict[str, Any] = {"mode": "quick" if args.quick else "full", "machine": machine.describe(),
                               "settings": {**settings.__dict__, "rounds": rounds, "docker_runs": docker_runs}}
    workdir = tempfile.mkdtemp(prefix="isolate-bench-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    # The program runs as 65534 when the caller is root; without namespaces
    # (no idmapped mount) it writes its granted cwd with plain permissions.
    os.chmod(workdir, 0o777)
    try:
        found: dict[str, peers.Peer] = {}
        if "spawn" in args.sections or "memory" in args.sections:
            _log("probing the peers")
            found = peers.find_peers(with_docker=not args.no_docker)
            for peer in found.values():
                _log(f"  {peer.key}: {'ok' if peer.usable else 'skipped: ' + str(peer.skipped)}")
        results["peers"] = {k: {"label": p.label, "argv": list(p.argv), "skipped": p.skipped} for k, p in found.items()}
        docker_reason = found["docker-run"].skipped if "docker-run" in found else "Docker left out"

        if "spawn" in args.sections:
            _log(f"spawn latency: {rounds} rounds per parent")
            try:
                usable = {k: list(p.argv) for k, p in found.items() if p.usable}
                keys = []
                skipped: dict[str, str] = {}
                for variant in spawn.VARIANTS:
                    if variant.kind == "peer" and variant.key not in usable:
                        skipped[variant.key] = found[variant.key].skipped or "not available"
                    elif variant.slow and docker_reason and variant.kind != "peer":
                        skipped[variant.key] = docker_reason
                    else:
                        keys.append(variant.key)
                figures = spawn.measure(keys, usable, rounds=rounds, slow_runs=docker_runs, workdir=workdir,
                                        cli=peers.cli_command(), image=peers.docker_image(), log=_log)
                for parent in figures["parents"].values():
                    for key, reason in skipped.items():
                        parent["variants"][key] = {"label": spawn.BY_KEY[key].label, "kind": spawn.BY_KEY[key].kind,
                                                   "skipped": reason}
                    order = [v.key for v in spawn.VARIANTS]
                    parent["variants"] = dict(sorted(parent["variants"].items(), key=lambda kv: order.index(kv[0])))
                results["spawn"] = figures
                results["spawn_analysis"] = output.spawn_analysis(figures)
            except Exception as exc:
                results["spawn"] = {"error": _error(exc)}

        if "overhead" in args.sections:
            from . import overhead

            try:
                results["overhead"] = overhead.measure(workdir=workdir, loops=settings.syscall_loops,
                                                       runs=settings.syscall_runs,
                                                       workload_runs=settings.workload_runs, log=_log)
            except Exception as exc:
                results["overhead"] = {"error": _error(exc)}

        if "throughput" in args.sections or "memory" in args.sections:
            from . import capacity

            if "throughput" in args.sections:
                _log("throughput")
                try:
                    results["throughput"] = capacity.throughput(seconds=settings.throughput_seconds, log=_log)
                except Exception as exc:
                    results["throughput"] = {"error": _error(exc)}
            if "memory" in args.sections:
                _log(f"memory: {settings.memory_n} live sandboxes of each kind")
                image = peers.docker_image() if not docker_reason and settings.docker_memory_n else None
                try:
                    results["memory"] = capacity.memory(n=settings.memory_n, reps=settings.memory_reps,
                                                        docker_image=image, docker_n=settings.docker_memory_n,
                                                        log=_log)
                    results["memory"]["method"] = (capacity.__doc__ or "").strip()
                except Exception as exc:
                    results["memory"] = {"error": _error(exc)}
        if "kept" in args.sections:
            from . import kept

            _log("kept sandboxes")
            try:
                results["kept"] = kept.measure(settings.kept_rounds, settings.kept_idle_n, settings.kept_many_n,
                                               _log, None if args.no_docker else peers.docker_image())
            except Exception as exc:
                results["kept"] = {"error": _error(exc)}
        if "egress" in args.sections:
            from . import egress

            _log("egress by name: the mediator on the host's loopback, then in a sandbox")
            try:
                results["egress"] = {
                    "mediator": egress.measure(settings.egress_rounds, settings.egress_downloads,
                                               settings.egress_size_mb, log=_log),
                    "sandboxed": egress.measure_sandboxed(settings.egress_rounds, settings.egress_downloads,
                                                          settings.egress_size_mb, log=_log),
                }
            except Exception as exc:
                results["egress"] = {"error": _error(exc)}
        if "cli" in args.sections:
            from . import cli

            _log(f"isolate-run binary against bwrap: {rounds} rounds")
            try:
                results["cli"] = cli.measure(rounds=rounds, workdir=workdir, log=_log)
            except Exception as exc:
                results["cli"] = {"error": _error(exc)}
        if "branches" in args.sections:
            from . import branches

            _log(f"branches: snapshot, fork and restore on {settings.branches_files} files / "
                 f"{settings.branches_mb} MB")
            try:
                results["branches"] = branches.measure(workdir, settings.branches_files, settings.branches_mb,
                                                       settings.branches_rounds, settings.branches_copy_rounds,
                                                       None if args.no_docker else peers.docker_image(), _log)
            except Exception as exc:
                results["branches"] = {"error": _error(exc)}
        if "why" in args.sections:
            from . import why

            try:
                results["why"] = why.measure(settings.why_runs, workdir, log=_log)
            except Exception as exc:
                results["why"] = {"error": _error(exc)}
        if "many" in args.sections:
            from . import many

            try:
                results["many"] = many.measure(args.quick, None if args.no_docker else peers.docker_image(), _log)
            except Exception as exc:
                results["many"] = {"error": _error(exc)}
        if "images" in args.sections:
            from . import images

            try:
                with tempfile.TemporaryDirectory(prefix="isolate-bench-images-", dir=os.path.dirname(workdir)) as tmp:
                    results["images"] = images.measure(settings.images_rounds, tmp, not args.no_docker, _log)
            except Exception as exc:
                results["images"] = {"error": _error(exc)}
        if "build" in args.sections:
            from . import build

            try:
                with tempfile.TemporaryDirectory(prefix="isolate-bench-build-", dir=os.path.dirname(workdir)) as tmp:
                    results["build"] = build.measure(settings.build_rounds, tmp, not args.no_docker, _log)
            except Exception as exc:
                results["build"] = {"error": _error(exc)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["machine"]["load_average_end"] = machine.load_average()
    results["duration_s"] = round(time.monotonic() - started, 1)
    return results


def _error(exc: BaseException) -> str:
    _log("".join(traceback.format_exception(exc)).rstrip())
    return f"{type(exc).__name__}: {exc}"[:500]


def summary(results: dict[str, Any]) -> list[str]:
    """The headline lines printed at the end."""
    lines = []
    spawn_figures = results.get("spawn", {})
    analysis = results.get("spawn_analysis")
    if analysis:
        small = spawn_figures["parents"]["small"]["variants"]
        for key in ("subprocess", "isolate.run", "isolate.run/ll", "preexec", "cli", "bwrap", "nsjail", "firejail",
                    "docker-run", "isolate-docker", "sandbox-exec", "isolate-sandbox"):
            entry = small.get(key, {})
            if "median_ms" in entry:
                failed = f" ({entry['failures']} failed runs)" if entry.get("failures") else ""
                lines.append(
                    f"spawn {entry['label']}: median {entry['median_ms']:.2f} ms, p99 {entry['p99_ms']:.2f} ms{failed}"
                )
        for goal in analysis["goals"]:
            state = "n/a" if goal["met"] is None else ("met" if goal["met"] else "NOT met")
            value = "n/a" if goal["value"] is None else f"{goal['value']:.3f}"
            lines.append(f"goal: {goal['goal']}: {value} ({state})")
        for name, value in analysis["isolate_vs_peers"]["small"].items():
            if value is not None:
                lines.append(f"ratio {name}: {value:.3f}")
    kept_figures = results.get("kept", {})
    if "create" in kept_figures:
        create = kept_figures["create"]
        lines.append(f"goal: Sandbox create <= 1.5x isolate.run: {create['create_over_run']:.3f} "
                     f"({'met' if create['create_over_run'] <= 1.5 else 'NOT met'})")
        idle = kept_figures["idle_memory"]
        lines.append(f"kept: idle sandbox {idle.get('pss_kib')} KiB PSS, {idle.get('mem_available_drop_kib')} KiB "
                     "MemAvailable")
        lines.append(f"kept: {kept_figures['many']['n']} sandboxes at once: "
                     f"{'ok' if kept_figures['many']['ok'] else 'FAILED'}")
    shell_figures = kept_figures.get("shell", {})
    if "goal" in shell_figures:
        met = "met" if shell_figures["goal"]["met"] else "NOT met"
        lines.append(f"goal: shell.run('true') <= {shell_figures['goal']['limit_ms']} ms (pipes, median): "
                     f"{shell_figures['pipe']['median_ms']} ms ({met})")
    sandboxed = results.get("egress", {}).get("sandboxed")
    if sandboxed:
        lines.append(f"goal: egress adds < 1 ms per connection: {sandboxed['added_ms']:.3f} ms "
                     f"({'met' if sandboxed['goals']['added_under_1ms'] else 'NOT met'})")
        lines.append(f"goal: egress throughput >= 80% of the host network's: {sandboxed['throughput']['ratio']} "
                     f"({'met' if sandboxed['goals']['throughput_at_least_80pct'] else 'NOT met'})")
    for text, goal in results.get("many", {}).get("goals", {}).items():
        lines.append(f"goal: {text} <= {goal['goal']}: {goal['value']} ({'met' if goal['met'] else 'NOT met'})")
    branch_figures = results.get("branches", {})
    for text, goal in branch_figures.get("goals", {}).items():
        lines.append(f"goal: {text}: {goal['value']:.2f} ms ({'met' if goal['met'] else 'NOT met'})")
    for label, figures in results.get("why", {}).get("workloads", {}).items():
        if "goal_met" not in figures:
            continue
        lines.append(f"goal: denial tracing costs <= 1.3x ({label}): {figures['ratio']} "
                     f"({'met' if figures['goal_met'] else 'NOT met'})")
    syscalls = results.get("overhead", {}).get("syscalls")
    if syscalls:
        for text, goal in syscalls["goals"].items():
            lines.append(f"goal: {text}: {goal['value']} ({'met' if goal['met'] else 'NOT met'})")
    image_figures = results.get("images", {})
    if "cli" in image_figures:
        cli_figures = image_figures["cli"]
        lines.append(f"images: isolate-run --image {cli_figures['image']['median_ms']:.2f} ms, "
                     f"{cli_figures['image_over_host']:.3f}x the host root's"
                     + "".join(f", {cli_figures[f'image_over_{tool}']:.4f}x {tool} run --rm"
                               for tool in image_figures.get("engines", [])))
        first = image_figures["kept"]["create_first_exec"]["image"]["median_ms"]
        lines.append(f"goal: kept sandbox from an image, create + first exec <= 15 ms: {first:.2f} ms "
                     f"({'met' if first <= 15 else 'NOT met'})")
    for text, goal in results.get("build", {}).get("goals", {}).items():
        lines.append(f"goal: {text}: {goal['value']} ({'met' if goal['met'] else 'NOT met'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    stem = "quick" if args.quick else "latest"
    json_path = os.path.join(args.out, f"{stem}.json")
    md_path = os.path.join(args.out, f"{stem}.md")
    png_path = os.path.join(args.out, "quick.png" if args.quick else "spawn.png")
    why_not = output.chart(results, png_path)
    results["chart"] = os.path.basename(png_path) if why_not is None else {"skipped": why_not}
    output.write_json(json_path, results)
    text = output.markdown(results)
    if why_not is not None:
        text = text.replace("![spawn latency](spawn.png)", f"(chart not drawn: {why_not})")
    elif args.quick:
        text = text.replace("![spawn latency](spawn.png)", "![spawn latency](quick.png)")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(text)
    for line in summary(results):
        print(line)
    print(f"results: {json_path}, {md_path}" + (f", {png_path}" if why_not is None else f" (no chart: {why_not})"))
    failed = [s for s in SECTIONS if isinstance(results.get(s), dict) and "error" in results[s]]
    if failed:
        print(f"sections that failed: {', '.join(failed)} (see the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
