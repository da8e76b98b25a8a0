"""The flags of ``isolate-run``: its parser, and the policy the flags describe.

The command line's words as data: ``build_parser()`` (whose help the CLI
reference in docs/ is generated from) and ``policy_from_args()``. The agent
layer's ``wrap`` reads the same flags, so this module runs nothing.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, NoReturn

from .._version import __version__
from ..model.policy import DEFAULT_READ, DEFAULT_TMPFS, DEFAULT_WRITE, NETWORK_MODES, Egress, Limits, Mount, Policy


class CliError(Exception):
    """A bad option: one line on stderr, exit 125, nothing run."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see isolate-run --help)")


#: isolate-run's own failure (bad option, setup error): the exit status of every subcommand too.
EXIT_SETUP = 125


class UsageError(Exception):
    """A subcommand's bad argument (``isolate-run sandbox``, ``image``): one line on stderr, exit 125."""


class UsageParser(argparse.ArgumentParser):
    """A subcommand's parser: a bad argument raises UsageError instead of printing usage and exiting 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


EPILOG = """\
defaults (no options): /usr /bin /sbin /lib /lib64 /etc read-only; the current
directory writable; a private /tmp; a private, empty, writable home
(/home/sandbox, HOME points at it); no network; the default seccomp filter; the
program is the caller (uid 65534 when the caller is root) and holds no
capability; PATH is the caller's, reduced to the directories that exist inside.

examples:
  isolate-run -- make test                       build in the current directory, offline
  isolate-run --ro ~/.venv -- ~/.venv/bin/pytest  a venv's tool: grant its directory
  isolate-run --net host --home-file .gitconfig -- git pull
  isolate-run --memory 512M --wall 60 --report r.json -- python3 job.py
  isolate-run --explain --rw out -- sh -c 'ls > out/list'    show the plan, run nothing

