"""The static part of a plan: what depends only on the policy, the directory and the caller.

``_build_static`` resolves and opens the granted paths, chooses the namespaces and ids, builds the
mounts, the Landlock rules and the seccomp filter, once; ``plan`` caches the result.
"""

from __future__ import annotations

import contextlib
import os
import resource
import stat
from collections.abc import Sequence
from typing import Any

from ..._core import INIT_PATH, ffi, init_fd, lib
from ...kernel import grants, hostinfo, landlock, mounts, privateids
from ...kernel.hostinfo import userns_error
from ...kernel.places import runtime_dir
from ...kernel.privateids import PrivateIds
from ...kernel.subids import SubIds
from ...model.errors import PolicyError, UnsupportedError
from ...model.policy import DEFAULT_READ, DEFAULT_TMPFS, DEFAULT_WRITE, Egress, Policy
from ...model.units import milliseconds_up
from . import egress as egress_plan
from . import imageroot
from .common import NOBODY, _Refusals, _Static, input_bytes
from .environment import _no_ns_tmpdir, _plan_home
from .filters import _apply_seccomp, _report_host_reach
from .limits import _cgroup_needs
from .observe import denials_observed
from .writes import _idmap_userns, _refuse_system_cwd, _write_route

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

HOSTNAME = "isolate"


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


def _yama_ptrace_scope() -> int:
    """/proc/sys/kernel/yama/ptrace_scope (0 without Yama)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as handle:
            return int(handle.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _plan_why(plan: Any, cstr: Any, for_preexec: bool, use_ns: bool, rules: list[tuple[str, int]],
              rule_fds: dict[int, int], enforced: dict[str, Any]) -> None:
    """Denial tracing: the init's spec (csrc/why.c), each Landlock rule by inode or by path inside."""
    if for_preexec or not use_ns:
        raise UnsupportedError(
            "trace_denials: naming refused file accesses needs the sandbox's init, which "
            + ("preexec_fn does not have: use isolate.run or isolate.Popen" if for_preexec else
               "a run without namespaces does not have: drop namespaces=False (--no-namespaces)"))
    parts = ["1", str(int(plan.landlock_handled_fs) if plan.landlock_abi else 0)]
    for i, (path, rights) in enumerate(rules):
        fd = rule_fds.get(i, -1)
        if fd >= 0:
            info = os.fstat(fd)
            parts.append(f"{rights}:{info.st_dev}:{info.st_ino}")
        else:  # a path only the sandbox has (its tmpfs, /dev, /proc): the init finds its inode
            parts.append(f"{rights}/{os.fsencode(path).hex()}")
    plan.why = cstr(",".join(parts))
    enforced["denial_tracing"] = "init (path system calls looked at and let continue)"


