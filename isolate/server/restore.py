"""A server's start on a state directory an earlier server used: its kept sandboxes served again.

For each record (isolate.server.keep), in the server's own words at start:

- a sandbox past its expiry (it passed while no server ran) is ended now,
  with its files, and the named volumes it held are let go (removed when the
  create that made them asked: ``deleteOnSandboxTermination``);
- a sandbox that ended meanwhile (killed, a reboot) is let go the same way;
- a sandbox that ended with the last server (one whose parts lived in it:
  a credential vault, the warm pool's, a Ray node's) likewise, and the
  credentials of its vault are counted as lost (their values were never
  written anywhere);
- a sandbox with an egress allow-list whose mediator process ended (it
  outlives the server, not a kill of its own) is ended: nothing would leave
  it, and the mediator cannot be started again (its listeners were made
  inside the sandbox at its start);
- any other is attached by its name and served under its id, with its
  metadata, expiry, tokens (as hashes), named volumes, code contexts (an
  interpreter or a bash context's shell is a process of the sandbox,
  connected to or adopted again at its next use: isolate.server.code; a Go
  context is made again; a Java context on a JDK before 16 ended) and
  background commands (processes of the sandbox too, their output and exit
  status in its files: isolate.server.background) and bash sessions (their
  shells adopted as a bash context's); the foreground commands the last
  server ran in it ended with it (the exec server ends a command whose host
  hung up), what they left running in the background runs on. One paused when the server ended stays
  paused.

A kept sandbox of this state directory's name without a record (the last
server was killed between its start and its record) is ended and removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from ..kept.sandbox import Sandbox
from ..model.errors import IsolationError
from .background import KeptCommand
from .keep import Record
from .state import OUTPUT_LIMIT, RUNNING, ManagedSandbox, ServerState, disk_upper_possible, thaw
from .stopped import (
    FromStopped,
    StoppedBox,
    boot_id,
    files_left,
    put_back,
    remove_aside,
    remove_files,
    set_aside,
)

#: The status reason of a sandbox a reboot stopped (Paused), and its message.
REBOOT_REASON = "host_reboot"
REBOOT_MESSAGE = ("its processes ended with a host reboot; its files are kept: resume starts it again over them "
                  "(POST /v1/sandboxes/{id}/resume), delete removes it")


def resume_restored(managed: ManagedSandbox) -> str:
    """Resume a sandbox a restarted server found paused: thawed, continued, attached again."""
    thaw(managed.box)
    for proc in managed.box.processes():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGCONT)
    name = managed.box.name
    assert name is not None
    managed.box = Sandbox.attach(name)
    for context in [*managed.contexts.values(), *managed.sessions.values()]:
        context.rebind(managed.box)  # made with the handle before (of one not attached, if paused at the restart)
    end_in_doubt(managed)  # its record is written once it runs
    return "thawed"


def end_in_doubt(managed: ManagedSandbox) -> None:
    """End the kept shells and interpreters a running sandbox's record names as ones to end (its last server was
    killed as it made or deleted them: ManagedSandbox.shell_in_doubt); each ended is named no longer."""
    from .code import KeptInterpreter
    from .code.shell import BashShell

    for key in sorted(managed.ending_shells):
        with contextlib.suppress(Exception):
            BashShell(managed.box, key, kept=True, fresh=False).close()
            managed.ending_shells.discard(key)
    for context_id, language in sorted(managed.ending_contexts.items()):
        with contextlib.suppress(Exception):
            KeptInterpreter(managed.box, language, context_id, fresh=False).close()
            managed.ending_contexts.pop(context_id, None)


def _stopped(state: ServerState, record: Record) -> ManagedSandbox | None:
    """A sandbox whose description a reboot took, kept stopped over its files when its copy reads back and its
    data directory is the one the copy names (isolate.server.stopped); None otherwise (it is let go)."""
    import functools

    from .models import parse_create

    if state.stopped is None or state.keeper is None:
        return None
    name = state.keeper.name_for(record.id)
    try:
        copy = state.stopped.read(record.id)
    except (OSError, ValueError, RecursionError, IsolationError):
        return None
    if not copy.boot or copy.boot == boot_id():
        return None  # no reboot since: its description went with a delete or a kill, and so does it
    if not files_left(name, copy):
        return None
    try:
        policy = parse_create(copy.request, state.profiles, state.any_image).policy
    except Exception:  # the image's profile is gone: listed all the same; its resume says why it cannot start
        from ..model.policy import Policy

        policy = Policy()
    box: Any = StoppedBox(name, policy, copy)
    managed = _from_record(state, record, box)
    managed.stopped = True
    if record.egress is not None:
        managed.egress_rules = list(record.egress)
    managed.on_close.append(functools.partial(state.stopped.forget, record.id))
    managed.set_state("Paused", REBOOT_REASON, REBOOT_MESSAGE.format(id=record.id))
    return managed


def _finish_resume(state: ServerState, sandbox_id: str, name: str, box: Sandbox) -> None:
    """A sandbox served again whose last server was killed as it resumed it after a reboot (the old data
    directory still set aside): its copy names the new one's layers, and the old directory goes."""
    from .stopped import ASIDE

    if state.stopped is None:
        return
    try:
        from ..kernel.places import state_path

        if not os.path.lexists(os.path.join(state_path("sandboxes"), name + ASIDE)):
            return
        copy = state.stopped.read(sandbox_id)
        state.stopped.keep(sandbox_id, copy.request, box)
        remove_aside(name, copy.data)
    except (OSError, ValueError, RecursionError, IsolationError):
        return


