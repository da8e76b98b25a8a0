"""The plans the native ``isolate-run`` binary replays (csrc/cli.c), written here.

``isolate-run`` is a small C executable. It splits its arguments into options
and command, looks the options up in a per-user cache and, on a hit whose
every premise still holds, replays the plan with the same C spawn code the
Python package uses. Anything else (a miss, a subcommand, ``--explain``, the
Docker backend, a cgroup limit, an option it does not know) it hands to
``handover_main`` here, through the interpreter recorded at build time.

``handover_main`` is still the place where a policy is parsed, validated,
resolved and compiled: it prepares the run exactly as ``isolate-run`` in
Python does (``isolate.cli``), writes the resulting ``struct iso_plan`` with
what it depends on into the cache, and execs the binary back to run it; a
run the binary cannot replay is run by ``isolate.cli.main`` itself.

A plan is keyed by the option arguments (``--report`` aside), the working
directory, the caller's ids and the whole environment (the plan holds its
SHA-256, not the environment); it records, and the
binary re-checks before every replay: the identity (device, inode, type) of
each descriptor the plan uses, reopened by path at the same number; the
inode of every path the policy names (or its absence); the contents of the
profile and seccomp files (read before planning used them, and again after), and
of an image's record (an inode number is no premise for a file renamed over
anew: a later one gets it); the host facts the plan depends on (boot id, user
namespace and ptrace sysctls); the size and time of the binary, and of every
file of this package that planning ran (each imported module's, the init's) and
the directories holding them. The cache lives in isolate's private runtime
directory (registry.runtime_dir: owned by the caller, mode 0700, hidden from
every sandbox); a plan file not owned by the caller, or writable by others,
is never used.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import sys
from collections.abc import Sequence
from typing import Any

from ..model.files import read_input_file, write_all

#: Environment variables between the binary and this module; never part of a key, never passed on.
ENV_BINARY = "ISOLATE_RUN_BINARY"  # the binary's path: this process may exec it back
ENV_NO_CACHE = "ISOLATE_RUN_NO_CACHE"  # the binary could not replay: run here, write nothing
ENV_REPLAY = "ISOLATE_RUN_REPLAY"  # sent by handover_main: a miss now hands over with ENV_NO_CACHE
ENV_TRACE = "ISOLATE_RUN_TRACE"  # set by the user: the binary says whether it replayed, and why not
MARKERS = (ENV_BINARY, ENV_NO_CACHE, ENV_REPLAY, ENV_TRACE)

#: Variables a shell changes between commands and isolate never reads: not part of a key, unless the
#: policy passes one on (then the plan is not written at all).
SHELL_NOISE = ("_", "OLDPWD", "SHLVL")
MAGIC = b"ISOPLAN3"
KEY_PREFIX = b"isolate-run plan v2\0"
#: The host facts a plan depends on, re-read by the binary (absent files recorded as absent).
HOST_FILES = (
    "/proc/sys/kernel/random/boot_id",
    "/proc/sys/kernel/yama/ptrace_scope",
    "/proc/sys/user/max_user_namespaces",
    "/proc/sys/kernel/unprivileged_userns_clone",
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
)
#: Plans kept per caller (the oldest go first).
MAX_PLANS = 256
NULL = 0xFFFFFFFF


def cache_dir(create: bool) -> str:
    """Where the caller's plans are kept: ``<runtime dir>/cli`` (owned by the caller, mode 0700)."""
    from ..kernel.places import runtime_dir

    path = os.path.join(runtime_dir(create=create), "cli")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise OSError(f"{path} is not a private directory of uid {os.geteuid()}")
    return path


def plan_name(key: bytes) -> str:
    """The file name of a key's plan: the start of its SHA-256 (the plan holds the whole digest)."""
    return hashlib.sha256(key).hexdigest()[:16] + ".plan"