def _build_static(policy: Policy, run_cwd: str, for_preexec: bool, static_fds: list[int]) -> _Static:
    refused_image = imageroot.image_refusal(policy)
    if refused_image:
        raise UnsupportedError(refused_image)  # even for best effort: see image_refusal
    image_root = imageroot.load(policy) if policy.image is not None else None
    refusals = _Refusals(policy.best_effort)
    enforced: dict[str, Any] = {}
    keep: list[Any] = []

    def cstr(text: str | bytes) -> Any:
        data = ffi.new("char[]", os.fsencode(text))
        keep.append(data)
        return data

    defaults_read = policy.read == DEFAULT_READ
    # An image is the system: the host's system directories (the default read grants) are not shown.
    read = [] if image_root is not None and defaults_read else _resolve(policy.read, run_cwd, "read",
                                                                         skip_missing=defaults_read)
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

    use_ns = policy.namespaces
    # isolate's runtime directory under a grant: hidden under an empty private tmpfs inside, or, with no
    # mount namespace to do that in, refused (grants.runtime_dir_below says why). A read grant too: a
    # program could read the cached CLI plans there, and connect() to a kept sandbox's socket needs no
    # write access to the mount. (A root caller's program is another uid: the directory's mode keeps it out.)
    hidden: list[str] = []
    store_hidden: list[str] = []  # the image store, reported apart: it is no runtime directory

    store = imageroot.store_path()
    store_exists = os.path.isdir(store)

    def hide_runtime_dir(real: str, target: str, path: str, field_name: str, readonly: bool = False) -> None:
        if store_exists and use_ns:
            # The image store: its layers become other sandboxes' roots. A grant holding it shows an empty
            # tmpfs in its place; a grant inside it is refused.
            if real == store or real.startswith(store + "/"):
                raise PolicyError(f"{field_name}: {path} lies in isolate's image store {store}; grant only the "
                                  "directories the program needs", field_name)
            if store.startswith(real.rstrip("/") + "/"):
                store_hidden.append(os.path.normpath(os.path.join(target, os.path.relpath(store, real))))
        below = grants.runtime_dir_below(real, path, field_name)
        if below is None:
            return
        if not use_ns:
            if readonly and os.geteuid() == 0:
                return
            grants.refuse_runtime_dir(real, path, field_name)
        runtime_dir()  # it must exist now, to be covered, rather than appear later in a granted tree
        hidden.append(os.path.normpath(os.path.join(target, below)))

    for path in read:
        real = open_source(path, "read")
        hide_runtime_dir(real, real, path, "read", readonly=True)
    for path in write:
        real = open_source(path, "write")
        hide_runtime_dir(real, real, path, "write")
    # Host paths shown at other paths: (real source, target, read-only).
    binds = [(open_source(os.path.join(run_cwd, m.source), "binds"), m.target, m.mode == "ro")
             for m in policy.binds]
    for (source, target, readonly), m in zip(binds, policy.binds, strict=True):
        hide_runtime_dir(source, target, m.source, "binds", readonly)
    rw_sources = [source for source, _, readonly in binds if not readonly]
    # Host paths granted read-only in an image sandbox (before egress's name files, which are isolate's own): the
    # image's root takes new entries only without them (imageroot.landlock_rules).
    image_read_only = [*read, *(source for source, _, readonly in binds if readonly)] if image_root else []
    tmpfs = list(policy.tmpfs) if use_ns or policy.tmpfs != DEFAULT_TMPFS else []
    if tmpfs and not use_ns:
        refusals.refuse("tmpfs: a private tmpfs needs namespaces (namespaces=true)")
        tmpfs = []
    tmpfs += [path for path in (*hidden, *store_hidden) if path not in tmpfs]
    if hidden:
        enforced["runtime_dir_hidden"] = hidden
    if store_hidden:
        enforced["image_store_hidden"] = store_hidden

    plan = ffi.new("struct iso_plan *")
    keep.append(plan)
    for i in range(8):
        plan.cgroup_procs_fds[i] = -1
    plan.idmap_userns_fd = -1
    plan.program_fd = -1
    plan.egress_fd = -1
    plan.why_stream_fd = -1
    caller_uid, caller_gid = os.geteuid(), os.getegid()
    root_caller = caller_uid == 0
    program_uid = policy.uid if policy.uid is not None else (NOBODY if root_caller else caller_uid)
    program_gid = policy.gid if policy.gid is not None else (NOBODY if root_caller else caller_gid)
    if not root_caller and (policy.uid not in (None, caller_uid) or policy.gid not in (None, caller_gid)):
        raise PolicyError("uid/gid: only a root caller can run the program as another user", "uid")
    ranges: SubIds | None = None  # a regular caller's subordinate ids, mapped through newuidmap
    #: A root caller's image User: isolate's private range maps its ids (the program's, the layers' owners).
    private: PrivateIds | None = None
    if image_root is not None:
        program_uid, program_gid, found_ranges = imageroot.program_ids(image_root, policy, program_uid,
                                                                       program_gid, root_caller, enforced,
                                                                       not for_preexec)
        if isinstance(found_ranges, PrivateIds):
            private = found_ranges
        else:
            ranges = found_ranges
        owners = None if root_caller else imageroot.owners_note(image_root, program_uid, ranges)
        if owners is not None:
            enforced["image_owners"] = owners

    # -- namespaces and ids ------------------------------------------------
    # Egress by name is the namespace's own loopback, plus the mediator's listeners on it.
    egress = policy.network if isinstance(policy.network, Egress) else None
    network: str = "loopback" if isinstance(policy.network, Egress) else policy.network
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
    # The program's ids inside its namespace (what it setuid()s to, what its home is given): the host's own,
    # but in a private range (program_uid and program_gid are then the host's ids of them).
    inside_uid, inside_gid = program_uid, program_gid
    if private is not None:
        program_uid, program_gid = private.host_uid(inside_uid), private.host_gid(inside_gid)
    write_route = "idmapped"
    if root_caller and (write or rw_sources):
        write_route, routed_uid, routed_gid = _write_route(
            write + rw_sources, policy, program_uid, program_gid,
            None if use_ns else "without namespaces there is no idmapped mount: plain permissions decide")
        if (routed_uid, routed_gid) != (program_uid, program_gid):
            # The writable paths' owner: a host user, the program runs as it (as without an image's User).
            if private is not None:
                enforced["image_user"] = (f"{image_root.image.config.user if image_root else ''} not applied: the "
                                          f"program runs as uid {routed_uid}, the writable paths' owner")
            private = None
            inside_uid, inside_gid = program_uid, program_gid = routed_uid, routed_gid
    if use_ns:
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        if network != "host":
            flags |= CLONE_NEWNET
        if private is not None:
            # Root stays root during the setup; the image's ids 1 to 65535 are isolate's private range, the
            # program one of them (the image's layers are idmapped alike: imageroot.idmapped_layers).
            plan.uid_map = cstr(private.uid_map())
            plan.gid_map = cstr(private.gid_map())
            enforced["id_map"] = "written by the parent (root): root, and isolate's private range: " + \
                private.describe()
        elif root_caller:
            # Root stays root inside during the setup (so that it can reach
            # the sources it binds, whatever their modes), and the program
            # and the init switch to the unprivileged ids before they exec.
            plan.uid_map = cstr(f"0 0 1\n{program_uid} {program_uid} 1\n")
            plan.gid_map = cstr(f"0 0 1\n{program_gid} {program_gid} 1\n")
            enforced["id_map"] = "written by the parent (root): root, and the program's ids"
        elif ranges is not None:
            # The caller is root inside (it owns the image's files), the program one of its subordinate ids;
            # the set-id helpers write the maps, the child waiting on its pipe meanwhile (csrc/userns.c).
            plan.uid_map = cstr(ranges.uid_map(caller_uid))
            plan.gid_map = cstr(ranges.gid_map(caller_gid))
            plan.newuidmap = cstr(ranges.newuidmap)
            plan.newgidmap = cstr(ranges.newgidmap)
            enforced["id_map"] = ranges.describe()
        else:
            plan.uid_map = cstr(f"{caller_uid} {caller_uid} 1\n")
            plan.gid_map = cstr(f"{caller_gid} {caller_gid} 1\n")
        plan.setgroups_deny = 0 if root_caller or ranges is not None else 1
        plan.hostname = cstr(HOSTNAME)
        plan.loopback_up = 1 if network == "loopback" else 0
        enforced["namespaces"] = [n for n, f in NAMESPACE_FLAGS.items() if flags & f]
        enforced["network"] = {"none": "netns-empty", "loopback": "netns-loopback", "host": "host"}[network]
    else:
        enforced["namespaces"] = []
    if egress is not None:
        if for_preexec or not use_ns:
            refusals.refuse("network: egress by name needs a network namespace of its own and isolate's mediator; "
                            + ("preexec_fn has no mediator: use isolate.run, isolate.Popen or isolate.Sandbox"
                               if for_preexec else "this run has no namespaces: drop --no-namespaces "
                               "(namespaces=True)"))
            network, egress = "none", None
            plan.loopback_up = 0
            if use_ns:
                enforced["network"] = "netns-empty"
        else:
            egress_plan.plan_listeners(plan, egress, keep, enforced)
            for source, target in egress_plan.name_files():
                binds.append((open_source(source, "network"), target, True))
    plan.clone_flags = flags
    plan.set_ids = 1 if root_caller or ranges is not None else 0
    plan.uid = inside_uid
    plan.gid = inside_gid
    plan.clear_groups = 1 if root_caller or ranges is not None else 0
    plan.drop_caps = 1
    plan.no_new_privs = 1
    plan.new_session = 1 if policy.new_session else 0
    plan.die_with_parent = 1 if policy.die_with_parent else 0
    enforced["user"] = {"uid": program_uid, "gid": program_gid}
    if private is not None:
        # The host's ids above; the image's inside, and the range (commit_image maps the upper layer's back).
        enforced["user"].update(inside={"uid": inside_uid, "gid": inside_gid},
                                private_range={"uid_start": private.uid_start, "gid_start": private.gid_start,
                                               "count": private.count})
    enforced["no_new_privs"] = True
    enforced["capabilities"] = "all dropped" if (use_ns or root_caller) else "none held (no_new_privs)"

    # -- the program's home ------------------------------------------------
    home, home_files = _plan_home(policy, use_ns, read + write, tmpfs, run_cwd, program_uid, program_gid,
                                  refusals, open_source)
    if image_root is not None:
        image_read_only.extend(real for real, _ in home_files)
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
    if egress is not None:
        # Who names a refused direct address (connect, sendto, sendmsg) in the report: the init, which
        # supervises them, or nobody where it does not (Landlock ABI 9 resolves unix sockets, so there is
        # no supervisor): the namespace refuses them all the same, and the report says they go unnamed.
        enforced["egress"]["direct_addresses"] = (
            "refused by the namespace, named by the init" if unix_mode == "supervisor" else
            "refused by the namespace, not named (no supervisor on this kernel: Landlock ABI 9)")
    if unix_mode == "supervisor":
        from ...kernel import seccomp as seccomp_mod

        spec = ",".join(
            [egress_plan.supervise_mode(network, egress, *(seccomp_mod.syscall_number(n) or -1
                                                           for n in ("sendto", "sendmsg", "sendmmsg")))]
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
            home_options = f"mode=0700,uid={inside_uid},gid={inside_gid}," + mounts.tmpfs_bounds(tmpfs_size)
            home_mount = mounts.Home(home, home_options if home not in tmpfs else "", home_files)
        mount_plan = mounts.plan_root(read, write_trees, tmpfs, tmpfs_options,
                                      source_fds if os.path.isdir("/proc/self/fd") else None, home_mount,
                                      shm_options="mode=1777," + mounts.tmpfs_bounds(shm_size),
                                      binds=bind_trees)
        steps = mount_plan.steps
        first: list[Any] = []
        if image_root is not None:
            imageroot.check_targets(image_root, steps)
            layers_dir = os.path.dirname(os.path.dirname(image_root.lowers[0]))
            store_fd = os.open(layers_dir, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY)
            static_fds.append(store_fd)
            first = imageroot.steps(image_root, store_fd, "mode=0755," + mounts.tmpfs_bounds(tmpfs_size))
            enforced["image"] = {"reference": image_root.image.reference, "id": image_root.image.id,
                                 "layers": len(image_root.lowers),
                                 "root": "overlayfs: the image's layers read-only, a private tmpfs as upper layer"
                                         + imageroot.upper_limits() + imageroot.whole_root_refusal(image_read_only)}
        cmounts = ffi.new("struct iso_mount[]", max(len(first) + len(steps), 1))
        keep.append(cmounts)
        for i, istep in enumerate(first):
            c = cmounts[i]
            c.kind, c.flags, c.fd, c.mode, c.target = istep.kind, istep.flags, istep.fd, istep.mode, cstr(istep.target)
            c.source = cstr(istep.source) if istep.source else ffi.NULL
            c.upper = cstr(istep.upper) if istep.upper else ffi.NULL
            c.work = cstr(istep.work) if istep.work else ffi.NULL
        for i, step in enumerate(steps, len(first)):
            cmounts[i].kind = step.kind
            cmounts[i].flags = step.flags
            cmounts[i].fd = step.fd
            cmounts[i].mode = step.mode
            cmounts[i].source = cstr(step.source) if step.source else ffi.NULL
            cmounts[i].target = cstr(mounts.NEWROOT + step.target)
        idmap_steps = [(i, step.source) for i, step in enumerate(steps, len(first))
                       if step.kind == lib.ISO_MOUNT_MOVE and root_caller and not for_preexec]
        plan.staging = cstr(mounts.STAGING)
        plan.mounts = cmounts
        plan.n_mounts = len(first) + len(steps)
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
    rules: list[tuple[str, int]] = []
    rule_fds: dict[int, int] = {}
    if abi:

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
            if image_root is not None:
                rules.extend(imageroot.landlock_rules(image_root, landlock.read_rights(abi),
                                                      landlock.write_rights(abi), not image_read_only,
                                                      resolve_unix))
            else:
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
    if policy.trace_denials:
        _plan_why(plan, cstr, for_preexec, use_ns, rules, rule_fds, enforced)
    refusal = None if use_ns else landlock.without_namespaces_refusal(abi)
    if refusal:
        refusals.refuse(refusal)
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
    # No set-user/group-ID bit on anything the program writes, for every
    # caller: what a root caller's program creates in an idmapped writable
    # path is root's on disk, and what a user's program creates is that
    # user's, which a set-ID bit would lend to whoever runs it later (another
    # account, a service). The namespace's nosuid mounts do not cover the
    # host's view of the grant.
    deny_setid = bool(write or rw_sources)
    seccomp_unix = {"supervisor": "supervise-sendto" if egress else "supervise",
                    "seccomp-no-unix-sockets": "deny"}.get(unix_mode, "")
    # A profile file's contents are a premise of this plan (read before the filter is compiled from them): the
    # plan is cached by the policy, which names the file, not what it holds.
    contents = [(policy.seccomp, input_bytes(policy.seccomp))] if isinstance(policy.seccomp, str) and \
        policy.seccomp not in ("default", "strict", "none") else []
    _apply_seccomp(policy, plan, keep, enforced, refusals, deny_sockets, deny_setid,
                   notify=use_ns and not for_preexec, unix_sockets=seccomp_unix, deny_host_reach=not use_ns)
    if not use_ns:
        _report_host_reach(plan, enforced, refusals, network)
    observed = denials_observed(use_ns, bool(plan.seccomp_notify), abi)
    if policy.trace_denials:
        detail = ("traced: the init looks at each path system call (open, exec, create, remove, rename, "
                  "truncate; stat, access, readlink and chdir for a path's absence) and names the refused ones; "
                  "calls on descriptors (ioctl, ftruncate) are not seen")
        observed["landlock"] = {"observed": True, "detail": detail}
        observed["mounts"] = {"observed": True, "detail": detail}
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
    rlimits = _within_hard_limits(rlimits, refusals)
    if limits.wall_seconds is not None:
        plan.wall_ms = milliseconds_up(limits.value("wall_seconds") or 0.0)
        enforced["wall_seconds"] = "init"
    enforced["session"] = "new" if policy.new_session else "inherited"
    plan.init_fd = init_fd()
    enforced["init"] = "isolate-init"
    cwd = os.path.abspath(policy.cwd) if policy.cwd else run_cwd
    if image_root is not None and not policy.cwd and not any(
            run_cwd == g or run_cwd.startswith(g.rstrip("/") + "/") for g in read + write):
        cwd = image_root.image.config.working_dir or "/"  # the caller's directory is not in the sandbox
    plan.cwd = cstr(cwd)
    if for_preexec and not policy.cwd:
        plan.cwd = ffi.NULL  # the hook keeps the directory subprocess chose

    stamps = []
    for path in read + write + [source for source, _, _ in binds]:
        info = os.stat(path)
        stamps.append((path, (info.st_dev, info.st_ino)))
    for path in image_root.stamps if image_root is not None else ():
        info = os.stat(path)
        stamps.append((path, (info.st_dev, info.st_ino)))
    # The files that gave the private range, or would now refuse it (useradd and usermod rename a new file over).
    for path in privateids.files() if private is not None else ():
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(path)
            stamps.append((path, (info.st_dev, info.st_ino)))
    return _Static(
        plan=plan, keep=keep, enforced=enforced, warnings=refusals.warnings, rlimits=rlimits,
        cgroup_needs=_cgroup_needs(policy), limit_cpu_seconds=limit_cpu, idmap_steps=idmap_steps,
        program_uid=program_uid, program_gid=program_gid, run_cwd=run_cwd, home=home, observed=observed,
        tmpdir=_no_ns_tmpdir(home, program_uid, program_gid) if home and not use_ns else None,
        granted=tuple(dict.fromkeys(read + write + [os.path.realpath(p) for p in read + write]
                                    + [target for _, target, _ in binds])), stamps=stamps,
        fds=static_fds, source_fds=dict(source_fds),
        image_env=image_root.env if image_root is not None else None,
        image_command=image_root.image.config if image_root is not None else None,
        image_store=image_root.image.store if image_root is not None else None,
        image_layers=tuple(os.path.dirname(d) for d in image_root.lowers) if image_root is not None else (),
        image_root=image_root, contents=contents, image_private=private,
    )


#: The policy's name of each rlimit it sets, the unit it is shown in, and how ``ulimit`` shows the hard limit.
_RLIMIT_FIELDS = {resource.RLIMIT_NOFILE: ("limits.open_files", "", "ulimit -Hn"),
                  resource.RLIMIT_FSIZE: ("limits.file_size", " bytes", "ulimit -Hf"),
                  resource.RLIMIT_CPU: ("limits.cpu_seconds", " s", "ulimit -Ht")}


def _within_hard_limits(rlimits: list[tuple[int, int, int]], refusals: _Refusals) -> list[tuple[int, int, int]]:
    """The rlimits, each refused (the value and the ceiling named) where it is above this process's own hard
    limit: the sandbox's setup can only lower a hard limit (it holds no CAP_SYS_RESOURCE over the host's
    limits), and the kernel's EPERM would blame the setup, not the value. A hard limit above a soft one that
    fits (RLIMIT_CPU's second of grace) is lowered to the ceiling; under best effort the ceiling stays."""
    out = []
    for which, soft, hard in rlimits:
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY and hard > ceiling:
            if soft > ceiling:
                field, unit, spelling = _RLIMIT_FIELDS.get(which, (f"rlimit {which}", "", "ulimit -H"))
                refusals.refuse(f"{field}: {soft}{unit} is above this process's own hard limit, {ceiling}{unit} "
                                f"({spelling}), which a sandbox cannot raise; ask for at most that, or raise the "
                                "hard limit before isolate runs")
            soft, hard = min(soft, ceiling), ceiling
        out.append((which, soft, hard))
    return out