def resume_stopped(state: ServerState, managed: ManagedSandbox) -> str:
    """Start a sandbox a reboot stopped again over its files (isolate.server.stopped): its kept create request
    parsed again as any create, its named and host volumes opened again, a new kept sandbox of its name
    started from one layer made of its old ones; the old data directory then removed."""
    import functools
    import math
    import shlex

    from .models import KEEPALIVE_ENTRYPOINT, ApiError, egress_with, parse_create
    from .volumes import open_volumes
    from .volumes import release as release_volumes
    from .volumes import verify as verify_volumes

    stand_in = managed.box
    assert isinstance(stand_in, StoppedBox) and state.stopped is not None
    copy, name = stand_in.copy, stand_in.name
    try:
        req = parse_create(copy.request, state.profiles, state.any_image)
    except ApiError as exc:
        raise ApiError(409, "CANNOT_RESUME", f"sandbox {managed.id}: its create request no longer maps onto this "
                       f"server's profiles ({exc.message}); start the server with the flags it had, or delete "
                       "it") from None
    policy = req.policy
    if managed.egress_rules is not None:  # the allow-list as changed at run time, not as created
        policy = policy.replace(network=egress_with([t for a, t in managed.egress_rules if a == "allow"],
                                                    policy.network))
    if copy.image is not None:
        from ..image import Image

        found = Image.find(policy.image) if policy.image is not None else None
        if found is None or found.id != copy.image:
            raise ApiError(409, "CANNOT_RESUME", f"sandbox {managed.id}: its root's changes lie over image "
                           f"{copy.image[:19]}, which its image {req.image[:200]!r} no longer is in the image "
                           "store; delete it")
    store = state.volume_store() if any(spec.claim is not None for spec in req.volumes) else None
    opened = open_volumes(req.volumes, state.volume_roots, store, state.named_volumes)
    try:
        set_aside(name, copy.data)
    except (OSError, IsolationError) as exc:
        release_volumes(opened, state.named_volumes)
        raise IsolationError(f"sandbox {managed.id}: its files: {exc}") from None
    try:
        box = Sandbox(policy, backend="native", mounts=[item.mount for item in opened], workspace=state.workspace,
                      name=name, idle_timeout=math.inf,
                      image_upper="disk" if copy.image is not None or (policy.image is not None
                                                                        and disk_upper_possible()) else "tmpfs")
        box._impl.start_from = FromStopped(name + ".resuming", copy)
        box.start()
        try:
            verify_volumes(box, opened)
            state.stopped.keep(managed.id, copy.request, box)
        except BaseException:
            box.close()
            raise
    except BaseException:
        release_volumes(opened, state.named_volumes)
        put_back(name)
        raise
    with contextlib.suppress(OSError, IsolationError):
        remove_aside(name, copy.data)
    with state.lock:
        deleted = state.sandboxes.get(managed.id) is not managed
        if not deleted:
            managed.box = box
    if deleted:  # a delete while it started: it ends now, not with the next server, and lets its volumes go
        box.close()
        release_volumes(opened, state.named_volumes)
        raise ApiError(404, "SANDBOX_NOT_FOUND", f"sandbox {managed.id} was deleted while it resumed")
    managed.stopped = False
    managed.on_close.append(functools.partial(release_volumes, opened, state.named_volumes))
    managed.event("started again over the files a host reboot left (a new sandbox of the same policy, image, "
                  "limits and volumes: no process of before)")
    if managed.entrypoint != KEEPALIVE_ENTRYPOINT:
        record = managed.start_command(shlex.join(managed.entrypoint), True, None, None, None, None)
        managed.entry_command = record.id
    return "started again over its files after a host reboot"


