"""What a server keeps of its sandboxes past its own end: a record per sandbox in its state directory.

A sandbox the server starts is a named kept sandbox (``osb-KEY-ID``, KEY
naming the state directory, ID the API's id): it does not die with the
server process, and a server started again with the same state directory
(``serve --state-dir``, else a directory of the server user's private
runtime directory) finds it by that name and serves it under the same id.
What the API knows about it and the sandbox does not (metadata, expiry, its
access tokens, the named volumes it holds) is this record:

- written whole or not at all (a temporary file, then a rename), through a
  descriptor of the state directory, never through a link;
- in a directory of the server's user that no one else may write and that
  no sandbox is granted (checked at start against the profiles' write
  grants and the volume roots);
- holding no secret: the access tokens and the own-port tokens are kept as
  SHA-256 hashes (a 24-byte random token cannot be guessed from one), so a
  reader of the directory cannot reach a sandbox with what it reads;
- read back as data, each field checked: a record that is not one of the
  server's (an unknown or malformed field, an id that is not a file name it
  makes) is skipped and reported, and nothing in it ever becomes a path:
  the sandbox's own files are found by the name derived from the id, the
  named volumes under the server's own volume store by their claim names.

One server uses one state directory at a time (a lock held while it runs).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from typing import Any

from ..kernel.links import DIR_FLAGS
from ..kernel.places import runtime_subdir, state_key
from ..model.errors import IsolationError
from ..model.policy import DEFAULT_WRITE

#: The API's sandbox ids (secrets.token_hex(12)); a record's file is named after one.
SANDBOX_ID = re.compile(r"[0-9a-f]{24}")
_HASH = re.compile(r"[0-9a-f]{64}")
#: A code context's id (ctx-HEX, or a language's default), the only part of its socket's path it names.
CONTEXT_ID = re.compile(r"ctx-[0-9a-f]{16}|default-[a-z]{2,10}")
#: The languages of the code contexts a kept sandbox keeps past its server (isolate.server.code says how).
KEPT_LANGUAGES = ("python", "java", "typescript", "javascript", "go", "bash")
#: Those whose contexts' interpreters are processes of the sandbox of their own (a kept driver, not a shell).
INTERPRETERS = ("python", "java", "typescript", "javascript")
#: A bash session's id (session-HEX): the key its shell's ends are kept under in the sandbox's exec server.
SESSION_ID = re.compile(r"session-[0-9a-f]{16}")
#: The key a kept bash shell's ends are held under by the exec server: a session's id, or a bash context's, after
#: ``code-`` (isolate.server.code.shell).
SHELL_KEY = re.compile(r"session-[0-9a-f]{16}|code-(ctx-[0-9a-f]{16}|default-bash)")
#: Kept code contexts and bash sessions per record (more than a server lets a sandbox have).
MAX_CONTEXTS = 256
#: A background command's id (secrets.token_hex(8)), the only part of its files' paths it names.
COMMAND_ID = re.compile(r"[0-9a-f]{16}")
#: Background commands per record (running ones, then the latest finished), and the part of a command's
#: text kept there (status says it; a restarted server says no more of it).
MAX_COMMANDS = 512
MAX_CONTENT = 512
_CLAIM = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: The largest record read back (a sandbox's metadata is small; a huge file is not one of ours).
MAX_RECORD = 1 << 20
#: Token hashes kept per sandbox: a restarted server gives out a new token (it has only the hashes) and
#: keeps accepting the older ones; each port likewise.
MAX_TOKENS = 16


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def hash_matches(given: str | None, hashes: list[str]) -> bool:
    """Whether ``given`` is a token one of ``hashes`` was made of (each compared in constant time)."""
    if not given or not hashes:
        return False
    digest = token_hash(given)
    found = False
    for known in hashes:
        found |= hmac.compare_digest(digest, known)
    return found


@dataclass(frozen=True)
class RecordedCommand:
    """What a sandbox's record says of one of its background commands (isolate.server.background)."""

    id: str
    content: str
    started_at: float
    #: The wrapper on the host: its pid and start time (psutil's create_time).
    pid: int
    pid_start: float
    #: The command's process group (and session) inside the sandbox: the launcher's pid there.
    group: int
    #: When its timeout ends it (None: none).
    deadline: float | None


