"""The Docker backend: a policy mapped onto a container of the local engine.

The engine is reached through the Docker SDK for Python (the Engine API over
``DOCKER_HOST``, a unix socket by default); no CLI output is parsed. Two ways
to run:

* one-shot, ``run(args, policy=...)``: create a container, attach its stdin,
  stdout and stderr, start it, wait, remove it;
* kept, through ``isolate.sandbox.Sandbox``: ``ensure_kept`` keeps a container
  alive (reused while its configuration hash matches, recreated when it does
  not) and ``exec_run`` runs each command in it.

Every policy field is either mapped onto the container or refused with
``UnsupportedError`` (warned about instead under ``best_effort``). Nothing is
ever pulled: a missing image is an error that says how to get it.

The mapping (``build_spec``)::

    always             read-only root, CapDrop ALL, no-new-privileges, private IPC,
                       docker-init as PID 1 (when the engine has it), log driver none
    read=              host paths bound read-only at the same path, except the
                       default system paths (/usr /bin /sbin /lib /lib64 /etc):
                       the image is the system
    write=             host paths bound read-write at the same path
    tmpfs=             Tmpfs "rw,exec,nosuid,nodev,mode=1777"
    home, home_files   a Tmpfs at home, HOME pointing at it; files bound read-only into it
    network            loopback -> NetworkMode none (a private lo, up); none -> the
                       same, plus socket() refused for every family but AF_UNIX in
                       the container's seccomp profile; host -> host; Egress -> refused
    seccomp            default/strict -> isolate.seccomp.oci_profile(mode) as JSON;
                       FILE -> the file's JSON; none -> unconfined
    limits.memory      Memory = MemorySwap
    limits.pids        PidsLimit
    limits.cpus        NanoCpus
    limits.cpu_seconds ulimit cpu (soft ceil(s), hard +1) and a tree-wide watch of
                       the engine's CPU stats that kills the container
    limits.open_files  ulimit nofile;  limits.file_size: ulimit fsize
    limits.wall_seconds  isolate kills the container at the deadline
    env, keep_env      Env (kept sandboxes: per exec)
    cwd                WorkingDir (default: the run's cwd on the host)
    uid, gid           User; default 65534:65534 for a root caller, else the caller's
    image              policy.image, $ISOLATE_DOCKER_IMAGE, DEFAULT_IMAGE
    die_with_parent    a watchdog process removes/kills the container if the caller dies
    namespaces, new_session  nothing to do: a container always has its own
                       namespaces and no controlling terminal
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import hashlib
import json
import locale
import os
import re
import secrets
import select
import signal as signal_mod
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Union

from ...errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    IsolationError,
    PolicyError,
    SetupError,
    UnsupportedError,
)
from ...grants import Grant, check_unchanged, read_input_file, resolve_grant
from ...policy import DEFAULT_READ, Egress, Policy
from ...report import Report, status_for

#: Environment variable naming the image used when a policy names none.
IMAGE_ENV = "ISOLATE_DOCKER_IMAGE"
#: The image used when neither the policy nor ``$ISOLATE_DOCKER_IMAGE`` names one.
DEFAULT_IMAGE = "debian:stable-slim"
#: Label carried by every container this backend creates.
LABEL = "isolate.sandbox"
LABEL_CONFIG_HASH = "isolate.config-hash"
LABEL_SPEC_HASH = "isolate.spec-hash"
LABEL_NAME = "isolate.name"
LABEL_KIND = "isolate.kind"
#: Prefix of the container names of kept sandboxes.
KEPT_PREFIX = "isolate-"
#: Prefix of the container names of one-shot runs (a random suffix follows).
RUN_PREFIX = "isolate-run-"
#: What a kept container runs between commands (the image must have ``sleep``).
KEEPER_COMMAND: tuple[str, ...] = ("sleep", "infinity")
#: The unprivileged uid/gid a root caller's program runs as (SPEC "Who the program is").
NOBODY = 65534
#: Seconds an engine request may take before it counts as unanswered.
ENGINE_TIMEOUT = 60.0
#: Options of every tmpfs: writable, executable, private, world-writable with the sticky bit.
TMPFS_OPTIONS = "rw,exec,nosuid,nodev,mode=1777"

Args = Union[str, bytes, "os.PathLike[str]", Sequence[Union[str, bytes, "os.PathLike[str]"]]]
CompletedProcess = subprocess.CompletedProcess


# --------------------------------------------------------------------------
# The engine


_client_lock = threading.Lock()
_clients: dict[tuple[str, ...], Any] = {}
_engines: dict[int, EngineInfo] = {}


def _env_key() -> tuple[str, ...]:
    return tuple(os.environ.get(name, "") for name in ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"))


def engine_address() -> str:
    """Where the engine is looked for: ``$DOCKER_HOST`` or the default unix socket."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def client() -> Any:
    """The ``docker.DockerClient`` for the current ``DOCKER_HOST``, made once per process.

    Raises ``UnsupportedError`` when the SDK is missing or no engine answers.
    """
    try:
        import docker
    except ImportError:
        raise UnsupportedError(
            "the docker backend needs the Python package 'docker'; install it (pip install docker)"
        ) from None
    key = _env_key()
    with _client_lock:
        found = _clients.get(key)
        if found is not None:
            return found
        try:
            made = docker.from_env(timeout=int(ENGINE_TIMEOUT))
            made.api.ping()
        except Exception as exc:  # the SDK raises DockerException, requests errors, OSError
            raise UnsupportedError(
                f"no Docker engine answers at {engine_address()} ({_short(exc)}); "
                "start dockerd or point DOCKER_HOST at a running engine"
            ) from None
        _clients[key] = made
        return made


@dataclass(frozen=True)
class EngineInfo:
    """What the engine says it can do (from ``/version`` and ``/info``)."""

    version: str
    api_version: str
    init: bool
    seccomp: bool
    memory_limit: bool
    swap_limit: bool
    pids_limit: bool
    cpu_cfs: bool
    cgroup_version: str


def engine_info(docker_client: Any | None = None) -> EngineInfo:
    """The capabilities of the engine, asked once per client."""
    cl = docker_client if docker_client is not None else client()
    found = _engines.get(id(cl))
    if found is not None:
        return found
    with _engine_errors("ask the engine what it supports"):
        version = cl.api.version()
        info = cl.api.info()
    options = " ".join(info.get("SecurityOptions") or [])
    made = EngineInfo(
        version=str(version.get("Version", "?")),
        api_version=str(version.get("ApiVersion", "?")),
        init=bool(info.get("InitBinary")),
        seccomp="seccomp" in options,
        memory_limit=bool(info.get("MemoryLimit")),
        swap_limit=bool(info.get("SwapLimit")),
        pids_limit=bool(info.get("PidsLimit")),
        cpu_cfs=bool(info.get("CpuCfsQuota")),
        cgroup_version=str(info.get("CgroupVersion", "1")),
    )
    _engines[id(cl)] = made
    return made


