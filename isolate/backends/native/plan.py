"""The native backend: turn a policy into a plan for the C core.

``prepare`` does every costly or fallible thing in the parent (resolving and
checking paths, choosing mechanisms, compiling seccomp, opening idmapped
trees, creating cgroups) and fills a ``struct iso_plan``; the C core then only
applies it in the child. Whatever cannot be enforced is refused here, before
anything runs, unless the policy asks for best effort.

This module caches the static part of each plan (``static``), adds what is each run's own
(``prepare``), starts it (``spawn``) and turns the C core's failures into errors.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import signal
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._core import ffi, lib, step_name
from ...kernel import hostinfo, landlock, mounts, netns
from ...kernel.hostinfo import userns_error
from ...model.errors import (
    CommandNotExecutableError,
    CommandNotFoundError,
    IsolationError,
    PolicyError,
    SetupError,
    UnsupportedError,
)
from ...model.forks import fork_safe
from ...model.policy import Egress, Policy
from . import egress as egress_plan
from . import imageroot, why
from .common import _close_all, _Refusals, _Static
from .environment import DEFAULT_PATH, check_command, program_environment, reduced_path
from .imageroot import image_refusal
from .limits import _cgroup_needs, _cgroup_refusal, _prepare_cgroup
from .static import CLONE_NEWNET, _build_static
from .writes import _idmap_userns


@dataclass
class Prepared:
    """A plan for one run, and everything that must outlive the spawn."""

    plan: Any
    enforced: dict[str, Any]
    warnings: list[str]
    status_fd: int = -1  # read end of the init's status pipe
    #: Denial tracing in a kept sandbox: the init's refusals as they happen (why.WhyStream).
    why_stream: Any = None
    cgroup: Any = None
    limit_cpu_seconds: float | None = None
    observed: dict[str, dict[str, Any]] = field(default_factory=dict)
    _keep: list[Any] = field(default_factory=list)
    _close_after_spawn: list[int] = field(default_factory=list)
    #: The overlays' layers (a workspace's, or learn mode's), each with the indices of its mount steps
    #: (their failures are its refusals).
    overlays: tuple[tuple[Any, range], ...] = ()
    #: Egress by name: the allow-list, the host's end of the listeners' channel, then the run's mediator.
    egress: Egress | None = None
    egress_channel: Any = None
    mediator: Any = None
    #: The mediator is a process of its own that outlives the caller (a named kept sandbox): the path of its
    #: control socket (None: the mediator runs in this process).
    egress_detached: str | None = None
    mediator_process: Any = None  # held so that the Popen of a named sandbox's mediator is reaped, not leaked
    #: This process's socket to ask that mediator process for its summary (egress per command).
    mediator_query: Any = None
    #: A sandbox of an image: its store, the layer directories it stands on, and its lease (image/leases.py).
    image_store: Any = None
    image_layers: tuple[str, ...] = ()
    lease: str | None = None

    def close_child_side(self) -> None:
        _close_all(self._close_after_spawn)

    def close_host_side(self) -> None:
        """Close the host's ends of a run that will not happen: the status pipe and the egress channel."""
        if self.status_fd >= 0:
            os.close(self.status_fd)
            self.status_fd = -1
        if self.egress_channel is not None:
            self.egress_channel.close()
            self.egress_channel = None
        if self.why_stream is not None:
            self.why_stream.close()

    def discard(self) -> None:
        """Release what a plan that never ran holds (``--explain``): descriptors and its cgroup."""
        self.close_child_side()
        self.close_host_side()
        if self.cgroup is not None:
            self.cgroup.remove()


_STATIC_CACHE: OrderedDict[tuple[Any, ...], _Static] = OrderedDict()
_STATIC_CACHE_SIZE = 16
_STATIC_LOCK = fork_safe(threading.Lock())