@dataclass
class Record:
    """One sandbox as its record says (see the module's docstring)."""

    id: str
    image: str
    entrypoint: list[str]
    metadata: dict[str, str]
    created_at: float
    expires_at: float | None
    #: Kept past the server (a named sandbox); False: it ends with the server (isolate.server.lifecycle).
    kept: bool
    #: Running or Paused; Starting: written before the start, a server that finds it ends what was made.
    state: str = "Running"
    renew_on_access: int | None = None
    token_hashes: list[str] = field(default_factory=list)
    #: Port -> hashes of the own-port tokens given out for it.
    port_hashes: dict[int, list[str]] = field(default_factory=dict)
    #: Named volumes it holds: (claim name, whether its last holder removes it).
    volumes: list[tuple[str, bool]] = field(default_factory=list)
    #: Credentials of its vault (their number only: the values never leave the server's memory).
    credentials: int = 0
    #: Written before its named volumes were claimed: ``volumes`` are those asked for, with whether the
    #: create asked to remove them (it may have made them when its server was killed).
    pending: bool = False
    #: Its egress rules as changed at run time ((action, target), PATCH /policy; None: as created). Its
    #: mediator process enforces them; the record lets the next server say them (GET /policy) and merge.
    egress: list[tuple[str, str]] | None = None
    #: Its code contexts whose interpreters outlive the server: (context id, language).
    contexts: list[tuple[str, str]] = field(default_factory=list)
    #: Its background commands, which outlive the server (isolate.server.background), and the one running the
    #: create's entrypoint (one of them; None: the SDK's keep-alive, or not recorded).
    commands: list[RecordedCommand] = field(default_factory=list)
    entry_command: str | None = None
    #: Its bash sessions, whose shells outlive the server (isolate.server.code.shell): their ids.
    sessions: list[str] = field(default_factory=list)
    #: Keys of kept bash shells the next server ends (``SHELL_KEY``): named from before the exec server keeps a
    #: shell's ends until a session or context names it, and from before a delete until the ends are let go.
    ending: list[str] = field(default_factory=list)
    #: Kept interpreters (Python, Node.js, Java: ``INTERPRETERS``) the next server ends, as ``ending``'s shells:
    #: (context id, language), named from before the driver starts until a context names it, and from before a
    #: delete until the driver is ended.
    ending_contexts: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "id": self.id, "image": self.image, "entrypoint": self.entrypoint,
                "metadata": self.metadata, "createdAt": self.created_at, "expiresAt": self.expires_at,
                "kept": self.kept, "state": self.state, "renewOnAccess": self.renew_on_access,
                "tokenHashes": self.token_hashes,
                "portHashes": {str(port): hashes for port, hashes in self.port_hashes.items()},
                "volumes": [[claim, doomed] for claim, doomed in self.volumes], "credentials": self.credentials,
                "pending": self.pending,
                "egress": None if self.egress is None else [[action, target] for action, target in self.egress],
                "contexts": [[cid, language] for cid, language in self.contexts],
                "sessions": list(self.sessions),
                # Only when there are (a server before it refuses the field, and has none to end).
                **({"endingShells": list(self.ending)} if self.ending else {}),
                **({"endingContexts": [[c, lang] for c, lang in self.ending_contexts]} if self.ending_contexts else {}),
                "commands": [{"id": c.id, "content": c.content[:MAX_CONTENT], "startedAt": c.started_at,
                              "pid": c.pid, "pidStart": c.pid_start, "group": c.group, "deadline": c.deadline}
                             for c in self.commands[-MAX_COMMANDS:]],
                "entryCommand": self.entry_command if any(c.id == self.entry_command
                                                          for c in self.commands[-MAX_COMMANDS:]) else None}


class BadRecord(ValueError):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise BadRecord(what)


def _time(value: object, what: str) -> float:
    _need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and 0 <= value < 1e11, f"{what}: not a time")
    assert isinstance(value, (int, float))
    return float(value)


