"""What the server keeps: its sandboxes, each with a token, its commands and their output.

A sandbox of ``isolate-run serve`` is a named kept ``isolate.Sandbox``
(isolate.server.keep): it ends with ``DELETE`` or at its expiry (the
server's reaper), and outlives the server process, killed or stopped: the
next server of the same state directory serves it again (``restore``).
Sandboxes whose parts live in the server process end with it: those with
a credential vault (its values), those of the warm pool (the pool's,
unnamed) and those on a Ray cluster. One with an egress allow-list is kept:
its mediator is a process of its own (isolate.server.reach). ``create_app`` (embedding, tests)
keeps nothing: its sandboxes are unnamed and end with the process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import selectors
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..kept.sandbox import Sandbox, SandboxProcess
from ..kernel.places import state_path
from ..model.errors import IsolationError
from ..model.policy import Policy
from ..model.workspace import Workspace
from .background import KeptCommand
from .common import log
from .keep import MAX_TOKENS, Keeper, Record, hash_matches, token_hash
from .models import ApiError, iso
from .stopped import StoppedCopies
from .volumes import NamedVolumes

#: Output kept per command (its tail); a poller that falls behind loses the oldest bytes.
OUTPUT_LIMIT = 16 << 20
#: Finished commands remembered per sandbox for status and logs.
KEEP_FINISHED = 256
#: Output kept over all the server's commands together: past it, the oldest bytes go (finished commands'
#: first, oldest command first), as a poller that falls behind loses them.
OUTPUT_TOTAL = 256 << 20
#: Sandboxes one server keeps at once (--max-sandboxes), and commands running at once in one sandbox.
MAX_SANDBOXES = 64
MAX_RUNNING = 256
#: Commands running at once over all the server's sandboxes: each holds a thread and descriptors of
#: the server's, which no client may take all of. Bash sessions and code contexts per sandbox.
MAX_RUNNING_TOTAL = 1024
MAX_SESSIONS = 32


class _Slots:
    """A count with a ceiling, shared by every sandbox of the server."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._used = 0

    def take(self, force: bool = False) -> bool:
        """One more (``force``: even past the ceiling, for what runs already), or False."""
        with self._lock:
            if self._used >= self.limit and not force:
                return False
            self._used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self._used = max(0, self._used - 1)


RUNNING = _Slots(MAX_RUNNING_TOTAL)


def room_for_session(managed: ManagedSandbox) -> None:
    """Refuse (429) a bash session or code context past MAX_SESSIONS in one sandbox: each is a process
    inside and a thread and descriptors of the server's."""
    if len(managed.sessions) + len(managed.contexts) >= MAX_SESSIONS:
        raise ApiError(429, "TOO_MANY_SESSIONS", f"a sandbox keeps at most {MAX_SESSIONS} bash sessions and code "
                       "contexts together; delete one first")
#: Lifecycle events kept per sandbox for diagnostics (the oldest are dropped).
KEEP_EVENTS = 1000
#: Renew-on-access renews a sandbox at most this often (seconds).
RENEW_COOLDOWN = 5.0
#: SIGTERM, then this long before SIGKILL, as upstream's interrupt does.
INTERRUPT_GRACE = 3.0

Listener = Callable[[str, Any], None]


