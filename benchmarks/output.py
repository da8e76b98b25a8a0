"""Ratios, goals, and the written results: JSON, a markdown table, and the spawn chart."""

from __future__ import annotations

import json
import os
from typing import Any

from ._stats import ratio

#: Peers that isolate's figures are set against, with the isolate variant that matches each.
PEER_COMPARISONS = (
    ("isolate.run", "bwrap"),
    ("isolate.run", "nsjail"),
    ("isolate.run", "unshare"),
    ("isolate.run", "firejail"),
    ("isolate.run", "docker-run"),
    ("isolate.run/ll", "bwrap"),
    ("sandbox-exec", "isolate.run"),
    ("sandbox-exec", "isolate-sandbox"),
    ("cli", "bwrap"),
    ("cli", "nsjail"),
    ("cli", "firejail"),
    ("cli", "docker-run"),
    ("isolate-docker", "docker-run"),
    ("isolate-sandbox", "docker-run"),
)


def _median(spawn: dict[str, Any], parent: str, key: str) -> float | None:
    entry = spawn.get("parents", {}).get(parent, {}).get("variants", {}).get(key, {})
    if "skipped" in entry or "dropped_in_round" in entry:
        return None
    value = entry.get("median_ms")
    return float(value) if value is not None else None


def _goal(value: float | None, limit: float, text: str) -> dict[str, Any]:
    return {"goal": text, "value": value, "limit": limit, "met": None if value is None else value <= limit}


def spawn_analysis(spawn: dict[str, Any]) -> dict[str, Any]:
    """Ratios to subprocess.run, isolate vs peers, parent growth, and the goals of issues 3 and 37."""
    out: dict[str, Any] = {"to_subprocess": {}, "isolate_vs_peers": {}, "big_over_small": {}}
    parents = list(spawn.get("parents", {}))
    keys: list[str] = []
    for parent in parents:
        for key in spawn["parents"][parent]["variants"]:
            if key not in keys:
                keys.append(key)
    for parent in parents:
        base = _median(spawn, parent, "subprocess")
        out["to_subprocess"][parent] = {k: ratio(_median(spawn, parent, k), base) for k in keys if k != "subprocess"}
        out["isolate_vs_peers"][parent] = {
            f"{mine} / {peer}": ratio(_median(spawn, parent, mine), _median(spawn, parent, peer))
            for mine, peer in PEER_COMPARISONS
        }
    if "small" in parents and "1GiB" in parents:
        out["big_over_small"] = {k: ratio(_median(spawn, "1GiB", k), _median(spawn, "small", k)) for k in keys}
    small = out["isolate_vs_peers"].get("small", {})
    growth = out["big_over_small"]
    out["goals"] = [
        _goal(small.get("isolate.run / bwrap"), 0.6, "isolate.run <= 0.6x bwrap (median, small parent)"),
        _goal(growth.get("isolate.run"), 1.15, "isolate.run from a 1 GiB parent <= 1.15x from a small parent"),
        _goal(growth.get("isolate.run/ll"), 1.15,
              "isolate.run (Landlock+seccomp only) from a 1 GiB parent <= 1.15x small"),
        _goal(small.get("cli / bwrap"), 2.5, "isolate-run CLI <= 2.5x bwrap (whole process, median)"),
        _goal(small.get("sandbox-exec / isolate.run"), 0.3, "Sandbox.exec (native) <= 0.3x isolate.run (median)"),
        _goal(small.get("sandbox-exec / isolate-sandbox"), 1 / 40,
              "Sandbox.exec (native) <= 1/40 of the Docker backend's kept exec (median)"),
        # Issue 37 (speed at the floor): the same rounds, tighter.
        _goal(out["to_subprocess"].get("small", {}).get("sandbox-exec"), 1.2,
              "Sandbox.exec (native) <= 1.2x subprocess.run (median, small parent)"),
        _goal(small.get("isolate.run / bwrap"), 0.45, "isolate.run <= 0.45x bwrap (median, small parent)"),
        _goal(small.get("cli / bwrap"), 0.6, "isolate-run CLI <= 0.6x bwrap (whole process, median)"),
    ]  # fmt: skip
    return out