def parse_record(data: object, expected_id: str) -> Record:
    """A record read back, each field checked (BadRecord: not one this server wrote)."""
    _need(isinstance(data, dict), "not an object")
    assert isinstance(data, dict)
    known = {"version", "id", "image", "entrypoint", "metadata", "createdAt", "expiresAt", "kept", "state",
             "renewOnAccess", "tokenHashes", "portHashes", "volumes", "credentials", "pending"}
    # Not in the records of servers before them.
    optional = {"egress", "contexts", "commands", "entryCommand", "sessions", "endingShells",
                "endingContexts"}
    _need(known <= set(data), f"fields missing: {', '.join(sorted(known - set(data)))[:200]}")
    unknown = set(data) - known - optional
    # A newer server's record (a downgrade): its sandbox is left as it is, for that server to serve.
    _need(not unknown, f"fields unknown to this server, written by a newer isolate? "
          f"({', '.join(sorted(map(str, unknown)))[:200]}); the sandbox is left as it is: serve it with that version")
    _need(data["version"] == 1, f"version {str(data['version'])[:20]} unknown to this server (1), written by a "
          "newer isolate? the sandbox is left as it is: serve it with that version")
    _need(data["id"] == expected_id and bool(SANDBOX_ID.fullmatch(expected_id)), "id does not match its file")
    image, entrypoint, metadata = data["image"], data["entrypoint"], data["metadata"]
    _need(isinstance(image, str) and len(image) <= 4096, "image")
    _need(isinstance(entrypoint, list) and len(entrypoint) <= 4096
          and all(isinstance(a, str) for a in entrypoint), "entrypoint")
    _need(isinstance(metadata, dict) and len(metadata) <= 4096
          and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()), "metadata")
    expires = None if data["expiresAt"] is None else _time(data["expiresAt"], "expiresAt")
    _need(isinstance(data["kept"], bool), "kept")
    _need(data["state"] in ("Starting", "Running", "Paused"), "state")
    renew = data["renewOnAccess"]
    _need(renew is None or (isinstance(renew, int) and not isinstance(renew, bool) and 0 < renew <= 86400),
          "renewOnAccess")
    hashes = data["tokenHashes"]
    _need(isinstance(hashes, list) and 0 < len(hashes) <= MAX_TOKENS
          and all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes), "tokenHashes")
    ports: dict[int, list[str]] = {}
    raw_ports = data["portHashes"]
    _need(isinstance(raw_ports, dict) and len(raw_ports) <= 65535, "portHashes")
    for key, value in raw_ports.items():
        _need(isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 5
              and 1 <= int(key) <= 65535, "portHashes: a port")
        _need(isinstance(value, list) and 0 < len(value) <= MAX_TOKENS
              and all(isinstance(h, str) and _HASH.fullmatch(h) for h in value), "portHashes: hashes")
        ports[int(key)] = list(value)
    volumes = data["volumes"]
    _need(isinstance(volumes, list) and len(volumes) <= 256, "volumes")
    claims: list[tuple[str, bool]] = []
    for item in volumes:
        _need(isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and len(item[0]) <= 253
              and bool(_CLAIM.fullmatch(item[0])) and isinstance(item[1], bool), "volumes: a claim")
        claims.append((item[0], item[1]))
    credentials = data["credentials"]
    _need(isinstance(credentials, int) and not isinstance(credentials, bool) and 0 <= credentials < 1 << 20,
          "credentials")
    _need(isinstance(data["pending"], bool) and (not data["pending"] or data["state"] == "Starting"), "pending")
    egress = _egress_rules(data.get("egress"))
    contexts = _contexts(data.get("contexts", []), KEPT_LANGUAGES, "contexts")
    sessions = data.get("sessions", [])
    _need(isinstance(sessions, list) and len(sessions) + len(contexts) <= MAX_CONTEXTS
          and all(isinstance(s, str) and SESSION_ID.fullmatch(s) for s in sessions), "sessions")
    ending = data.get("endingShells", [])
    _need(isinstance(ending, list) and len(ending) <= MAX_CONTEXTS
          and all(isinstance(k, str) and SHELL_KEY.fullmatch(k) for k in ending), "endingShells")
    ending_contexts = _contexts(data.get("endingContexts", []), INTERPRETERS, "endingContexts")
    return Record(expected_id, image, list(entrypoint), dict(metadata), _time(data["createdAt"], "createdAt"),
                  expires, data["kept"], data["state"], renew, list(hashes), ports, claims, credentials,
                  data["pending"], egress, contexts, *_commands(data.get("commands", []), data.get("entryCommand")),
                  sessions=list(sessions), ending=list(ending), ending_contexts=ending_contexts)