subcommands: 'isolate-run doctor [--json]' shows what this host can enforce;
'isolate-run sandbox create|exec|shell|cp|diff|commit|pause|resume|list|rm|prune' keeps sandboxes;
'isolate-run serve [--listen HOST:PORT] [--api-key KEY] [--profile FILE]' serves the OpenSandbox API.
exit status: the command's; 128+N if it died of signal N; 125 isolate-run failed;
126 the command cannot be executed; 127 not found.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="isolate-run",
        usage="isolate-run [OPTIONS] [--] COMMAND [ARG...]",
        description="Run COMMAND confined by Landlock, seccomp, namespaces, rlimits and cgroups.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"isolate-run {__version__}")
    fs = parser.add_argument_group("filesystem (repeatable; relative paths are against the current directory)")
    fs.add_argument("--ro", action="append", default=[], metavar="PATH",
                    help="grant read + execute under PATH, e.g. --ro ~/.venv")
    fs.add_argument("--rw", action="append", default=[], metavar="PATH",
                    help="grant read + write + execute under PATH, e.g. --rw build/")
    fs.add_argument("--bind", action="append", default=[], metavar="SRC:DST",
                    help="show host path SRC at DST inside, writable, e.g. --bind ./out:/output")
    fs.add_argument("--ro-bind", action="append", default=[], metavar="SRC:DST",
                    help="show host path SRC at DST inside, read-only, e.g. --ro-bind ~/data:/data")
    fs.add_argument("--tmpfs", action="append", default=[], metavar="PATH",
                    help="a fresh private writable tmpfs at PATH inside, e.g. --tmpfs /var/tmp")
    fs.add_argument("--chdir", metavar="DIR",
                    help="working directory of the program (must be granted), e.g. --chdir src")
    fs.add_argument("--no-defaults", action="store_true",
                    help="drop the default read-only system paths and the writable current directory")
    fs.add_argument("--home", metavar="PATH|none",
                    help="where the private home is (default /home/sandbox); 'none': no home, HOME is the caller's")
    fs.add_argument("--home-file", action="append", default=[], metavar="FILE",
                    help="share FILE (relative to your HOME) read-only in the private home, "
                    "e.g. --home-file .gitconfig")
    net = parser.add_argument_group("network")
    net.add_argument("--net", choices=NETWORK_MODES, default=None,
                     help="none (default: no network at all) | loopback (only 127.0.0.1) | host, e.g. --net host")
    net.add_argument("--unix-socket", action="append", default=[], metavar="PATH",
                     help="let the program connect to this unix socket (under --net none/loopback only sockets "
                          "in writable paths are reachable), e.g. --unix-socket /run/postgresql/.s.PGSQL.5432")
    net.add_argument("--allow-host", action="append", default=[], metavar="HOST[:PORT]",
                     help="let the program reach this name (repeatable; *.DOMAIN for names under it; no port: "
                          "80 and 443) and nothing else, through isolate's mediator, e.g. --allow-host pypi.org")
    net.add_argument("--add-host", action="append", default=[], metavar="NAME:IP",
                     help="a static name for --allow-host, reached at IP (loopback included), "
                          "e.g. --add-host db.test:127.0.0.1 --allow-host db.test:5432")
    net.add_argument("--dns", metavar="IP[:PORT]",
                     help="the DNS server the mediator asks for allowed names (default: the host's resolver)")
    net.add_argument("--allow-private", action="store_true",
                     help="let an allowed name that DNS resolves to a loopback or private address be reached "
                          "(refused by default: DNS rebinding)")
    lim = parser.add_argument_group("limits (none by default)")
    lim.add_argument("--memory", metavar="SIZE",
                     help="memory of the whole tree, bytes or K/M/G, swap off, e.g. --memory 512M")
    lim.add_argument("--cpu", metavar="SECONDS", help="CPU seconds of the whole process tree, e.g. --cpu 30")
    lim.add_argument("--cpus", metavar="N", help="CPU bandwidth in cores, e.g. --cpus 1.5")
    lim.add_argument("--wall", metavar="SECONDS",
                     help="wall-clock seconds before the sandbox is killed, e.g. --wall 60")
    lim.add_argument("--pids", metavar="N", help="processes and threads at once in the tree, e.g. --pids 64")
    lim.add_argument("--nofile", metavar="N", help="open files per process, e.g. --nofile 256")
    lim.add_argument("--fsize", metavar="SIZE", help="largest file a process may write, K/M/G, e.g. --fsize 64M")
    lim.add_argument("--tmpfs-size", metavar="SIZE",
                     help="size of each private tmpfs (/tmp, --tmpfs, the home, /dev/shm); default the --memory "
                     "limit, else 1G (/dev/shm 64M), e.g. --tmpfs-size 256M")
    sec = parser.add_argument_group("system calls")
    sec.add_argument("--seccomp", metavar="MODE",
                     help="default | strict (compute only) | none | FILE (OCI/Docker JSON), e.g. --seccomp strict")
    env = parser.add_argument_group("environment (default: PATH, HOME, LANG, TERM only)")
    env.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="set a variable, e.g. --env PYTHONDONTWRITEBYTECODE=1")
    env.add_argument("--keep-env", action="append", default=[], metavar="NAME",
                     help="pass the caller's variable on, e.g. --keep-env CI")
    run = parser.add_argument_group("backend and policy")
    run.add_argument("--backend", choices=("auto", "native", "docker"), default=None,
                     help="auto (default: native, Docker where native cannot enforce) | native | docker")
    run.add_argument("--image", metavar="IMAGE",
                     help="the image the sandbox's root is made of (see isolate-run image; Docker: its engine's)")
    run.add_argument("--image-store", metavar="DIR", help="the image store --image comes from (default: "
                     "$ISOLATE_IMAGE_STORE, else <state dir>/images)")
    run.add_argument("--profile", metavar="FILE", help="a TOML policy file; flags apply on top, e.g. --profile ci.toml")
    run.add_argument("--uid", metavar="N", help="the program's uid when the caller is root (default 65534)")
    run.add_argument("--gid", metavar="N", help="the program's gid when the caller is root (default 65534)")
    run.add_argument("--no-namespaces", action="store_true",
                     help="no namespaces: Landlock, seccomp and rlimits only (faster, weaker)")
    run.add_argument("--best-effort", action="store_true",
                     help="warn instead of failing where a protection cannot be enforced")
    run.add_argument("--explain", action="store_true",
                     help="print the resolved paths, the policy and its mechanisms; run nothing. With --report "
                          "FILE and no command: each refusal of that finished run and the flag that grants it")
    run.add_argument("--report", metavar="FILE", help="write the JSON report of the run to FILE, e.g. --report r.json")
    run.add_argument("--why", action="store_true",
                     help="name every file access the policy refused (report.denied, and one line each on stderr); "
                          "the init looks at each path system call, at a small cost per call")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments")
    return parser


