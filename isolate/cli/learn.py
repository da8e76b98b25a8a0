"""``isolate-run learn [--out profile.toml] [--rounds N] [OPTIONS] -- COMMAND``: write the policy a command needs.

Learning never lifts the confinement: the command runs in a sandbox every
time, with denial tracing on (``trace_denials``), so each refused file access
is named in the report. After each run the grants that would have allowed the
refused accesses are added, and the command runs again, until a run refuses
nothing (or ``--rounds`` runs have been made; the command then still needs
something no grant gives, and learn says which). The command thus runs up to
``--rounds`` times: learn it on something whose repetition is harmless (a
build, a test suite), as its effects happen each time.

The command is untrusted: what it is refused must not become, by itself, a
way out (isolate/cli/learnsafe.py). While learning, nothing it writes reaches
the host outside the grants it was given: a learned write grant is tried on a
copy-on-write view of its directory (an overlay whose upper layer is thrown
away after the run), never on the directory; reads learned stay read-only.
Only the profile, once a person has read it, grants the real directory.

The grants, collapsed by one rule: a read or an execute grants the file's
directory (read-only); a write, a truncate or a create, remove or rename of an
entry grants that directory (writable); a grant already under another is
dropped, and a read grant under a write grant too. Never / or the caller's
home (nor a directory above it), nor a directory that holds a credential or
a shell start-up path: there the file itself is granted when it exists, and
anything else is written as a comment to grant by hand. A credential or
start-up path itself (``~/.ssh``, ``~/.config``, ``~/.local/bin``, rc files,
``/etc``, ``/root``, ``/var/spool/cron`` ...: learnsafe's lists) is never
granted: a comment names the one file. A system call the seccomp profile
refused is let through in a copy of that profile written beside the TOML
(``profile.seccomp.json``), unless --seccomp chose the profile, or it is one
the default filter refuses for the sandbox's safety (modules, kexec, bpf,
perf, keyrings, mounts, ptrace, userfaultfd, io_uring ...): those stay
refused, each named in a comment with why. Refusals that no grant fixes
(file modes as the sandbox's uid) are written as comments with the way out.

A setup failure a grant fixes is learned like a refusal: a working directory
nothing granted holds (the next runs start there in an empty directory shown
read-only, what is read or written in it refused and learned), an executable
whose program loader is not in the sandbox (its PT_INTERP or #! line, each
link on the way). So ``learn --no-defaults`` learns from nothing.

The network is learned unless chosen with --net: a default "none" runs as
egress by name with nothing allowed (still no route out: the mediator refuses
and names each destination). Each "HOST:PORT" the command reached for is a
comment in the profile; with --learn-net it is allowed in the next run, and
the profile gets them as ``[network] egress`` (or keeps "none" when nothing
was reached for). Static names (--add-host, --allow-private, --dns) may be
given to learn without --allow-host.

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
import stat
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from ..model.errors import CommandNotFoundError, IsolationError, SetupError, UnsupportedError
from ..model.policy import Egress, Limits, Mount, Policy
from ..model.units import whole_number
from . import learnsafe
from .flags import CliError, _Parser, build_parser, policy_from_args

DEFAULT_ROUNDS = 8
_WRITES = ("write", "truncate", "create", "remove", "rename")


def _broad(directory: str) -> bool:
    """Whether granting directory gives far more than any one access asks for: / and the caller's home
    (and each directory above it). A program that reads ~/.x must not learn itself all of the home (its
    keys), nor one that creates ~/.x the home writable (its shell's startup files)."""
    return any(_under(home, directory) for home in learnsafe.homes())  # $HOME's, and the password database's


def _grant_of(entry: dict[str, Any]) -> tuple[str, str] | None:
    """("read" | "write", directory or file) that would have allowed a refused access, or None."""
    if entry.get("mechanism") not in ("absent", "landlock", "read-only") or entry.get("cut"):
        return None
    resolved = str(entry.get("resolved") or "")
    if not resolved.startswith("/") or learnsafe.sensitive(resolved):
        return None  # a credential or start-up path: never learned (a comment names it)
    directory = os.path.dirname(resolved.rstrip("/")) or "/"
    kind = "write" if entry.get("access") in _WRITES else "read"
    if kind == "read" and os.path.isdir(resolved):
        directory = resolved  # listing a directory: the directory itself
    if _broad(directory) or learnsafe.holds_sensitive(directory):
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
        #: Destinations are allowed in the next run only with --learn-net; else each is a comment.
        self.learn_net = True
        #: The run could not start in its working directory (nothing granted holds it): the next runs start
        #: in an empty, read-only stand-in there, until a grant lies in it.
        self.cwd: str | None = None

    def add(self, denied: list[dict[str, Any]]) -> int:
        """Take a run's refusals in; returns how many new grants they gave."""
        added = 0
        for entry in denied:
            if entry.get("mechanism") == "egress" and entry.get("host") and entry.get("port") and \
                    "not allowed" in str(entry.get("reason", "")):
                target = f"{entry['host']}:{entry['port']}"
                if not self.learn_net:
                    self.unfixable.setdefault(f"egress:{target}", (
                        f"network: {target} was reached for ({entry.get('count', 1)} connection(s) refused): not "
                        f"learned without --learn-net; allow it with --allow-host {target} if it is meant"))
                    continue
                if target not in self.hosts:
                    self.hosts[target] = f"{target} was reached for ({entry.get('count', 1)} connection(s) refused)"
                    added += 1
                continue
            if entry.get("mechanism") == "seccomp" and entry.get("syscall") and self.learn_syscalls:
                name = str(entry["syscall"])
                why_refused = learnsafe.never_learned_syscalls().get(name)
                if why_refused is not None:
                    self.unfixable.setdefault(f"syscall:{name}", (
                        f"system call {name} stays refused, whatever the program does: learning never lets it "
                        f"through ({why_refused}, refused by the default filter for the sandbox's safety)"))
                    continue
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

    def command(self, name: str, base: Policy, why: str = "the command itself") -> None:
        """The command's own directory (and its link's target's), when no grant holds it."""
        import shutil

        found = shutil.which(name) if "/" not in name else name
        if not found:
            return
        granted = [os.path.abspath(p) for p in (*base.read, *base.write)]
        for path in _link_chain(os.path.abspath(found)):
            directory = os.path.dirname(path)
            if _broad(directory) or learnsafe.holds_sensitive(directory):
                # A command in the home itself, or among credentials and start-up paths (~/.local/bin): that
                # file, not all of its directory; and never a credential a link or a #! line names (no key
                # is an executable).
                if learnsafe.sensitive(path) and not (os.path.isfile(path) and os.access(path, os.X_OK)):
                    self.unfixable.setdefault(path, f"{why} {path}: never learned, it lies in "
                                              f"{learnsafe.sensitive(path)}, a credential or start-up path")
                    continue
                directory = path
            if not any(_under(directory, g) for g in granted) and directory not in self.read:
                self.read[directory] = f"{why} ({path})"

    def interpreter(self, name: str, base: Policy) -> bool:
        """The program loader the command's executable names (ELF PT_INTERP, or a script's #! line), when
        the exec failed for want of it; whether a grant was added."""
        import shutil

        found = shutil.which(name) if "/" not in name else name
        added = False
        for _ in range(4):  # a script's interpreter may be a script (bounded)
            loader = _loader_of(found) if found else None
            if loader is None:
                break
            before = len(self.read)
            self.command(loader, base, why="the program loader of")
            added = added or len(self.read) > before
            found = loader
        return added

    def collapsed(self) -> tuple[dict[str, str], dict[str, str]]:
        """The grants, with every one under another of the same kind (or under a write grant) dropped."""
        write = {p: w for p, w in self.write.items() if not any(q != p and _under(p, q) for q in self.write)}
        read = {p: w for p, w in self.read.items()
                if not any(q != p and _under(p, q) for q in self.read) and not any(_under(p, q) for q in write)}
        return read, write


def _link_chain(path: str) -> list[str]:
    """path, and each path its links lead to in turn, as written (the sandbox must show every hop: the
    directory holding each link, and the links under / a path goes through)."""
    chain = [path]
    while len(chain) < 40:
        parent = os.path.realpath(os.path.dirname(chain[-1]))
        here = os.path.join(parent, os.path.basename(chain[-1]))
        if not os.path.islink(here):
            break
        text = os.readlink(here)
        chain.append(os.path.normpath(text if text.startswith("/") else os.path.join(parent, text)))
    return chain


def _loader_of(path: str) -> str | None:
    """The interpreter an executable names: a script's #! line, or an ELF file's PT_INTERP; None if none."""
    import struct

    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
            if head.startswith(b"#!"):
                words = head[2:].split(b"\n", 1)[0].split()
                return os.fsdecode(words[0]) if words and words[0].startswith(b"/") else None
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
                return None
            order = "<" if head[5] == 1 else ">"
            phoff, = struct.unpack_from(order + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            for i in range(min(phnum, 64)):
                handle.seek(phoff + i * phentsize)
                ptype, _, offset, _, _, size = struct.unpack(order + "IIQQQQ", handle.read(40))
                if ptype == 3 and 0 < size < 4096:  # PT_INTERP
                    handle.seek(offset)
                    return os.fsdecode(handle.read(size).rstrip(b"\0")) or None
    except (OSError, struct.error, IndexError):
        return None
    return None


def _unfixable(entry: dict[str, Any]) -> str:
    mechanism = entry.get("mechanism")
    if entry.get("cut"):
        return (f"{entry.get('access')} of a path longer than the tracer keeps (it begins "
                f"{str(entry.get('resolved') or entry.get('path'))[:80]}...): not learned; grant it with --ro/--rw")
    resolved = str(entry.get("resolved") or "")
    if mechanism in ("absent", "landlock", "read-only") and resolved.startswith("/"):
        held = learnsafe.sensitive(resolved)
        if held is not None:
            flag = "--ro" if entry.get("access") not in _WRITES else "--rw"
            return (f"{entry.get('access')} {resolved}: never learned, {held} is a credential or start-up path; "
                    f"grant it by hand with {flag} {resolved} if it is meant")
        return (f"{entry.get('access')} {resolved}: not learned, its grant would be all of / or the home (or a "
                "directory above it, or one holding a credential or start-up path); grant it with --ro/--rw if "
                "it is meant")
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
    _write_text(path, json.dumps(seccomp_profile(base.seccomp, list(learned.syscalls)), indent=1) + "\n")
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
    if learned.cwd is not None and not any(_under(g, learned.cwd) or _under(learned.cwd, g) for g in (
            *(os.path.abspath(p) for p in (*base.read, *base.write)), *read, *write)):
        if _broad(learned.cwd) or learnsafe.holds_sensitive(learned.cwd):
            # The same rule as every learned grant: the working directory is where the command was started,
            # not what it needs; the home, / or a directory holding a credential is never granted by it.
            learned.unfixable.setdefault(f"cwd:{learned.cwd}", (
                f"the working directory {learned.cwd}: not learned, it is / or the home (or a directory above "
                "it, or one holding a credential or start-up path); grant it with --ro/--rw if it is meant, "
                "or start the command from a directory of its own"))
        else:
            read[learned.cwd] = "the working directory: the command starts in it, and nothing granted holds it"
    lines = [f"# Learned by isolate-run learn in {rounds} run(s) of: {_comment(' '.join(command))}",
             "# Every run was confined: these grants are what the command needed under enforcement.",
             "# While learning, nothing the command wrote reached the host: a learned write grant was tried on a",
             "# copy-on-write view of its directory (an overlay whose upper layer was thrown away), never on the",
             "# directory itself. This profile grants the real directories: read it before you use it.",
             "# Never learned (see docs/cli.md): the system calls the default filter refuses for the sandbox's",
             "# safety, credentials and shell start-up paths, and destinations without --learn-net: each one",
             "# the command was refused is a comment at the end.", ""]
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


def round_policy(base: Policy, learned: Learned, network: str | Egress, seccomp_file: str | None,
                 views: learnsafe.Views) -> tuple[Policy, list[str]]:
    """The policy of the next run, and the learned write grants' directories it shows on copy-on-write views.

    A learned directory to write is a tmpfs in the policy, which the run replaces by an overlay of the
    directory (its Landlock rule is the tmpfs's: by path, on what is mounted there); a learned file to
    write is shown read-only (a file takes no overlay): its write is refused again, and granted in the
    profile only. Reads learned stay read-only.
    """
    read, write = learned.collapsed()
    directories = [p for p in write if os.path.isdir(p)]
    files = [p for p in write if p not in directories]
    binds = base.binds
    granted = [*(os.path.abspath(p) for p in (*base.read, *base.write)), *read, *write]
    if learned.cwd is not None and not any(_under(learned.cwd, g) for g in granted):
        # The working directory, which nothing granted holds: an empty directory shown read-only there
        # (what the command reads or writes in it is refused, and learned), the grants below mounted in it.
        below = [os.path.relpath(g, learned.cwd) for g in granted if _under(g, learned.cwd)]
        binds = (*binds, Mount(views.stand_in(below), learned.cwd, "ro"))
    # Learn's own directories (the views' upper layers, the stand-in) under a grant: hidden under an empty
    # tmpfs, as the runtime directory is. Seen, a run could swap one for a link, and learn made the next
    # run's upper layer (where its writes land) in a host directory of the program's choosing.
    real_granted = [os.path.realpath(g) for g in granted]
    hidden = [own for own in (views.root, views.stand_in_root) if own is not None
              and any(_under(os.path.realpath(own), g) for g in real_granted)]
    policy = base.replace(read=tuple(p for p in dict.fromkeys([*base.read, *read, *files]) if p not in directories),
                          write=base.write, tmpfs=tuple(dict.fromkeys([*base.tmpfs, *directories, *hidden])),
                          binds=binds,
                          network=network, seccomp=seccomp_file or base.seccomp, trace_denials="lookups")
    return policy, directories


def _run(command: Sequence[str], policy: Policy, overlays: list[Any]) -> Any:
    """One confined run, its output captured; learned write grants on their overlays (native backend)."""
    from ..oneshot import runs

    if not overlays:
        return runs.run(command, policy=policy, capture_output=True)
    from ..backends.native.popen import Popen
    from ..oneshot.runs import CompletedProcess

    class _Viewed(Popen):
        _overlay = overlays

    with _Viewed(list(command), policy=policy.replace(backend="native"), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE) as process:
        try:
            stdout, stderr = process.communicate()
        except BaseException:
            process.kill()
            raise
    return CompletedProcess(process.args, process.returncode, stdout, stderr, process.report)


def _check_out(path: str) -> None:
    """Refuse, before any run, an --out the profile could not be written to: its directory must exist, and
    what is there already must be a regular file (a FIFO waited for a reader for ever, after every run)."""
    if not path:
        raise CliError("--out: an empty name; give the profile's file, e.g. --out profile.toml")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"--out {path}: {directory} is not a directory")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise CliError(f"--out {path}: there is something there that is not a regular file")


def _write_text(path: str, text: str) -> None:
    """Write ``path`` anew, never blocking on a FIFO or writing onto what is not a regular file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CliError(f"--out {path}: not a regular file")
        os.ftruncate(fd, 0)
        handle.write(text)


def learn_main(argv: Sequence[str]) -> int:
    parser = _Parser(prog="isolate-run learn", add_help=True, allow_abbrev=False,
                     description="Run COMMAND confined, again and again, granting what it was refused, then write "
                                 "the profile it needs.")
    parser.add_argument("--out", default="profile.toml", metavar="FILE",
                        help="where the profile goes (default profile.toml)")
    parser.add_argument("--learn-net", action="store_true",
                        help="allow each destination the command reached for in the next run, and grant it in the "
                             "profile (without it they are named in comments only)")
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
    _check_out(own.out)
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
    # The network is learned unless chosen (--net): destinations reached for are named, and become
    # --allow-host with --learn-net only.
    learn_net = isinstance(base.network, Egress) or (base.network == "none" and options.net is None)
    learned = Learned()
    learned.auto_names = learned_auto
    learned.learn_net = own.learn_net
    learned.learn_syscalls = base.seccomp != "none" and options.seccomp is None
    learned.command(command[0], base)
    print("isolate-run: learn: every run is confined; refused accesses are granted for the next run (writes "
          "on a throw-away copy-on-write view: nothing reaches the host)", file=sys.stderr)
    report: Any = None
    returncode = 0
    with learnsafe.views() as views:
        for round_number in range(1, own.rounds + 1):
            network = learned_network(base, learned)
            if learn_net and network == "none":
                network = Egress(())  # nothing allowed, every destination named
            policy, directories = round_policy(base, learned, network, _seccomp_file(base, learned, own.out),
                                               views)
            try:
                with views.for_run(directories) as overlays:
                    result = _run(command, policy, overlays)
            except UnsupportedError as exc:
                if not directories:
                    raise
                # Never the host directory instead: learning stops here, and says why.
                raise UnsupportedError(f"the learned write grants ({', '.join(directories)}) are tried on "
                                       f"copy-on-write views, and one cannot be made here: {exc}") from None
            except CommandNotFoundError:
                # The executable is there (granted above) but its loader is not: learned like a refusal.
                if not learned.interpreter(command[0], base):
                    raise
                print(f"isolate-run: learn: run {round_number}: the command's program loader is not in the "
                      "sandbox: granted for the next run", file=sys.stderr)
                continue
            except SetupError as exc:
                if exc.step != "chdir" or learned.cwd is not None:
                    raise
                # A setup failure a grant fixes, learned like a refusal: the working directory is not in
                # the sandbox. The next runs start there in an empty directory shown read-only (what the
                # command reads or writes in it is refused, and learned), until a grant holds it.
                learned.cwd = os.path.realpath(base.cwd or os.getcwd())
                print(f"isolate-run: learn: run {round_number}: cannot start in {learned.cwd} (nothing granted "
                      "holds it): the next run starts there, in an empty directory", file=sys.stderr)
                continue
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
    _write_text(own.out, text)
    state = "runs" if returncode == 0 else f"still exits {returncode}"
    print(f"isolate-run: learn: wrote {own.out} (the command {state} under it)", file=sys.stderr)
    return 0 if returncode == 0 else 1