def _mediator_answers(box: Sandbox) -> bool:
    """Whether a sandbox with an egress allow-list still has its mediator process (it answers at its control
    socket); True for one without."""
    from ..model.policy import Egress

    if not isinstance(box.policy.network, Egress) or box.name is None:
        return True
    from ..backends.native.egress import MediatorControl
    from ..backends.native.kept import Paths

    return MediatorControl(Paths.of(box.name).egress).listening()


def _state_of(box: Sandbox) -> str:
    state: Any = getattr(box._impl, "state", None)
    return str(state()) if callable(state) else "ended"


def _release_claims(state: ServerState, record: Record) -> None:
    store = state.volume_store() if record.volumes else ""
    for claim, doomed in record.volumes:
        path = os.path.join(store, claim)
        if record.pending:
            # Killed while it claimed them: one it asked to remove with it may have been made by it; it is
            # empty then (no sandbox ran on it yet), and goes when no sandbox served again holds it.
            if doomed and state.named_volumes.users(path) == 0:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            continue
        state.named_volumes.adopt(path, doomed)
        state.named_volumes.release(path)


def _listeners(path: str) -> list[int]:
    """The processes holding the unix socket bound at path (listening): from /proc/net/unix, its inode, then
    the descriptors of /proc/*/fd that are that socket."""
    try:
        with open("/proc/net/unix") as table:
            # Every socket bound at that path (a sandbox on the host's network could bind one of its own at the
            # same path in its mount namespace: killing its holders ends only that sandbox's own processes).
            wanted = {f"socket:[{fields[6]}]" for fields in (line.split() for line in table.read().splitlines()[1:])
                      if len(fields) >= 8 and fields[7] == path}
    except OSError:
        return []
    if not wanted:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                    pids.append(int(entry))
                    break
            except OSError:
                continue
    return pids


def _end_from_inside(name: str) -> None:
    """Ask the exec server listening at the sandbox's socket (in the server user's private runtime directory:
    only a sandbox of its own listens there) to run ``kill -KILL -1``: every process of the sandbox that may
    be signalled ends, the exec server among them, and its init then ends the PID namespace."""
    from ..backends.native.kept import NativeSandbox, Paths
    from ..backends.native.named import _listening
    from ..model.policy import Policy
    from ..model.workspace import Workspace

    if not _listening(Paths.of(name).socket):
        return
    box = Sandbox._around(NativeSandbox(Policy(), Workspace(), (), name, None, None), name)
    impl: Any = box._impl
    with contextlib.suppress(Exception):  # the conversation ends with the server it asked
        impl._files = impl.connect()  # the file connection, which a command's request goes on
        box.exec(["/bin/sh", "-c", "kill -KILL -1"], timeout=10)
    deadline = time.monotonic() + 10
    while _listening(Paths.of(name).socket) and time.monotonic() < deadline:
        time.sleep(0.05)


def _clear_half_made(name: str) -> None:
    """What a kept sandbox's start left when its maker was killed before it described it (no description to
    attach by): its exec server (the holder of its socket, whose end ends the sandbox's init and PID
    namespace) killed, its socket and data directory removed."""
    from ..backends.native.kept import Paths
    from ..backends.registry import Registry

    paths = Paths.of(name)
    _end_from_inside(name)
    for pid in _listeners(paths.socket):  # root reads every process's descriptors; another user, not these
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)
    for path in (paths.socket, paths.meta, paths.egress):
        with contextlib.suppress(OSError):
            os.unlink(path)
    # A description its maker was writing (NAME.json.HEX, renamed over NAME.json once whole).
    directory = os.path.dirname(paths.meta)
    with contextlib.suppress(OSError):
        for entry in os.listdir(directory):
            if entry.startswith(f"{name}.json."):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, entry))
    _remove_data(name)
    with contextlib.suppress(IsolationError):
        Registry().forget("native", name)


def _remove_data(name: str) -> None:
    """The data directory (workspace layers) of a kept sandbox whose description is gone (a reboot emptied the
    runtime directory, or its maker was killed before it wrote it): found through the state directory's
    descriptor, removed as the directory found there, never through a link."""
    from ..kernel.tree import remove_state_entry

    remove_state_entry("sandboxes", name)


