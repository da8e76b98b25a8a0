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
    seccomp            default/strict -> isolate.kernel.seccomp.oci_profile(mode) as JSON;
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

The code is split by concern: ``engine`` (the client, what the engine
supports, its errors, the image check), ``spec`` (the mapping above),
``streams`` (standard streams and the hijacked engine connection), ``watch``
(the stats monitor and the die_with_parent watchdog), ``runs`` (driving a run,
one-shot runs) and ``kept`` (kept containers). This module re-exports the
names its users reach for as ``isolate.backends.docker.NAME``.
"""

from __future__ import annotations

from .engine import ENGINE_TIMEOUT, IMAGE_ENV, EngineInfo, available, check_image, client, engine_address, engine_info
from .kept import (
    KEEPER_COMMAND,
    KEPT_PREFIX,
    ended_runs,
    ensure_kept,
    exec_run,
    kept_container_name,
    kept_failure,
    list_containers,
    remove_container,
)
from .runs import RUN_PREFIX, CompletedProcess, run
from .runs import _classify as _classify
from .runs import _Outcome as _Outcome
from .spec import (
    DEFAULT_IMAGE,
    LABEL,
    LABEL_CONFIG_HASH,
    LABEL_KIND,
    LABEL_NAME,
    LABEL_SPEC_HASH,
    NOBODY,
    TMPFS_OPTIONS,
    BindMount,
    ContainerSpec,
    build_spec,
    default_image,
    prepare,
    program_ids,
    seccomp_option,
    unsupported,
    unsupported_reasons,
)
from .streams import _TINI_HOLD as _TINI_HOLD
from .streams import Args
from .streams import _Demux as _Demux
from .streams import _Holder as _Holder
from .streams import _Sink as _Sink
from .watch import _Monitor as _Monitor
from .watch import watchdog

__all__ = [
    "DEFAULT_IMAGE",
    "ENGINE_TIMEOUT",
    "IMAGE_ENV",
    "KEEPER_COMMAND",
    "KEPT_PREFIX",
    "LABEL",
    "LABEL_CONFIG_HASH",
    "LABEL_KIND",
    "LABEL_NAME",
    "LABEL_SPEC_HASH",
    "NOBODY",
    "RUN_PREFIX",
    "TMPFS_OPTIONS",
    "Args",
    "BindMount",
    "CompletedProcess",
    "ContainerSpec",
    "EngineInfo",
    "available",
    "build_spec",
    "check_image",
    "client",
    "default_image",
    "ended_runs",
    "engine_address",
    "engine_info",
    "ensure_kept",
    "exec_run",
    "kept_container_name",
    "kept_failure",
    "list_containers",
    "prepare",
    "program_ids",
    "remove_container",
    "run",
    "seccomp_option",
    "unsupported",
    "unsupported_reasons",
    "watchdog",
]