def _static_for(policy: Policy, run_cwd: str, for_preexec: bool) -> _Static:
    if for_preexec:
        return _prepare_static(policy, run_cwd, for_preexec)
    # An image's name means the store's image, and a grant holding the store hides it (static.py): another
    # store (ISOLATE_IMAGE_STORE), or one made since, is another plan.
    store = imageroot.store_path()
    key = (policy, run_cwd, os.geteuid(), os.getegid(), store, os.path.isdir(store))
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
    bind_sources: Mapping[str, int] | None = None,
    overlay: Any = None,
    egress_detached: str | None = None,
    image_upper: Any = None,
) -> Prepared:
    """The plan for one run of ``args``: the cached static part plus what is this run's own.

    ``program_fd``: exec that executable (an O_PATH descriptor) with ``args``
    as its argv, instead of looking ``args[0]`` up (a kept sandbox's server).
    ``bind_sources``: {stand-in: descriptor}: the policy binds the stand-in
    directory (a real, empty one on the same file system); this run binds the
    directory open at the descriptor (O_PATH, the caller's) in its place. A
    kept sandbox's workspace is a new directory each time, and this keeps its
    policy's plan cached.
    ``overlay``: an overlay (``isolate.kernel.overlay.Layers``), or a sequence of them, each
    mounted in place of the tmpfs the policy has at its target (a kept sandbox's workspace; the
    copy-on-write views of ``isolate-run learn``'s write grants).
    ``image_upper``: a kept sandbox's upper layer on the host (``imageroot.HostUpper``), in place of the
    private tmpfs of an image's root.
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
    cmounts = None
    if static.idmap_steps or bind_sources or image_upper is not None or static.image_private is not None:
        cmounts = ffi.new("struct iso_mount[]", max(plan.n_mounts, 1))
        keep.append(cmounts)
        ffi.memmove(cmounts, plan.mounts, ffi.sizeof("struct iso_mount") * plan.n_mounts)
        plan.mounts = cmounts
    if bind_sources:
        assert cmounts is not None
        _substitute_binds(plan, cmounts, static, bind_sources, enforced, keep)

    if static.image_private is not None:
        assert cmounts is not None
        close_after.extend(imageroot.idmapped_layers(cmounts, plan.n_mounts, static.image_private))
    if image_upper is not None:
        assert cmounts is not None
        if plan.newuidmap != ffi.NULL:
            _close_all(close_after)
            # The program's files in the upper layer (and the image's files copied up, which keep their owners
            # through the ranges) would belong to a subordinate id on the host: the caller could neither read them
            # back (commit_image, a snapshot) nor remove them with the sandbox.
            raise UnsupportedError(
                f"image: the sandbox maps the caller's subordinate ids (its User, uid {static.program_uid} inside, "
                "or the owners of the image's files, kept through them), whose files in an upper layer on disk "
                f"({image_upper.purpose}) the caller could neither read back nor remove: use the tmpfs upper layer "
                f"(image_upper='tmpfs'), or run as the caller (uid={os.geteuid()}) an image pulled without "
                "subordinate ids (ISOLATE_IMAGE_OWNERS unset or 'caller', then into another store or after a prune)")
        try:
            close_after.extend(imageroot.plan_host_upper(image_upper, cmounts, plan.n_mounts, static.program_uid,
                                                         static.program_gid, cstr))
        except BaseException:
            _close_all(close_after)  # the layers' idmapped tree, made above
            raise
        shown = dict(enforced.get("image") or {})
        # What the static plan said of the root beyond its upper layer (imageroot.whole_root_refusal) stays said.
        said = str(shown.get("root", ""))
        refusal = said[said.index(imageroot.NO_NEW_ENTRY):] if imageroot.NO_NEW_ENTRY in said else ""
        enforced["image"] = dict(shown, root="overlayfs: the image's layers read-only, the sandbox's own upper "
                                 f"layer in {image_upper.upper} ({image_upper.purpose}){refusal}")

    # -- idmapped trees are consumed by each sandbox ---------------------------
    if static.idmap_steps:
        assert cmounts is not None
        userns_fd = _idmap_userns(static.program_uid, static.program_gid)
        for index, _ in static.idmap_steps:
            path = os.fsdecode(ffi.string(cmounts[index].source))
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

    # -- an overlay workspace takes the place of the tmpfs at its target --------
    overlays: list[tuple[Any, range]] = []
    many = isinstance(overlay, Sequence)
    for index, layers in enumerate(() if overlay is None else overlay if many else (overlay,)):
        try:
            steps = _plan_overlay(layers, plan, static, keep, close_after, enforced, cstr, index, many)
            # Its steps took the place of one: those of an overlay planned before, further on, moved.
            overlays = [(o, r if r.start < steps.start else range(r.start + len(steps) - 1, r.stop + len(steps) - 1))
                        for o, r in overlays]
            overlays.append((layers, steps))
        except BaseException:
            _close_all(close_after)
            raise

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
    program_env = program_environment(policy, env, static.home, static.image_env)
    if static.tmpdir and "TMPDIR" not in program_env:
        program_env["TMPDIR"] = static.tmpdir
    if static.image_env is None and "PATH" not in policy.env and not (
            env and any(os.fsdecode(k) == "PATH" for k in env)):
        # The caller's PATH, reduced to the directories that exist inside.
        program_env["PATH"] = reduced_path(program_env["PATH"], static.granted)
    if static.image_command is not None and program_fd < 0 and not for_preexec and executable is None:
        args = static.image_command.command([os.fsdecode(a) for a in args])  # Entrypoint, then args or Cmd
    if not for_preexec and args and program_fd < 0 and static.image_env is None:
        check_command(os.fsdecode(executable) if executable else os.fsdecode(args[0]), program_env["PATH"],
                      static.granted, run_cwd)
    egress_channel = None
    if isinstance(policy.network, Egress) and plan.n_egress_ports and not for_preexec:
        for name, value in egress_plan.proxy_environment().items():
            program_env.setdefault(name, value)
        egress_channel, plan.egress_fd = egress_plan.channel()
        close_after.append(plan.egress_fd)
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
    why_r = -1
    if program_fd >= 0 and plan.why != ffi.NULL:
        # A kept sandbox (its program is the exec server): the init writes each refusal as it happens,
        # with the caller's session, so that each command's report names its own (why.WhyStream).
        why_r, why_w = os.pipe2(os.O_CLOEXEC)
        plan.why_stream_fd = why_w
        close_after.append(why_w)
    enforced["fds"] = "closed above 2" + (f" except {fds}" if fds else "")

    prepared = Prepared(
        plan=plan,
        enforced=enforced,
        warnings=refusals.warnings,
        status_fd=status_r,
        why_stream=why.WhyStream(why_r) if why_r >= 0 else None,
        cgroup=prepared_cgroup,
        limit_cpu_seconds=limit_cpu,
        observed=static.observed,
        _keep=keep,
        _close_after_spawn=close_after,
        overlays=tuple(overlays),
        image_store=static.image_store,
        image_layers=static.image_layers,
        egress=policy.network if isinstance(policy.network, Egress) and egress_channel is not None else None,
        egress_channel=egress_channel,
        egress_detached=egress_detached,
    )
    return prepared


def _substitute_binds(plan: Any, cmounts: Any, static: _Static, bind_sources: Mapping[str, int],
                      enforced: dict[str, Any], keep: list[Any]) -> None:
    """Point this run's bind steps and Landlock rules at other directories than the stand-ins planned.

    The caller opened each directory (and checked it is the one it made); the
    child checks it bound that inode, as for any planned bind.
    """
    rules = None
    if plan.n_landlock_rules:
        rules = ffi.new("struct iso_landlock_rule[]", plan.n_landlock_rules)
        keep.append(rules)
        ffi.memmove(rules, plan.landlock_rules, ffi.sizeof("struct iso_landlock_rule") * plan.n_landlock_rules)
        plan.landlock_rules = rules
    for stand_in, fd in bind_sources.items():
        old_fd = static.source_fds.get(stand_in, -1)
        if old_fd < 0:
            raise IsolationError(f"binds: {stand_in} is not a source this policy binds")
        directory = os.readlink(f"/proc/self/fd/{fd}")
        found = 0
        old_sources = {(mounts.OLDROOT + stand_in).encode(), f"/proc/self/fd/{old_fd}".encode()}
        for i in range(plan.n_mounts):
            step = cmounts[i]
            if step.source == ffi.NULL or ffi.string(step.source) not in old_sources:
                continue
            if step.kind == lib.ISO_MOUNT_BIND:
                source = ffi.new("char[]", os.fsencode(mounts.OLDROOT + directory))
                step.fd = fd
            elif step.kind == lib.ISO_MOUNT_MOVE:
                source = ffi.new("char[]", f"/proc/self/fd/{fd}".encode())
            else:
                continue
            keep.append(source)  # the plan points into it: it lives as long as the run's plan
            step.source = source
            found += 1
        if rules is not None:
            for i in range(plan.n_landlock_rules):
                if rules[i].fd == old_fd:
                    path = ffi.new("char[]", os.fsencode(directory))
                    keep.append(path)
                    rules[i].fd = fd
                    rules[i].path = path
        if found != 1:
            raise IsolationError(f"binds: {stand_in} is bound {found} times by this policy; expected once")
        if "binds" in enforced:
            enforced["binds"] = [b.replace(stand_in + ":", directory + ":", 1) if b.startswith(stand_in + ":")
                                 else b for b in enforced["binds"]]
def _plan_overlay(layers: Any, plan: Any, static: _Static, keep: list[Any], close_after: list[int],
                  enforced: dict[str, Any], cstr: Any, index: int = 0, many: bool = False) -> range:
    """Put the overlay's steps (isolate/kernel/overlay.py) where the plan mounts a tmpfs at its target."""
    from ...kernel import overlay as overlay_mod

    target = os.fsencode(mounts.NEWROOT + layers.target)
    at = next((i for i in range(plan.n_mounts)
               if plan.mounts[i].kind == lib.ISO_MOUNT_TMPFS and ffi.string(plan.mounts[i].target) == target), -1)
    if at < 0 or not plan.clone_flags:
        raise UnsupportedError(f"workspace mode overlay: {layers.target} is mounted inside the sandbox's own "
                               "mount namespace, and this plan has none; " + overlay_mod.WAY_OUT)
    planned = overlay_mod.plan(layers, mounts.NEWROOT, mounts.OLDROOT, static.program_uid, static.program_gid, index)
    close_after.extend(planned.fds)
    n = plan.n_mounts - 1 + len(planned.steps)
    cmounts = ffi.new("struct iso_mount[]", n)
    keep.append(cmounts)
    ffi.memmove(cmounts, plan.mounts, ffi.sizeof("struct iso_mount") * at)
    for j, step in enumerate(planned.steps):
        c = cmounts[at + j]
        c.kind, c.target, c.flags, c.fd, c.mode = step.kind, cstr(step.target), step.flags, step.fd, step.mode
        c.source = cstr(step.source) if step.source else ffi.NULL
        c.upper = cstr(step.upper) if step.upper else ffi.NULL
        c.work = cstr(step.work) if step.work else ffi.NULL
    rest = plan.n_mounts - at - 1
    if rest:
        ffi.memmove(cmounts + (at + len(planned.steps)), plan.mounts + (at + 1),
                    ffi.sizeof("struct iso_mount") * rest)
    plan.mounts = cmounts
    plan.n_mounts = n
    if many:
        enforced.setdefault("overlays", []).append(dict(planned.enforced, target=layers.target))
    else:
        enforced["workspace"] = planned.enforced
    return range(at, at + len(planned.steps))