def key_material(option_args: Sequence[str], cwd: str) -> bytes:
    """The exact bytes both sides build (csrc/cli.c ``build_key``)."""
    parts = [KEY_PREFIX, f"{os.getuid()} {os.geteuid()} {os.getgid()} {os.getegid()}\0".encode(),
             os.fsencode(cwd) + b"\0", b"argv\0"]
    parts += [os.fsencode(a) + b"\0" for a in option_args]
    parts.append(b"env\0")
    entries = sorted(k + b"=" + v for k, v in os.environb.items() if os.fsdecode(k) not in MARKERS + SHELL_NOISE)
    parts += [e + b"\0" for e in entries]
    return b"".join(parts)


def split_options(args: Sequence[str], command: Sequence[str]) -> list[str]:
    """The option arguments of ``args`` (those before the command), ``--report`` and its value left out."""
    options = list(args[: len(args) - len(command)])
    out: list[str] = []
    skip = False
    for arg in options:
        if skip:
            skip = False
            continue
        if arg == "--report":
            skip = True
            continue
        if arg.startswith("--report="):
            continue
        out.append(arg)
    return out


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u32(self, value: int) -> None:
        self.parts.append(struct.pack("<I", value & 0xFFFFFFFF))

    def i32(self, value: int) -> None:
        self.parts.append(struct.pack("<i", value))

    def u64(self, value: int) -> None:
        self.parts.append(struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF))

    def i64(self, value: int) -> None:
        self.parts.append(struct.pack("<q", value))

    def data(self, value: bytes | str | None) -> None:
        """Length, bytes, NUL (the binary points into its buffer); None as the NULL length."""
        if value is None:
            self.u32(NULL)
            return
        raw = os.fsencode(value) if isinstance(value, str) else value
        self.u32(len(raw))
        self.parts.append(raw + b"\0")

    def strings(self, values: Sequence[bytes | str]) -> None:
        self.u32(len(values))
        for value in values:
            self.data(value)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class NotCovered(Exception):
    """The binary cannot replay this run: isolate.cli runs it."""


#: The fields of the C structs the plan file carries (csrc/cli.c reads them back). A field added to
#: csrc/isolate.h later is not carried: a plan that sets it is never written, so it is never replayed
#: without it (isolate.cli runs such a run) until both sides carry it.
CARRIED = {
    "struct iso_plan": frozenset((
        "clone_flags", "uid_map", "gid_map", "setgroups_deny", "cgroup_procs_fds", "staging", "mounts", "n_mounts",
        "hostname", "idmap_userns_fd", "loopback_up", "new_session", "die_with_parent", "cwd", "rlimits",
        "n_rlimits", "set_ids", "uid", "gid", "clear_groups", "drop_caps", "no_new_privs", "landlock_abi",
        "landlock_handled_fs", "landlock_handled_net", "landlock_scoped", "landlock_rules", "n_landlock_rules",
        "seccomp_filter", "seccomp_len", "seccomp_notify", "seccomp_errnos", "stdio", "keep_fds", "n_keep_fds",
        "program_fd", "file", "search_path", "argv", "envp", "init_fd", "status_fd", "wall_ms", "supervise")),
    "struct iso_mount": frozenset(("kind", "flags", "fd", "mode", "source", "target", "upper", "work")),
    "struct iso_landlock_rule": frozenset(("path", "access", "fd")),
}


#: Fields not carried whose "not used" value is not 0: the binary sets these itself (csrc/cli.c).
UNSET = {"struct iso_plan": {"egress_fd": -1, "why_stream_fd": -1}}


def _layers_step(ffi: Any, lib: Any, static: Any) -> int | None:
    """The index of the static plan's bind of an image's layers where each run idmaps them (None: none)."""
    if static.image_private is None:
        return None
    from ..backends.native.imageroot import STAGING_LAYERS

    for i in range(static.plan.n_mounts):
        step = static.plan.mounts[i]
        if step.kind == lib.ISO_MOUNT_BIND and _cstring(ffi, step.target) == STAGING_LAYERS.encode():
            return i
    raise NotCovered("an image User's plan without its layers' bind")