def available() -> tuple[bool, str]:
    """(True, "Docker Engine 20.10.24, API 1.41 at unix:///...") or (False, the reason)."""
    try:
        info = engine_info()
    except IsolationError as exc:
        return False, str(exc)
    return True, f"Docker Engine {info.version}, API {info.api_version} at {engine_address()}"


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "explanation", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextlib.contextmanager
def _engine_errors(step: str) -> Iterator[None]:
    """Turn SDK and transport errors into isolate errors naming ``step``."""
    try:
        yield
    except IsolationError:
        raise
    except Exception as exc:
        import docker.errors
        import requests.exceptions

        if isinstance(exc, docker.errors.ImageNotFound):
            raise UnsupportedError(
                f"docker: cannot {step}: the image is not in the engine and isolate never pulls ({_short(exc)}); "
                "build or pull it first, or choose another with --image / ISOLATE_DOCKER_IMAGE"
            ) from None
        if isinstance(exc, (requests.exceptions.ConnectionError, ConnectionError)):
            raise UnsupportedError(
                f"docker: cannot {step}: the engine at {engine_address()} stopped answering ({_short(exc)}); "
                "check that dockerd is running"
            ) from None
        if isinstance(exc, docker.errors.APIError):
            raise SetupError(f"docker: cannot {step}: {_short(exc)}", step="docker", detail=step) from None
        if isinstance(exc, (docker.errors.DockerException, requests.exceptions.RequestException, OSError)):
            raise SetupError(f"docker: cannot {step}: {_short(exc)}", step="docker", detail=step) from None
        raise


# --------------------------------------------------------------------------
# The policy mapped onto a container


@dataclass(frozen=True)
class BindMount:
    """A host path bound inside the container; ``grant`` is how it was resolved (isolate.grants)."""

    source: str
    target: str
    read_only: bool
    grant: Grant | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ContainerSpec:
    """A policy resolved for one engine and one working directory: the container to make.

    ``environment`` is applied per command (kept sandboxes pass it to each
    exec), so it is not part of ``spec_hash``.
    """

    image: str
    uid: int
    gid: int
    working_dir: str
    environment: tuple[tuple[str, str], ...]
    mounts: tuple[BindMount, ...]
    tmpfs: tuple[str, ...]
    tmpfs_size: int
    shm_size: int
    network_mode: str
    security_opt: tuple[str, ...]
    ulimits: tuple[tuple[str, int, int], ...]
    memory: int | None
    pids: int | None
    nano_cpus: int | None
    cpu_seconds: float | None
    wall_seconds: float | None
    file_size: int | None
    init: bool
    die_with_parent: bool
    config_hash: str
    enforced: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def user(self) -> str:
        return f"{self.uid}:{self.gid}"

    def verify_binds(self) -> None:
        """Refuse a bind whose host path now leads elsewhere than when the spec was built.

        The engine resolves bind sources by path at every start (a kept
        container's restart included): called before each create and start.
        """
        for m in self.mounts:
            if m.grant is not None:
                check_unchanged(m.grant, "read" if m.read_only else "write")

    def host_config(self) -> dict[str, Any]:
        """Keyword arguments of ``APIClient.create_host_config``, made just before the container is.

        Each bind's host path is checked again here: a path swapped for a link
        (or another file) since the spec was built is refused, never bound.
        """
        from docker.types import Mount, Ulimit

        self.verify_binds()

        config: dict[str, Any] = {
            "read_only": True,
            "network_mode": self.network_mode,
            "cap_drop": ["ALL"],
            "security_opt": list(self.security_opt),
            "ipc_mode": "private",
            "init": self.init,
            "log_config": {"Type": "none", "Config": {}},
            "tmpfs": {path: f"{TMPFS_OPTIONS},size={self.tmpfs_size}" for path in self.tmpfs},
            "shm_size": self.shm_size,
            "mounts": [Mount(m.target, m.source, type="bind", read_only=m.read_only) for m in self.mounts],
            "ulimits": [Ulimit(name=name, soft=soft, hard=hard) for name, soft, hard in self.ulimits],
        }
        if self.memory is not None:
            config["mem_limit"] = self.memory
            config["memswap_limit"] = self.memory
        if self.pids is not None:
            config["pids_limit"] = self.pids
        if self.nano_cpus is not None:
            config["nano_cpus"] = self.nano_cpus
        return config

    def spec_hash(self) -> str:
        """sha256 of everything that shapes the container (not the per-command environment)."""
        data = {
            "image": self.image,
            "user": self.user,
            "working_dir": self.working_dir,
            "mounts": [[m.source, m.target, m.read_only] for m in self.mounts],
            "tmpfs": list(self.tmpfs),
            "tmpfs_size": [self.tmpfs_size, self.shm_size],
            "network": self.network_mode,
            "security_opt": list(self.security_opt),
            "ulimits": [list(u) for u in self.ulimits],
            "memory": self.memory,
            "pids": self.pids,
            "nano_cpus": self.nano_cpus,
            "init": self.init,
            "config_hash": self.config_hash,
        }
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def labels(self, kind: str, name: str | None = None) -> dict[str, str]:
        labels = {
            LABEL: "1",
            LABEL_CONFIG_HASH: self.config_hash,
            LABEL_SPEC_HASH: self.spec_hash(),
            LABEL_KIND: kind,
        }
        if name is not None:
            labels[LABEL_NAME] = name
        return labels


def default_image() -> str:
    """``$ISOLATE_DOCKER_IMAGE``, else ``DEFAULT_IMAGE``."""
    return os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE


def program_ids(policy: Policy) -> tuple[int, int]:
    """(uid, gid) of the program: SPEC "Who the program is".

    ``policy.uid``/``gid`` when given; otherwise 65534 for a root caller, the
    caller's own ids for anyone else.
    """
    root = os.geteuid() == 0
    uid = policy.uid if policy.uid is not None else (NOBODY if root else os.geteuid())
    gid = policy.gid if policy.gid is not None else (NOBODY if root else os.getegid())
    return uid, gid


def seccomp_option(mode: str, no_network: bool = False, unix_guard: bool = False) -> tuple[str, str]:
    """(security option, report value) for a policy's ``seccomp``.

    "default"/"strict" hand ``isolate.seccomp.oci_profile(mode)`` to the engine
    as JSON, a file path hands over that file's JSON, "none" is ``unconfined``.
    ``no_network`` (network none) adds the refusal of socket() for every
    family but AF_UNIX to that profile (to an allow-all one for "none");
    ``unix_guard`` adds the rules refusing AF_UNIX sockets
    (``isolate.seccomp.unix_guard_rules``), to "none"'s allow-all profile too.
    """
    if mode == "none" and not (no_network or unix_guard):
        return "seccomp=unconfined", "none"
    try:
        from ... import seccomp as seccomp_mod  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        if mode in ("default", "strict") or no_network or unix_guard:
            raise UnsupportedError(
                f"seccomp: the {mode!r} profile cannot be built ({exc}); reinstall isolate, or pass a JSON profile file"
            ) from None
        profile = _read_profile(mode)
    else:
        if mode == "none":
            profile = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}
        else:
            profile = seccomp_mod.oci_profile(mode)  # validates a file's profile too
        if no_network:
            profile = seccomp_mod.without_network_sockets(profile)
        if unix_guard:
            profile["syscalls"] = list(profile.get("syscalls", [])) + seccomp_mod.unix_guard_rules()
            try:
                seccomp_mod._parse(profile, f"<{mode} profile with the unix socket guard>")
            except PolicyError as exc:
                raise UnsupportedError(
                    f"unix sockets: the container's read-only binds would expose the host's unix sockets, and the "
                    f"seccomp guard cannot be added to the {mode!r} profile ({exc}); use the native backend, or "
                    "network host"
                ) from None
    report = mode if mode in ("default", "strict", "none") else os.path.abspath(mode)
    return "seccomp=" + json.dumps(profile, sort_keys=True, separators=(",", ":")), report


def _read_profile(path: str) -> dict[str, Any]:
    try:
        profile = json.loads(read_input_file(path).decode("utf-8"))
    except OSError as exc:
        raise PolicyError(f"seccomp: cannot read the profile {path!r}: {exc.strerror}", "seccomp") from None
    except ValueError as exc:  # not UTF-8, not JSON, or too large
        raise PolicyError(f"seccomp: {path!r} is not a JSON seccomp profile ({exc})", "seccomp") from None
    if not isinstance(profile, dict) or "defaultAction" not in profile:
        raise PolicyError(f"seccomp: {path!r} has no defaultAction; give an OCI/Docker seccomp profile", "seccomp")
    return profile