def _contexts(raw: object, languages: tuple[str, ...], what: str) -> list[tuple[str, str]]:
    """A record's list of contexts, each [context id, language] (a language of ``languages``)."""
    _need(isinstance(raw, list) and len(raw) <= MAX_CONTEXTS, what)
    contexts: list[tuple[str, str]] = []
    for item in raw if isinstance(raw, list) else []:
        _need(isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and len(item[0]) <= 64
              and bool(CONTEXT_ID.fullmatch(item[0])) and item[1] in languages, f"{what}: a context")
        contexts.append((item[0], item[1]))
    return contexts


def _int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _commands(raw: object, entry: object) -> tuple[list[RecordedCommand], str | None]:
    """The record's background commands: at most MAX_COMMANDS, each field checked (a pid is only ever compared
    with a process's start time before it is used; the id names the command's files)."""
    _need(isinstance(raw, list) and len(raw) <= MAX_COMMANDS, "commands")
    assert isinstance(raw, list)
    commands: list[RecordedCommand] = []
    for item in raw:
        _need(isinstance(item, dict) and set(item) == {"id", "content", "startedAt", "pid", "pidStart", "group",
                                                        "deadline"}, "commands: a command")
        _need(isinstance(item["id"], str) and bool(COMMAND_ID.fullmatch(item["id"])), "commands: an id")
        _need(isinstance(item["content"], str) and len(item["content"]) <= MAX_CONTENT, "commands: its content")
        _need(_int(item["pid"], 0, 1 << 22) and _int(item["group"], 1, 1 << 22), "commands: a pid")
        deadline = None if item["deadline"] is None else _time(item["deadline"], "commands: a deadline")
        commands.append(RecordedCommand(item["id"], item["content"], _time(item["startedAt"], "commands: a start"),
                                 item["pid"], _time(item["pidStart"], "commands: a process's start"), item["group"],
                                 deadline))
    _need(len({c.id for c in commands}) == len(commands), "commands: an id twice")
    _need(entry is None or any(c.id == entry for c in commands), "entryCommand: not one of its commands")
    assert entry is None or isinstance(entry, str)
    return commands, entry


def _egress_rules(raw: object) -> list[tuple[str, str]] | None:
    """The record's egress rules: None, or at most egress_rules.MAX_ENTRIES [action, target] pairs (the
    targets are checked again as names when a server applies them)."""
    from ..model.egress_rules import MAX_ENTRIES

    if raw is None:
        return None
    _need(isinstance(raw, list) and len(raw) <= MAX_ENTRIES, "egress")
    assert isinstance(raw, list)
    rules: list[tuple[str, str]] = []
    for item in raw:
        _need(isinstance(item, list) and len(item) == 2 and item[0] in ("allow", "deny")
              and isinstance(item[1], str) and 0 < len(item[1]) <= 300, "egress: a rule")
        rules.append((item[0], item[1]))
    return rules


def _check_private(path: str, fd: int) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise IsolationError(f"--state-dir {path}: belongs to uid {info.st_uid}, not to this server's user "
                             f"({os.geteuid()}); give a directory of the server's user")
    if info.st_mode & 0o022:
        raise IsolationError(f"--state-dir {path}: others may write it (mode {stat.S_IMODE(info.st_mode):o}); "
                             f"the server's records must be its user's alone: chmod go-w {path}")