def spawn(prepared: Prepared, args: Sequence[str]) -> int:
    """Start the sandbox; returns the pid of its init. Raises SetupError and friends."""
    failure = ffi.new("struct iso_failure *")
    starting = contextlib.ExitStack()
    if prepared.image_store is not None:
        # Under the store's lock (shared): the layers are there, and the lease is written before prune can
        # look (image/leases.py).
        try:
            starting.enter_context(prepared.image_store.starting(list(prepared.image_layers), "image"))
        except BaseException:
            prepared.close_child_side()
            prepared.close_host_side()
            raise
    with starting:
        plan = prepared.plan
        netns_fd = (netns.take() if plan.clone_flags & CLONE_NEWNET and not plan.loopback_up and plan.egress_fd < 0
                    and not plan.netns_fd else -1)
        if netns_fd >= 0:  # an empty network namespace made ahead: the sandbox is born in it (kernel/netns.py)
            plan.netns_fd, plan.clone_flags = netns_fd, plan.clone_flags & ~CLONE_NEWNET
        try:
            pid = lib.iso_spawn(plan, failure)
        finally:
            if netns_fd >= 0:
                plan.netns_fd, plan.clone_flags = 0, plan.clone_flags | CLONE_NEWNET
                os.close(netns_fd)
            prepared.close_child_side()
        if pid >= 0 and prepared.image_store is not None:
            from ...image import leases

            try:
                prepared.lease = leases.write(prepared.image_store.path, int(pid), prepared.image_layers)
            except OSError as exc:
                # No lease, no run: prune could take the layers from under it.
                os.kill(int(pid), signal.SIGKILL)
                os.waitpid(int(pid), 0)
                prepared.close_host_side()
                raise IsolationError(f"image: cannot write the sandbox's lease in the image store "
                                     f"{prepared.image_store.path}: {exc.strerror}") from None
    if pid < 0:
        prepared.close_host_side()
        raise failure_to_error(prepared, failure, args)
    if prepared.egress_channel is not None:
        assert prepared.egress is not None
        channel, prepared.egress_channel = prepared.egress_channel, None
        try:
            if prepared.egress_detached is not None:
                prepared.mediator_process, prepared.mediator_query = egress_plan.start_mediator_process(
                    prepared.egress, channel, int(pid), prepared.egress_detached)
            else:
                prepared.mediator = egress_plan.start_mediator(prepared.egress, channel)
        except BaseException:
            # No mediator, no run: the sandbox ends before its program can wait on it.
            os.kill(int(pid), signal.SIGKILL)
            os.waitpid(int(pid), 0)
            raise
    return int(pid)