def unsupported_reasons(policy: Policy, engine: EngineInfo | None = None) -> dict[str, str]:
    """Policy fields this backend cannot enforce, each with the reason (and the way out)."""
    reasons: dict[str, str] = {}
    if isinstance(policy.network, Egress):
        reasons["network"] = (
            "a filtered network (egress to chosen hosts) cannot be expressed with the Docker API; "
            "use network loopback or host, or the native backend"
        )
    if policy.seccomp in ("default", "strict"):
        try:
            from ... import seccomp as seccomp_mod  # type: ignore[attr-defined,unused-ignore]  # noqa: F401
        except ImportError as exc:
            reasons["seccomp"] = f"the {policy.seccomp!r} profile cannot be built ({exc}); pass a JSON profile file"
    if policy.unix_sockets:
        reasons["unix_sockets"] = (
            "named unix sockets need the native backend (a container cannot supervise connect())"
        )
    if engine is not None:
        limits = policy.limits
        if (policy.seccomp != "none" or policy.network == "none") and not engine.seccomp:
            reasons["seccomp"] = "the Docker engine has no seccomp support; build dockerd with seccomp"
            if policy.network == "none":
                reasons["network"] = (
                    "network none needs seccomp in the container (its lo is always up: socket() is refused "
                    "for every family but AF_UNIX), and this engine has none; use network loopback"
                )
        if limits.memory is not None and not engine.memory_limit:
            reasons["limits.memory"] = "the Docker engine cannot limit memory (no memory cgroup)"
        if limits.pids is not None and not engine.pids_limit:
            reasons["limits.pids"] = "the Docker engine cannot limit processes (no pids cgroup)"
        if limits.cpus is not None and not engine.cpu_cfs:
            reasons["limits.cpus"] = "the Docker engine cannot limit CPU bandwidth (no CFS quota)"
    return reasons


def unsupported(policy: Policy) -> list[str]:
    """The policy fields this backend cannot enforce (asks the engine when one answers)."""
    engine: EngineInfo | None
    try:
        engine = engine_info()
    except IsolationError:
        engine = None
    return sorted(unsupported_reasons(policy, engine))