class _OutputBudget:
    """OUTPUT_TOTAL over every CommandRecord alive: the bytes added since the last count, and the records."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: weakref.WeakSet[CommandRecord] = weakref.WeakSet()
        self._total = 0

    def add(self, record: CommandRecord) -> None:
        with self._lock:
            self._records.add(record)

    def charge(self, size: int) -> None:
        """Count size more bytes kept; over OUTPUT_TOTAL, count them all again and drop the oldest down to
        three quarters of it (so that a count happens once every quarter of the budget at most)."""
        with self._lock:
            self._total += size
            if self._total <= OUTPUT_TOTAL:
                return
            records = sorted(self._records, key=lambda r: (r.running, r.started_at))
            total = sum(len(r.output) for r in records)
            for record in records:
                if total <= OUTPUT_TOTAL * 3 // 4:
                    break
                with record.lock:
                    drop = min(len(record.output), total - OUTPUT_TOTAL * 3 // 4)
                    del record.output[:drop]
                    record.output_base += drop
                total -= drop
            self._total = total


OUTPUT_BUDGET = _OutputBudget()


@dataclass(eq=False)
class CommandRecord:
    """One command: its process, its combined output, its end."""

    id: str
    content: str
    background: bool
    proc: SandboxProcess
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    exit_code: int | None = None
    error: str = ""
    report_status: str = ""
    output: bytearray = field(default_factory=bytearray)
    output_base: int = 0  # absolute offset of output[0] (the tail is kept)
    listener: Listener | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def running(self) -> bool:
        return self.finished_at is None

    def __post_init__(self) -> None:
        OUTPUT_BUDGET.add(self)

    def add_output(self, kind: str, chunk: bytes) -> None:
        with self.lock:
            self.output += chunk
            excess = len(self.output) - OUTPUT_LIMIT
            if excess > 0:
                del self.output[:excess]
                self.output_base += excess
            listener = self.listener
        OUTPUT_BUDGET.charge(len(chunk))  # not under self.lock: the budget takes records' locks
        if listener is not None:
            listener(kind, chunk)

    def read_from(self, cursor: int) -> tuple[bytes, int]:
        with self.lock:
            start = max(0, cursor - self.output_base)
            return bytes(self.output[start:]), self.output_base + len(self.output)


def _pump_remote(record: CommandRecord) -> None:
    """``_pump`` for a command on a Ray node (isolate.ray.RemoteProcess): a reader per stream, then its end."""
    proc = record.proc

    def read(kind: str) -> None:
        stream = getattr(proc, kind)
        while chunk := stream.read1():
            record.add_output(kind, chunk)

    readers = [threading.Thread(target=read, args=(kind,), daemon=True) for kind in ("stdout", "stderr")]
    for reader in readers:
        reader.start()
    try:
        rc = proc.wait()
        for reader in readers:
            reader.join()
        report = proc.report
        record.report_status = report.status if report is not None else ""
    except Exception as exc:  # the sandbox (or its node) ended under the command
        record.error, rc = str(exc), -1
    _finish(record, rc)


def _pump(record: CommandRecord) -> None:
    """The command's thread: read stdout/stderr as they come, then its end (a background child may hold the pipes)."""
    proc = record.proc
    if not hasattr(proc, "stdout_fd"):
        _pump_remote(record)
        return
    fds = {proc.stdout_fd: "stdout"}
    if proc.stderr_fd >= 0:
        fds[proc.stderr_fd] = "stderr"
    for fd in fds:
        os.set_blocking(fd, False)
    sel = selectors.DefaultSelector()
    for fd in fds:
        sel.register(fd, selectors.EVENT_READ)
    wait = 0.005
    rc: int | None = None
    try:
        while True:
            if sel.get_map():
                events = sel.select(wait)
            else:
                time.sleep(wait)
                events = []
            got = False
            for key, _ in events:
                fd = int(key.fd)
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    got = True
                    record.add_output(fds[fd], chunk)
                else:
                    sel.unregister(fd)
            if got:
                wait = 0.005
                continue
            try:
                rc = proc.poll()
            except Exception as exc:  # the sandbox ended under the command
                record.error = str(exc)
                rc = -1
            if rc is not None:
                break
            # Idle: back off (a command's end is seen within this long).
            wait = min(wait * 2, 0.1)
        # What it wrote before it ended is in the pipes now; a background child keeping them open is not waited on.
        for fd, kind in fds.items():
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    break
                if not chunk:
                    break
                record.add_output(kind, chunk)
        report = proc.report
        record.report_status = report.status if report is not None else ""
    finally:
        sel.close()
        _finish(record, rc)


def _finish(record: CommandRecord, rc: int | None) -> None:
    """A command's end: its status and error, its slot given back, its listener told."""
    if rc is not None:
        record.exit_code = rc
        if rc != 0 and not record.error:
            record.error = {"timeout": "timed out", "killed": "killed"}.get(record.report_status,
                                                                              f"exit status {rc}")
    RUNNING.give()
    record.finished_at = time.time()
    try:
        record.proc.close()
    except OSError:
        pass
    listener = record.listener
    record.done.set()
    if listener is not None:
        listener("exit", record)


