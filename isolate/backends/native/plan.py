"""The native backend: turn a policy into a plan for the C core.

``prepare`` does every costly or fallible thing in the parent (resolving and
checking paths, choosing mechanisms, compiling seccomp, opening idmapped
trees, creating cgroups) and fills a ``struct iso_plan``; the C core then only
applies it in the child. Whatever cannot be enforced is refused here, before
anything runs, unless the policy asks for best effort.
"""

from __future__ import annotations

import errno as errno_mod
import os
import resource
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ... import grants, hostinfo, landlock, mounts
from ..._core import INIT_PATH, ffi, init_fd, lib, step_name
from ...errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    PolicyError,
    SetupError,
    UnsupportedError,
)
from ...policy import DEFAULT_HOME, DEFAULT_READ, DEFAULT_TMPFS, DEFAULT_WRITE, Egress, Policy
from ...units import milliseconds_up

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

NAMESPACE_FLAGS = {
    "user": CLONE_NEWUSER,
    "mnt": CLONE_NEWNS,
    "pid": CLONE_NEWPID,
    "ipc": CLONE_NEWIPC,
    "uts": CLONE_NEWUTS,
    "net": CLONE_NEWNET,
    "cgroup": CLONE_NEWCGROUP,
}

#: The uid a root caller's program runs as, unless the policy names one.
NOBODY = 65534
HOSTNAME = "isolate"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


@lru_cache(maxsize=1)
def userns_error() -> int:
    """0 when this caller can create a user namespace, else the errno."""
    return int(lib.iso_probe_userns())