def write_json(path: str, results: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _met(goal: dict[str, Any]) -> str:
    if goal["met"] is None:
        return "not measured"
    return "met" if goal["met"] else "**not met**"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# isolate benchmarks",
        "",
        f"`python -m benchmarks{' --quick' if results['mode'] == 'quick' else ''}` on {m['date']}, "
        f"took {results['duration_s']:.0f} s ({results['mode']} mode).",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB; Linux {m['kernel']} "
        f"({m['distro']}, {m['arch']}); {m['python']}; isolate {m['isolate']}; Landlock ABI {m['landlock_abi']}; "
        f"euid {m['euid']}. Load average at start {m['load_average_start']}, at the end "
        f"{m.get('load_average_end')}.",
        "",
    ]
    spawn = results.get("spawn")
    if spawn and "parents" in spawn:
        analysis = results["spawn_analysis"]
        lines += [
            "## Spawn latency of /bin/true",
            "",
            f"{spawn['rounds']} interleaved rounds per parent (Docker variants: {spawn['slow_runs']} runs, spread "
            "over the rounds). Times in ms, whole call as seen by the caller. \"1 GiB parent\": the calling "
            "process has written every page of a 1 GiB buffer.",
            "",
            "| variant | median | p99 | x subprocess | 1 GiB parent median | p99 | 1 GiB / small |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        small = spawn["parents"].get("small", {}).get("variants", {})
        big = spawn["parents"].get("1GiB", {}).get("variants", {})
        skipped: list[str] = []
        notes: list[str] = []

        def cells(e: dict[str, Any]) -> tuple[str, str]:
            if "skipped" in e:
                return "skipped", ""
            if "dropped_in_round" in e:
                return f"failing ({_fmt(e.get('median_ms'))})", _fmt(e.get("p99_ms"))
            return _fmt(e.get("median_ms")), _fmt(e.get("p99_ms"))

        for key in [*small, *[k for k in big if k not in small]]:
            entry, other = small.get(key, {}), big.get(key, {})
            label = entry.get("label") or other.get("label") or key
            if "skipped" in entry and "skipped" in other and entry["skipped"] == other["skipped"]:
                skipped.append(f"- {label}: {entry['skipped']}")
                continue
            for parent, e in (("small", entry), ("1 GiB", other)):
                if "skipped" in e:
                    skipped.append(f"- {label} ({parent} parent): {e['skipped']}")
                if e.get("failures"):
                    state = f"dropped after round {e['dropped_in_round']}" if "dropped_in_round" in e else "kept"
                    notes.append(f"- {label} ({parent} parent): {e['failures']} failed runs ({state}); "
                                 f"first: {e.get('first_failure')}")
            small_median, small_p99 = cells(entry)
            big_median, big_p99 = cells(other)
            lines.append(
                f"| {label} | {small_median} | {small_p99} | {_fmt(analysis['to_subprocess']['small'].get(key))} | "
                f"{big_median} | {big_p99} | {_fmt(analysis['big_over_small'].get(key))} |"
            )
        if skipped:
            lines += ["", "Skipped:", "", *skipped]
        if notes:
            lines += ["", "Failures:", "", *notes]
        lines += ["", "### isolate against the peers (ratio of medians; < 1 means isolate is faster)", "",
                  "| comparison | small parent | 1 GiB parent |", "|---|---:|---:|"]
        for name, value in analysis["isolate_vs_peers"].get("small", {}).items():
            big_value = analysis["isolate_vs_peers"].get("1GiB", {}).get(name)
            lines.append(f"| {name} | {_fmt(value, 3)} | {_fmt(big_value, 3)} |")
        lines += ["", "### Goals (issues 3 and 37; reported, not asserted)", "", "| goal | value | |", "|---|---:|---|"]
        for goal in analysis["goals"]:
            lines.append(f"| {goal['goal']} | {_fmt(goal['value'], 3)} | {_met(goal)} |")
        lines += ["", "![spawn latency](spawn.png)", ""]
    elif spawn:
        lines += ["## Spawn latency", "", f"Not measured: {spawn.get('error')}", ""]

    over = results.get("overhead")
    if over and "syscalls" in over:
        sc = over["syscalls"]
        lines += [
            "## Inside the sandbox: system calls",
            "",
            f"ns per call, best of 5 repetitions of {sc['loops']} calls (open/close: a tenth), median over "
            f"{sc['runs']} interleaved runs. Under isolate.run with the default policy but for `seccomp`.",
            "",
            "| variant | getpid | open+close | ioctl(FIONREAD) (argument-checked) |",
            "|---|---:|---:|---:|",
        ]
        for variant, row in sc["ns_per_call"].items():
            lines.append(f"| {variant} | {row['getpid_ns']:.1f} | {row['open_close_ns']:.1f} | "
                         f"{row['ioctl_fionread_ns']:.1f} |")
        r = sc["ratios"]
        lines += [
            "",
            "| ratio | getpid | open+close | ioctl(FIONREAD) |",
            "|---|---:|---:|---:|",
        ]
        for name in ("default/none", "strict/none", "none/unsandboxed", "default/unsandboxed"):
            lines.append(f"| {name} | {_fmt(r.get(name + ' getpid'), 3)} | {_fmt(r.get(name + ' open_close'), 3)} | "
                         f"{_fmt(r.get(name + ' ioctl_fionread'), 3)} |")
        lines += ["", "| goal | value | |", "|---|---:|---|"]
        for text, goal in sc["goals"].items():
            lines.append(f"| {text} | {_fmt(goal['value'], 3)} | {'met' if goal['met'] else '**not met**'} |")
        lines.append("")
    elif over:
        lines += ["## Inside the sandbox", "", f"Skipped: {over.get('skipped') or over.get('error')}", ""]
    if over and over.get("workloads"):
        lines += ["## Short real workloads (whole run, start-up included)", "",
                  "| workload | plain ms | isolate.run | seccomp=none | bwrap | isolate.run / plain |",
                  "|---|---:|---:|---:|---:|---:|"]
        for label, w in over["workloads"].items():
            if "skipped" in w:
                lines.append(f"| {label} | skipped: {w['skipped']} | | | | |")
                continue
            ms = w["median_ms"]
            lines.append(f"| {label} | {_fmt(ms.get('plain'), 1)} | {_fmt(ms.get('isolate.run'), 1)} | "
                         f"{_fmt(ms.get('isolate.run seccomp=none'), 1)} | {_fmt(ms.get('bwrap'), 1)} | "
                         f"{_fmt(w['ratio_to_plain'].get('isolate.run'), 3)} |")
        guard = [w for w in over["workloads"].values() if (w.get("seccomp=none enforced") or {}).get("setid_files")]
        if guard:
            lines += ["", "seccomp=none: as the caller is root and the working directory is writable, the filter "
                      "that refuses set-ID files stays."]
        lines.append("")

    tp = results.get("throughput")
    if tp and "per_second" in tp:
        lines += ["## Throughput: sandboxes started per second (`/bin/true`, threads calling back to back)", "",
                  "| | 1 worker | 2 workers |", "|---|---:|---:|"]
        for name, row in tp["per_second"].items():
            lines.append(f"| {name} | {_fmt(row.get('1 worker'), 0)} | {_fmt(row.get('2 workers'), 0)} |")
        lines.append("")
    mem = results.get("memory")
    if mem and "kib_per_sandbox" in mem:
        lines += [
            "## Memory of a live sandbox (KiB per sandbox, program `sleep 600`)",
            "",
            f"{mem['n']} at once, median of {mem['reps']} passes. cgroup growth: this process's memory cgroup "
            "(user and kernel memory of the children); MemAvailable: system-wide, noisy; PSS: user pages of the "
            "sandbox's own processes and of the program.",
            "",
            "| kind | cgroup growth | beyond a plain process | MemAvailable drop | PSS sandbox processes | "
            "PSS program |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, row in mem["kib_per_sandbox"].items():
            if "skipped" in row:
                lines.append(f"| {name} | skipped: {row['skipped']} | | | | |")
                continue
            beyond = mem["beyond_program_kib"].get(name, {})
            lines.append(f"| {name} | {_fmt(row.get('cgroup_growth_kib'), 0)} | "
                         f"{_fmt(beyond.get('cgroup_growth_kib', beyond.get('mem_available_drop_kib')), 0)} | "
                         f"{_fmt(row.get('mem_available_drop_kib'), 0)} | "
                         f"{_fmt(row.get('pss_sandbox_processes_kib'), 0)} | {_fmt(row.get('pss_program_kib'), 0)} |")
        lines.append("")
    kept = results.get("kept")
    if isinstance(kept, dict) and "create" in kept:
        create, idle, many = kept["create"], kept["idle_memory"], kept["many"]
        lines += [
            "## Kept sandboxes (`isolate.Sandbox`, native)",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| create (`Sandbox().start()`), median | {create['create']['median_ms']:.2f} ms |",
            f"| `isolate.run` of /bin/true in the same rounds, median | {create['isolate.run']['median_ms']:.2f} ms |",
            f"| create / isolate.run (goal <= 1.5) | {create['create_over_run']:.3f} |",
            f"| idle sandbox: PSS of its processes ({idle.get('processes_per_sandbox')} per sandbox) | "
            f"{_fmt(idle.get('pss_kib'), 0)} KiB |",
            f"| idle sandbox: MemAvailable drop (kernel memory included; noisy) | "
            f"{_fmt(idle.get('mem_available_drop_kib'), 0)} KiB |",
            f"| {many['n']} sandboxes open at once, a command and a file in each | "
            f"{'ok' if many['ok'] else 'FAILED'} ({many['total_seconds']} s) |",
            "",
            "Exec latency: `sandbox-exec` in the spawn table above (same rounds as `isolate.run` and the peers).",
            "",
        ]
        pair = kept.get("exec_pair")
        if isinstance(pair, dict) and "ratio" in pair:
            lines += [
                f"The exec alone against `subprocess.run`, {pair['rounds']} rounds, the two in each, nothing else "
                "between them (issue 37's row):",
                "",
                "| measure | median | p99 |",
                "|---|---:|---:|",
                f"| `Sandbox.exec([\"/bin/true\"])` | {pair['exec']['median_ms']:.3f} ms | "
                f"{pair['exec']['p99_ms']:.3f} ms |",
                f"| `subprocess.run([\"/bin/true\"])` | {pair['subprocess']['median_ms']:.3f} ms | "
                f"{pair['subprocess']['p99_ms']:.3f} ms |",
                "",
                f"Goal (issue 37): exec <= {pair['goal']['limit']}x subprocess.run: {pair['ratio']}x, "
                f"{'met' if pair['goal']['met'] else 'not met'}.",
                "",
            ]
        lines += _shell_markdown(kept.get("shell"))
    egress = results.get("egress")
    if isinstance(egress, dict) and "sandboxed" in egress:
        boxed, mediator = egress["sandboxed"], egress["mediator"]
        cpu = mediator["mediator_cpu_ms_per_download"]
        size = boxed["throughput"]["size_mb"]
        lines += [
            "## Egress by name (`--allow-host`)",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| connect + 1-byte request/response, sandbox on the host network, median | "
            f"{boxed['latency']['direct']['median_ms']:.3f} ms |",
            f"| the same through the mediator (a sandbox with an allow-list), median | "
            f"{boxed['latency']['mediated']['median_ms']:.3f} ms |",
            f"| added per connection (goal < 1 ms) | {boxed['added_ms']:.3f} ms |",
            f"| a DNS lookup answered by the mediator, median | {boxed['dns_lookup']['median_ms']:.3f} ms |",
            f"| {size} MB download, host network | {boxed['throughput']['direct_mb_s']} MB/s |",
            f"| the same through the mediator | {boxed['throughput']['mediated_mb_s']} MB/s |",
            f"| ratio (goal >= 0.8) | {boxed['throughput']['ratio']} |",
            f"| `isolate.run(['true'])` with an allow-list, minus without (the mediator's start and end) | "
            f"{boxed['start_added_ms']:.3f} ms |",
            f"| the mediator alone on the host's loopback: added per connection (transparent, proxy) | "
            f"{mediator['added_ms']['transparent']:.3f}, {mediator['added_ms']['proxy']:.3f} ms |",
            f"| the mediator alone: throughput ratio; its CPU per download (user+system) | "
            f"{mediator['throughput']['ratio']}; {cpu['user'] + cpu['system']:.0f} ms |",
            "",
        ]
    lines += _branches_markdown(results.get("branches"))
    many_figures = results.get("many")
    if isinstance(many_figures, dict) and "pool" in many_figures:
        from .many import markdown as many_markdown

        lines += many_markdown(many_figures)
    for section in ("overhead", "throughput", "memory", "kept", "egress", "branches", "many"):
        value = results.get(section)
        if isinstance(value, dict) and "error" in value:
            lines += [f"{section}: not measured: {value['error']}", ""]
    lines += [
        "## Method",
        "",
        "See `benchmarks/*.py` (each module's docstring) and the README's Benchmarks section. Peers run "
        "`/bin/true` with the equivalent of isolate's default namespaces and binds: `bwrap --unshare-all "
        "--die-with-parent --ro-bind /usr /usr --symlink usr/lib /lib --symlink usr/lib64 /lib64 --symlink "
        "usr/bin /bin --proc /proc --dev /dev --tmpfs /tmp`, `unshare -Urnpf --mount-proc`, `firejail --quiet "
        "--noprofile --net=none`, `nsjail -Mo` with the same binds, `docker run --rm --network none` on a local "
        "busybox image.",
        "",
    ]
    return "\n".join(lines)


#: The kept shell's rows: its own ``run("true")`` in each shell, and the floor of one in-band round trip.
_SHELL_ROWS = (("pipe", "`/bin/sh` (dash), pipes"), ("pty", "`/bin/sh` (dash), a terminal"),
               ("pipe_busybox_ash", "busybox ash, pipes"), ("pipe_bash", "bash, pipes"),
               ("in_band_floor", "floor: one in-band round trip through a shell's pipe, no framing"))


def _shell_markdown(shell: Any) -> list[str]:
    if not isinstance(shell, dict) or "pipe" not in shell:
        return []
    lines = [f"Kept shell: `Sandbox.shell().run(\"true\")`, median of {shell.get('rounds')} runs of each shell, "
             f"in blocks of {shell.get('block')}, the shells taking turns (us).", "",
             "| shell | median | p99 |", "|---|---:|---:|"]
    for key, label in _SHELL_ROWS:
        row = shell.get(key)
        if isinstance(row, dict) and "median_ms" in row:
            lines.append(f"| {label} | {row['median_ms'] * 1000:.0f} | {row['p99_ms'] * 1000:.0f} |")
    goal = shell.get("goal")
    if isinstance(goal, dict):
        lines += ["", f"Goal (issues 34 and 37): dash over pipes <= {goal['limit_ms'] * 1000:.0f} us: "
                  f"{'met' if goal['met'] else 'not met'}."]
    return [*lines, ""]


def _branches_markdown(figures: Any) -> list[str]:
    """The branches section (benchmarks/branches.py): isolate's layers against a copy and Docker."""
    if not isinstance(figures, dict) or "isolate" not in figures:
        return []
    mine, copy, docker = figures["isolate"], figures["copy"], figures["docker"]
    kept = figures.get("copy_workspace") or {}

    def cell(entry: Any) -> str:
        return _fmt(entry.get("median_ms")) if isinstance(entry, dict) and "median_ms" in entry else "n/a"

    lines = [
        f"## Branches: snapshot, fork, restore ({figures['files']} files, {figures['size_mb']} MB; "
        f"episodes of {figures['episode_files']} files)", "",
        f"Median ms over {figures['rounds']} rounds (copy and Docker: fewer). {figures['mechanism']}.", "",
        "| | isolate, overlay workspace | isolate, copy workspace | a whole copy of the workspace | "
        "docker commit / docker run -d |", "|---|---:|---:|---:|---:|",
        f"| snapshot | {cell(mine['snapshot'])} | {cell(kept.get('snapshot'))} | {cell(copy.get('snapshot'))} | "
        f"{cell(docker.get('commit'))} |",
        f"| fork | {cell(mine['fork'])} | {cell(kept.get('fork'))} | {cell(copy.get('fork_or_restore'))} | "
        f"{cell(docker.get('run'))} |",
        f"| restore | {cell(mine['restore'])} | {cell(kept.get('restore'))} | {cell(copy.get('fork_or_restore'))} | "
        f"{cell(docker.get('run'))} |",
        "",
    ]
    if kept:
        lines += [f"Copy workspace: its snapshots are {kept.get('snapshots')}; its first copy is a sandbox's start "
                  "(the whole copy's fork column).", ""]
    if "skipped" in docker:
        lines += [f"Docker: skipped: {docker['skipped']}", ""]
    lines += ["| goal | value | |", "|---|---:|---|"]
    lines += [f"| {text} | {_fmt(goal['value'])} | {'met' if goal['met'] else 'NOT met'} |"
              for text, goal in figures["goals"].items()]
    return [*lines, ""]


def chart(results: dict[str, Any], path: str) -> str | None:
    """Write the spawn chart; None when written, else why not."""
    spawn = results.get("spawn")
    if not spawn or "parents" not in spawn:
        return "no spawn figures"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the package's bench extra)"
    small = spawn["parents"].get("small", {}).get("variants", {})
    big = spawn["parents"].get("1GiB", {}).get("variants", {})
    rows = [(k, e) for k, e in small.items() if "median_ms" in e]
    rows.sort(key=lambda item: item[1]["median_ms"])
    labels = [e["label"] for _, e in rows]
    colors = {"baseline": "#9e9e9e", "isolate": "#1f77b4", "peer": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.6), dpi=110)
    height = 0.38
    for i, (key, entry) in enumerate(rows):
        color = colors.get(entry["kind"], "#555555")
        ax.barh(i - height / 2, entry["median_ms"], height, color=color)
        other = big.get(key, {})
        if "median_ms" in other and "dropped_in_round" not in other:
            ax.barh(i + height / 2, other["median_ms"], height, color=color, alpha=0.45, hatch="//",
                    edgecolor="white")
            ax.text(other["median_ms"] * 1.05, i + height / 2, f"{other['median_ms']:.1f}", va="center", fontsize=7,
                    color="#555555")
        ax.text(entry["median_ms"] * 1.05, i - height / 2, f"{entry['median_ms']:.1f}", va="center", fontsize=8)
        if "skipped" in other or "dropped_in_round" in other:
            ax.text(entry["median_ms"] * 1.05, i + height / 2, "1 GiB parent: hung or failed (see latest.md)",
                    va="center", fontsize=7, color="#b00020")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(e["median_ms"] for _, e in rows) * 3)
    ax.set_xlabel("median spawn latency of /bin/true, ms (log scale)")
    m = results["machine"]
    ax.set_title(f"Spawn latency: solid = small parent, hatched = parent holding 1 GiB\n"
                 f"Linux {m['kernel']}, {m['cpu_model']}, {m['cores']} cores", fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colors["isolate"], label="isolate"), Patch(color=colors["peer"], label="peers"),
                       Patch(color=colors["baseline"], label="no sandbox")], loc="upper right", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