def _abs(path: str, base: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _covered(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def build_spec(
    policy: Policy,
    *,
    cwd: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    image: str | None = None,
    engine: EngineInfo | None = None,
) -> ContainerSpec:
    """Map ``policy`` onto a container: the one place that decides the mapping.

    ``cwd`` is the run's working directory on the host (default: the current
    one): relative ``read``/``write`` paths are resolved against it, and it is
    the working directory inside unless ``policy.cwd`` says otherwise.
    ``environ`` is the caller's environment for ``keep_env`` (default:
    ``os.environ``). ``engine`` (when known) refuses what the engine cannot do.

    Raises ``UnsupportedError`` for what cannot be mapped (``warnings`` in
    the spec instead, under ``policy.best_effort``) and ``PolicyError`` for a
    host path that cannot be bound.
    """
    base = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
    environ = os.environ if environ is None else environ
    warnings: list[str] = []
    enforced: dict[str, Any] = {"mechanism": "docker"}

    problems = unsupported_reasons(policy, engine)
    network = policy.network
    for name, reason in problems.items():
        if not policy.best_effort:
            raise UnsupportedError(f"{name}: {reason}")
        warnings.append(f"{name} not enforced by the docker backend: {reason}")

    # Filesystem: the image is the system; host paths are bound at the same path.
    mounts: list[BindMount] = []
    # Every host path goes through isolate.grants, as with the native backend:
    # no link planted below / is followed, and each is checked again just
    # before the container is created (ContainerSpec.host_config).
    for kind, paths, read_only in (("read", policy.read, True), ("write", policy.write, False)):
        for path in paths:
            if read_only and path in DEFAULT_READ:
                continue  # the image provides the system directories
            target = _abs(path, base)
            grant = resolve_grant(target, kind)
            mounts.append(BindMount(grant.real, target, read_only, grant))
    # The program's home, as with the native backend: a private tmpfs, files shared read-only into it.
    home_tmpfs: tuple[str, ...] = ()
    if policy.home is not None:
        if policy.home not in policy.tmpfs:
            home_tmpfs = (policy.home,)
        for name in policy.home_files:
            grant = resolve_grant(os.path.join(os.path.expanduser("~"), name), "home_files")
            mounts.append(BindMount(grant.real, os.path.join(policy.home, os.path.basename(os.path.normpath(name))),
                                    True, grant))
        enforced["home"] = {"path": policy.home, "kind": "tmpfs (private to the run)",
                            "files": [m.target for m in mounts if m.target.startswith(policy.home + "/")]}
    mounts.sort(key=lambda m: (m.target.count("/"), m.target))
    working_dir = policy.cwd or base
    if policy.cwd is None and not _covered(working_dir, [m.target for m in mounts] + list(policy.tmpfs)):
        warnings.append(
            f"the working directory {working_dir} is not granted: inside the container it is an empty directory"
        )
    enforced["rootfs"] = "read-only"
    enforced["binds"] = {
        "ro": [m.target for m in mounts if m.read_only],
        "rw": [m.target for m in mounts if not m.read_only],
    }
    enforced["tmpfs"] = list(policy.tmpfs)

    # Network.
    # Under best effort a filtered network falls back to the closed one, never to the host's.
    network_mode = "host" if network == "host" else "none"
    # Docker's "none" is a private network namespace whose lo is up (no capability inside can take it
    # down): the program reaches nothing but itself. That is "loopback"; for "none" the container's
    # seccomp profile also refuses socket() for every family but AF_UNIX, so that nothing network-usable
    # exists, as with the native backend without a network namespace.
    no_network = network == "none" and "network" not in problems
    enforced["network"] = ("host" if network_mode == "host" else
                           "netns-loopback+seccomp-sockets" if no_network else "loopback")
    namespaces = ["mnt", "pid", "ipc", "uts"] + (["net"] if network_mode == "none" else [])
    enforced["namespaces"] = namespaces

    # Unix sockets: a read-only bind does not stop connect() on a socket under
    # it, and a container has no supervisor; under a private network AF_UNIX
    # sockets are refused by seccomp when a host directory is bound read-only.
    unix_guard = network_mode == "none" and any(m.read_only for m in mounts)
    if network_mode == "host":
        enforced["unix_sockets"] = "host"
    elif not unix_guard:
        enforced["unix_sockets"] = "no host directory bound read-only"

    # Privilege.
    security = ["no-new-privileges:true"]
    if "seccomp" in problems:  # best effort: the engine's own default profile, if any
        seccomp_report = "engine-default" if (engine is None or engine.seccomp) else "none"
        if unix_guard:
            enforced["unix_sockets"] = None
            warnings.append("unix_sockets not enforced by the docker backend: host sockets under read-only binds "
                            "are reachable (no seccomp)")
    else:
        option, seccomp_report = seccomp_option(policy.seccomp, no_network, unix_guard)
        security.append(option)
        if unix_guard:
            enforced["unix_sockets"] = "seccomp-no-unix-sockets"
    enforced["seccomp"] = seccomp_report
    enforced["no_new_privs"] = True
    enforced["capabilities"] = "dropped"
    uid, gid = program_ids(policy)
    enforced["user"] = f"{uid}:{gid}"

    # Limits.
    limits = policy.limits
    ulimits: list[tuple[str, int, int]] = []
    memory = limits.memory if "limits.memory" not in problems else None
    pids = limits.pids if "limits.pids" not in problems else None
    nano_cpus = int(float(limits.cpus) * 1e9) if limits.cpus is not None and "limits.cpus" not in problems else None
    if memory is not None:
        assert isinstance(memory, int)
        enforced["memory"] = "docker-cgroup"
        if engine is not None and not engine.swap_limit:
            warnings.append("the engine cannot limit swap: memory is limited, swap is not")
    if pids is not None:
        enforced["pids"] = "docker-cgroup"
    if nano_cpus is not None:
        enforced["cpus"] = "docker-cfs"
    cpu_seconds = float(limits.cpu_seconds) if limits.cpu_seconds is not None else None
    if cpu_seconds is not None:
        soft = max(1, int(-(-cpu_seconds // 1)))
        ulimits.append(("cpu", soft, soft + 1))
        enforced["cpu_seconds"] = "docker-ulimit+stats"
    if limits.open_files is not None:
        assert isinstance(limits.open_files, int)
        ulimits.append(("nofile", limits.open_files, limits.open_files))
        enforced["open_files"] = "docker-ulimit"
    file_size = limits.file_size if isinstance(limits.file_size, int) else None
    if file_size is not None:
        ulimits.append(("fsize", file_size, file_size))
        enforced["file_size"] = "docker-ulimit"
    wall = float(limits.wall_seconds) if limits.wall_seconds is not None else None
    if wall is not None:
        enforced["wall_seconds"] = "docker-kill"
    init = engine.init if engine is not None else True
    if policy.die_with_parent:
        enforced["die_with_parent"] = "watchdog"

    env: dict[str, str] = {name: environ[name] for name in policy.keep_env if name in environ}
    if policy.home is not None:
        env["HOME"] = policy.home
    env.update(policy.env)
    chosen_image = image or policy.image or default_image()
    enforced["image"] = chosen_image
    return ContainerSpec(
        image=chosen_image,
        uid=uid,
        gid=gid,
        working_dir=working_dir,
        environment=tuple(env.items()),
        mounts=tuple(mounts),
        tmpfs=tuple(policy.tmpfs) + home_tmpfs,
        tmpfs_size=policy.limits.tmpfs_sizes()[0],
        shm_size=policy.limits.tmpfs_sizes()[1],
        network_mode=network_mode,
        security_opt=tuple(security),
        ulimits=tuple(ulimits),
        memory=memory if isinstance(memory, int) else None,
        pids=pids if isinstance(pids, int) else None,
        nano_cpus=nano_cpus,
        cpu_seconds=cpu_seconds,
        wall_seconds=wall,
        file_size=file_size,
        init=init,
        die_with_parent=policy.die_with_parent,
        config_hash=policy.config_hash(),
        enforced=enforced,
        warnings=tuple(warnings),
    )


def prepare(policy: Policy, *, cwd: str | os.PathLike[str] | None = None, image: str | None = None) -> ContainerSpec:
    """``build_spec`` checked against the engine in use, whose image must be present."""
    cl = client()
    spec = build_spec(policy, cwd=cwd, image=image, engine=engine_info(cl))
    check_image(spec.image, cl)
    return spec


_images_seen: set[tuple[int, str]] = set()


def check_image(image: str, docker_client: Any | None = None) -> None:
    """Raise ``UnsupportedError`` unless ``image`` is in the engine (nothing is ever pulled)."""
    cl = docker_client if docker_client is not None else client()
    if (id(cl), image) in _images_seen:
        return
    import docker.errors

    try:
        cl.api.inspect_image(image)
    except docker.errors.NotFound:
        raise UnsupportedError(
            f"docker: the image {image!r} is not in the engine at {engine_address()} and isolate never pulls; "
            f"`docker pull {image}` (or build it), or choose another with --image / {IMAGE_ENV}"
        ) from None
    except Exception as exc:
        with _engine_errors(f"look up the image {image}"):
            raise exc
    _images_seen.add((id(cl), image))


# --------------------------------------------------------------------------
# Standard streams


@dataclass
class _Sink:
    """Where one output stream of the program goes."""

    kind: str  # "capture" | "fd" | "discard"
    fd: int = -1
    chunks: list[bytes] = field(default_factory=list)

    def write(self, data: bytes) -> None:
        if self.kind == "capture":
            self.chunks.append(data)
        elif self.kind == "fd":
            _write_all(self.fd, data)

    def value(self) -> bytes | None:
        return b"".join(self.chunks) if self.kind == "capture" else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [], 1.0)
            continue
        except OSError as exc:
            if exc.errno == errno_mod.EPIPE:
                return  # the reader went away, as a pipe to a child would
            raise
        view = view[written:]


def _fileno(stream: Any, name: str) -> int:
    if isinstance(stream, int):
        return stream
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError) as exc:
        raise ValueError(f"{name}: expected PIPE, DEVNULL, a file descriptor or a file with a fileno ({exc})") from None


def _sink(stream: Any, name: str, default_fd: int) -> _Sink:
    if stream is None:
        return _Sink("fd", default_fd)
    if stream == subprocess.PIPE:
        return _Sink("capture")
    if stream == subprocess.DEVNULL:
        return _Sink("discard")
    return _Sink("fd", _fileno(stream, name))


@dataclass
class _Streams:
    """The standard streams of one run, resolved from subprocess-style arguments."""

    stdin_data: bytes | None
    stdin_fd: int | None
    out: _Sink
    err: _Sink
    text: bool
    encoding: str
    errors: str

    @property
    def open_stdin(self) -> bool:
        return self.stdin_data is not None or self.stdin_fd is not None

    @classmethod
    def from_args(
        cls,
        *,
        input: bytes | str | None,
        stdin: Any,
        stdout: Any,
        stderr: Any,
        capture_output: bool,
        text: bool | None,
        encoding: str | None,
        errors: str | None,
    ) -> _Streams:
        if capture_output:
            if stdout is not None or stderr is not None:
                raise ValueError("stdout and stderr arguments may not be used with capture_output.")
            stdout = stderr = subprocess.PIPE
        if input is not None and stdin is not None:
            raise ValueError("stdin and input arguments may not both be used.")
        text_mode = bool(text or encoding or errors)
        enc = encoding or locale.getpreferredencoding(False)
        errs = errors or "strict"
        data: bytes | None = None
        fd: int | None = None
        if input is not None:
            if isinstance(input, str):
                if not text_mode:
                    raise TypeError("input must be bytes unless text, encoding or errors is given")
                data = input.encode(enc, errs)
            else:
                data = bytes(input)
        elif stdin is None:
            fd = _usable_fd(0)
        elif stdin in (subprocess.DEVNULL, subprocess.PIPE):
            fd = None  # PIPE without input: an empty stdin, as subprocess.run gives
        else:
            fd = _fileno(stdin, "stdin")
        out = _sink(stdout, "stdout", 1)
        if stderr == subprocess.STDOUT:
            err = out
        else:
            err = _sink(stderr, "stderr", 2)
        return cls(data, fd, out, err, text_mode, enc, errs)

    def decode(self, data: bytes | None) -> bytes | str | None:
        if data is None or not self.text:
            return data
        return data.decode(self.encoding, self.errors).replace("\r\n", "\n").replace("\r", "\n")


def _usable_fd(fd: int) -> int | None:
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


def _argv(args: Args) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        items: list[Any] = [args]
    else:
        items = list(args)
    argv = [os.fsdecode(item) for item in items]
    if not argv or not argv[0]:
        raise ValueError("args: an empty command; name a program to run")
    return argv


# --------------------------------------------------------------------------
# A hijacked engine connection (attach, exec start)


class _Conn:
    """The raw socket behind an upgraded engine request: multiplexed output, raw stdin."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.leftover = b""
        try:
            reader = response.raw._fp.fp
            raw = reader.raw
            sock = getattr(raw, "_sock", raw)
        except AttributeError:
            raise UnsupportedError(
                f"docker: the connection to {engine_address()} cannot be used for streaming; "
                "use a unix:// or tcp:// DOCKER_HOST"
            ) from None
        if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket):
            response.close()
            raise UnsupportedError(
                f"docker: streaming over {engine_address()} (TLS or ssh) is not supported; "
                "use a unix:// DOCKER_HOST (an ssh -L tunnel to the remote socket works) or plain tcp://"
            )
        self.sock = sock
        sock.setblocking(False)
        with contextlib.suppress(Exception):
            buffered = reader.peek()  # bytes the HTTP reader took past the headers
            if buffered:
                self.leftover = reader.read(len(buffered))
        self._write_closed = False
        self._lock = threading.Lock()

    def recv(self) -> bytes | None:
        """Bytes, ``b""`` at the end of the stream, ``None`` when nothing is ready."""
        if self.leftover:
            data, self.leftover = self.leftover, b""
            return data
        try:
            return self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return None
        except ConnectionResetError:
            return b""

    def send_all(self, data: bytes, stop: threading.Event) -> bool:
        view = memoryview(data)
        while view:
            if stop.is_set():
                return False
            _, writable, _ = select.select([], [self.sock], [], 0.1)
            if not writable:
                continue
            try:
                sent = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                continue
            view = view[sent:]
        return True

    def close_write(self) -> None:
        with self._lock:
            if not self._write_closed:
                self._write_closed = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.response.close()
        with contextlib.suppress(OSError):
            self.sock.close()


def _attach(api: Any, container_id: str, open_stdin: bool) -> _Conn:
    params = {"stdin": int(open_stdin), "stdout": 1, "stderr": 1, "stream": 1}
    response = api.post(
        api._url("/containers/{0}/attach", container_id),
        params=params,
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        stream=True,
    )
    api._raise_for_status(response)
    return _Conn(response)


def _exec_start(api: Any, exec_id: str) -> _Conn:
    response = api._post_json(
        api._url("/exec/{0}/start", exec_id),
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        data={"Tty": False, "Detach": False},
        stream=True,
    )
    api._raise_for_status(response)
    return _Conn(response)


class _Demux:
    """Splits the engine's multiplexed stream (8-byte headers) into (stream, payload)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buffer += data
        frames: list[tuple[int, bytes]] = []
        while len(self.buffer) >= 8:
            size = int.from_bytes(self.buffer[4:8], "big")
            if len(self.buffer) < 8 + size:
                break
            frames.append((self.buffer[0], bytes(self.buffer[8 : 8 + size])))
            del self.buffer[: 8 + size]
        return frames


_TINI_FAILURE = re.compile(rb"^\[FATAL tini \(\d+\)\] exec (.*) failed: (.*?)\s*$", re.DOTALL)
_RUNTIME_EXEC_FAILURE = re.compile(rb"^OCI runtime exec failed: .*?exec: (.*?): (.*?)(: unknown)?\s*$", re.DOTALL)


@dataclass(frozen=True)
class _HoldRule:
    """Output that may be an exec failure reported by tini or the runtime rather than the program's own."""

    stream: int
    prefix: bytes
    pattern: re.Pattern[bytes]


_TINI_HOLD = _HoldRule(2, b"[FATAL tini (", _TINI_FAILURE)
_EXEC_HOLD = _HoldRule(1, b"OCI runtime exec failed", _RUNTIME_EXEC_FAILURE)


class _Holder:
    """Holds back the start of one stream while it may still be a failure message (it may come in pieces)."""

    def __init__(self, rule: _HoldRule | None, sink: _Sink) -> None:
        self.rule = rule
        self.sink = sink
        self.buffer = bytearray()
        self.held: bytes | None = None

    def feed(self, payload: bytes) -> None:
        rule = self.rule
        if rule is None:
            self.sink.write(payload)
            return
        self.buffer += payload
        size = min(len(self.buffer), len(rule.prefix))
        if bytes(self.buffer[:size]) != rule.prefix[:size]:
            self.release()
        elif b"\n" in self.buffer:
            self.finish()

    def finish(self) -> None:
        """Decide with what has come: a failure message is kept, anything else goes on to the sink."""
        if self.rule is not None and self.buffer and self.rule.pattern.match(bytes(self.buffer)):
            self.held = bytes(self.buffer)
            self.buffer.clear()
            self.rule = None
        else:
            self.release()

    def release(self) -> None:
        self.rule = None
        if self.buffer:
            data = bytes(self.buffer)
            self.buffer.clear()
            self.sink.write(data)


def _feed_stdin(conn: _Conn, streams: _Streams, stop: threading.Event) -> None:
    try:
        if streams.stdin_data is not None:
            conn.send_all(streams.stdin_data, stop)
        elif streams.stdin_fd is not None:
            while not stop.is_set():
                ready, _, _ = select.select([streams.stdin_fd], [], [], 0.1)
                if not ready:
                    continue
                try:
                    chunk = os.read(streams.stdin_fd, 65536)
                except (BlockingIOError, InterruptedError):
                    continue  # a non-blocking stdin with nothing to read after all
                if not chunk or not conn.send_all(chunk, stop):
                    break
    except OSError:
        pass  # the program closed its stdin or the engine went away: nothing more to feed
    finally:
        conn.close_write()


# --------------------------------------------------------------------------
# Resource monitor and watchdog


class _Monitor:
    """Follows the container's engine stats: peak memory, CPU time, the tree-wide CPU limit."""

    def __init__(self, api: Any, container_id: str, cpu_limit: float | None, on_cpu_limit: Callable[[], None]) -> None:
        self.api = api
        self.container_id = container_id
        self.cpu_limit = cpu_limit
        self.on_cpu_limit = on_cpu_limit
        self.max_memory = 0
        self.cpu_total = 0.0
        self.cpu_user = 0.0
        self.cpu_system = 0.0
        self.samples = 0
        self.hit_cpu_limit = False
        self._base: tuple[float, float, float] | None = None
        self._baseline = False
        self._response: Any = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="isolate-docker-stats", daemon=True)

    def start(self, baseline: bool = False) -> None:
        self._baseline = baseline
        self._thread.start()

    def _follow(self) -> None:
        response: Any = None
        try:
            response = self.api._get(
                self.api._url("/containers/{0}/stats", self.container_id), params={"stream": True}, stream=True
            )
            self._response = response
            if self._stopped.is_set():
                return
            for line in response.iter_lines():
                if self._stopped.is_set():
                    break
                if line:
                    self._sample(json.loads(line))
        except Exception:  # the stream ends when the run ends; a lost sample only loses numbers
            return
        finally:
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()

    def _sample(self, stats: dict[str, Any]) -> None:
        usage = (stats.get("cpu_stats") or {}).get("cpu_usage") or {}
        total = float(usage.get("total_usage") or 0) / 1e9
        user = float(usage.get("usage_in_usermode") or 0) / 1e9
        system = float(usage.get("usage_in_kernelmode") or 0) / 1e9
        if not total and not (stats.get("memory_stats") or {}):
            return  # the container is gone: an empty sample
        if self._base is None:
            self._base = (total, user, system) if self._baseline else (0.0, 0.0, 0.0)
        self.samples += 1
        memory = stats.get("memory_stats") or {}
        self.max_memory = max(self.max_memory, int(memory.get("max_usage") or memory.get("usage") or 0))
        self.cpu_total = max(self.cpu_total, total - self._base[0])
        self.cpu_user = max(self.cpu_user, user - self._base[1])
        self.cpu_system = max(self.cpu_system, system - self._base[2])
        if self.cpu_limit is not None and self.cpu_total >= self.cpu_limit and not self.hit_cpu_limit:
            self.hit_cpu_limit = True
            with contextlib.suppress(Exception):
                self.on_cpu_limit()

    def stop(self) -> None:
        """End the stats stream without waiting for its next sample (the reader holds its lock)."""
        self._stopped.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.raw._fp.fp.raw._sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG_CODE = r"""
import json, sys, time
sys.path[:0] = json.loads(sys.argv[1])
armed = {}
for line in sys.stdin:
    parts = line.split()
    if len(parts) == 3 and parts[0] == "arm":
        armed[parts[1]] = parts[2]
    elif len(parts) == 2 and parts[0] == "disarm":
        armed.pop(parts[1], None)
if armed:
    import docker
    import docker.errors
    api = docker.from_env(timeout=60).api
    for attempt in (1, 2):
        missing = {}
        for cid, action in armed.items():
            try:
                if action == "rm":
                    api.remove_container(cid, force=True, v=True)
                else:
                    api.kill(cid)
            except docker.errors.NotFound:
                missing[cid] = action  # a create still on its way to the engine: look once more
            except Exception:
                pass
        armed = missing
        if armed and attempt == 1:
            time.sleep(2)
"""


class _Watchdog:
    """A small process that kills or removes armed containers when this process dies.

    It reads ``arm ID ACTION`` / ``disarm ID`` lines from a pipe; when the pipe
    closes (this process exited or was killed) it acts on what is still armed:
    "rm" removes the container, "kill" kills it. One per process, spawned on
    first use; it lives in its own session, so a Ctrl-C on the terminal reaches
    the caller, not the watchdog. A container may be armed several times (an
    unnamed kept sandbox for its life, each of its commands for theirs): "rm"
    wins over "kill", and it stays armed until every arming is undone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._fd = -1
        self._armed: dict[str, list[str]] = {}

    def _spawn(self) -> None:
        if not sys.executable:
            raise UnsupportedError("die_with_parent: no Python executable to run the docker watchdog with")
        read_end, write_end = os.pipe()
        try:
            os.posix_spawn(
                sys.executable,
                [sys.executable, "-c", _WATCHDOG_CODE, json.dumps([p for p in sys.path if p])],
                dict(os.environ),
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, read_end, 0),
                    (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                ],
                setsid=True,
            )
        except OSError as exc:
            os.close(write_end)
            raise UnsupportedError(f"die_with_parent: cannot start the docker watchdog ({exc.strerror})") from None
        finally:
            os.close(read_end)
        if self._fd >= 0 and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = write_end
        self._pid = os.getpid()
        for cid in self._armed:
            self._send(self._line(cid))

    def _line(self, container_id: str) -> str:
        actions = self._armed.get(container_id)
        if not actions:
            return f"disarm {container_id}\n"
        return f"arm {container_id} {'rm' if 'rm' in actions else 'kill'}\n"

    def _send(self, line: str) -> None:
        _write_all(self._fd, line.encode())

    def _update(self, container_id: str) -> None:
        if self._pid != os.getpid():
            if self._pid != -1:  # a forked child: the parent's containers are the parent's business
                self._armed = {cid: actions for cid, actions in self._armed.items() if cid == container_id}
            self._spawn()
            return
        try:
            self._send(self._line(container_id))
        except OSError:
            self._spawn()

    def arm(self, container_id: str, action: str) -> None:
        """On this process's death: ``action`` "rm" removes the container, "kill" kills it."""
        with self._lock:
            self._armed.setdefault(container_id, []).append(action)
            self._update(container_id)

    def disarm(self, container_id: str, action: str) -> None:
        """Undo one ``arm(container_id, action)``."""
        with self._lock:
            actions = self._armed.get(container_id)
            if not actions or action not in actions:
                return
            actions.remove(action)
            if not actions:
                del self._armed[container_id]
            with contextlib.suppress(OSError, IsolationError):
                self._update(container_id)


watchdog = _Watchdog()


# --------------------------------------------------------------------------
# Driving one run


@dataclass
class _Outcome:
    killed_for: str | None = None  # "timeout" | "wall" | "cpu"
    wall_seconds: float = 0.0
    held_error: bytes | None = None


def _drive(
    conn: _Conn,
    streams: _Streams,
    *,
    kill: Callable[[], None],
    timeout: float | None,
    wall: float | None,
    monitor: _Monitor,
    hold: _HoldRule | None,
    started: float,
) -> _Outcome:
    """Move stdin in and stdout/stderr out until the stream ends; kill at the deadline."""
    outcome = _Outcome()
    stop = threading.Event()
    feeder: threading.Thread | None = None
    if streams.open_stdin:
        feeder = threading.Thread(
            target=_feed_stdin, args=(conn, streams, stop), name="isolate-docker-stdin", daemon=True
        )
        feeder.start()
    demux = _Demux()
    holders = {
        1: _Holder(hold if hold is not None and hold.stream == 1 else None, streams.out),
        2: _Holder(hold if hold is not None and hold.stream == 2 else None, streams.err),
    }
    deadlines = [(started + t, why) for t, why in ((timeout, "timeout"), (wall, "wall")) if t is not None]
    deadline, deadline_reason = min(deadlines) if deadlines else (None, None)
    killed_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if monitor.hit_cpu_limit and outcome.killed_for is None:
                outcome.killed_for, killed_at = "cpu", now
            if deadline is not None and now >= deadline and outcome.killed_for is None:
                outcome.killed_for, killed_at = deadline_reason, now
                with contextlib.suppress(Exception):
                    kill()
            if killed_at is not None and now - killed_at > 10.0:
                break  # the engine did not end the stream after the kill: give up on the rest
            wait = 0.5 if deadline is None or outcome.killed_for else max(0.0, min(0.5, deadline - now))
            data = conn.recv()
            if data is None:
                select.select([conn.sock], [], [], wait)
                continue
            if not data:
                break
            for stream, payload in demux.feed(data):
                holder = holders.get(stream)
                if holder is not None:
                    holder.feed(payload)
        for holder in holders.values():
            holder.finish()
            if holder.held is not None:
                outcome.held_error = holder.held
    finally:
        stop.set()
        outcome.wall_seconds = time.monotonic() - started
        if feeder is not None:
            feeder.join(timeout=1.0)
    return outcome


def _command_error(held: bytes, argv: list[str], image: str, code: int) -> IsolationError:
    detail = held.decode(errors="replace").strip()
    if code == 127 or "not found" in detail or "No such file" in detail:
        return CommandNotFoundError(
            f"{argv[0]}: command not found in the container (image {image}): {detail}; "
            "use a path that exists in the image or another image"
        )
    return CommandNotExecutableError(
        f"{argv[0]}: cannot be executed in the container (image {image}): {detail}; check its permissions"
    )


def _classify(
    code: int, *, oom: bool, outcome: _Outcome, spec: ContainerSpec, monitor: _Monitor
) -> tuple[int, str | None]:
    """(subprocess-style returncode, limit that ended the run) from the engine's exit code.

    The engine reports death by signal N as 128+N, indistinguishable from an
    exit with that code; it is read as a signal only when isolate knows why:
    its own kill (deadline, CPU), the OOM killer, or the signal of a limit the
    policy set (SIGXCPU for cpu_seconds, SIGXFSZ for file_size).
    """
    if outcome.killed_for is not None:
        limit = {"timeout": "timeout", "wall": "timeout", "cpu": "cpu"}[outcome.killed_for]
        return -signal_mod.SIGKILL, limit
    if oom and code != 0:
        return (-(code - 128) if code > 128 else code), "memory"
    if code > 128:
        sig = code - 128
        if sig == signal_mod.SIGXCPU and spec.cpu_seconds is not None:
            return -sig, None
        if sig == signal_mod.SIGXFSZ and spec.file_size is not None:
            return -sig, None
        if sig == signal_mod.SIGKILL and spec.cpu_seconds is not None and monitor.cpu_total >= spec.cpu_seconds * 0.9:
            return -sig, "cpu"
    return code, None


def _report(
    returncode: int, limit: str | None, *, spec: ContainerSpec, outcome: _Outcome, monitor: _Monitor, oom_kills: int
) -> Report:
    status, exit_code, sig = status_for(returncode, limit)
    warnings = list(spec.warnings)
    if monitor.samples == 0:
        warnings.append("the run ended before the engine's first stats sample: cpu and memory figures are unknown")
    return Report(
        status=status,
        exit_code=exit_code,
        signal=sig,
        wall_seconds=round(outcome.wall_seconds, 6),
        cpu_seconds=round(monitor.cpu_total, 6),
        user_seconds=round(monitor.cpu_user, 6),
        system_seconds=round(monitor.cpu_system, 6),
        max_rss_bytes=monitor.max_memory,
        oom_kills=oom_kills,
        backend="docker",
        enforced=dict(spec.enforced),
        warnings=warnings,
        denials_observed={"seccomp": {"observed": False, "detail": "the engine does not report seccomp denials"}},
    )


def _finish(
    args: Any,
    returncode: int,
    streams: _Streams,
    report: Report,
    *,
    outcome: _Outcome,
    timeout: float | None,
    check: bool,
) -> subprocess.CompletedProcess[Any]:
    out = streams.decode(streams.out.value())
    err = streams.decode(streams.err.value()) if streams.err is not streams.out else None
    if outcome.killed_for == "timeout":
        assert timeout is not None
        raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
    result: subprocess.CompletedProcess[Any] = subprocess.CompletedProcess(args, returncode, out, err)
    result.report = report  # type: ignore[attr-defined]
    if check and returncode != 0:
        raise subprocess.CalledProcessError(returncode, args, out, err)
    return result


# --------------------------------------------------------------------------
# One-shot runs


def run(
    args: Args,
    *,
    policy: Policy,
    input: bytes | str | None = None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    text: bool | None = None,
    encoding: str | None = None,
    errors: str | None = None,
    spec: ContainerSpec | None = None,
) -> subprocess.CompletedProcess[Any]:
    """Run ``args`` in a fresh container under ``policy``, like ``subprocess.run``.

    stdout/stderr ``None`` pass through to this process's fds 1 and 2, PIPE
    captures; stdin ``None`` feeds this process's fd 0 to the program. The
    result carries ``.report`` (``isolate.report.Report``, backend "docker").
    ``timeout`` kills the container and raises ``subprocess.TimeoutExpired``;
    ``policy.limits.wall_seconds`` kills it with report status "timeout".
    ``spec`` (from ``prepare``) skips the mapping, for callers that run one
    policy many times.
    """
    argv = _argv(args)
    streams = _Streams.from_args(
        input=input, stdin=stdin, stdout=stdout, stderr=stderr, capture_output=capture_output,
        text=text, encoding=encoding, errors=errors,
    )  # fmt: skip
    if spec is None:
        spec = prepare(policy, cwd=cwd)
    api = client().api
    # A fresh name, armed before the container exists: a death at any point leaves nothing behind.
    name = f"{RUN_PREFIX}{secrets.token_hex(8)}"
    if spec.die_with_parent:
        watchdog.arm(name, "rm")
    monitor: _Monitor | None = None
    conn: _Conn | None = None
    try:
        with _engine_errors(f"create a container from {spec.image}"):
            created = api.create_container(
                image=spec.image,
                command=argv,
                name=name,
                user=spec.user,
                environment=dict(spec.environment),
                working_dir=spec.working_dir,
                labels=spec.labels("run"),
                stdin_open=streams.open_stdin,
                host_config=api.create_host_config(**spec.host_config()),
            )
        container_id: str = created["Id"]
        engine_warnings = [str(w) for w in created.get("Warnings") or []]
        with _engine_errors("attach to the container"):
            conn = _attach(api, container_id, streams.open_stdin)
        spec.verify_binds()  # the engine binds the paths at start: the last moment to look
        try:
            api.start(container_id)
        except Exception as exc:
            _raise_start_error(exc, argv, spec.image)
        started = time.monotonic()
        monitor = _Monitor(api, container_id, spec.cpu_seconds, lambda: api.kill(container_id))
        monitor.start()
        outcome = _drive(
            conn, streams, kill=lambda: api.kill(container_id), timeout=timeout, wall=spec.wall_seconds,
            monitor=monitor, hold=_TINI_HOLD if spec.init else None, started=started,
        )  # fmt: skip
        with _engine_errors("wait for the container"):
            api.wait(container_id)
            state = api.inspect_container(container_id)["State"]
    finally:
        if monitor is not None:
            monitor.stop()
        if conn is not None:
            conn.close()
        with contextlib.suppress(Exception):
            api.remove_container(name, force=True, v=True)
        if spec.die_with_parent:
            watchdog.disarm(name, "rm")
    code = int(state.get("ExitCode") or 0)
    if outcome.held_error is not None and code in (126, 127):
        raise _command_error(outcome.held_error, argv, spec.image, code)
    oom = bool(state.get("OOMKilled"))
    returncode, limit = _classify(code, oom=oom, outcome=outcome, spec=spec, monitor=monitor)
    report = _report(returncode, limit, spec=spec, outcome=outcome, monitor=monitor, oom_kills=int(oom))
    report.warnings.extend(engine_warnings)
    return _finish(args, returncode, streams, report, outcome=outcome, timeout=timeout, check=check)


_START_EXEC_FAILURE = re.compile(
    r'exec: "?(.*?)"?: (executable file not found|no such file or directory|permission denied)'
)


def _raise_start_error(exc: Exception, argv: list[str], image: str) -> NoReturn:
    """Map an engine error from starting a container: the runtime's exec failure, or a setup error."""
    if isinstance(exc, IsolationError):
        raise exc
    message = _short(exc)
    failure = _START_EXEC_FAILURE.search(message)
    if failure and failure.group(2) == "permission denied":
        raise CommandNotExecutableError(
            f"{argv[0]}: cannot be executed in the container (image {image}); check its permissions"
        ) from None
    if failure:
        raise CommandNotFoundError(
            f"{argv[0]}: command not found in the container (image {image}); "
            "use a path that exists in the image or another image"
        ) from None
    raise SetupError(f"docker: the engine could not start the container: {message}", step="docker-start") from None


# --------------------------------------------------------------------------
# Kept containers (used by isolate.sandbox)


def kept_container_name(name: str) -> str:
    return KEPT_PREFIX + name


def ensure_kept(name: str, spec: ContainerSpec) -> tuple[str, str]:
    """(container id, what was done) for the kept sandbox ``name`` under ``spec``.

    What was done is "reused" (running, same spec hash), "restarted" (stopped,
    same hash), "recreated" (the hash changed: removed and made anew) or
    "created".
    """
    api = client().api
    import docker.errors

    cname = kept_container_name(name)
    for _ in range(3):
        try:
            info = api.inspect_container(cname)
        except docker.errors.NotFound:
            info = None
        except Exception as exc:
            with _engine_errors(f"inspect the kept container {cname}"):
                raise exc
        action = "created"
        if info is not None:
            labels = (info.get("Config") or {}).get("Labels") or {}
            if labels.get(LABEL) != "1":
                raise PolicyError(
                    f"sandbox {name!r}: a container named {cname} exists and was not made by isolate; "
                    "choose another sandbox name or remove that container",
                    "name",
                )
            if labels.get(LABEL_SPEC_HASH) == spec.spec_hash():
                if (info.get("State") or {}).get("Running"):
                    return str(info["Id"]), "reused"
                spec.verify_binds()  # a restart binds the host paths again
                try:
                    api.start(info["Id"])
                except docker.errors.NotFound:
                    continue
                except Exception as exc:
                    _raise_start_error(exc, list(KEEPER_COMMAND), spec.image)
                return str(info["Id"]), "restarted"
            with _engine_errors(f"remove the outdated kept container {cname}"):
                try:
                    api.remove_container(info["Id"], force=True, v=True)
                except docker.errors.NotFound:
                    pass
            action = "recreated"
        try:
            created = api.create_container(
                image=spec.image,
                command=list(KEEPER_COMMAND),
                name=cname,
                user=spec.user,
                working_dir=spec.working_dir,
                labels=spec.labels("kept", name),
                host_config=api.create_host_config(**spec.host_config()),
                detach=True,
            )
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                continue  # someone else created it meanwhile: look again
            with _engine_errors(f"create the kept container {cname} from {spec.image}"):
                raise exc
        except Exception as exc:
            with _engine_errors(f"create the kept container {cname} from {spec.image}"):
                raise exc
        try:
            spec.verify_binds()
            api.start(created["Id"])
        except Exception as exc:
            with contextlib.suppress(Exception):
                api.remove_container(created["Id"], force=True, v=True)
            if isinstance(exc, PolicyError):
                raise
            if isinstance(exc, docker.errors.APIError) and "not found" in _short(exc).lower():
                raise UnsupportedError(
                    f"sandbox {name!r}: the image {spec.image} cannot keep a container alive: it has no "
                    f"`{' '.join(KEEPER_COMMAND)}`; choose an image with sleep"
                ) from None
            _raise_start_error(exc, list(KEEPER_COMMAND), spec.image)
        return str(created["Id"]), action
    raise SetupError(f"sandbox {name!r}: the container {cname} kept changing under isolate; try again", step="docker")


def kept_failure(container_id: str) -> str | None:
    """Why a kept container does not stay up, when its keeper could not run; else None."""
    try:
        state = client().api.inspect_container(container_id)["State"]
    except Exception:
        return None
    if state.get("Running") or int(state.get("ExitCode") or 0) not in (126, 127):
        return None
    return (
        f"the kept container exits at once: its image has no runnable `{' '.join(KEEPER_COMMAND)}` "
        f"(exit status {state.get('ExitCode')}); choose an image with sleep"
    )


def exec_run(
    container_id: str,
    spec: ContainerSpec,
    args: Args,
    *,
    input: bytes | str | None = None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    text: bool | None = None,
    encoding: str | None = None,
    errors: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[Any]:
    """Run ``args`` in the kept container ``container_id`` (made from ``spec``).

    Same arguments and result as ``run``; ``cwd`` is a directory inside the
    container (default: the sandbox's working directory). A deadline or the
    CPU limit kills the whole container (the next command restarts it), since
    the engine cannot kill one exec.
    """
    argv = _argv(args)
    streams = _Streams.from_args(
        input=input, stdin=stdin, stdout=stdout, stderr=stderr, capture_output=capture_output,
        text=text, encoding=encoding, errors=errors,
    )  # fmt: skip
    api = client().api
    env = dict(spec.environment)
    if environ is not None:
        env = dict(environ)
    workdir = os.fspath(cwd) if cwd is not None else spec.working_dir
    with _engine_errors("create an exec in the kept container"):
        exec_id = api.exec_create(
            container_id, argv, stdin=streams.open_stdin, stdout=True, stderr=True, tty=False,
            user=spec.user, environment=env, workdir=workdir,
        )["Id"]  # fmt: skip
    if spec.die_with_parent:
        watchdog.arm(container_id, "kill")
    monitor = _Monitor(api, container_id, spec.cpu_seconds, lambda: api.kill(container_id))
    conn: _Conn | None = None
    since = time.time()
    try:
        with _engine_errors("start the exec"):
            conn = _exec_start(api, exec_id)
        started = time.monotonic()
        monitor.start(baseline=True)
        outcome = _drive(
            conn, streams, kill=lambda: api.kill(container_id), timeout=timeout, wall=spec.wall_seconds,
            monitor=monitor, hold=_EXEC_HOLD, started=started,
        )  # fmt: skip
        code = _exec_exit_code(api, exec_id)
    finally:
        monitor.stop()
        if conn is not None:
            conn.close()
        if spec.die_with_parent:
            watchdog.disarm(container_id, "kill")
    if outcome.held_error is not None and code in (126, 127):
        raise _command_error(outcome.held_error, argv, spec.image, code)
    oom_kills = 0
    if code == 128 + signal_mod.SIGKILL and outcome.killed_for is None:
        oom_kills = _oom_events(api, container_id, since)
    returncode, limit = _classify(code, oom=oom_kills > 0, outcome=outcome, spec=spec, monitor=monitor)
    report = _report(returncode, limit, spec=spec, outcome=outcome, monitor=monitor, oom_kills=oom_kills)
    return _finish(args, returncode, streams, report, outcome=outcome, timeout=timeout, check=check)


def _exec_exit_code(api: Any, exec_id: str) -> int:
    deadline = time.monotonic() + 10.0
    delay = 0.001
    while True:
        with _engine_errors("read the exit status of the exec"):
            info = api.exec_inspect(exec_id)
        if not info.get("Running") or time.monotonic() > deadline:
            code = info.get("ExitCode")
            return int(code) if code is not None else 128 + signal_mod.SIGKILL
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _oom_events(api: Any, container_id: str, since: float) -> int:
    """How many OOM kills the engine saw in the container since ``since`` (epoch seconds)."""
    try:
        events = api.events(
            since=f"{since - 1:.6f}",
            until=f"{time.time() + 0.5:.6f}",
            filters={"container": container_id, "event": "oom"},
            decode=True,
        )
        return sum(1 for _ in events)
    except Exception:
        return 0


def remove_container(id_or_name: str) -> bool:
    """Remove a container (and its anonymous volumes); False when it did not exist."""
    api = client().api
    import docker.errors

    try:
        api.remove_container(id_or_name, force=True, v=True)
    except docker.errors.NotFound:
        return False
    except Exception as exc:
        with _engine_errors(f"remove the container {id_or_name}"):
            raise exc
    return True


def list_containers(kind: str | None = None) -> list[dict[str, Any]]:
    """The engine's containers made by isolate (``kind`` "run" or "kept" to narrow)."""
    labels = [f"{LABEL}=1"] + ([f"{LABEL_KIND}={kind}"] if kind else [])
    with _engine_errors("list the isolate containers"):
        found = client().api.containers(all=True, filters={"label": labels})
    return list(found)


def ended_runs(older_than: float, now: float | None = None) -> list[str]:
    """Ids of one-shot containers that ended more than ``older_than`` seconds ago (leftovers)."""
    now = time.time() if now is None else now
    api = client().api
    found = []
    for container in list_containers("run"):
        if container.get("State") not in ("exited", "dead"):
            continue  # created or running: some process may still be driving it
        try:
            state = api.inspect_container(container["Id"])["State"]
        except Exception:
            continue
        finished = _epoch(str(state.get("FinishedAt") or ""))
        if finished is not None and now - finished >= older_than:
            found.append(str(container["Id"]))
    return found


def _epoch(stamp: str) -> float | None:
    """Seconds since the epoch from the engine's RFC 3339 time (nanoseconds allowed)."""
    import datetime

    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", stamp)
    if not match or stamp.startswith("0001-"):
        return None
    base = datetime.datetime.fromisoformat(match.group(1) + (match.group(3).replace("Z", "+00:00")))
    return base.timestamp() + float("0." + (match.group(2) or "0"))