def _uncarried(ffi: Any, ctype: str, value: Any) -> str | None:
    """The first field of ``value`` the plan file does not carry and this plan sets, or None."""
    for name, _ in ffi.typeof(ctype).fields:
        if name in CARRIED[ctype]:
            continue
        field = getattr(value, name)
        if isinstance(field, int):
            unset = field == UNSET.get(ctype, {}).get(name, 0)
        elif isinstance(field, ffi.CData) and ffi.typeof(field).kind == "array":
            unset = not any(field[i] for i in range(len(field)))
        elif isinstance(field, ffi.CData):
            unset = field == ffi.NULL
        else:
            unset = not field
        if not unset:
            return f"{ctype}.{name}"
    return None


def _cstring(ffi: Any, value: Any) -> bytes | None:
    return None if value == ffi.NULL else bytes(ffi.string(value))


def _stamp(path: str) -> tuple[int, int, int]:
    try:
        info = os.stat(path)
    except OSError:
        return 0, 0, 0
    return 1, info.st_dev, info.st_ino


def _contents(path: str) -> bytes | None:
    """A profile's or seccomp file's bytes, read as the policy reads them (never blocking on a FIFO); None where
    it cannot be read (then no plan rests on it)."""
    try:
        return read_input_file(path)
    except (OSError, ValueError):
        return None