def _filesystem_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (from /proc/self/mountinfo), or "unknown"."""
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return kind


_IDMAP_PROBED: dict[tuple[int, int, int], str | None] = {}


def _idmap_problem(device: int, path: str, uid: int, gid: int) -> str | None:
    """None when ``path``'s file system (``device``) takes an idmapped mount here, else why not.

    Probed once per file system (and mapping), in the parent, with the very
    call a run makes; never discovered by a failure in the child. (A kept
    sandbox's workspace is a new directory each time: the path is not the key.)
    """
    key = (device, uid, gid)
    if key not in _IDMAP_PROBED:
        _IDMAP_PROBED[key] = _probe_idmap(path, uid, gid)
    return _IDMAP_PROBED[key]


def _probe_idmap(path: str, uid: int, gid: int) -> str | None:
    userns = int(lib.iso_make_idmap_userns(uid, gid))
    if userns < 0:
        err = ffi.errno
        return f"a user namespace for the mapping cannot be made ({os.strerror(err)})"
    fd = int(lib.iso_open_idmapped_tree(os.fsencode(path), userns))
    err = ffi.errno
    os.close(userns)
    if fd >= 0:
        os.close(fd)
        return None
    if err == errno_mod.EPERM:
        return ("this process may not make idmapped mounts (EPERM: no CAP_SYS_ADMIN over the file system, "
                "as inside a container)")
    kind = _filesystem_type(path)
    return (f"its file system ({kind}) does not support idmapped mounts ({os.strerror(err)}; overlayfs, a "
            "container's root, never does; tmpfs only from Linux 6.3)")


def _writable_by(info: os.stat_result, uid: int, gid: int) -> bool:
    if info.st_uid == uid:
        return bool(info.st_mode & 0o200)
    if info.st_gid == gid:
        return bool(info.st_mode & 0o020)
    return bool(info.st_mode & 0o002)


def _write_route(write: Sequence[str], policy: Policy, uid: int, gid: int,
                 no_idmap: str | None = None) -> tuple[str, int, int]:
    """How a root caller's program gets its writable paths: (route, program uid, program gid).

    "idmapped" where every writable path's file system takes an idmapped
    mount (the program is uid 65534 but owns what root owns there). Where one
    does not, the program must still never hold power over host files, so it
    is never root: "owner" runs it as the one non-root owner of all the
    writable paths (unless uid= says otherwise), "plain" keeps 65534 where the
    paths are writable by it; otherwise the run is refused, naming the cause
    and the ways out.
    """
    infos = {path: os.stat(grants.host_symlinks(path, "write")[1]) for path in write}
    problems = {path: no_idmap or _idmap_problem(info.st_dev, grants.host_symlinks(path, "write")[1], uid, gid)
                for path, info in infos.items()}
    failing = {path: why for path, why in problems.items() if why}
    if not failing:
        return "idmapped", uid, gid
    path, why = next(iter(failing.items()))
    owners = {(info.st_uid, info.st_gid) for info in infos.values()}
    if policy.uid is None and len(owners) == 1 and next(iter(owners))[0] != 0:
        owner_uid, owner_gid = next(iter(owners))
        # Never the root group: a root-group directory gives the program 65534's group instead.
        return "owner", owner_uid, (policy.gid if policy.gid is not None else owner_gid or gid)
    if all(_writable_by(info, uid, gid) for info in infos.values()):
        return "plain", uid, gid
    raise UnsupportedError(
        f"write: {path}: a root caller's program runs as uid {uid}, which cannot write there: it would own its "
        f"writable paths through an idmapped mount, but {why}; ways out: work in a directory owned by a regular "
        "user (the program then "
        f"runs as that user), make {path} writable by uid {uid} (chown {uid} {path}), pass --uid N for a "
        "directory owned by uid N, or run isolate-run as a regular user"
    )


@lru_cache(maxsize=8)
def _idmap_userns(uid: int, gid: int) -> int:
    fd = int(lib.iso_make_idmap_userns(uid, gid))
    if fd < 0:
        err = ffi.errno
        raise UnsupportedError(
            f"a root caller's writable paths need an idmapped mount, and creating its user namespace failed: "
            f"{os.strerror(err)}; run as a regular user, or pass uid= of the paths' owner"
        )
    return fd


@dataclass
class Prepared:
    """A plan for one run, and everything that must outlive the spawn."""

    plan: Any
    enforced: dict[str, Any]
    warnings: list[str]
    status_fd: int = -1  # read end of the init's status pipe
    cgroup: Any = None
    limit_cpu_seconds: float | None = None
    observed: dict[str, dict[str, Any]] = field(default_factory=dict)
    _keep: list[Any] = field(default_factory=list)
    _close_after_spawn: list[int] = field(default_factory=list)

    def close_child_side(self) -> None:
        _close_all(self._close_after_spawn)


def _close_all(fds: list[int], _os_close: Callable[[int], None] = os.close) -> None:
    # (The default argument keeps os.close reachable at interpreter shutdown.)
    for fd in fds:
        try:
            _os_close(fd)
        except OSError:
            pass
    fds.clear()


class _Refusals:
    """Collects what cannot be enforced: raises, or warns under best effort."""

    def __init__(self, best_effort: bool) -> None:
        self.best_effort = best_effort
        self.warnings: list[str] = []

    def refuse(self, message: str) -> None:
        if not self.best_effort:
            raise UnsupportedError(message)
        self.warnings.append(f"not enforced: {message}")


def _resolve(paths: Sequence[str], cwd: str, field_name: str, skip_missing: bool) -> list[str]:
    out = []
    for path in paths:
        absolute = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
        if not os.path.exists(absolute):
            if skip_missing:
                continue
            raise PolicyError(
                f"{field_name}: {path!r} does not exist; create it or drop it from the policy", field_name
            )
        out.append(absolute)
    return out


#: Where a root caller's default writable cwd is refused: the default read-only
#: system paths and the kernel's own trees. Writable there, the program
#: (owning what root owns, through the idmapped mount) could rewrite /etc.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/boot",
                "/proc", "/sys", "/dev")


def _refuse_system_cwd(real_cwd: str) -> None:
    """Refuse "cwd writable" (the default ".") for a root caller whose cwd is a system path.

    An explicit absolute grant of the same directory is the caller's choice and stays allowed."""
    for top in SYSTEM_PATHS:
        real_top = os.path.realpath(top)
        if real_cwd == real_top or real_cwd.startswith(real_top.rstrip("/") + "/"):
            raise PolicyError(
                f"write: the working directory {real_cwd} is a system path ({top}), and the default makes the "
                "working directory writable: run from a project directory, or grant it explicitly by its path "
                f"(--rw {real_cwd}), or --chdir to a directory that is not a system path",
                "write",
            )


def _yama_ptrace_scope() -> int:
    """/proc/sys/kernel/yama/ptrace_scope (0 without Yama)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as handle:
            return int(handle.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def program_environment(policy: Policy, extra: Mapping[str, str] | None, home: str | None = None
                        ) -> dict[str, str]:
    """The minimal environment: keep_env names from the caller, HOME the program's own home, then
    policy.env, then ``extra``."""
    env = {name: os.environ[name] for name in policy.keep_env if name in os.environ}
    if home is not None:
        env["HOME"] = home
    env.update(policy.env)
    if extra:
        env.update({os.fsdecode(k): os.fsdecode(v) for k, v in extra.items()})
    env.setdefault("PATH", DEFAULT_PATH)
    return env


#: Without namespaces, a root caller's program keeps its home here (one directory per uid).
NO_NS_HOME_ROOT = "/var/lib/isolate/home"


def _plan_home(
    policy: Policy,
    use_ns: bool,
    granted: list[str],
    tmpfs: list[str],
    run_cwd: str,
    uid: int,
    gid: int,
    refusals: _Refusals,
    open_source: Callable[[str, str], str],
) -> tuple[str | None, list[tuple[str, str]]]:
    """The program's home and the (host real path, path inside) of each home file.

    With namespaces the home is a tmpfs of its own at ``policy.home`` (mode 0700, owned by the
    program): private to the run. Without them nothing can be mounted, so it is a real directory
    the program owns, private to its uid and kept between runs (``NO_NS_HOME_ROOT``/UID for a root
    caller, whose program cannot reach root's home; else isolate's state directory).
    """
    home = policy.home
    if home is None:
        return None, []
    if not use_ns:
        if policy.home_files:
            refusals.refuse("home_files: sharing files into the home needs namespaces (a read-only bind "
                            "into the private home); without them grant the files with read=")
        return _no_ns_home(uid, gid), []
    for path in granted:
        real = grants.host_symlinks(path)[1]
        if home == real or home.startswith(real.rstrip("/") + "/"):
            message = (f"home: the private home {home} would be inside the granted {real}; choose another "
                       "home (home=, --home PATH) or none (--home none)")
            if home != DEFAULT_HOME:
                raise PolicyError(message, "home")
            refusals.warnings.append(f"no private home: {message.split('; ')[0].split(': ', 1)[1]}; "
                                     "HOME is the caller's (choose one with --home PATH)")
            return None, []
    files: list[tuple[str, str]] = []
    caller_home = os.path.expanduser("~")
    for name in policy.home_files:
        source = os.path.normpath(os.path.join(caller_home if not os.path.isabs(name) else "/", name))
        if not os.path.lexists(source):
            raise PolicyError(f"home_files: {source} does not exist; create it or drop it", "home_files")
        real = open_source(source, "home_files")
        target = os.path.join(home, os.path.basename(source))
        if any(target == t for _, t in files):
            raise PolicyError(f"home_files: two files would be {target}; share one of them", "home_files")
        files.append((real, target))
    return home, files


def _no_ns_tmpdir(home: str, uid: int, gid: int) -> str | None:
    """A run without namespaces has no private /tmp: TMPDIR is a ``tmp`` directory in its private home.

    Made by the parent with mkdir (which never follows a link the program may
    have left at that name) and handed to the program's uid; whatever is
    already there is left as it is (it is the program's own).
    """
    path = os.path.join(home, "tmp")
    try:
        os.mkdir(path, 0o700)
        if os.geteuid() == 0:
            os.chown(path, uid, gid, follow_symlinks=False)
    except FileExistsError:
        pass
    except OSError:
        return None
    return path


def _no_ns_home(uid: int, gid: int) -> str:
    """A directory owned by ``uid`` (created 0700 if missing), never reached through a link."""
    if os.geteuid() == 0:
        base = NO_NS_HOME_ROOT
        leaf = os.path.join(base, str(uid))
    else:
        from ...registry import state_dir

        base = state_dir()
        leaf = os.path.join(base, "home")
    try:
        os.makedirs(base, mode=0o755, exist_ok=True)
        try:
            os.mkdir(leaf, 0o700)
            if os.geteuid() == 0:
                os.lchown(leaf, uid, gid)
        except FileExistsError:
            pass
        info = os.lstat(leaf)
    except OSError as exc:
        raise UnsupportedError(f"home: cannot make the program's home {leaf}: {exc.strerror}; "
                               "choose another (--home none keeps no home)") from None
    import stat

    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise UnsupportedError(f"home: {leaf} is not a private directory of uid {uid} (a link, another owner "
                               "or open permissions); remove it, or run with --home none")
    return leaf


def _inside(path: str, granted: Sequence[str]) -> bool:
    return any(path == g or path.startswith(g.rstrip("/") + "/") for g in granted)


def reduced_path(search_path: str, granted: Sequence[str]) -> str:
    """``search_path`` without the directories the program cannot see (an empty result: the
    granted part of the default PATH)."""
    kept = [d for d in search_path.split(":") if d and os.path.isabs(d) and _inside(os.path.normpath(d), granted)]
    if not kept:
        kept = [d for d in DEFAULT_PATH.split(":") if _inside(d, granted)] or DEFAULT_PATH.split(":")[:1]
    return ":".join(dict.fromkeys(kept))


def check_command(program: str, search_path: str, granted: Sequence[str], cwd: str) -> None:
    """Refuse, naming its directory and the way to grant it, a command that exists on the host
    only outside the grants (a venv's, pyenv's or conda's binary, say)."""
    if "/" in program:
        host = os.path.normpath(os.path.join(cwd, program))
        if os.path.exists(host) and not _inside(host, granted) and not _inside(os.path.realpath(host), granted):
            directory = os.path.dirname(host)
            raise CommandNotFoundError(
                errno_mod.ENOENT, f"{program}: its directory {directory} is not granted to the sandbox; "
                f"grant it with --ro {directory} (read=)", program)
        return
    inside = which(program, search_path)
    outside = which(program, os.environ.get("PATH", DEFAULT_PATH))
    if outside is not None and outside != inside and not _inside(os.path.normpath(outside), granted):
        # The caller would run this one: running another (or none) silently would surprise.
        directory = os.path.dirname(outside)
        other = f", or name {inside} to run that one" if inside else ""
        raise CommandNotFoundError(
            errno_mod.ENOENT, f"{program}: found at {outside}, whose directory is not granted to the sandbox; "
            f"grant it with --ro {directory} (read=){other}", program)


def which(program: str, search_path: str) -> str | None:
    for directory in search_path.split(":"):
        candidate = os.path.join(directory, program)
        if directory and os.path.isabs(directory) and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


@lru_cache(maxsize=1)
def audit_state() -> str:
    """The kernel audit subsystem as this caller sees it: "enabled", "disabled" or "unreadable".

    Landlock (ABI 7) reports denials only as audit records (AUDIT_LANDLOCK_ACCESS); reading them
    needs the audit netlink socket, whose status request and log multicast group need
    CAP_AUDIT_CONTROL / CAP_AUDIT_READ: root only.
    """
    import socket
    import struct

    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9) as sock:  # NETLINK_AUDIT
            sock.settimeout(1.0)
            sock.bind((0, 0))
            sock.send(struct.pack("=IHHII", 16, 1000, 1, 1, 0))  # AUDIT_GET, NLM_F_REQUEST
            data = sock.recv(8192)
    except OSError:
        return "unreadable"
    if len(data) < 20:
        return "unreadable"
    kind = struct.unpack_from("=H", data, 4)[0]
    if kind == 2:  # NLMSG_ERROR: refused (EPERM for a caller without CAP_AUDIT_CONTROL)
        return "unreadable"
    if kind != 1000 or len(data) < 24:
        return "unreadable"
    return "enabled" if struct.unpack_from("=I", data, 20)[0] else "disabled"


def denials_observed(use_ns: bool, notify: bool, landlock_abi: int) -> dict[str, dict[str, Any]]:
    """Whether each mechanism's denials can be seen in the report, and why not (never guessed)."""
    out: dict[str, dict[str, Any]] = {}
    if notify:
        out["seccomp"] = {"observed": True, "detail": "each denial is a notification answered by the init"}
    else:
        out["seccomp"] = {"observed": False, "detail": "no init receives notifications in this mode "
                          "(no namespaces, or preexec_fn): denials happen but are not counted"}
    if 0 < landlock_abi < 7:
        out["landlock"] = {"observed": False, "detail": f"this kernel's Landlock (ABI {landlock_abi}) cannot "
                           "log denials (ABI 7 logs them to the audit subsystem); a denied access fails with EACCES"}
    elif landlock_abi:
        state = audit_state()
        why = {"disabled": "the audit subsystem is disabled on this host (no auditd)",
               "unreadable": "reading the audit log needs CAP_AUDIT_READ (root)",
               "enabled": "isolate does not ask Landlock to log after exec nor read the audit log yet"}[state]
        out["landlock"] = {"observed": False, "detail": "Landlock reports denials only to the audit subsystem "
                           f"(ABI 7 and later); {why}; a denied file access fails with EACCES"}
    if use_ns:
        out["mounts"] = {"observed": False, "detail": "a path outside the granted ones does not exist inside "
                         "the sandbox: the program gets ENOENT and the kernel records nothing"}
    return out


def unsupported_reasons(policy: Policy) -> list[str]:
    """What the native backend cannot enforce for ``policy`` on this host (empty: all of it)."""
    reasons = []
    if isinstance(policy.network, Egress):
        reasons.append("network: filtered egress (allow-host) is not available in the native backend yet")
    limits = policy.limits
    if limits.memory is not None or limits.pids is not None or limits.cpus is not None:
        refusal = _cgroup_refusal(frozenset(_cgroup_needs(policy)))
        if refusal:
            reasons.append(refusal)
    if policy.namespaces and userns_error():
        reasons.append(f"namespaces: this caller cannot create a user namespace ({os.strerror(userns_error())}): "
                       + hostinfo.userns_advice(userns_error()))
    if not policy.namespaces and landlock.abi() == 0:
        reasons.append("filesystem: without namespaces, Landlock is needed and this kernel has none")
    return reasons


@lru_cache(maxsize=16)
def _cgroup_refusal(needs: frozenset[str]) -> str | None:
    """Why no cgroup with ``needs`` can be made here (None: one can), asked once per process.

    Only the backend choice uses this; each run still creates its own cgroup
    and refuses then if that fails.
    """
    from ... import cgroup

    try:
        cgroup.check_available(set(needs))
    except UnsupportedError as exc:
        return str(exc)
    return None


def _cgroup_needs(policy: Policy) -> set[str]:
    needs = set()
    if policy.limits.memory is not None:
        needs.add("memory")
    if policy.limits.pids is not None:
        needs.add("pids")
    if policy.limits.cpus is not None:
        needs.add("cpu")
    if policy.limits.cpu_seconds is not None:
        needs.add("cpuacct")
    return needs


@dataclass
class _Static:
    """The part of a plan that depends only on the policy, the directory and the caller: cached."""

    plan: Any
    keep: list[Any]
    enforced: dict[str, Any]
    warnings: list[str]
    rlimits: list[tuple[int, int, int]]
    cgroup_needs: set[str]
    limit_cpu_seconds: float | None
    idmap_steps: list[tuple[int, str]]
    program_uid: int
    program_gid: int
    run_cwd: str
    home: str | None
    observed: dict[str, dict[str, Any]]
    tmpdir: str | None  # TMPDIR of a run without namespaces (no private /tmp there)
    granted: tuple[str, ...]  # what the program can see of the host: granted paths, as named and real
    stamps: list[tuple[str, tuple[int, int]]]
    fds: list[int]

    def fresh(self) -> bool:
        """Whether every granted path is still the inode it was when the plan was made."""
        for path, stamp in self.stamps:
            try:
                info = os.stat(path)
            except OSError:
                return False
            if (info.st_dev, info.st_ino) != stamp:
                return False
        return True

    def __del__(self, _close: Callable[[list[int]], None] = _close_all) -> None:
        # Only when no run holds this plan any more: a descriptor closed
        # under a child that is adding its Landlock rules could be reused.
        # (The default argument keeps the helper reachable at shutdown.)
        _close(self.fds)


_STATIC_CACHE: OrderedDict[tuple[Any, ...], _Static] = OrderedDict()
_STATIC_CACHE_SIZE = 16
_STATIC_LOCK = threading.Lock()


def _static_for(policy: Policy, run_cwd: str, for_preexec: bool) -> _Static:
    if for_preexec:
        return _prepare_static(policy, run_cwd, for_preexec)
    key = (policy, run_cwd, os.geteuid(), os.getegid())
    with _STATIC_LOCK:
        static = _STATIC_CACHE.get(key)
        if static is not None and static.fresh():
            _STATIC_CACHE.move_to_end(key)
            return static
    static = _prepare_static(policy, run_cwd, for_preexec)
    with _STATIC_LOCK:
        _STATIC_CACHE[key] = static
        _STATIC_CACHE.move_to_end(key)
        while len(_STATIC_CACHE) > _STATIC_CACHE_SIZE:
            _STATIC_CACHE.popitem(last=False)
    return static


def _prepare_static(policy: Policy, run_cwd: str, for_preexec: bool) -> _Static:
    """Resolve paths, choose mechanisms, build mounts, Landlock rules and seccomp: once per policy and directory.

    A refusal part-way closes what was opened so far (a caller retrying a
    refused policy in a loop must not run out of descriptors).
    """
    opened: list[int] = []
    try:
        return _build_static(policy, run_cwd, for_preexec, opened)
    except BaseException:
        _close_all(opened)
        raise


def _build_static(policy: Policy, run_cwd: str, for_preexec: bool, static_fds: list[int]) -> _Static:
    refusals = _Refusals(policy.best_effort)
    enforced: dict[str, Any] = {}
    keep: list[Any] = []

    def cstr(text: str | bytes) -> Any:
        data = ffi.new("char[]", os.fsencode(text))
        keep.append(data)
        return data

    defaults_read = policy.read == DEFAULT_READ
    read = _resolve(policy.read, run_cwd, "read", skip_missing=defaults_read)
    write = _resolve(policy.write, run_cwd, "write", skip_missing=False)
    # Named unix sockets: each must be a socket now; its inode is what the
    # supervisor allows (whatever path reaches it), and it is bound into the
    # sandbox as a read grant of its own.
    sockets: list[str] = []
    socket_ids: list[tuple[int, int]] = []
    for path in _resolve(policy.unix_sockets, run_cwd, "unix_sockets", skip_missing=False):
        real = grants.host_symlinks(path, "unix_sockets")[1]
        try:
            info = os.lstat(real)
        except OSError as exc:
            raise PolicyError(f"unix_sockets: {path}: {exc.strerror}", "unix_sockets") from None
        if not stat.S_ISSOCK(info.st_mode):
            raise PolicyError(f"unix_sockets: {path} is not a unix socket", "unix_sockets")
        sockets.append(real)
        socket_ids.append((info.st_dev, info.st_ino))
        if real not in read and real not in write:
            read.append(real)
    if len(socket_ids) > 64:  # the init's allow-list (csrc/supervise.c) has room for 64
        raise PolicyError("unix_sockets: at most 64 sockets can be named; grant their directory writable instead",
                          "unix_sockets")
    if any(p in DEFAULT_WRITE for p in policy.write) and os.geteuid() == 0:
        explicit = {os.path.realpath(os.path.join(run_cwd, p)) for p in policy.write if p not in DEFAULT_WRITE}
        if os.path.realpath(run_cwd) not in explicit:
            _refuse_system_cwd(os.path.realpath(run_cwd))
    if defaults_read:
        read = [p for p in read if p not in write]  # an explicit write grant wins over a default read
    for name, paths in (("read", read), ("write", write)):
        if "/" in paths:
            raise PolicyError(
                f"{name}: the whole filesystem (/) cannot be granted; grant the directories the program needs"
                + (" (the working directory is / here: run from another directory or set write=)"
                   if name == "write" else ""),
                name,
            )
    # Every granted path is resolved once (following only root's top-level
    # links) and opened here; binds, idmapped trees and Landlock rules all
    # use these inodes, never the path again.
    source_fds: dict[str, int] = {}

    def open_source(path: str, field_name: str) -> str:
        real = grants.host_symlinks(path, field_name)[1]
        if real == "/":
            raise PolicyError(f"{field_name}: {path} is the whole filesystem (/); grant the directories the "
                              "program needs", field_name)
        if real not in source_fds:
            try:
                fd = os.open(real, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as exc:
                raise PolicyError(f"{field_name}: {path}: cannot open it: {exc.strerror}", field_name) from None
            static_fds.append(fd)
            source_fds[real] = fd
        return real

    for path in read:
        open_source(path, "read")
    for path in write:
        open_source(path, "write")
    # Host paths shown at other paths: (real source, target, read-only).
    binds = [(open_source(os.path.join(run_cwd, m.source), "binds"), m.target, m.mode == "ro")
             for m in policy.binds]
    rw_sources = [source for source, _, readonly in binds if not readonly]
    use_ns = policy.namespaces
    tmpfs = list(policy.tmpfs) if use_ns or policy.tmpfs != DEFAULT_TMPFS else []
    if tmpfs and not use_ns:
        refusals.refuse("tmpfs: a private tmpfs needs namespaces (namespaces=true)")
        tmpfs = []

    plan = ffi.new("struct iso_plan *")
    keep.append(plan)
    for i in range(8):
        plan.cgroup_procs_fds[i] = -1
    plan.idmap_userns_fd = -1
    plan.program_fd = -1
    caller_uid, caller_gid = os.geteuid(), os.getegid()
    root_caller = caller_uid == 0
    program_uid = policy.uid if policy.uid is not None else (NOBODY if root_caller else caller_uid)
    program_gid = policy.gid if policy.gid is not None else (NOBODY if root_caller else caller_gid)
    if not root_caller and (policy.uid not in (None, caller_uid) or policy.gid not in (None, caller_gid)):
        raise PolicyError("uid/gid: only a root caller can run the program as another user", "uid")

    # -- namespaces and ids ------------------------------------------------
    network = policy.network
    if isinstance(network, Egress):
        refusals.refuse("network: filtered egress (allow-host) is not built yet; use none, loopback or host")
        network = "none"
    flags = 0
    if use_ns:
        err = userns_error()
        if err:
            refusals.refuse(
                f"namespaces: this caller cannot create a user namespace ({os.strerror(err)}): "
                + hostinfo.userns_advice(err)
            )
            use_ns = False
            tmpfs = []
    # -- a root caller's writable paths: idmapped, or another route -----------
    write_route = "idmapped"
    if root_caller and (write or rw_sources):
        write_route, program_uid, program_gid = _write_route(
            write + rw_sources, policy, program_uid, program_gid,
            None if use_ns else "without namespaces there is no idmapped mount: plain permissions decide")
    if use_ns:
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        if network != "host":
            flags |= CLONE_NEWNET
        if root_caller:
            # Root stays root inside during the setup (so that it can reach
            # the sources it binds, whatever their modes), and the program
            # and the init switch to the unprivileged ids before they exec.
            plan.uid_map = cstr(f"0 0 1\n{program_uid} {program_uid} 1\n")
            plan.gid_map = cstr(f"0 0 1\n{program_gid} {program_gid} 1\n")
        else:
            plan.uid_map = cstr(f"{caller_uid} {caller_uid} 1\n")
            plan.gid_map = cstr(f"{caller_gid} {caller_gid} 1\n")
        plan.setgroups_deny = 0 if root_caller else 1
        plan.hostname = cstr(HOSTNAME)
        plan.loopback_up = 1 if network == "loopback" else 0
        enforced["namespaces"] = [n for n, f in NAMESPACE_FLAGS.items() if flags & f]
        enforced["network"] = {"none": "netns-empty", "loopback": "netns-loopback", "host": "host"}[network]
    else:
        enforced["namespaces"] = []
    plan.clone_flags = flags
    plan.set_ids = 1 if root_caller else 0
    plan.uid = program_uid
    plan.gid = program_gid
    plan.clear_groups = 1 if root_caller else 0
    plan.drop_caps = 1
    plan.no_new_privs = 1
    plan.new_session = 1 if policy.new_session else 0
    plan.die_with_parent = 1 if policy.die_with_parent else 0
    enforced["user"] = {"uid": program_uid, "gid": program_gid}
    enforced["no_new_privs"] = True
    enforced["capabilities"] = "all dropped" if (use_ns or root_caller) else "none held (no_new_privs)"

    # -- the program's home ------------------------------------------------
    home, home_files = _plan_home(policy, use_ns, read + write, tmpfs, run_cwd, program_uid, program_gid,
                                  refusals, open_source)
    if home is not None:
        enforced["home"] = {
            "path": home,
            "kind": "tmpfs (private to the run)" if use_ns else "directory (private to the uid, kept between runs)",
            "files": [target for _, target in home_files],
        }

    # -- pathname unix sockets (the network namespace does not scope them) ----
    abi = landlock.abi()
    unix_mode = landlock.unix_socket_mechanism(abi, network, use_ns, has_init=not for_preexec)
    enforced["unix_sockets"] = unix_mode
    if sockets:
        enforced["unix_sockets_allowed"] = list(sockets)
        if unix_mode in ("seccomp-no-sockets", "seccomp-no-unix-sockets"):
            refusals.refuse(
                "unix_sockets: " + ("without namespaces, network none refuses every socket"
                                    if unix_mode == "seccomp-no-sockets" else
                                    "preexec_fn has no init to supervise connect(), so unix sockets are refused")
                + "; use isolate.run/Popen with namespaces, or network='host'"
            )
    if unix_mode == "supervisor":
        from ... import seccomp as seccomp_mod

        spec = ",".join(
            ["n" if network == "none" else "l"]
            + [str(seccomp_mod.syscall_number(n)) for n in ("connect", "socket", "socketpair")]
            + [f"{dev}:{ino}" for dev, ino in socket_ids]
        )
        plan.supervise = cstr(spec)
        scope = _yama_ptrace_scope()
        if scope >= 2:
            # The init needs ptrace-class access to take the program's socket:
            # every connect() would be refused (closed, never open).
            refusals.warnings.append(
                f"Yama ptrace_scope is {scope} here: the init cannot supervise connect(), so every connect() of "
                "the program will fail with EACCES; use network='host', or a kernel with Landlock ABI 9"
            )
    resolve_unix = landlock.resolve_unix_right(abi) if unix_mode == "landlock" else 0

    # -- mounts ------------------------------------------------------------
    if use_ns:
        write_trees: list[tuple[str, int]] = []
        for path in write:
            fd = -1
            if root_caller and write_route == "idmapped":
                # The tree is opened per run (or by the pre-exec hook itself):
                # attaching it consumes it. The namespace is made once, here.
                userns_fd = _idmap_userns(program_uid, program_gid)
                if for_preexec:
                    plan.idmap_userns_fd = userns_fd
                fd = mounts.IDMAP
            write_trees.append((path, fd))
        bind_trees = [(source, target, readonly,
                       mounts.IDMAP if not readonly and root_caller and write_route == "idmapped" else -1)
                      for source, target, readonly in binds]
        if any(fd == mounts.IDMAP for *_, fd in bind_trees):
            userns_fd = _idmap_userns(program_uid, program_gid)
            if for_preexec:
                plan.idmap_userns_fd = userns_fd
        tmpfs_size, shm_size = policy.limits.tmpfs_sizes()
        tmpfs_options = "mode=1777," + mounts.tmpfs_bounds(tmpfs_size)
        enforced["tmpfs_size"] = {"tmpfs": tmpfs_size, "/dev/shm": shm_size}
        home_mount = None
        if home is not None:
            home_options = f"mode=0700,uid={program_uid},gid={program_gid}," + mounts.tmpfs_bounds(tmpfs_size)
            home_mount = mounts.Home(home, home_options if home not in tmpfs else "", home_files)
        mount_plan = mounts.plan_root(read, write_trees, tmpfs, tmpfs_options,
                                      source_fds if os.path.isdir("/proc/self/fd") else None, home_mount,
                                      shm_options="mode=1777," + mounts.tmpfs_bounds(shm_size),
                                      binds=bind_trees)
        steps = mount_plan.steps
        cmounts = ffi.new("struct iso_mount[]", max(len(steps), 1))
        keep.append(cmounts)
        for i, step in enumerate(steps):
            cmounts[i].kind = step.kind
            cmounts[i].flags = step.flags
            cmounts[i].fd = step.fd
            cmounts[i].mode = step.mode
            cmounts[i].source = cstr(step.source) if step.source else ffi.NULL
            cmounts[i].target = cstr(mounts.NEWROOT + step.target)
        idmap_steps = [(i, step.source) for i, step in enumerate(steps)
                       if step.kind == lib.ISO_MOUNT_MOVE and root_caller and not for_preexec]
        plan.staging = cstr(mounts.STAGING)
        plan.mounts = cmounts
        plan.n_mounts = len(steps)
        enforced["filesystem"] = ["mount-namespace"] + (["landlock"] if abi else [])
        enforced["root"] = "built (pivot_root)"
        if root_caller and (write or rw_sources):
            enforced["write_ownership"] = write_route
        if binds:
            enforced["binds"] = [f"{source}:{target}:{'ro' if ro else 'rw'}" for source, target, ro in binds]
    else:
        enforced["filesystem"] = ["landlock"] if abi else []
        idmap_steps = []
        if root_caller and write:
            enforced["write_ownership"] = write_route

    # -- Landlock ----------------------------------------------------------
    if abi:
        rules: list[tuple[str, int]] = []
        rule_fds: dict[int, int] = {}

        def grant(path: str, rights: int) -> None:
            real = os.path.realpath(path)
            fd = source_fds.get(real, -1)
            if fd < 0:
                try:
                    fd = os.open(real, os.O_PATH | os.O_CLOEXEC)
                except OSError as exc:
                    raise PolicyError(f"{path}: cannot open it to grant it: {exc.strerror}") from None
                static_fds.append(fd)
            if not os.path.isdir(real):
                rights &= landlock.FILE_RIGHTS
            rule_fds[len(rules)] = fd
            rules.append((real, rights))

        # Under ABI 9 the lookup of a unix socket is a right of its own:
        # write grants, tmpfs mounts and named sockets get it, read grants not.
        for path in read:
            real = grants.host_symlinks(path)[1]
            grant(real, landlock.read_rights(abi) | (resolve_unix if real in sockets else 0))
        for path in write:
            grant(grants.host_symlinks(path, "write")[1], landlock.write_rights(abi) | resolve_unix)
        # A rule is on the inode: it holds wherever a bind shows it.
        for source, _, readonly in binds:
            grant(source, landlock.read_rights(abi) if readonly else landlock.write_rights(abi) | resolve_unix)
        if use_ns:
            for path in tmpfs:
                rules.append((path, landlock.write_rights(abi) | resolve_unix))
            if home is not None and home not in tmpfs:
                rules.append((home, landlock.write_rights(abi) | resolve_unix))
            rules.append(("/dev", landlock.device_rights(abi)))
            rules.append(("/dev/shm", landlock.write_rights(abi) | resolve_unix))
            rules.append(("/proc", landlock.proc_rights(abi)))
            # The root is the sandbox's own read-only tmpfs: listing it shows
            # only what was granted.
            rules.append(("/", landlock.LANDLOCK_ACCESS_FS_READ_DIR))
            # A kept sandbox's program is the init executable (execserver.c),
            # exec'd through the parent's descriptor. No path inside leads to
            # it and the descriptor is closed at exec: only that exec uses this.
            rule_fds[len(rules)] = init_fd()
            rules.append((INIT_PATH, landlock.LANDLOCK_ACCESS_FS_EXECUTE | landlock.LANDLOCK_ACCESS_FS_READ_FILE))
        else:
            if home is not None:
                grant(home, landlock.write_rights(abi))
            grant("/dev/null", landlock.device_rights(abi) & landlock.FILE_RIGHTS)
            # /proc, read-only: Landlock's own ptrace rule already keeps the
            # program out of the memory, environment and descriptors of every
            # process outside its domain; what remains is what ps shows.
            grant("/proc", landlock.proc_rights(abi))
        deny_tcp = network == "none" or (not use_ns and network != "host")
        crules = ffi.new("struct iso_landlock_rule[]", max(len(rules), 1))
        keep.append(crules)
        for i, (path, rights) in enumerate(rules):
            crules[i].path = cstr(path)
            crules[i].access = rights
            crules[i].fd = rule_fds.get(i, -1)
        plan.landlock_abi = abi
        plan.landlock_handled_fs = landlock.handled_fs(abi, resolve_unix=bool(resolve_unix))
        plan.landlock_handled_net = landlock.handled_net(abi, deny_tcp)
        plan.landlock_scoped = landlock.scoped(abi)
        plan.landlock_rules = crules
        plan.n_landlock_rules = len(rules)
        enforced["landlock"] = abi
        if plan.landlock_handled_net:
            enforced["landlock_net"] = "tcp bind/connect denied"
        if plan.landlock_scoped:
            enforced["landlock_scope"] = ["signal", "abstract-unix-socket"]
    else:
        enforced["landlock"] = None
        if not use_ns:
            refusals.refuse("filesystem: without namespaces, Landlock is needed and this kernel has none")
    if not use_ns and network == "none":
        enforced["network"] = "landlock-tcp+seccomp-sockets"
    elif not use_ns and network == "loopback":
        refusals.refuse("network: loopback-only needs a network namespace (namespaces=true)")
    elif not use_ns:
        enforced["network"] = "host"
        # Landlock (up to ABI 7) does not govern connect() on a socket file.
        enforced["unix_sockets"] = "reachable by path (no mount namespace)"

    # -- seccomp -----------------------------------------------------------
    deny_sockets = not use_ns and network == "none"
    # What a root caller's program creates in an idmapped writable path is
    # root's on disk: no set-user/group-ID bit may be set there.
    deny_setid = use_ns and root_caller and bool(write or rw_sources)
    seccomp_unix = {"supervisor": "supervise", "seccomp-no-unix-sockets": "deny"}.get(unix_mode, "")
    _apply_seccomp(policy, plan, keep, enforced, refusals, deny_sockets, deny_setid,
                   notify=use_ns and not for_preexec, unix_sockets=seccomp_unix, deny_host_reach=not use_ns)
    if not use_ns:
        _report_host_reach(plan, enforced, refusals, network)
    observed = denials_observed(use_ns, bool(plan.seccomp_notify), abi)
    if enforced.get("seccomp") is None:
        observed.pop("seccomp")
    if for_preexec and not use_ns and policy.limits.wall_seconds is not None:
        refusals.refuse("wall_seconds: preexec_fn without namespaces has no init to keep the clock; "
                        "use isolate.run/Popen, or namespaces=true")

    # -- limits (the cgroup is made per run) ---------------------------------
    limit_cpu: float | None = None
    rlimits: list[tuple[int, int, int]] = [(resource.RLIMIT_CORE, 0, 0)]
    limits = policy.limits
    open_files, file_size, cpu_seconds = (limits.value(n) for n in ("open_files", "file_size", "cpu_seconds"))
    if open_files is not None:
        rlimits.append((resource.RLIMIT_NOFILE, int(open_files), int(open_files)))
        enforced["open_files"] = "rlimit"
    if file_size is not None:
        rlimits.append((resource.RLIMIT_FSIZE, int(file_size), int(file_size)))
        enforced["file_size"] = "rlimit"
    if cpu_seconds is not None:
        seconds = max(1, int(-(-cpu_seconds // 1)))
        rlimits.append((resource.RLIMIT_CPU, seconds, seconds + 1))
        enforced["cpu_seconds"] = "rlimit (per process)"
        limit_cpu = cpu_seconds
    if limits.wall_seconds is not None:
        plan.wall_ms = milliseconds_up(limits.value("wall_seconds") or 0.0)
        enforced["wall_seconds"] = "init"
    enforced["session"] = "new" if policy.new_session else "inherited"
    plan.init_fd = init_fd()
    enforced["init"] = "isolate-init"
    plan.cwd = cstr(os.path.abspath(policy.cwd) if policy.cwd else run_cwd)
    if for_preexec and not policy.cwd:
        plan.cwd = ffi.NULL  # the hook keeps the directory subprocess chose

    stamps = []
    for path in read + write + [source for source, _, _ in binds]:
        info = os.stat(path)
        stamps.append((path, (info.st_dev, info.st_ino)))
    return _Static(
        plan=plan, keep=keep, enforced=enforced, warnings=refusals.warnings, rlimits=rlimits,
        cgroup_needs=_cgroup_needs(policy), limit_cpu_seconds=limit_cpu, idmap_steps=idmap_steps,
        program_uid=program_uid, program_gid=program_gid, run_cwd=run_cwd, home=home, observed=observed,
        tmpdir=_no_ns_tmpdir(home, program_uid, program_gid) if home and not use_ns else None,
        granted=tuple(dict.fromkeys(read + write + [os.path.realpath(p) for p in read + write]
                                    + [target for _, target, _ in binds])), stamps=stamps,
        fds=static_fds,
    )


def prepare(
    policy: Policy,
    args: Sequence[str],
    *,
    executable: str | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    stdio: tuple[int, int, int] = (-1, -1, -1),
    pass_fds: Sequence[int] = (),
    for_preexec: bool = False,
    program_fd: int = -1,
) -> Prepared:
    """The plan for one run of ``args``: the cached static part plus what is this run's own.

    ``program_fd``: exec that executable (an O_PATH descriptor) with ``args``
    as its argv, instead of looking ``args[0]`` up (a kept sandbox's server).
    """
    run_cwd = os.path.abspath(cwd) if cwd is not None else os.getcwd()
    static = _static_for(policy, run_cwd, for_preexec)
    keep: list[Any] = [static]
    close_after: list[int] = []
    enforced = dict(static.enforced)
    refusals = _Refusals(policy.best_effort)
    refusals.warnings = list(static.warnings)

    def cstr(text: str | bytes) -> Any:
        data = ffi.new("char[]", os.fsencode(text))
        keep.append(data)
        return data

    plan = ffi.new("struct iso_plan *")
    keep.append(plan)
    ffi.memmove(plan, static.plan, ffi.sizeof("struct iso_plan"))

    # -- idmapped trees are consumed by each sandbox ---------------------------
    if static.idmap_steps:
        cmounts = ffi.new("struct iso_mount[]", plan.n_mounts)
        keep.append(cmounts)
        ffi.memmove(cmounts, plan.mounts, ffi.sizeof("struct iso_mount") * plan.n_mounts)
        userns_fd = _idmap_userns(static.program_uid, static.program_gid)
        for index, path in static.idmap_steps:
            fd = int(lib.iso_open_idmapped_tree(os.fsencode(path), userns_fd))
            if fd < 0:
                err = ffi.errno
                for opened in close_after:
                    os.close(opened)
                # ``path`` may be /proc/self/fd/N: name the directory as granted.
                target = os.fsdecode(ffi.string(cmounts[index].target))[len(mounts.NEWROOT):]
                raise UnsupportedError(
                    f"write: {target}: cannot give the program (uid {static.program_uid}) ownership through an "
                    f"idmapped mount: {os.strerror(err)} (it worked when the policy was prepared: the directory "
                    "or its file system changed since)"
                )
            close_after.append(fd)
            cmounts[index].fd = fd
        plan.mounts = cmounts

    # -- limits over the tree -------------------------------------------------
    rlimits = list(static.rlimits)
    prepared_cgroup = None
    needs = static.cgroup_needs
    if needs - {"cpuacct"} or (needs and not for_preexec):
        prepared_cgroup = _prepare_cgroup(policy, needs, plan, enforced, refusals, rlimits, for_preexec)
    crl = ffi.new("struct iso_rlimit[]", len(rlimits))
    keep.append(crl)
    for i, (res, soft, hard) in enumerate(rlimits):
        crl[i].resource = res
        crl[i].soft = soft
        crl[i].hard = hard
    plan.rlimits = crl
    plan.n_rlimits = len(rlimits)
    limit_cpu = static.limit_cpu_seconds

    # -- the program ---------------------------------------------------------
    program_env = program_environment(policy, env, static.home)
    if static.tmpdir and "TMPDIR" not in program_env:
        program_env["TMPDIR"] = static.tmpdir
    if "PATH" not in policy.env and not (env and any(os.fsdecode(k) == "PATH" for k in env)):
        # The caller's PATH, reduced to the directories that exist inside.
        program_env["PATH"] = reduced_path(program_env["PATH"], static.granted)
    if not for_preexec and args and program_fd < 0:
        check_command(os.fsdecode(executable) if executable else os.fsdecode(args[0]), program_env["PATH"],
                      static.granted, run_cwd)
    envp = ffi.new("char *[]", len(program_env) + 1)
    keep.append(envp)
    for i, (name, value) in enumerate(program_env.items()):
        envp[i] = cstr(f"{name}={value}")
    args = [os.fsdecode(a) for a in args]
    if not args:
        raise PolicyError("command: nothing to run; give a command", "command")
    argv = ffi.new("char *[]", len(args) + 1)
    keep.append(argv)
    for i, arg in enumerate(args):
        if "\0" in arg:
            raise PolicyError("command: an argument holds a NUL byte", "command")
        argv[i] = cstr(arg)
    plan.argv = argv
    plan.envp = envp
    plan.file = cstr(os.fsdecode(executable) if executable else args[0])
    plan.program_fd = program_fd
    plan.search_path = cstr(program_env.get("PATH", DEFAULT_PATH))
    for i in range(3):
        plan.stdio[i] = stdio[i]
    fds = sorted({int(fd) for fd in pass_fds if int(fd) > 2})
    if len(fds) > 64:
        raise PolicyError("pass_fds: at most 64 descriptors can be passed on", "pass_fds")
    keep_fds = ffi.new("int32_t[]", max(len(fds), 1))
    keep.append(keep_fds)
    for i, fd in enumerate(fds):
        keep_fds[i] = fd
    plan.keep_fds = keep_fds
    plan.n_keep_fds = len(fds)

    # -- the init's report ----------------------------------------------------
    status_r = -1
    if for_preexec:
        plan.status_fd = -1
    else:
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        plan.status_fd = status_w
        close_after.append(status_w)
    enforced["fds"] = "closed above 2" + (f" except {fds}" if fds else "")

    prepared = Prepared(
        plan=plan,
        enforced=enforced,
        warnings=refusals.warnings,
        status_fd=status_r,
        cgroup=prepared_cgroup,
        limit_cpu_seconds=limit_cpu,
        observed=static.observed,
        _keep=keep,
        _close_after_spawn=close_after,
    )
    return prepared


def _apply_seccomp(
    policy: Policy,
    plan: Any,
    keep: list[Any],
    enforced: dict[str, Any],
    refusals: _Refusals,
    deny_sockets: bool,
    deny_setid: bool,
    notify: bool,
    unix_sockets: str = "",
    deny_host_reach: bool = False,
) -> None:
    if policy.seccomp == "none" and not (deny_sockets or deny_setid or unix_sockets or deny_host_reach):
        enforced["seccomp"] = None
        return
    # Compiled in this process (and kept in seccomp's in-memory cache), never
    # read back from disk: any file of the caller's may have been written by
    # an earlier sandbox granted that directory, and a filter loaded from it
    # would be whatever that sandbox wanted.
    try:
        from ... import seccomp

        compiled: Any = seccomp.compile_filter(policy.seccomp, notify=notify, deny_inet_sockets=deny_sockets,
                                               deny_setid=deny_setid, unix_sockets=unix_sockets,
                                               deny_host_reach=deny_host_reach)
    except UnsupportedError as exc:
        if deny_setid:
            raise UnsupportedError(
                f"a root caller's writable paths need seccomp to forbid set-user-ID files, and it is not "
                f"available: {exc}; run as a regular user or grant no writable path"
            ) from None
        if unix_sockets:
            # Nothing else keeps the program from the host's unix sockets.
            plan.supervise = ffi.NULL
            enforced["unix_sockets"] = None
            refusals.refuse(f"unix_sockets: keeping the program from host daemons' unix sockets under network "
                            f"none/loopback needs seccomp here, and it is not available: {exc}")
        refusals.refuse(str(exc))
        enforced["seccomp"] = None
        return
    if compiled is None:
        enforced["seccomp"] = None
        return
    buffer = ffi.from_buffer(compiled.bpf)
    keep.extend([compiled, buffer])
    plan.seccomp_filter = buffer
    plan.seccomp_len = len(compiled.bpf) // 8
    plan.seccomp_notify = 1 if notify and (compiled.notify or unix_sockets == "supervise") else 0
    if plan.seccomp_notify:
        # The init answers each notification with the errno the plain filter
        # would have returned; "-1" carries the profile's default errno.
        entries = sorted(compiled.notify_errnos.items())
        if compiled.notify_default_errno is not None:
            entries.append((-1, compiled.notify_default_errno))
        table = ",".join(f"{nr}:{err}" for nr, err in entries)
        text = ffi.new("char[]", table.encode())
        keep.append(text)
        plan.seccomp_errnos = text
    enforced["seccomp"] = compiled.profile
    if deny_sockets:
        enforced["seccomp_sockets"] = "socket() refused (socketpair(AF_UNIX) allowed)"
    if deny_setid:
        enforced["setid_files"] = "refused (seccomp)"
    if deny_host_reach:
        enforced["host_ipc"] = "refused (seccomp): SysV IPC, POSIX message queues, keyrings"
        enforced["other_processes"] = "limits and priorities refused (seccomp)"


def _report_host_reach(plan: Any, enforced: dict[str, Any], refusals: _Refusals, network: str) -> None:
    """Without namespaces: say how signals and abstract unix sockets toward the host are kept back.

    Landlock scoping (ABI 6) confines both; below it a program can signal
    every process of its uid, and reach abstract sockets when the network is
    the host's. The caller gave up the PID namespace explicitly (namespaces=
    false), so this is reported and warned about, not refused.
    """
    if "host_ipc" not in enforced:  # seccomp refused under best effort: the warning is there already
        enforced["host_ipc"] = None
    if plan.landlock_scoped:
        enforced["signals"] = enforced["abstract_unix_sockets"] = "landlock-scope"
        return
    enforced["abstract_unix_sockets"] = (
        "socket() refused (seccomp)" if network == "none" and "seccomp_sockets" in enforced
        else "reachable (no network namespace, Landlock below ABI 6)"
    )
    enforced["signals"] = "host processes of the same uid (no PID namespace, Landlock below ABI 6)"
    refusals.warnings.append(
        "namespaces=false: this kernel's Landlock cannot scope signals (ABI 6, Linux 6.12): the program can "
        "signal every process of its uid; use namespaces to prevent it"
    )

def _prepare_cgroup(
    policy: Policy,
    needs: set[str],
    plan: Any,
    enforced: dict[str, Any],
    refusals: _Refusals,
    rlimits: list[tuple[int, int, int]],
    for_preexec: bool,
) -> Any:
    limits = policy.limits
    try:
        from ... import cgroup

        run_cgroup = cgroup.RunCgroup.create(limits, need=needs)
    except (ImportError, UnsupportedError) as exc:
        hard = needs - {"cpuacct"}
        if hard:
            refusals.refuse(str(exc) if isinstance(exc, UnsupportedError) else f"cgroups: {exc}")
        memory, pids = limits.value("memory"), limits.value("pids")
        if memory is not None:
            rlimits.append((resource.RLIMIT_AS, int(memory), int(memory)))
            enforced["memory"] = "rlimit-as (per process, best effort)"
        if pids is not None:
            rlimits.append((resource.RLIMIT_NPROC, int(pids), int(pids)))
            enforced["pids"] = "rlimit-nproc (per user, best effort)"
        return None
    if for_preexec:
        # The hook cannot join a cgroup for the process subprocess is about to exec.
        run_cgroup.remove()
        refusals.refuse("memory/pids/cpus limits cover the tree only with isolate.run/Popen, not preexec_fn")
        return None
    fds = run_cgroup.procs_fds()
    for i, fd in enumerate(fds[:8]):
        plan.cgroup_procs_fds[i] = fd
    enforced.update(run_cgroup.enforced())
    return run_cgroup


def spawn(prepared: Prepared, args: Sequence[str]) -> int:
    """Start the sandbox; returns the pid of its init. Raises SetupError and friends."""
    failure = ffi.new("struct iso_failure *")
    try:
        pid = lib.iso_spawn(prepared.plan, failure)
    finally:
        prepared.close_child_side()
    if pid < 0:
        if prepared.status_fd >= 0:
            os.close(prepared.status_fd)
            prepared.status_fd = -1
        raise failure_to_error(prepared, failure, args)
    return int(pid)


def failure_to_error(prepared: Prepared, failure: Any, args: Sequence[str]) -> Exception:
    step, err, index = int(failure.step), int(failure.err), int(failure.index)
    plan = prepared.plan
    name = step_name(step)
    if step == lib.ISO_STEP_EXEC:
        program = ffi.string(plan.file).decode(errors="replace")
        if err == errno_mod.ENOENT and "/" in program and os.path.exists(program):
            return CommandNotFoundError(
                err, f"{program}: exists, but its interpreter or dynamic loader is not in the sandbox "
                "(grant /lib, /lib64 or the interpreter's directory with read=)", program,
            )
        if err in (errno_mod.ENOENT, errno_mod.ENOTDIR):
            return CommandNotFoundError(
                err, f"{program}: command not found inside the sandbox (is its directory granted with read=?)",
                program,
            )
        if err == errno_mod.EACCES:
            return CommandNotExecutableError(
                err, f"{program}: permission denied inside the sandbox (not executable, or not granted)", program
            )
        return CommandNotExecutableError(err, f"{program}: cannot execute: {os.strerror(err)}", program)
    detail = ""
    if step in (lib.ISO_STEP_MOUNT_DIR, lib.ISO_STEP_MOUNT_BIND, lib.ISO_STEP_MOUNT_TMPFS,
                lib.ISO_STEP_MOUNT_SYMLINK, lib.ISO_STEP_MOUNT_MOVE, lib.ISO_STEP_MOUNT_READONLY,
                lib.ISO_STEP_MOUNT_PROC, lib.ISO_STEP_MOUNT_DEVPTS) and 0 <= index < plan.n_mounts:
        detail = ffi.string(plan.mounts[index].target).decode()
        detail = detail[len(mounts.NEWROOT):] or "/"
    elif step == lib.ISO_STEP_LANDLOCK and 0 <= index < plan.n_landlock_rules:
        detail = ffi.string(plan.landlock_rules[index].path).decode()
    elif step == lib.ISO_STEP_RLIMIT and 0 <= index < plan.n_rlimits:
        detail = f"resource {plan.rlimits[index].resource}"
    elif step == lib.ISO_STEP_CHDIR and plan.cwd != ffi.NULL:
        detail = ffi.string(plan.cwd).decode()
        return SetupError(
            f"sandbox setup failed at chdir: {detail}: {os.strerror(err)}; the working directory must be "
            "inside a granted path (grant it with write= or read=, or set cwd=)",
            name, err, detail,
        )
    where = f" ({detail})" if detail else ""
    if step == lib.ISO_STEP_MOUNT_PROC and err in (errno_mod.EPERM, errno_mod.EACCES):
        return SetupError(f"sandbox setup failed at {name}{where}: {os.strerror(err)}: "
                          + hostinfo.proc_mount_advice(), name, err, detail)
    return SetupError(
        f"sandbox setup failed at {name}{where}: {os.strerror(err)}; run `isolate-run doctor` to see what this "
        "host can enforce",
        name, err, detail,
    )