def failure_to_error(prepared: Prepared, failure: Any, args: Sequence[str]) -> Exception:
    step, err, index = int(failure.step), int(failure.err), int(failure.index)
    plan = prepared.plan
    name = step_name(step)
    for layers, steps in prepared.overlays:
        if index in steps:
            from ...kernel import overlay as overlay_mod

            return overlay_mod.failure(err, layers, name)
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
        if err == errno_mod.EPERM and plan.seccomp_filter != ffi.NULL:
            # Landlock and DAC say EACCES; EPERM from the exec is the seccomp profile's rule on execveat's
            # arguments (one that refuses it whatever they are is refused before the run: compiler._check_start).
            return SetupError(f"{program}: the seccomp profile refused execveat, the system call that starts the "
                              "program (isolate execs it with execveat(2)): allow execveat in the profile",
                              name, err, "execveat")
        return CommandNotExecutableError(err, f"{program}: cannot execute: {os.strerror(err)}", program)
    detail = ""
    if step in (lib.ISO_STEP_MOUNT_DIR, lib.ISO_STEP_MOUNT_BIND, lib.ISO_STEP_MOUNT_TMPFS,
                lib.ISO_STEP_MOUNT_SYMLINK, lib.ISO_STEP_MOUNT_MOVE, lib.ISO_STEP_MOUNT_READONLY,
                lib.ISO_STEP_MOUNT_PROC, lib.ISO_STEP_MOUNT_DEVPTS) and 0 <= index < plan.n_mounts:
        detail = os.fsdecode(ffi.string(plan.mounts[index].target))
        detail = detail[len(mounts.NEWROOT):] or "/"
    elif step == lib.ISO_STEP_LANDLOCK and 0 <= index < plan.n_landlock_rules:
        detail = os.fsdecode(ffi.string(plan.landlock_rules[index].path))
    elif step == lib.ISO_STEP_RLIMIT and 0 <= index < plan.n_rlimits:
        detail = f"resource {plan.rlimits[index].resource}"
    elif step == lib.ISO_STEP_CHDIR and plan.cwd != ffi.NULL:
        detail = os.fsdecode(ffi.string(plan.cwd))
        return SetupError(
            f"sandbox setup failed at chdir: {detail}: {os.strerror(err)}; the working directory must be "
            "inside a granted path (grant it with write= or read=, or set cwd=)",
            name, err, detail,
        )
    where = f" ({detail})" if detail else ""
    if step == lib.ISO_STEP_USERNS_MAP and plan.newuidmap != ffi.NULL:
        helpers = f"{os.fsdecode(ffi.string(plan.newuidmap))} or {os.fsdecode(ffi.string(plan.newgidmap))}"
        return SetupError(f"sandbox setup failed at {name}: {helpers} refused the caller's subordinate ids "
                          f"({os.strerror(err)}; its own message is above): check the caller's lines in /etc/subuid "
                          "and /etc/subgid, or run as the caller (uid=)", name, err, detail)
    if step == lib.ISO_STEP_MOUNT_PROC and err in (errno_mod.EPERM, errno_mod.EACCES):
        return SetupError(f"sandbox setup failed at {name}{where}: {os.strerror(err)}: "
                          + hostinfo.proc_mount_advice(), name, err, detail)
    return SetupError(
        f"sandbox setup failed at {name}{where}: {os.strerror(err)}; run `isolate-run doctor` to see what this "
        "host can enforce",
        name, err, detail,
    )


def unsupported_reasons(policy: Policy) -> list[str]:
    """What the native backend cannot enforce for ``policy`` on this host (empty: all of it)."""
    reasons = []
    refusal = image_refusal(policy)
    if refusal:
        reasons.append(refusal)
    if isinstance(policy.network, Egress) and not policy.namespaces:
        reasons.append("network: egress by name needs a network namespace of its own (namespaces=true)")
    limits = policy.limits
    if limits.memory is not None or limits.pids is not None or limits.cpus is not None:
        refusal = _cgroup_refusal(frozenset(_cgroup_needs(policy)))
        if refusal:
            reasons.append(refusal)
    if policy.namespaces and userns_error():
        reasons.append(f"namespaces: this caller cannot create a user namespace ({os.strerror(userns_error())}): "
                       + hostinfo.userns_advice(userns_error()))
    refusal = None if policy.namespaces else landlock.without_namespaces_refusal(landlock.abi())
    if refusal:
        reasons.append(refusal)
    return reasons