def _package_files() -> list[tuple[str, int, int]]:
    """(path, size, mtime) of the package's code the plan was made with: the file of every module of the
    package this process has imported (called once the plan is made: what planning ran is among them),
    the init, and the directories that hold them (a file added or removed there, which could change
    what an import finds, changes its directory's time). The package's other files (the server, images,
    the agents: some 120 of 190) never ran for it, and each is one ``stat`` fewer before every replay."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the whole isolate package
    files = {os.path.join(here, "isolate-init")}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.startswith(here + os.sep) and path.endswith((".py", ".so")):
            files.add(path)
    paths = sorted(files | {os.path.dirname(path) for path in files})
    out = []
    for path in paths:
        info = os.stat(path)
        out.append((path, info.st_size, info.st_mtime_ns))
    return out


def build_plan(args: Sequence[str], binary: str) -> tuple[bytes, bytes]:
    """(key, plan file) for ``isolate-run ARGS``; raises NotCovered, or the error the run would raise."""
    from .._core import ffi, lib
    from ..backends.native import plan as plan_mod
    from ..model.policy import Egress
    from ..oneshot import runs as popen
    from . import flags

    if args and args[0] in ("doctor", "sandbox", "serve", "learn", "image"):
        raise NotCovered("subcommand")
    options = flags.build_parser().parse_args(list(args))
    command = list(options.command)
    if options.explain or not command:
        raise NotCovered("explain, or no command")
    option_args = split_options(args, command)
    if command[0] == "--":
        command = command[1:]
    if not command or command[0] == "--":
        raise NotCovered("no command")
    # The contents a plan rests on are read before they are used, and again when the plan is written: a file
    # changed in between would leave a plan of its old contents resting on its new ones, replayed for good.
    inputs: dict[str, bytes | None] = {}
    if options.profile:
        inputs[os.path.abspath(options.profile)] = _contents(options.profile)
    policy = flags.policy_from_args(options)
    if policy.seccomp not in ("default", "strict", "none", None) and os.path.isfile(str(policy.seccomp)):
        inputs[os.path.abspath(str(policy.seccomp))] = _contents(str(policy.seccomp))
    if set(policy.keep_env) & set(SHELL_NOISE + MARKERS):
        raise NotCovered("keep_env names a variable the key leaves out")
    if isinstance(policy.network, Egress):
        raise NotCovered("filtered egress")
    if popen.choose_backend(policy) != "native":
        raise NotCovered("the Docker backend")
    cwd = os.getcwd()
    prepared = plan_mod.prepare(policy, command)
    try:
        if prepared.cgroup is not None:
            raise NotCovered("a cgroup per run")
        static = plan_mod._static_for(policy, cwd, False)
        if static.image_command is not None and static.image_command.entrypoint:
            raise NotCovered("an image's Entrypoint (the binary replays the command as given)")
        if policy.image is not None:
            from ..backends.native.imageroot import disk_by_default

            if disk_by_default(policy):
                raise NotCovered("an image's upper layer on disk, made for each run (before Linux 6.6)")
        plan = prepared.plan
        if plan.n_keep_fds or plan.program_fd >= 0 or plan.idmap_userns_fd >= 0:
            raise NotCovered("descriptors passed on")
        uncarried = _uncarried(ffi, "struct iso_plan", plan) or next(
            (u for i in range(plan.n_mounts) if (u := _uncarried(ffi, "struct iso_mount", plan.mounts[i]))), None
        ) or next((u for i in range(plan.n_landlock_rules)
                   if (u := _uncarried(ffi, "struct iso_landlock_rule", plan.landlock_rules[i]))), None)
        if uncarried:
            raise NotCovered(f"{uncarried} is not carried by the plan file")
        idmap = {index for index, _ in static.idmap_steps}
        # An image User's layers: the plan's bind of the store (the static plan's step: this run's is its idmapped
        # tree, which the binary makes again for each replay).
        layers = _layers_step(ffi, lib, static)
        fds: dict[int, None] = {}
        if plan.init_fd >= 0:
            fds[int(plan.init_fd)] = None
        for i in range(plan.n_mounts):
            step = static.plan.mounts[i] if i == layers else plan.mounts[i]
            if step.fd >= 0 and i not in idmap:
                fds[int(step.fd)] = None
            source = _cstring(ffi, step.source)
            # (/dev/stdin and friends are symlinks to /proc/self/fd/N: text, not descriptors)
            if step.kind == lib.ISO_MOUNT_MOVE and source and source.startswith(b"/proc/self/fd/"):
                fds[int(source[len(b"/proc/self/fd/"):])] = None
        for i in range(plan.n_landlock_rules):
            if plan.landlock_rules[i].fd >= 0:
                fds[int(plan.landlock_rules[i].fd)] = None
        for i in range(8):
            if plan.cgroup_procs_fds[i] >= 0:
                raise NotCovered("a cgroup per run")

        w = _Writer()
        w.parts.append(MAGIC)
        key = key_material(option_args, cwd)
        w.data(hashlib.sha256(key).digest())  # never the key: it holds the caller's whole environment
        # -- what the plan relies on -------------------------------------------
        info = os.stat(binary)
        w.u64(info.st_dev)
        w.u64(info.st_ino)
        w.i64(info.st_size)
        w.i64(info.st_mtime_ns)
        package = _package_files()
        w.u32(len(package))
        for path, size, mtime in package:
            w.data(path)
            w.i64(size)
            w.i64(mtime)
        w.u32(len(HOST_FILES))
        for path in HOST_FILES:
            w.data(path)
            try:
                with open(path, "rb") as handle:
                    content: bytes | None = handle.read(4096)
            except OSError:
                content = None
            w.data(content)
        for path, content in inputs.items():
            if content is None or _contents(path) != content:
                raise NotCovered(f"{path} changed while the plan was made")
        if static.image_root is not None:
            # The image's record, by its bytes: its inode is reused by a later pull or load of the name.
            inputs[static.image_root.stamps[0]] = static.image_root.record
        w.u32(len(inputs))
        for path, content in inputs.items():
            w.data(path)
            w.data(content)
        named = [os.path.normpath(os.path.join(cwd, os.path.expanduser(p)))
                 for p in (*policy.read, *policy.write, *policy.unix_sockets)]
        named += [os.path.join(cwd, m.source) for m in policy.binds]
        named += [os.path.join(os.path.expanduser("~"), n) for n in policy.home_files]
        from ..backends.native.imageroot import store_path

        # The image store: made since, a grant holding it would have to hide it (a plan made before did not).
        named += [cwd, store_path(), *(path for path, _ in static.stamps)]
        named = list(dict.fromkeys(named))
        w.u32(len(named))
        for path in named:
            present, dev, ino = _stamp(path)
            w.data(path)
            w.u32(present)
            w.u64(dev)
            w.u64(ino)
        w.u32(len(fds))
        for fd in fds:
            target = os.readlink(f"/proc/self/fd/{fd}".encode())
            if not target.startswith(b"/") or target.endswith(b" (deleted)"):
                raise NotCovered(f"descriptor {fd} has no path")
            finfo = os.fstat(fd)
            w.i32(fd)
            w.data(target)
            w.u32(stat.S_IFMT(finfo.st_mode))
            w.u64(finfo.st_dev)
            w.u64(finfo.st_ino)
        # An image's command is found in the image, by the init: no host path to check it against ("/").
        w.strings(["/"] if static.image_env is not None else list(static.granted))
        # -- the plan ------------------------------------------------------------
        w.i32(plan.clone_flags)
        w.data(_cstring(ffi, plan.uid_map))
        w.data(_cstring(ffi, plan.gid_map))
        w.i32(plan.setgroups_deny)
        w.data(_cstring(ffi, plan.staging))
        w.u32(plan.n_mounts)
        for i in range(plan.n_mounts):
            step = static.plan.mounts[i] if i == layers else plan.mounts[i]
            w.i32(step.kind)
            w.i32(step.flags)
            w.i32(-1 if i in idmap else step.fd)
            w.i32(step.mode)
            for text in (step.source, step.target, step.upper, step.work):
                w.data(_cstring(ffi, text))
        w.data(_cstring(ffi, plan.hostname))
        w.i32(plan.loopback_up)
        w.i32(plan.new_session)
        w.i32(plan.die_with_parent)
        w.data(_cstring(ffi, plan.cwd))
        w.u32(plan.n_rlimits)
        for i in range(plan.n_rlimits):
            w.i32(plan.rlimits[i].resource)
            w.u64(plan.rlimits[i].soft)
            w.u64(plan.rlimits[i].hard)
        for value in (plan.set_ids, plan.uid, plan.gid, plan.clear_groups, plan.drop_caps, plan.no_new_privs,
                      plan.landlock_abi):
            w.i64(int(value))
        w.u64(plan.landlock_handled_fs)
        w.u64(plan.landlock_handled_net)
        w.u64(plan.landlock_scoped)
        w.u32(plan.n_landlock_rules)
        for i in range(plan.n_landlock_rules):
            rule = plan.landlock_rules[i]
            w.data(_cstring(ffi, rule.path))
            w.u64(rule.access)
            w.i32(rule.fd)
        if plan.seccomp_filter == ffi.NULL:
            w.data(None)
        else:
            w.data(bytes(ffi.buffer(ffi.cast("char *", plan.seccomp_filter), 8 * plan.seccomp_len)))
        w.i32(plan.seccomp_len)
        w.i32(plan.seccomp_notify)
        w.data(_cstring(ffi, plan.seccomp_errnos))
        envp = []
        i = 0
        while plan.envp[i] != ffi.NULL:
            envp.append(bytes(ffi.string(plan.envp[i])))
            i += 1
        w.strings(envp)
        w.data(_cstring(ffi, plan.search_path))
        w.i32(plan.init_fd)
        w.i64(plan.wall_ms)
        w.data(_cstring(ffi, plan.supervise))
        w.u32(static.program_uid)
        w.u32(static.program_gid)
        w.u32(len(idmap))
        for index in sorted(idmap):
            w.u32(index)
        private = static.image_private
        w.u32(0xFFFFFFFF if layers is None else layers)
        w.data(None if private is None else private.uid_map())
        w.data(None if private is None else private.layers_gid_map())
        # -- the report and the messages ------------------------------------------
        _write_report_parts(w, policy, prepared)
        # -- an image's sandbox: its lease (isolate/image/leases.py), written by the binary ---------------
        from ..image import leases

        w.data(static.image_store.path if static.image_store is not None else None)
        w.data(leases.body(static.image_layers) if static.image_store is not None else None)
        return key, w.getvalue()
    finally:
        prepared.discard()


def _write_report_parts(w: _Writer, policy: Any, prepared: Any) -> None:
    """The report around what the run fills in, the limit messages and the denial hints, made by isolate.cli."""
    from ..kernel import seccomp
    from ..model.report import Report
    from . import main as cli

    report = Report(backend="native", enforced=dict(prepared.enforced), warnings=list(prepared.warnings),
                    denials_observed={k: dict(v) for k, v in prepared.observed.items()})
    text = report.to_json()
    head, sep, rest = text.partition('\n  "backend": ')
    mid, sep2, tail = rest.partition('\n  "denied": []')
    if not sep or not sep2 or not head.endswith('"oom_kills": 0,'):
        raise NotCovered("report layout")
    w.data('  "backend": ' + mid + '\n  "denied": ')
    w.data(tail + "\n")
    w.strings([f"isolate-run: warning: {warning}" for warning in prepared.warnings])
    for status in ("timeout", "cpu", "file-size"):
        message = cli.limit_message(policy, Report(status=status))
        w.data(f"isolate-run: {message}" if message else None)
    for entry in ({"mechanism": "network", "address": "@H@", "port": "@P@"},
                  {"mechanism": "unix-socket", "path": "@S@"},
                  {"mechanism": "unix-socket", "syscall": "socket", "type": "datagram"}):
        lines = cli.denial_hints(Report(denied=[entry]), policy)
        w.data(f"isolate-run: {lines[0]}" if lines else None)
    from .._core import ffi

    names: list[tuple[int, str]] = []
    if prepared.plan.seccomp_errnos != ffi.NULL:
        for item in ffi.string(prepared.plan.seccomp_errnos).decode().split(","):
            nr_text = item.partition(":")[0]
            if nr_text.strip().lstrip("-").isdigit():
                names.append((int(nr_text), seccomp.syscall_name(int(nr_text))))
    w.u32(len(names))
    for nr, name in names:
        w.i32(nr)
        w.data(name)


def write_plan(key: bytes, data: bytes) -> str:
    """Store a plan (atomically, mode 0600) and keep the cache bounded; returns its path."""
    directory = cache_dir(create=True)
    name = plan_name(key)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    path = os.path.join(directory, name)
    os.rename(temporary, path)
    try:
        entries = [e for e in os.scandir(directory) if e.name.endswith(".plan")]
        if len(entries) > MAX_PLANS:
            entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
            for entry in entries[: len(entries) - MAX_PLANS]:
                os.unlink(entry.path)
    except OSError:
        pass
    return path


def handover_main(early: Sequence[int] = ()) -> int:
    """What the binary runs when it does not replay: plan and exec it back, or run in Python. ``early``: the
    signals its boot script recorded before isolate was imported (startup.py)."""
    from . import startup

    startup.record(early)
    binary = os.environ.pop(ENV_BINARY, None)
    no_cache = os.environ.pop(ENV_NO_CACHE, None)
    os.environ.pop(ENV_REPLAY, None)
    args = sys.argv[1:]
    if binary and not no_cache:
        try:
            key, data = build_plan(args, binary)
            write_plan(key, data)
        except Exception:
            pass  # not covered, or the run would fail: isolate.cli says why, exactly as it always has
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            env = dict(os.environb)
            env[ENV_REPLAY.encode()] = b"1"
            # Held across the exec (the binary unblocks them once it catches them); one that came before is
            # recorded by now (its handler ran as hold returned): the run ends here, unstarted.
            startup.hold()
            status = startup.stopped()
            if status is not None:
                return status
            try:
                os.execve(binary, [binary, *args], env)
            except OSError:
                startup.record()  # the binary is gone meanwhile: run here

    from .main import main

    return main(args)