def _end(state: ServerState, record: Record, box: Sandbox | None) -> None:
    assert state.keeper is not None
    if box is not None:
        with contextlib.suppress(Exception):
            thaw(box)  # one paused when the last server ended: a frozen tree cannot take its SIGKILL
            box.close()
    elif record.kept:
        _clear_half_made(state.keeper.name_for(record.id))
    if state.stopped is not None:
        with contextlib.suppress(OSError, IsolationError):
            remove_files(state.keeper.name_for(record.id), None)  # one a resume had set aside
        state.stopped.forget(record.id)
    _release_claims(state, record)
    state.keeper.remove(record.id)


def _served(state: ServerState, record: Record, box: Sandbox, paused: bool) -> ManagedSandbox:
    managed = _from_record(state, record, box)
    managed.restored = True
    if record.egress is not None:
        from .models import egress_with

        # What its mediator process enforces since a runtime change (the process outlived the last server).
        managed.egress_rules = list(record.egress)
        with contextlib.suppress(IsolationError):
            managed.egress = egress_with([t for a, t in record.egress if a == "allow"], box.policy.network)
    from .code import CodeContext
    from .code.shell import BashShell

    # The kept shells and interpreters the last server was making or ending when it was killed: ended (a paused
    # sandbox's at its resume: its exec server answers nothing), and none is a session's or context's.
    managed.ending_shells, managed.ending_contexts = set(record.ending), dict(record.ending_contexts)
    if not paused:
        end_in_doubt(managed)
    for context_id, language in record.contexts:
        # Its interpreter, a process of the sandbox, is connected to at the context's first use.
        if f"code-{context_id}" not in record.ending and context_id not in dict(record.ending_contexts):
            managed.contexts[context_id] = CodeContext(box, language, context_id, kept=True, fresh=False)
    for session_id in record.sessions:
        if session_id not in record.ending:  # its shell adopted at its first use
            managed.sessions[session_id] = BashShell(box, session_id, kept=True, fresh=False)
    for recorded in record.commands:
        # Its wrapper, a process of the sandbox, is held again if it still runs; its files are read when asked.
        RUNNING.take(force=True)  # given back at its end (it runs already: no ceiling refuses it)
        managed.commands[recorded.id] = KeptCommand.served_again(managed._usable_box, recorded, OUTPUT_LIMIT,
                                                                 RUNNING.give)
    managed.entry_command = record.entry_command  # its output: GET .../diagnostics/logs?scope=container
    # Its cgroup's owner (the last server) is gone: once it has ended, its empty cgroups are swept.
    managed.on_close.append(_sweep_cgroups)
    managed.message = "served again by a restarted server"
    managed.event("served again by a restarted server of its state directory (the foreground commands the last one "
                  "ran in it ended with it, and Java code contexts on a JDK before 16; its background commands, bash "
                  "sessions and code contexts live on)")
    if paused:
        managed.set_state("Paused", "server_restart", "paused when the last server ended")
    return managed


def _from_record(state: ServerState, record: Record, box: Any) -> ManagedSandbox:
    """The sandbox a record describes, over ``box``: its id, metadata, expiry, token hashes, and the named
    volumes it holds (adopted: released when it ends)."""
    import functools

    managed = ManagedSandbox(record.id, "", box, record.image, record.entrypoint, record.metadata,
                             record.created_at, record.expires_at, kept=True,
                             token_hashes=list(record.token_hashes),
                             port_hashes={port: list(h) for port, h in record.port_hashes.items()},
                             volume_claims=list(record.volumes))
    managed.renew_on_access = record.renew_on_access
    store = state.volume_store() if record.volumes else ""
    for claim, doomed in record.volumes:
        path = os.path.join(store, claim)
        state.named_volumes.adopt(path, doomed)
        managed.on_close.append(functools.partial(state.named_volumes.release, path))
    return managed


def _sweep_cgroups() -> None:
    from ..kernel.cgroup import sweep_stale

    with contextlib.suppress(OSError):
        sweep_stale()


def _sweep_pool() -> None:
    """The warm pool's sandboxes (unnamed) ended with the killed server that made them (their init dies with
    its parent), and left their files: removed, with those of any unnamed sandbox of this user whose maker is
    gone and whose socket no one holds (as ``isolate-run sandbox prune`` does)."""
    from ..backends.native.named import sweep_unnamed

    with contextlib.suppress(OSError, IsolationError):
        sweep_unnamed()


