"""The policy mapped onto a container: ``build_spec`` and the ``ContainerSpec`` it makes (see the package doc)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...kernel.grants import Grant, check_unchanged, refuse_runtime_dir, resolve_grant
from ...model.errors import IsolationError, PolicyError, UnsupportedError
from ...model.files import read_input_file
from ...model.policy import DEFAULT_READ, Egress, Policy
from .engine import IMAGE_ENV, EngineInfo, check_image, client, engine_info

#: The image used when neither the policy nor ``$ISOLATE_DOCKER_IMAGE`` names one.
DEFAULT_IMAGE = "debian:stable-slim"
#: Label carried by every container this backend creates.
LABEL = "isolate.sandbox"
LABEL_CONFIG_HASH = "isolate.config-hash"
LABEL_SPEC_HASH = "isolate.spec-hash"
LABEL_NAME = "isolate.name"
LABEL_KIND = "isolate.kind"
#: The unprivileged uid/gid a root caller's program runs as (SPEC "Who the program is").
NOBODY = 65534
#: Options of every tmpfs: writable, executable, private, world-writable with the sticky bit. Each is also
#: owned by the program's user (``tmpfs_options``): the engine's runc (1.1) gives a tmpfs mounted on a
#: directory of the image that directory's mode, whatever ``mode=`` says (an image's ``/tmp`` of mode 0755
#: made it root's alone), and the owner's bits of the modes images give such directories let it write.
TMPFS_OPTIONS = "rw,exec,nosuid,nodev,mode=1777"


def tmpfs_options(uid: int, gid: int, size: int) -> str:
    """A tmpfs's mount options for a container whose program runs as uid:gid."""
    return f"{TMPFS_OPTIONS},size={size},uid={uid},gid={gid}"


# --------------------------------------------------------------------------
# The policy mapped onto a container


@dataclass(frozen=True)
class BindMount:
    """A host path bound inside the container; ``grant`` is how it was resolved (isolate.kernel.grants)."""

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
            "tmpfs": {path: tmpfs_options(self.uid, self.gid, self.tmpfs_size) for path in self.tmpfs},
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


def seccomp_option(mode: str, no_network: bool = False, unix_guard: bool = False,
                   server_socket: bool = False) -> tuple[str, str]:
    """(security option, report value) for a policy's ``seccomp``.

    "default"/"strict" hand ``isolate.kernel.seccomp.oci_profile(mode)`` to the engine
    as JSON, a file path hands over that file's JSON, "none" is ``unconfined``.
    ``no_network`` (network none) adds the refusal of socket() for every
    family but AF_UNIX to that profile (to an allow-all one for "none");
    ``unix_guard`` adds the rules refusing AF_UNIX sockets
    (``isolate.kernel.seccomp.unix_guard_rules``), to "none"'s allow-all profile too.
    ``server_socket`` (a kept sandbox, whose exec server must make its
    listening socket): the guard refuses AF_UNIX stream and datagram sockets
    but lets seqpacket ones be made.
    """
    if mode == "none" and not (no_network or unix_guard):
        return "seccomp=unconfined", "none"
    try:
        from ...kernel import seccomp as seccomp_mod
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
            guard = seccomp_mod.unix_guard_rules()
            if server_socket:
                guard = _but_seqpacket(guard)
            profile["syscalls"] = list(profile.get("syscalls", [])) + guard
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


def _but_seqpacket(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The unix socket guard with socket(AF_UNIX, SOCK_SEQPACKET) allowed (types 1 stream, 2 dgram, 3 raw refused).

    Nothing can hand a descriptor into a container, so a kept sandbox's exec
    server makes its own listening socket; a host socket of that type under a
    read-only bind stays reachable, which the report says.
    """
    out: list[dict[str, Any]] = []
    for rule in rules:
        if rule.get("names") != ["socket"]:
            out.append(rule)
            continue
        for kind in (1, 2, 3):
            type_arg = {"index": 1, "value": 0xF, "valueTwo": kind, "op": "SCMP_CMP_MASKED_EQ"}
            out.append(dict(rule, args=[*rule.get("args", []), type_arg]))
    return out


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
            "egress by name (--allow-host) runs through isolate's mediator, which the Docker backend does not "
            "have; use the native backend (--backend native, backend=\"native\"), which enforces it"
        )
    if policy.seccomp in ("default", "strict"):
        try:
            from ...kernel import seccomp as seccomp_mod  # noqa: F401
        except ImportError as exc:
            reasons["seccomp"] = f"the {policy.seccomp!r} profile cannot be built ({exc}); pass a JSON profile file"
    if policy.unix_sockets:
        reasons["unix_sockets"] = (
            "named unix sockets need the native backend (a container cannot supervise connect())"
        )
    if policy.trace_denials:
        reasons["trace_denials"] = (
            "naming refused file accesses needs the native backend's init, which looks at each path system call; "
            "use the native backend (--backend native)"
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
    server_socket: bool = False,
) -> ContainerSpec:
    """Map ``policy`` onto a container: the one place that decides the mapping.

    ``cwd`` is the run's working directory on the host (default: the current
    one): relative ``read``/``write`` paths are resolved against it, and it is
    the working directory inside unless ``policy.cwd`` says otherwise.
    ``environ`` is the caller's environment for ``keep_env`` (default:
    ``os.environ``). ``engine`` (when known) refuses what the engine cannot do.
    ``server_socket``: the container's main process is a kept sandbox's exec
    server, which makes a unix seqpacket socket (see ``seccomp_option``).

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
    # Every host path goes through isolate.kernel.grants, as with the native backend:
    # no link planted below / is followed, and each is checked again just
    # before the container is created (ContainerSpec.host_config).
    for kind, paths, read_only in (("read", policy.read, True), ("write", policy.write, False)):
        for path in paths:
            if read_only and path in DEFAULT_READ:
                continue  # the image provides the system directories
            target = _abs(path, base)
            grant = resolve_grant(target, kind)
            if not read_only or os.geteuid() != 0:  # a root caller's container user is another uid
                refuse_runtime_dir(grant.real, target, kind)
            mounts.append(BindMount(grant.real, target, read_only, grant))
    # Mounts at other paths (isolate.Mount): the same resolver, bound at their target.
    for bind in policy.binds:
        grant = resolve_grant(_abs(bind.source, base), "binds")
        if bind.mode != "ro" or os.geteuid() != 0:
            refuse_runtime_dir(grant.real, bind.source, "binds")
        mounts.append(BindMount(grant.real, bind.target, bind.mode == "ro", grant))
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
        option, seccomp_report = seccomp_option(policy.seccomp, no_network, unix_guard, server_socket)
        security.append(option)
        if unix_guard:
            enforced["unix_sockets"] = ("seccomp-no-unix-sockets-but-seqpacket" if server_socket else
                                        "seccomp-no-unix-sockets")
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


def prepare(policy: Policy, *, cwd: str | os.PathLike[str] | None = None, image: str | None = None,
            server_socket: bool = False) -> ContainerSpec:
    """``build_spec`` checked against the engine in use, whose image must be present."""
    cl = client()
    spec = build_spec(policy, cwd=cwd, image=image, engine=engine_info(cl), server_socket=server_socket)
    check_image(spec.image, cl)
    return spec