def _int_option(value: str | None, name: str) -> int | None:
    """An id: ASCII digits only (int() takes other scripts' digits, signs, spaces and underscores)."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 10:
        raise CliError(f"{name}: {value!r} is not a whole number (ASCII digits)")
    number = int(value)
    if number <= 0:
        raise CliError(f"{name}: must be a positive number, got {value}")
    return number


def refuse_empty(options: argparse.Namespace) -> None:
    """An option given an empty value is refused, never taken for one not given: each was read as "if given",
    so ``--image ""`` ran on the host's root, ``--report ""`` wrote no report, ``--profile ""`` dropped the profile
    and ``--seccomp ""``, ``--chdir ""``, ``--home ""``, ``--image-store ""`` their settings, all in silence (a
    script's unset variable)."""
    for name, value in sorted(vars(options).items()):
        if isinstance(value, str) and not value:
            raise CliError(f"--{name.replace('_', '-')}: an empty value; give one, or leave the option out")


def policy_from_args(options: argparse.Namespace) -> Policy:
    """The policy the options describe (a profile first, then the flags on top)."""
    base = Policy.load(options.profile) if options.profile else Policy()
    if options.tmpfs and (options.no_namespaces or not base.namespaces):
        # Asked for explicitly: never dropped in silence.
        raise CliError("--tmpfs needs a mount namespace, and this run has none (--no-namespaces); without "
                       "namespaces the program's TMPDIR is a private directory in its home instead")
    read = list(base.read)
    write = list(base.write)
    tmpfs = list(base.tmpfs)
    if options.no_defaults:
        read = [p for p in read if p not in DEFAULT_READ]
        write = [p for p in write if p not in DEFAULT_WRITE]
    read += options.ro
    write += options.rw
    tmpfs += [p for p in options.tmpfs if p not in tmpfs]
    if options.no_namespaces and tmpfs == list(DEFAULT_TMPFS) and not options.tmpfs:
        tmpfs = []
    env = dict(base.env)
    for item in options.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"--env: {item!r} is not NAME=VALUE")
        env[name] = value
    keep_env = list(base.keep_env) + [n for n in options.keep_env if n not in base.keep_env]
    limits = base.limits.to_dict()
    for flag, field_name in (("memory", "memory"), ("cpu", "cpu_seconds"), ("cpus", "cpus"),
                             ("wall", "wall_seconds"), ("pids", "pids"), ("nofile", "open_files"),
                             ("fsize", "file_size"), ("tmpfs_size", "tmpfs_size")):
        value = getattr(options, flag)
        if value is not None:
            limits[field_name] = value
    network: str | Egress = options.net if options.net else base.network
    if options.allow_host:
        if options.net not in (None, "none"):
            raise CliError(f"--allow-host filters the network; it cannot go with --net {options.net}")
        network = Egress(tuple(options.allow_host), add_hosts=tuple(options.add_host), resolver=options.dns,
                         allow_private=options.allow_private)
    else:
        for flag, given in (("--add-host", options.add_host), ("--dns", options.dns),
                            ("--allow-private", options.allow_private)):
            if given and not isinstance(network, Egress):
                raise CliError(f"{flag} belongs to egress by name; allow the names with --allow-host NAME[:PORT]")
        if isinstance(network, Egress) and (options.add_host or options.dns or options.allow_private):
            network = Egress(network.hosts, add_hosts=tuple(network.add_hosts) + tuple(options.add_host),
                             resolver=options.dns or network.resolver,
                             allow_private=options.allow_private or network.allow_private)
    changes: dict[str, Any] = {
        "read": tuple(read),
        "write": tuple(write),
        "tmpfs": tuple(tmpfs),
        "env": env,
        "keep_env": tuple(keep_env),
        "limits": Limits(**limits),
        "network": network,
    }
    for text in options.ro_bind:
        if text.endswith(":rw"):
            raise CliError(f"--ro-bind {text}: a read-only bind cannot say :rw (use --bind)")
    binds = [Mount.parse(text, "rw") for text in options.bind] + [Mount.parse(text, "ro") for text in options.ro_bind]
    if binds:
        changes["binds"] = tuple(base.binds) + tuple(
            Mount(os.path.abspath(os.path.expanduser(b.source)), b.target, b.mode) for b in binds)
    if options.unix_socket:
        changes["unix_sockets"] = tuple(base.unix_sockets) + tuple(options.unix_socket)
    if options.chdir:
        changes["cwd"] = os.path.abspath(options.chdir)
    if options.home is not None:
        changes["home"] = None if options.home == "none" else options.home
    if options.home_file:
        changes["home_files"] = tuple(base.home_files) + tuple(options.home_file)
    if options.seccomp:
        changes["seccomp"] = options.seccomp
    if options.backend:
        changes["backend"] = options.backend
    if options.image:
        changes["image"] = options.image
    if getattr(options, "image_store", None):
        # The store is the process's (isolate.image.store.STORE_ENV): the plan's cache key holds it.
        os.environ["ISOLATE_IMAGE_STORE"] = os.path.abspath(options.image_store)
    if options.best_effort:
        changes["best_effort"] = True
    if options.no_namespaces:
        changes["namespaces"] = False
    if getattr(options, "why", False):
        changes["trace_denials"] = True
    uid = _int_option(options.uid, "--uid")
    gid = _int_option(options.gid, "--gid")
    if uid is not None:
        changes["uid"] = uid
    if gid is not None:
        changes["gid"] = gid
    return base.replace(**changes)


def printable(text: str) -> str:
    """A message on one line, with nothing in it that reaches the terminal as a control sequence (a name an image
    archive, a registry or a program chose may hold a newline or an escape)."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