def _sweep_trash(state: ServerState) -> None:
    """Named volumes a killed server had renamed out of the store to remove (``.removed-*``: never a claim
    name, which is a DNS label) go now."""
    from ..kernel.links import open_directory
    from ..kernel.places import state_dir
    from ..kernel.tree import _remove_tree
    from .state import VOLUME_STORE

    try:
        fd = open_directory(state.given_volume_store or os.path.join(state_dir(), VOLUME_STORE))
    except (OSError, IsolationError, ValueError):
        return  # none yet
    try:
        for entry in os.listdir(fd):
            if entry.startswith(".removed-"):
                with contextlib.suppress(OSError):
                    _remove_tree(fd, entry)
    finally:
        os.close(fd)


def restore(state: ServerState) -> list[str]:
    from ..backends.native.named import native_names

    snapshot_lines = state.snapshots.recover()
    keeper = state.keeper
    if keeper is None:
        return snapshot_lines
    records, lines = keeper.load()
    lines += snapshot_lines
    now = time.time()
    lost_credentials = lost_with_them = 0
    served = expired = gone = kept_stopped = 0
    # Those served again hold their named volumes before any other lets go of one: a volume shared with
    # one that ended is then not removed under the one that lives on.
    ending: list[tuple[Record, Sandbox | None]] = []
    for record in records:
        name = keeper.name_for(record.id)
        if not record.kept:
            ending.append((record, None))
            gone += 1
            if record.credentials:
                lost_credentials += record.credentials
                lost_with_them += 1
            lines.append(f"sandbox {record.id}: ended with the last server (its credential vault, warm pool or "
                         "cluster node was the server's)")
            continue
        box: Sandbox | None
        try:
            box = Sandbox.attach(name, ping=False)
        except IsolationError:
            box = None
        alive = _state_of(box) if box is not None else "ended"
        if record.state == "Starting":
            ending.append((record, box))
            gone += 1
            lines.append(f"sandbox {record.id}: the last server ended while it started it (its create was not "
                         "answered); ended")
            continue
        if record.expires_at is not None and record.expires_at <= now:
            ending.append((record, box))
            expired += 1
            lines.append(f"sandbox {record.id}: its timeout passed while no server ran; ended")
            continue
        if box is None and record.state != "Starting":
            stopped = _stopped(state, record)
            if stopped is not None:
                with state.lock:
                    state.sandboxes[stopped.id] = stopped
                stopped.persist = state.saved
                kept_stopped += 1
                lines.append(f"sandbox {record.id}: its processes ended with a host reboot; kept stopped over its "
                             "files (Paused: resume starts it again, delete removes it)")
                continue
        paused = record.state == "Paused" and alive == "not answering"
        if alive != "running" and not paused:
            ending.append((record, box))
            gone += 1
            lines.append(f"sandbox {record.id}: ended while no server ran ({alive}); its record and volumes let go")
            continue
        assert box is not None
        try:
            if not paused:
                box = Sandbox.attach(name)  # with its file conversation
        except IsolationError as exc:
            ending.append((record, box))
            gone += 1
            lines.append(f"sandbox {record.id}: could not be attached again ({exc}); ended")
            continue
        if not _mediator_answers(box):
            ending.append((record, box))
            gone += 1
            lines.append(f"sandbox {record.id}: its egress mediator process ended (killed?), so nothing leaves the "
                         "sandbox any more; ended")
            continue
        managed = _served(state, record, box, paused)
        _finish_resume(state, record.id, name, box)
        with state.lock:
            state.sandboxes[managed.id] = managed
        managed.persist = state.saved
        served += 1
    for record, maybe_box in ending:
        _end(state, record, maybe_box)
    _sweep_trash(state)
    # The warm pool's sandboxes (unnamed, anon-PID-...) ended with the last server, killed: no close() removed
    # their files (prune would); nor the cgroups it owned of those that ended.
    _sweep_pool()
    _sweep_cgroups()
    if state.stopped is not None:
        with contextlib.suppress(OSError):
            state.stopped.sweep({record.id for record in records} - {record.id for record, _ in ending})
    known = {keeper.name_for(record.id) for record in records}
    for name in native_names():
        if name.startswith(keeper.prefix()) and name not in known:
            try:
                Sandbox.attach(name, ping=False).close()
            except IsolationError:
                _clear_half_made(name)
            except OSError:
                pass
            lines.append(f"kept sandbox {name}: the last server was making it (no record); removed")
    if served or expired or gone or kept_stopped:
        lines.append(f"{served} sandbox(es) of the last server served again, {kept_stopped} kept stopped after a "
                     f"reboot, {expired} expired, {gone} ended")
    if lost_credentials:
        lines.append(f"{lost_credentials} credentials were lost with the last server (a credential vault's values "
                     f"are never written to disk), with the {lost_with_them} sandbox(es) whose vaults held them: "
                     "create them again and re-add them")
    return lines