class Keeper:
    """The server's state directory: its lock, and the record of each sandbox."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            self.path = runtime_subdir(f"opensandbox-server-{state_key()}")
        else:
            if not path:
                # abspath("") is the working directory: every file there would be read as a record.
                raise IsolationError("--state-dir: empty; give a directory of the server's user")
            self.path = os.path.abspath(path)
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise IsolationError(f"--state-dir {self.path}: cannot be made ({exc.strerror})") from None
        try:
            self.fd = os.open(self.path, DIR_FLAGS)
        except OSError as exc:
            raise IsolationError(f"--state-dir {self.path}: {exc.strerror} (a link is not followed there: give "
                                 "the real path of a directory)") from None
        try:
            _check_private(self.path, self.fd)
            #: Names this server's sandboxes: another state directory's server (same user) has others.
            self.key = hashlib.sha256(os.fsencode(os.path.realpath(self.path))).hexdigest()[:8]
            self._lock_fd = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                    dir_fd=self.fd)
            try:
                # A lock of this process (POSIX, F_SETLK), not of the open file: a child the server forked holds
                # a flock() of it too, and one still running after the server was killed refused the restart.
                fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(self._lock_fd)
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise IsolationError(f"state directory {self.path}: its lock: {exc.strerror}") from None
                raise IsolationError(f"state directory {self.path}: another isolate-run serve uses it; give each "
                                     "server its own --state-dir") from None
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        for fd in (self._lock_fd, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def name_for(self, sandbox_id: str) -> str:
        """The kept sandbox's name of an API id (isolate-run sandbox list shows it)."""
        return f"osb-{self.key}-{sandbox_id}"

    def prefix(self) -> str:
        return f"osb-{self.key}-"

    def write(self, record: Record) -> None:
        """The record, whole: a temporary file of its own, renamed over the old one. Not fsync'd: what it
        guards against is the server's end, after which the kernel still holds what was written; a host
        crash ends the sandbox too (the next start then lets a record go whatever it says)."""
        temp = f".{record.id}.{secrets.token_hex(4)}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.fd)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(record.to_json()))  # one write
            os.rename(temp, f"{record.id}.json", src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=self.fd)
            raise

    def remove(self, sandbox_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{sandbox_id}.json", dir_fd=self.fd)

    def load(self) -> tuple[list[Record], list[str]]:
        """Every record (checked), and a line for each entry skipped; temporary files a crash left go."""
        records, skipped = [], []
        for entry in sorted(os.listdir(self.fd)):
            # snapshots/: isolate.server.snapkeep's copies; stopped/: isolate.server.stopped's
            if entry in (".lock", "snapshots", "stopped"):
                continue
            if entry.startswith(".") and entry.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=self.fd)  # a write the last server did not finish
                continue
            sandbox_id = entry[:-5] if entry.endswith(".json") else ""
            if not SANDBOX_ID.fullmatch(sandbox_id):
                skipped.append(f"{entry[:80]!r}: not a record of this server's; left alone")
                continue
            try:
                records.append(self._read(entry, sandbox_id))
            except (OSError, ValueError, RecursionError) as exc:
                skipped.append(f"record {entry}: skipped, not trusted ({exc})")
        return records, skipped

    def _read(self, entry: str, sandbox_id: str) -> Record:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            _need(stat.S_ISREG(info.st_mode), "not a regular file")
            _need(info.st_uid == os.geteuid(), "not the server user's")
            _need(info.st_size <= MAX_RECORD, "too large")
            data = json.loads(handle.read(MAX_RECORD + 1))
        return parse_record(data, sandbox_id)


def _overlaps(a: str, b: str) -> bool:
    a, b = a.rstrip("/") or "/", b.rstrip("/") or "/"
    return a == b or a.startswith(b + "/") or b.startswith(a + "/") or "/" in (a, b)


def check_out_of_reach(path: str, policies: list[Any], host_dirs: list[str]) -> None:
    """Refuse a state directory a sandbox could write: under (or above) a profile's write grant or
    read-write bind, a volume root or the volume store (IsolationError). The runtime directory, the
    default, is refused as a grant by every native run already."""
    real = os.path.realpath(path)
    reachable: list[tuple[str, str]] = [(os.path.realpath(d), "a volume root or the volume store") for d in host_dirs]
    for policy in policies:
        if policy.write != DEFAULT_WRITE:  # a kept sandbox drops the default (the caller's cwd)
            reachable += [(os.path.realpath(os.path.expanduser(w)), "a profile's write grant") for w in policy.write]
        reachable += [(os.path.realpath(m.source), "a profile's read-write bind") for m in policy.binds
                      if m.mode == "rw"]
    for where, what in reachable:
        if _overlaps(real, where):
            raise IsolationError(f"--state-dir {path}: {what} ({where}) reaches it, and a sandbox could then "
                                 "rewrite the server's records; give a directory no sandbox is granted")
