"""``isolate-run learn [--out profile.toml] [--rounds N] [OPTIONS] -- COMMAND``: write the policy a command needs.

Learning never lifts the confinement: the command runs in a sandbox every
time, with denial tracing on (``trace_denials``), so each refused file access
is named in the report. After each run the grants that would have allowed the
refused accesses are added, and the command runs again, until a run refuses
nothing (or ``--rounds`` runs have been made; the command then still needs
something no grant gives, and learn says which). The command thus runs up to
``--rounds`` times: learn it on something whose repetition is harmless (a
build, a test suite), as its effects happen each time.

The grants, collapsed by one rule: a read or an execute grants the file's
directory (read-only); a write, a truncate or a create, remove or rename of an
entry grants that directory (writable); a grant already under another is
dropped, and a read grant under a write grant too. Never / or the caller's
home (nor a directory above it): there the file itself is granted when it
exists, and anything else is written as a comment to grant by hand (one
file read in the home is not all of its keys). A system call the
seccomp profile refused is let through in a copy of that profile written
beside the TOML (``profile.seccomp.json``), unless --seccomp chose the
profile. Refusals that no grant fixes (file modes as the sandbox's uid) are
written as comments with the way out.

The network is learned unless chosen with --net: a default "none" runs as
egress by name with nothing allowed (still no route out: the mediator refuses
and names each destination), and each "HOST:PORT" the command reached for is
allowed in the next run; the profile gets them as ``[network] egress``, or
keeps "none" when nothing was reached for. Static names (--add-host,
--allow-private, --dns) may be given to learn without --allow-host.

The limits seen in the last run are written with headroom: memory twice the
peak (at least 64 MiB), CPU and wall time three times what was used (at
least 5 and 10 seconds).

Each entry of the profile carries a comment saying why it is there. The
profile then runs the command with ``isolate-run --profile profile.toml --
COMMAND`` and no other flag.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..model.errors import IsolationError
from ..model.policy import Egress, Limits, Policy
from ..model.units import whole_number
from .flags import CliError, _Parser, build_parser, policy_from_args

DEFAULT_ROUNDS = 8
_WRITES = ("write", "truncate", "create", "remove", "rename")


def _broad(directory: str) -> bool:
    """Whether granting directory gives far more than any one access asks for: / and the caller's home
    (and each directory above it). A program that reads ~/.x must not learn itself all of the home (its
    keys), nor one that creates ~/.x the home writable (its shell's startup files)."""
    home = os.path.realpath(os.path.expanduser("~"))
    return _under(home, directory)


def _grant_of(entry: dict[str, Any]) -> tuple[str, str] | None:
    """("read" | "write", directory or file) that would have allowed a refused access, or None."""
    if entry.get("mechanism") not in ("absent", "landlock", "read-only") or entry.get("cut"):
        return None
    resolved = str(entry.get("resolved") or "")
    if not resolved.startswith("/"):
        return None
    directory = os.path.dirname(resolved.rstrip("/")) or "/"
    kind = "write" if entry.get("access") in _WRITES else "read"
    if kind == "read" and os.path.isdir(resolved):
        directory = resolved  # listing a directory: the directory itself
    if _broad(directory):
        # The file alone, when a rule can name it (one that exists: read, or written in place, also by an
        # open that would have made it); an entry made anew, removed or renamed there, or the directory
        # listed, needs the directory: not learned.
        if entry.get("access") in ("read", "execute", "write", "truncate", "create") and os.path.isfile(resolved):
            return kind, resolved
        return None
    return kind, directory


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


class Learned:
    """The grants found so far, each with why."""

    def __init__(self) -> None:
        self.read: dict[str, str] = {}
        self.write: dict[str, str] = {}
        self.unfixable: dict[str, str] = {}
        #: Egress by name: "HOST:PORT" the command was refused, each with why.
        self.hosts: dict[str, str] = {}
        #: Names allowed only because --add-host names them (dropped once a port of theirs is learned).
        self.auto_names: set[str] = set()
        #: System calls the seccomp profile refused, each with why (learned when the profile is one
        #: learn can widen: a built-in or an OCI file).
        self.syscalls: dict[str, str] = {}
        self.learn_syscalls = True

    def add(self, denied: list[dict[str, Any]]) -> int:
        """Take a run's refusals in; returns how many new grants they gave."""
        added = 0
        for entry in denied:
            if entry.get("mechanism") == "egress" and entry.get("host") and entry.get("port") and \
                    str(entry.get("reason", "")).startswith(("not allowed", "port not allowed")):
                target = f"{entry['host']}:{entry['port']}"
                if target not in self.hosts:
                    self.hosts[target] = f"{target} was reached for ({entry.get('count', 1)} connection(s) refused)"
                    added += 1
                continue
            if entry.get("mechanism") == "seccomp" and entry.get("syscall") and self.learn_syscalls:
                name = str(entry["syscall"])
                if name not in self.syscalls:
                    self.syscalls[name] = f"{name} was refused by the filter ({entry.get('count', 1)} time(s))"
                    added += 1
                continue
            why = f"{entry.get('access')} {entry.get('path')} was refused ({entry.get('mechanism')})"
            grant = _grant_of(entry)
            if grant is None:
                key = str(entry.get("path") or entry.get("syscall") or entry.get("address") or entry)
                self.unfixable.setdefault(key, _unfixable(entry))
                continue
            kind, directory = grant
            table = self.write if kind == "write" else self.read
            if directory not in table and not any(_under(directory, p) for p in self.write):
                table[directory] = why
                added += 1
        return added

    def command(self, name: str, base: Policy) -> None:
        """The command's own directory (and its link's target's), when no grant holds it."""
        import shutil

        found = shutil.which(name) if "/" not in name else name
        if not found:
            return
        granted = [os.path.abspath(p) for p in (*base.read, *base.write)]
        for path in dict.fromkeys((os.path.abspath(found), os.path.realpath(found))):
            directory = os.path.dirname(path)
            if _broad(directory):
                directory = path  # a command in the home itself: that file, not all of the home
            if not any(_under(directory, g) for g in granted) and directory not in self.read:
                self.read[directory] = f"the command itself ({path})"

    def collapsed(self) -> tuple[dict[str, str], dict[str, str]]:
        """The grants, with every one under another of the same kind (or under a write grant) dropped."""
        write = {p: w for p, w in self.write.items() if not any(q != p and _under(p, q) for q in self.write)}
        read = {p: w for p, w in self.read.items()
                if not any(q != p and _under(p, q) for q in self.read) and not any(_under(p, q) for q in write)}
        return read, write


def _unfixable(entry: dict[str, Any]) -> str:
    mechanism = entry.get("mechanism")
    if entry.get("cut"):
        return (f"{entry.get('access')} of a path longer than the tracer keeps (it begins "
                f"{str(entry.get('resolved') or entry.get('path'))[:80]}...): not learned; grant it with --ro/--rw")
    if mechanism in ("absent", "landlock", "read-only") and str(entry.get("resolved") or "").startswith("/"):
        return (f"{entry.get('access')} {entry.get('resolved')}: not learned, its grant would be all of / or the "
                "home (or a directory above it); grant it with --ro/--rw if it is meant")
    if mechanism == "dac":
        return (f"{entry.get('access')} {entry.get('resolved')}: refused by its file modes for the sandbox's uid; "
                "no grant changes that (--uid N, or change the file's owner)")
    if mechanism == "seccomp":
        return (f"system call {entry.get('syscall')} is refused by the default seccomp filter; allow it with "
                "seccomp = \"PROFILE.json\" (an OCI profile that permits it)")
    if mechanism in ("network", "egress"):
        where = entry.get("host") or entry.get("address")
        return f"network: {where}:{entry.get('port')} was refused; allow it with --allow-host or network = \"host\""
    if mechanism == "unix-socket":
        return f"unix socket {entry.get('path')} was refused; allow it with unix_sockets = [\"{entry.get('path')}\"]"
    return f"{entry}"


def _limits(report: Any, policy: Policy) -> tuple[dict[str, Any], list[str]]:
    """Limits with headroom over what the last run used, and the comment of each."""
    given = {k: v for k, v in policy.limits.to_dict().items() if v is not None}
    limits = dict(given)
    notes = []
    peak = int(getattr(report, "max_rss_bytes", 0) or 0)
    if "memory" not in limits and peak:
        mib = max(64, math.ceil(2 * peak / (1 << 20)))
        limits["memory"] = f"{mib}M"
        notes.append(f"memory: twice the peak seen ({peak / (1 << 20):.1f} MiB)")
    cpu = float(getattr(report, "cpu_seconds", 0.0) or 0.0)
    if "cpu_seconds" not in limits:
        limits["cpu_seconds"] = max(5, math.ceil(3 * cpu))
        notes.append(f"cpu_seconds: three times the CPU time seen ({cpu:.2f} s), at least 5")
    wall = float(getattr(report, "wall_seconds", 0.0) or 0.0)
    if "wall_seconds" not in limits:
        limits["wall_seconds"] = max(10, math.ceil(3 * wall))
        notes.append(f"wall_seconds: three times the time the run took ({wall:.2f} s), at least 10")
    # Only what this host enforces for this caller: a limit it cannot hold would refuse the run.
    from ..backends import native

    for name in ("memory", "cpu_seconds"):
        if name in limits and name not in given:
            try:
                refused = native.unsupported_reasons(policy.replace(limits=Limits(**limits)))
            except IsolationError:
                refused = ["?"]
            if refused:
                del limits[name]
                notes = [n for n in notes if not n.startswith(name)]
                notes.append(f"{name}: not written, this host cannot hold it for this caller ({'; '.join(refused)})")
    return limits, notes


def _toml_string(text: str) -> str:
    """A TOML basic string: every control character escaped (a path may hold any but / and NUL)."""
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
                         for c in text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


def _comment(text: str) -> str:
    """One line of a comment: control characters (which TOML refuses there) and what is not text escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in " ".join(text.split()))


def seccomp_profile(mode: str, allowed: Sequence[str]) -> dict[str, Any]:
    """The OCI profile of ``mode`` (built-in or a file) with the ``allowed`` calls let through.

    A call refused by a rule without argument conditions leaves that rule; one refused by the
    default action gets a rule of its own. A conditional rule is left as it is.
    """
    import json

    from ..kernel.seccomp import oci_profile

    if mode in ("default", "strict"):
        data: dict[str, Any] = oci_profile(mode)
    else:
        with open(mode, encoding="utf-8") as handle:
            data = json.load(handle)
    wanted = set(allowed)
    rules = []
    for rule in data.get("syscalls", []):
        if rule.get("action") != "SCMP_ACT_ALLOW" and not rule.get("args"):
            rule = dict(rule, names=[n for n in rule.get("names", []) if n not in wanted])
            if not rule["names"]:
                continue
        rules.append(rule)
    if data.get("defaultAction") != "SCMP_ACT_ALLOW":
        rules.append({"names": sorted(wanted), "action": "SCMP_ACT_ALLOW",
                      "comment": "learned by isolate-run learn: the command was refused these"})
    data["syscalls"] = rules
    return data


def _seccomp_file(base: Policy, learned: Learned, out: str) -> str | None:
    """Write the widened profile beside the TOML; its path, or None when nothing was learned."""
    import json

    if not learned.syscalls:
        return None
    path = os.path.abspath(os.path.splitext(out)[0] + ".seccomp.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(seccomp_profile(base.seccomp, list(learned.syscalls)), handle, indent=1)
        handle.write("\n")
    return path


def learned_network(base: Policy, learned: Learned) -> str | Egress:
    """The network a run of this round gets: the base's, with the hosts learned so far.

    A base of "none" given by default is learned as egress by name with nothing allowed (still no
    route out: the mediator refuses and names each destination); it stays "none" if nothing was
    reached for.
    """
    network = base.network
    if isinstance(network, Egress):
        return Egress(tuple(dict.fromkeys([*network.hosts, *learned.hosts])), add_hosts=network.add_hosts,
                      resolver=network.resolver, allow_private=network.allow_private)
    return Egress(tuple(learned.hosts)) if learned.hosts else network


def render(base: Policy, learned: Learned, report: Any, command: Sequence[str], rounds: int,
           seccomp_file: str | None = None) -> str:
    """The profile: the base policy's fields, the learned grants and limits, each with a comment."""
    read, write = learned.collapsed()
    lines = [f"# Learned by isolate-run learn in {rounds} run(s) of: {_comment(' '.join(command))}",
             "# Every run was confined: these grants are what the command needed under enforcement.", ""]
    data = base.to_dict()
    for name in ("read", "write"):
        lines.append(f"{name} = [")
        for path in data.get(name, []):
            lines.append(f"    {_toml_string(path)},  # given (default or option)")
        for path, why in (read if name == "read" else write).items():
            if path not in data.get(name, []):
                lines.append(f"    # {_comment(why)}")
                lines.append(f"    {_toml_string(path)},")
        lines.append("]")
    limits, notes = _limits(report, base)
    network = learned_network(base, learned)
    skip = {"read", "write", "limits", "trace_denials"} | ({"network"} if isinstance(network, Egress) else set())
    import tomli_w

    rest = {k: v for k, v in data.items() if k not in skip}
    if seccomp_file is not None:
        lines.append(f"# seccomp: the {base.seccomp} profile with {', '.join(sorted(learned.syscalls))} let "
                     f"through: {_comment('; '.join(learned.syscalls.values()))}")
        rest["seccomp"] = seccomp_file
    lines.append(tomli_w.dumps(rest).rstrip())
    lines.append("")
    if isinstance(network, Egress):
        lines.append("[network]")
        lines.append("egress = [")
        given = list(base.network.hosts) if isinstance(base.network, Egress) else []
        for host in network.hosts:
            if host in learned.auto_names and any(h.startswith(host + ":") for h in learned.hosts):
                continue
            why = "given (--allow-host, --add-host)" if host in given else learned.hosts.get(host, "")
            lines.append(f"    # {_comment(why)}")
            lines.append(f"    {_toml_string(host)},")
        lines.append("]")
        extra = {k: v for k, v in network.to_dict().items() if k != "egress"}
        if extra:
            lines.append(tomli_w.dumps(extra).rstrip())
        lines.append("")
    lines.append("[limits]")
    for note in notes:
        lines.append(f"# {_comment(note)}")
    lines.append(tomli_w.dumps(limits).rstrip())
    if learned.unfixable:
        lines.append("")
        lines.append("# Refused, and no grant above changes it:")
        for text in learned.unfixable.values():
            lines.append(f"#   {_comment(text)}")
    return "\n".join(lines) + "\n"


def learn_main(argv: Sequence[str]) -> int:
    from ..oneshot import runs

    parser = _Parser(prog="isolate-run learn", add_help=True, allow_abbrev=False,
                     description="Run COMMAND confined, again and again, granting what it was refused, then write "
                                 "the profile it needs.")
    parser.add_argument("--out", default="profile.toml", metavar="FILE",
                        help="where the profile goes (default profile.toml)")
    parser.add_argument("--rounds", type=whole_number, default=DEFAULT_ROUNDS, metavar="N",
                        help=f"runs at most (default {DEFAULT_ROUNDS})")
    own, rest = parser.parse_known_args(list(argv))
    options = build_parser().parse_args(rest)
    command = list(options.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("no command given: isolate-run learn [--out FILE] [OPTIONS] -- COMMAND [ARG...]")
    if own.rounds < 1:
        raise CliError("--rounds: at least 1")
    # Egress by name with nothing allowed yet may still name static hosts (--add-host), a resolver
    # (--dns) and private addresses (--allow-private): what is learned is the list of destinations.
    static = (tuple(options.add_host), options.dns, options.allow_private)
    if not options.allow_host and options.net is None and any(static):
        options.add_host, options.dns, options.allow_private = [], None, False
        base = policy_from_args(options)
        # A static name must be allowed (Egress checks it): its default ports at first, the ports it
        # is reached on once learned (the bare name is then left out of the profile).
        names = tuple(dict.fromkeys(entry.partition(":")[0] for entry in static[0]))
        learned_auto = set(names)
        base = base.replace(network=Egress(names, add_hosts=static[0], resolver=static[1], allow_private=static[2]))
    else:
        learned_auto = set()
        base = policy_from_args(options)
    # The network is learned unless chosen (--net): destinations reached for become --allow-host.
    learn_net = isinstance(base.network, Egress) or (base.network == "none" and options.net is None)
    learned = Learned()
    learned.auto_names = learned_auto
    learned.learn_syscalls = base.seccomp != "none" and options.seccomp is None
    learned.command(command[0], base)
    print("isolate-run: learn: every run is confined; refused accesses are granted for the next run",
          file=sys.stderr)
    report: Any = None
    returncode = 0
    for round_number in range(1, own.rounds + 1):
        read, write = learned.collapsed()
        network = learned_network(base, learned)
        if learn_net and network == "none":
            network = Egress(())  # nothing allowed, every destination named
        seccomp_file = _seccomp_file(base, learned, own.out)
        policy = base.replace(read=tuple(dict.fromkeys([*base.read, *read])),
                              write=tuple(dict.fromkeys([*base.write, *write])), network=network,
                              seccomp=seccomp_file or base.seccomp, trace_denials="lookups")
        result = runs.run(command, policy=policy, capture_output=True)
        report, returncode = result.report, result.returncode
        added = learned.add(report.denied)
        print(f"isolate-run: learn: run {round_number}: exit {returncode}, {len(report.denied)} refusal(s), "
              f"{added} new grant(s)", file=sys.stderr)
        if not added:
            break
    text = render(base, learned, report, command, round_number, _seccomp_file(base, learned, own.out))
    try:
        Policy.from_toml(text, own.out)  # what is written reads back
    except IsolationError as exc:  # pragma: no cover - a bug here, never the user's input
        raise IsolationError(f"learn: the profile it made does not read back: {exc}") from None
    with open(own.out, "w", encoding="utf-8") as handle:
        handle.write(text)
    state = "runs" if returncode == 0 else f"still exits {returncode}"
    print(f"isolate-run: learn: wrote {own.out} (the command {state} under it)", file=sys.stderr)
    return 0 if returncode == 0 else 1