def thaw(box: Sandbox) -> None:
    """Thaw the cgroup freezer of a sandbox paused by an earlier server (whose RunCgroup went with it): its
    run cgroups are found from its processes' /proc/PID/cgroup (the init on the host's side stays outside
    them), and only isolate's own (isolate-PID-N) are written."""
    from ..kernel.cgroup.hierarchy import RUN_NAME, find_hierarchies

    try:
        with open("/proc/self/mountinfo") as mounts:
            mountinfo = mounts.read()
    except OSError:
        return
    targets: set[tuple[str, str]] = set()
    for proc in box.processes():
        try:
            with open(f"/proc/{proc.pid}/cgroup") as own:
                hierarchies = find_hierarchies(own.read(), mountinfo)
        except OSError:
            continue
        for found in hierarchies:
            if found.directory is None or not RUN_NAME.fullmatch(os.path.basename(found.directory)):
                continue
            if found.version == 1 and "freezer" in found.controllers:
                targets.add((os.path.join(found.directory, "freezer.state"), "THAWED"))
            elif found.version == 2:
                targets.add((os.path.join(found.directory, "cgroup.freeze"), "0"))
    for target, value in sorted(targets):
        with contextlib.suppress(OSError):
            fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)


@dataclass
class ManagedSandbox:
    """One sandbox of the server, as the API sees it."""

    id: str
    token: str
    box: Sandbox
    image: str
    entrypoint: list[str]
    metadata: dict[str, str]
    created_at: float
    expires_at: float | None
    state: str = "Running"
    reason: str = "running"
    message: str = ""
    transition_at: float = field(default_factory=time.time)
    commands: dict[str, CommandRecord | KeptCommand] = field(default_factory=dict)
    sessions: dict[str, Any] = field(default_factory=dict)
    contexts: dict[str, Any] = field(default_factory=dict)
    #: Keys of kept bash shells its record names as ones the next server ends (see ``shell_in_doubt``).
    ending_shells: set[str] = field(default_factory=set)
    #: Kept interpreters its record names as ones the next server ends: context id -> language (``context_in_doubt``).
    ending_contexts: dict[str, str] = field(default_factory=dict)
    #: Held while a context of the key (a language's default) is made: one at a time (isolate.server.execd.contexts).
    making: dict[str, Any] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: Held by the reaper's round over its kept background commands (tend_commands).
    _tending: threading.Lock = field(default_factory=threading.Lock)
    #: The background command running the create request's entrypoint (None: the SDK's keep-alive).
    entry_command: str | None = None
    #: (time, text) of what happened to the sandbox, for GET .../diagnostics/events.
    events: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=KEEP_EVENTS))
    #: The last CPU reading (monotonic time, CPU seconds), for the usage between two readings.
    cpu_sample: tuple[float, float] | None = None
    #: The own-port forwarder (isolate.server.ports), made at the first forwarded connection.
    forwarder: Any = None
    #: The allow-list as changed at run time (PATCH /policy), when it was (isolate.model.policy.Egress).
    egress: Any = None
    #: Its rules as (action, target) since then, deny rules included, as GET /policy lists them.
    egress_rules: list[tuple[str, str]] | None = None
    #: Created with credentialProxy.enabled; its credential vault (isolate.egress.vault.Vault), once given.
    credential_proxy: bool = False
    vault: Any = None
    #: Renew-on-access (extensions["access.renew.extend.seconds"]): seconds, and when it last renewed.
    renew_on_access: int | None = None
    renewed_at: float = 0.0
    #: Files moving to or from it now (downloads, uploads, replaces; isolate.server.execd.access.transfer_slot).
    transfers: int = 0
    #: Run once the sandbox is closed (the named volumes made for it, released).
    on_close: list[Callable[[], None]] = field(default_factory=list)
    #: A named sandbox that outlives the server (isolate.server.keep); False: it ends with the server.
    kept: bool = False
    #: SHA-256 of every access token given out for it (the record keeps these, never a token): a restarted
    #: server has no token until it gives out a new one (``token`` is "" until then) and accepts the old.
    token_hashes: list[str] = field(default_factory=list)
    #: Port -> hashes of the own-port tokens given out for it (accepted after a restart too).
    port_hashes: dict[int, list[str]] = field(default_factory=dict)
    #: The named volumes it holds: (claim name, whether the last holder removes it).
    volume_claims: list[tuple[str, bool]] = field(default_factory=list)
    #: Served again by a restarted server (attached by its name: no cgroup or process handle of this one's).
    restored: bool = False
    #: Its processes ended with a host reboot: ``box`` is an isolate.server.stopped.StoppedBox, and resume
    #: starts a new sandbox over its files (isolate.server.restore.resume_stopped).
    stopped: bool = False
    #: Writes its record again after a change (ServerState.saved; None: nothing is recorded).
    persist: Callable[[ManagedSandbox], None] | None = None

    def __post_init__(self) -> None:
        if self.token and token_hash(self.token) not in self.token_hashes:
            self.token_hashes.append(token_hash(self.token))

    def token_ok(self, given: str | None) -> bool:
        """Whether ``given`` is one of the access tokens given out for this sandbox (by this server or an
        earlier one of its state directory)."""
        return hash_matches(given, self.token_hashes)

    def current_token(self) -> tuple[str, bool]:
        """The access token to give out, and whether it is new (a restarted server makes one: it has only
        the hashes of the earlier ones, which stay valid)."""
        with self.lock:
            if self.token:
                return self.token, False
            self.token = secrets.token_urlsafe(24)
            self.token_hashes = [*self.token_hashes, token_hash(self.token)][-MAX_TOKENS:]
            return self.token, True

    def port_token_given(self, port: int, token: str) -> bool:
        """Remember an own-port token given out (its hash); whether that is new."""
        digest = token_hash(token)
        with self.lock:
            known = self.port_hashes.get(port, [])
            if digest in known:
                return False
            self.port_hashes = {**self.port_hashes, port: [*known, digest][-MAX_TOKENS:]}
            return True

    def port_token_ok(self, port: int, given: str | None) -> bool:
        return hash_matches(given, self.port_hashes.get(port, []))

    def changed(self) -> None:
        """What its record holds changed (metadata, expiry, state, a token, its vault): write it again."""
        if self.persist is not None:
            self.persist(self)

    def record(self) -> Record:
        vault = self.vault
        return Record(self.id, self.image, list(self.entrypoint), dict(self.metadata), self.created_at,
                      self.expires_at, self.kept, "Paused" if self.state in ("Paused", "Pausing") else "Running",
                      self.renew_on_access, list(self.token_hashes),
                      {port: list(h) for port, h in self.port_hashes.items()}, list(self.volume_claims),
                      len(vault.credentials()) if vault is not None else 0,
                      egress=None if self.egress_rules is None else list(self.egress_rules),
                      contexts=[(c.id, c.language) for c in list(self.contexts.values()) if c.kept],
                      commands=[c.recorded for c in list(self.commands.values())
                                if isinstance(c, KeptCommand) and c.settled.is_set()],
                      entry_command=self.entry_command,
                      sessions=[sid for sid, shell in list(self.sessions.items()) if getattr(shell, "kept", False)],
                      ending=sorted(self.ending_shells), ending_contexts=sorted(self.ending_contexts.items()))

    def shell_in_doubt(self, key: str, doubt: bool) -> None:
        """Its record names the kept bash shell ``key`` (a session's id, or ``code-`` and a bash context's) as one
        the next server ends (``doubt``), or no longer, and is written: from before the exec server keeps the
        shell's ends until a session or context names it, and from before a delete until the ends are let go. A
        server killed at any step leaves no kept shell that no record names (it would live on in the exec
        server's table, one of its 64 keys, for good), and no name of one the client never had or deleted."""
        with self.lock:
            (self.ending_shells.add if doubt else self.ending_shells.discard)(key)
        self.changed()

    def context_in_doubt(self, context_id: str, language: str, doubt: bool) -> None:
        """As ``shell_in_doubt``, for a kept interpreter's context (isolate.server.code.KeptInterpreter): named as one
        the next server ends from before its driver starts (a process of the sandbox, which outlives the server)
        until its context is in the record, and from before a delete until the driver is ended."""
        with self.lock:
            if doubt:
                self.ending_contexts[context_id] = language
            else:
                self.ending_contexts.pop(context_id, None)
        self.changed()

    def event(self, text: str) -> None:
        self.events.append((time.time(), text))

    def accessed(self) -> None:
        """A request reached the sandbox through this server: renew its expiry if it opted in (OSEP-0009).

        To now plus its seconds, when that is later than the expiry it has; at most once every
        RENEW_COOLDOWN seconds, so a busy sandbox does not renew (and record it) on every request."""
        if self.renew_on_access is None or self.state != "Running":
            return
        now = time.time()
        with self.lock:
            if self.expires_at is None or now - self.renewed_at < RENEW_COOLDOWN:
                return
            when = now + self.renew_on_access
            if when <= self.expires_at:
                return
            self.expires_at, self.renewed_at = when, now
        self.event(f"expiration renewed on access to {iso(when)}")
        self.changed()

    def set_state(self, state: str, reason: str, message: str = "") -> None:
        self.state, self.reason, self.message, self.transition_at = state, reason, message, time.time()
        self.event(f"state {state} (reason {reason})" + (f": {message}" if message else ""))

    def usable(self) -> None:
        """Refuse execution requests while paused (the exec server is frozen and would not answer)."""
        if self.stopped:
            raise ApiError(409, "SANDBOX_NOT_RUNNING", f"sandbox {self.id} is {self.state}: its processes ended "
                           f"with a host reboot; resume it first (POST /v1/sandboxes/{self.id}/resume starts it "
                           "again over its files)")
        if self.state != "Running":
            raise ApiError(409, "SANDBOX_NOT_RUNNING", f"sandbox {self.id} is {self.state}; resume it first")

    def start_command(self, content: str, background: bool, cwd: str | None, env: Mapping[str, str] | None,
                      timeout: float | None, listener: Listener | None) -> CommandRecord | KeptCommand:
        # One sandbox runs at most a quarter of what the server runs: a flood of commands in one leaves
        # room for the others.
        most = min(MAX_RUNNING, max(1, RUNNING.limit // 4))
        with self.lock:
            # Ends as last seen (a kept command's by the reaper, each second): no wait on a sandbox's file here.
            if sum(1 for c in self.commands.values() if c.finished_at is None) >= most:
                raise ApiError(429, "TOO_MANY_COMMANDS", f"at most {most} commands run at once in a sandbox")
        if not RUNNING.take():
            raise ApiError(429, "TOO_MANY_COMMANDS", f"this server runs at most {RUNNING.limit} commands at once "
                           "over all its sandboxes; wait for some to end")
        # bash when the sandbox has it (as upstream's execd: brace expansion, [[ ]], ...), else sh.
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        if background and self.kept and self.box.backend == "native":
            return self._start_kept(content, shell, cwd, env, timeout)
        try:
            try:
                proc = self.box.spawn([shell, "-c", content], cwd=cwd, env=env, timeout=timeout)
            except FileNotFoundError:
                if shell == "/bin/sh":
                    raise
                proc = self.box.spawn(["/bin/sh", "-c", content], cwd=cwd, env=env, timeout=timeout)
        except BaseException:
            RUNNING.give()
            raise
        record = CommandRecord(secrets.token_hex(8), content, background, proc, listener=listener)
        self._listed(record)
        threading.Thread(target=_pump, args=(record,), name=f"isolate-serve-cmd-{record.id}", daemon=True).start()
        return record

    def _listed(self, record: CommandRecord | KeptCommand) -> None:
        """List a command; the oldest finished past KEEP_FINISHED go (a kept one's files with it)."""
        with self.lock:
            self.commands[record.id] = record
            finished = [c for c in self.commands.values() if c.finished_at is not None]
            gone = finished[:max(0, len(finished) - KEEP_FINISHED)]
            for old in gone:
                del self.commands[old.id]
        for old in gone:
            if isinstance(old, KeptCommand):
                old.forget()

    def _usable_box(self) -> Sandbox | None:
        """The sandbox while its exec server answers (not paused): a kept command's files are reached through it."""
        return self.box if self.state == "Running" else None

    def _start_kept(self, content: str, shell: str, cwd: str | None, env: Mapping[str, str] | None,
                    timeout: float | None) -> KeptCommand:
        """A background command that outlives the server (isolate.server.background)."""
        try:
            command = KeptCommand.start(self._usable_box, secrets.token_hex(8), content, shell, cwd, env, timeout,
                                        OUTPUT_LIMIT, RUNNING.give, self.changed)
        except BaseException:
            RUNNING.give()
            raise
        self._listed(command)  # its record is written once its wrapper is found (``changed``)
        if command.settled.is_set():
            # It settled before it was listed (its settling runs on a thread of its own): the record its
            # settling wrote did not name it; this one does.
            self.changed()
        return command

    def tend_commands(self, now: float) -> None:
        """The reaper's round over its kept commands (their ends, timeouts, logs' oldest bytes), on a thread of
        its own: one whose sandbox does not answer (its exec server stopped from inside) holds only that
        thread, and the next rounds of that sandbox are skipped until it is done."""
        if any(isinstance(c, KeptCommand) and c.finished_at is None for c in list(self.commands.values())) \
                and self._tending.acquire(blocking=False):
            threading.Thread(target=self._tend, args=(now,), name=f"isolate-serve-tend-{self.id}",
                             daemon=True).start()

    def _tend(self, now: float) -> None:
        try:
            for command in list(self.commands.values()):
                if isinstance(command, KeptCommand) and command.finished_at is None:
                    try:
                        command.tend(now)
                    except Exception as exc:  # one command's trouble does not stop the round
                        log.warning("sandbox %s: background command %s: %s", self.id, command.id, exc)
        finally:
            self._tending.release()

    def interrupt(self, record: CommandRecord | KeptCommand) -> None:
        """SIGTERM to the command's process group; after INTERRUPT_GRACE, SIGKILL to everything it started."""
        if isinstance(record, KeptCommand):
            record.interrupt(INTERRUPT_GRACE)
            return
        try:
            if not record.running:
                return
            record.proc.signal(signal.SIGTERM)
            if not record.done.wait(INTERRUPT_GRACE):
                record.proc.kill()
                record.done.wait(INTERRUPT_GRACE)
        except OSError:
            pass  # it ended meanwhile and its conversation is closed

    def _let_go(self, detach: bool = False) -> None:
        """End the server's side of it: its forwarder, bash sessions and code contexts. A kept context is let
        go, not ended: its interpreter is left running for the next server (``detach``), or ends with the
        sandbox's PID namespace (``close``; ending it first would connect to a context of an earlier server,
        and a process of the sandbox that took its socket could hold the end for the hello's wait, each)."""
        forwarder = self.forwarder
        if forwarder is not None:
            forwarder.close()
        with self.lock:
            for session in [*self.sessions.values(), *self.contexts.values()]:
                try:
                    if getattr(session, "kept", False):
                        session.detach()
                    else:
                        session.close()
                except Exception:
                    pass
            self.sessions.clear()
            self.contexts.clear()
            kept = [c for c in self.commands.values() if isinstance(c, KeptCommand)]
        for command in kept:
            if detach:
                command.close()  # it runs on; the next server reads its files
            else:
                command.ended_with_sandbox()

    def detach(self) -> None:
        """Leave a kept sandbox running for the next server (its foreground commands end: the exec server ends a
        command whose host hung up; its background commands, bash sessions and code contexts run on)."""
        self._let_go(detach=True)
        self.box.detach()

    def close(self) -> None:
        self.persist = None  # its record goes: nothing still running (a command's settling) writes it again
        self._let_go()
        if self.state in ("Paused", "Pausing", "Resuming"):
            try:
                self.box.resume()  # a frozen tree cannot take its SIGKILL until thawed
                if self.restored:
                    thaw(self.box)  # its cgroup's freezer (this server holds no handle on it)
            except Exception:
                pass
        try:
            self.box.close()
        finally:
            while self.on_close:
                self.on_close.pop()()


def _init_gone(box: Sandbox) -> bool:
    """Whether a native sandbox's init has ended (the process this server started, or the one it attached to,
    told apart from a reused pid by its start time): a look at /proc, no conversation."""
    impl: Any = getattr(box, "_impl", None)
    process = getattr(impl, "process", None)
    if process is not None:
        return process.poll() is not None
    init_pid = getattr(impl, "_init_pid", None)
    return callable(init_pid) and init_pid() is None


#: The state directory's entry that every sandbox's /workspace is an overlay of (kept empty).
WORKSPACE_BASE = "opensandbox-workspace"
#: The state directory's entry where named (pvc) volumes are kept, unless serve --volume-store says.
VOLUME_STORE = "opensandbox-volumes"


def server_workspace() -> Workspace:
    """An overlay workspace over ``<state dir>/opensandbox-workspace``, which must be empty (IsolationError
    otherwise: its files would be every sandbox's)."""
    path = state_path(WORKSPACE_BASE)
    if os.listdir(path):
        raise IsolationError(f"{path} holds files; it is the empty lower layer of every sandbox's /workspace "
                             "that isolate-run serve makes: empty it")
    return Workspace(path, mode="overlay")


class ServerState:
    """The sandboxes of one server (one API key)."""

    def __init__(self, api_key: str, profiles: Mapping[str, Policy], any_image: Policy | None,
                 backend: str | None = None, max_sandboxes: int = MAX_SANDBOXES,
                 volume_roots: tuple[str, ...] = (), warm: int = 0, volume_store: str | None = None,
                 keeper: Keeper | None = None, end_on_exit: bool = True) -> None:
        from .snapshots import SnapshotStore

        self.api_key = api_key
        #: The state directory sandboxes are recorded in, to outlive the server (None: they end with it).
        self.keeper = keeper
        #: A stop of the server ends its sandboxes (else the kept ones stay for the next server).
        self.end_on_exit = end_on_exit
        #: The host directories below which create requests may name volumes (--volume-root; real paths).
        self.volume_roots = volume_roots
        #: Where named (pvc) volumes are kept (--volume-store; else the state directory's, made when first used),
        #: and who holds each (a volume a create made is removed with the last when it asked).
        self.given_volume_store = volume_store
        self.named_volumes = NamedVolumes()
        self.snapshots = SnapshotStore()
        if keeper is not None:
            from .snapkeep import SnapshotCopies

            self.snapshots.copies = SnapshotCopies(keeper.fd)
        #: What a resume after a host reboot needs of each kept sandbox (isolate.server.stopped).
        self.stopped: StoppedCopies | None = None
        if keeper is not None:
            self.stopped = StoppedCopies(keeper.fd)
        #: Every new sandbox's /workspace: an overlay over an empty directory of the state directory, so
        #: that a snapshot is a layer (what the sandbox changed) and a sandbox from one starts on it.
        self.workspace = server_workspace()
        #: --warm: how many sandboxes of the SDK's default create to keep started (start_pool makes them).
        self.warm = warm
        self.pool: Any = None
        self.max_sandboxes = max_sandboxes
        self.starting = 0
        self.profiles = dict(profiles)
        self.any_image = any_image
        self.backend = backend
        #: Sandboxes go to the nodes of a Ray cluster (``serve --ray``): isolate.ray.Sandbox.
        self.cluster = False
        self.sandboxes: dict[str, ManagedSandbox] = {}
        self.lock = threading.Lock()
        self._save_lock = threading.Lock()

    def start_pool(self) -> None:
        """Start the warm pool (--warm N): sandboxes in the shape of the SDK's default create (the default
        profile, 1 CPU and 2 GiB, keep-alive entrypoint), each handed out once (isolate.SandboxPool)."""
        if self.warm <= 0 or self.pool is not None:
            return
        from ..kept.pool import SandboxPool
        from .models import KEEPALIVE_ENTRYPOINT, parse_create

        shape = parse_create({"image": {"uri": "default"}, "resourceLimits": {"cpu": "1", "memory": "2Gi"},
                              "entrypoint": KEEPALIVE_ENTRYPOINT}, self.profiles, self.any_image)
        self.pool = SandboxPool(shape.policy, size=self.warm, backend=self.backend, workspace=self.workspace)

    def volume_store(self) -> str:
        return self.given_volume_store or state_path(VOLUME_STORE)

    def take_warm(self, policy: Policy) -> Sandbox | None:
        """A started sandbox of the warm pool when ``policy`` is its shape, else None."""
        pool = self.pool
        if pool is None or policy != pool.policy:
            return None
        box: Sandbox = pool.acquire()
        return box

    def get(self, sandbox_id: str) -> ManagedSandbox:
        with self.lock:
            managed = self.sandboxes.get(sandbox_id)
        if managed is None:
            raise ApiError(404, "SANDBOX_NOT_FOUND", f"sandbox {sandbox_id[:64]!r} not found")
        return managed

    def reserve(self) -> None:
        """Count a sandbox being made against --max-sandboxes, or refuse it (429)."""
        with self.lock:
            if len(self.sandboxes) + self.starting >= self.max_sandboxes:
                raise ApiError(429, "TOO_MANY_SANDBOXES", f"this server keeps at most {self.max_sandboxes} sandboxes "
                               "(--max-sandboxes); delete one first")
            self.starting += 1

    def release(self) -> None:
        with self.lock:
            self.starting -= 1

    def add(self, managed: ManagedSandbox) -> None:
        with self.lock:
            self.starting -= 1
            self.sandboxes[managed.id] = managed
        managed.persist = self.saved

    def remove(self, sandbox_id: str) -> ManagedSandbox | None:
        with self.lock:
            return self.sandboxes.pop(sandbox_id, None)

    def all(self) -> list[ManagedSandbox]:
        with self.lock:
            return list(self.sandboxes.values())

    def expired(self, now: float) -> list[ManagedSandbox]:
        with self.lock:
            gone = [m for m in self.sandboxes.values() if m.expires_at is not None and m.expires_at <= now]
            for managed in gone:
                del self.sandboxes[managed.id]
            return gone

    def ended(self) -> list[ManagedSandbox]:
        """The sandboxes whose init no longer runs (killed), taken out of the server's list."""
        with self.lock:
            gone = [m for m in self.sandboxes.values() if _init_gone(m.box)]
            for managed in gone:
                del self.sandboxes[managed.id]
            return gone

    def save(self, managed: ManagedSandbox) -> None:
        """Write the sandbox's record (when the server keeps records); OSError when it cannot."""
        if self.keeper is not None:
            with self._save_lock:  # the record made and written in one go: two changes write in their order
                record = managed.record()
                if record.volumes:
                    # A shared volume goes with its last holder when the create that made it asked: every
                    # holder's record says so, or a restart after its maker's end would keep it forever.
                    store = self.volume_store()
                    record.volumes = [(claim, doomed or self.named_volumes.doomed(os.path.join(store, claim)))
                                      for claim, doomed in record.volumes]
                self.keeper.write(record)

    def saved(self, managed: ManagedSandbox) -> None:
        """``save`` after a change the sandbox lives on without (metadata, expiry, a token): a failure is
        logged (the record keeps what it said before)."""
        try:
            self.save(managed)
        except OSError as exc:
            log.warning("sandbox %s: its record in %s could not be written: %s", managed.id,
                        self.keeper.path if self.keeper else "", exc)

    def forget(self, managed: ManagedSandbox) -> None:
        """The sandbox ended: its record goes."""
        if self.stopped is not None:
            self.stopped.forget(managed.id)  # first: a copy is never left without its record
        if self.keeper is not None:
            self.keeper.remove(managed.id)

    def close_all(self) -> None:
        with self.lock:
            boxes = list(self.sandboxes.values())
            self.sandboxes.clear()
        if self.pool is not None:
            self.pool.close()
        for managed in boxes:
            try:
                if managed.kept and not self.end_on_exit:
                    managed.detach()  # the next server of this state directory serves it again
                    continue
                managed.close()
                if self.end_on_exit:
                    self.forget(managed)
                # else its record stays: the next start says it ended with this server (and the credentials
                # its vault lost)
            except Exception:
                pass
        self.snapshots.close_remote()
        if self.snapshots.copies is not None:
            self.snapshots.copies.close()
        if self.keeper is not None:
            self.keeper.close()


def disk_upper_possible() -> bool:
    """Whether isolate's state directory's file system keeps user.* attributes (an image sandbox's upper layer
    on disk keeps its metadata in them)."""
    from ..kernel.places import state_dir

    return _keeps_user_xattrs(state_dir())


@functools.cache
def _keeps_user_xattrs(path: str) -> bool:
    from ..kernel.overlay import xattr_problem

    return xattr_problem(path, path) is None
