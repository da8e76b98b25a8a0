"""The host's side of the exec server's protocol (csrc/execserver.c).

One SOCK_SEQPACKET connection per conversation: a file connection carries
requests one after another; an EXEC request hands its connection to a
monitor inside, which answers STARTED and, later, EXITED. The layouts are
isolate.h's, read through cffi, so both sides share one definition.

Everything that comes back is the sandbox's word, and the sandbox may be
hostile: replies are checked for size and magic, descriptors for type, and
an unexpected packet ends the conversation.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import socket
import stat as stat_mod
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..._core import ffi, lib
from ...model.errors import IsolationError, PolicyError

REQUEST_SIZE = ffi.sizeof("struct iso_xs_request")
REPLY_SIZE = ffi.sizeof("struct iso_xs_reply")
DIRENT_SIZE = ffi.sizeof("struct iso_xs_dirent")
MAX_MESSAGE = int(lib.ISO_XS_MAX_MESSAGE)
#: Strings in one packet at most (the server's MAX_STRINGS); more go in a memfd (encode_exec).
MAX_INLINE_STRINGS = 16384
#: How long the host waits for the server's answer to a file operation or a
#: command's start. The server answers these at once; one that does not was
#: stopped (a command may SIGSTOP it: same uid, same Landlock domain) or its
#: sandbox paused, and the host must not wait for it forever.
REPLY_TIMEOUT = 30.0


class ServerGone(IsolationError):
    """The sandbox's exec server does not answer: the sandbox has ended (or was killed from inside)."""


@dataclass(frozen=True)
class Stat:
    """A file's status as the program sees it (uid and gid are the sandbox's)."""

    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    mtime_ns: int
    ino: int
    dev: int

    @property
    def is_dir(self) -> bool:
        return stat_mod.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return stat_mod.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat_mod.S_ISLNK(self.mode)


def _stat(raw: Any) -> Stat:
    return Stat(int(raw.mode), int(raw.uid), int(raw.gid), int(raw.nlink), int(raw.size), int(raw.mtime_ns),
                int(raw.ino), int(raw.dev))


def _layout(struct_name: str, fields: Sequence[tuple[str, str]]) -> struct.Struct:
    """A struct.Struct for isolate.h's ``struct_name`` (native byte order), checked against cffi's view of
    it field by field (offset and size): a header changed on one side only fails at import, never on the wire."""
    layout = struct.Struct("=" + "".join(code for _, code in fields))
    offset = 0
    for name, code in fields:
        at = ffi.offsetof(struct_name, *name.split("."))  # "st.mode": a field of a nested struct
        if at != offset:
            raise ImportError(f"{struct_name}.{name}: at {at}, expected {offset}")
        offset += struct.calcsize("=" + code)
    if offset != ffi.sizeof(struct_name):
        raise ImportError(f"{struct_name}: {ffi.sizeof(struct_name)} bytes, expected {offset}")
    return layout


# The request and reply packed and parsed by struct (one call each), not field by field through cffi objects:
# a kept exec sends one and reads one per command.
_REQUEST = _layout("struct iso_xs_request", [("magic", "I"), ("op", "I"), ("flags", "i"), ("mode", "i"),
                                             ("timeout_ms", "q"), ("n_strings", "I"), ("n_argv", "I")])
_REPLY = _layout("struct iso_xs_reply", [
    ("magic", "I"), ("kind", "I"), ("err", "i"), ("step", "i"), ("pid", "i"), ("wait_status", "i"), ("reason", "i"),
    ("count", "I"), ("user_usec", "q"), ("system_usec", "q"), ("maxrss_kib", "q"),
    ("st.mode", "I"), ("st.uid", "I"), ("st.gid", "I"), ("st.nlink", "I"), ("st.size", "q"), ("st.mtime_ns", "q"),
    ("st.ino", "Q"), ("st.dev", "Q")])
_MAGIC = int(lib.ISO_XS_MAGIC)
#: The status of a reply that carries none (STARTED, EXITED, ERROR): one shared instance (it is frozen).
_NO_STAT = Stat(0, 0, 0, 0, 0, 0, 0, 0)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_FDS_SPACE = socket.CMSG_SPACE(4 * 4)
_SEQPACKET = int(socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)


@dataclass(frozen=True)
class Reply:
    kind: int
    err: int
    step: int
    pid: int
    wait_status: int
    reason: int
    count: int
    user_usec: int
    system_usec: int
    maxrss_kib: int
    stat: Stat
    payload: bytes
    fd: int | None


def encode(op: int, strings: Sequence[str | bytes] = (), *, flags: int = 0, mode: int = 0, timeout_ms: int = 0,
           n_argv: int = 0) -> bytes:
    """One request packet; raises PolicyError (a ValueError) for what the server would refuse."""
    packet = b"".join([_header(op, flags, mode, timeout_ms, len(strings), n_argv),
                       *(_nul_terminated(text) for text in strings)])
    if len(packet) > MAX_MESSAGE or len(strings) > MAX_INLINE_STRINGS:
        raise _TooLarge(f"the request takes {len(packet)} bytes in {len(strings)} strings; at most {MAX_MESSAGE} "
                        f"bytes and {MAX_INLINE_STRINGS} strings go to a sandbox in one packet")
    return packet


#: argv and environment of one EXEC at most (the kernel's own limit, ARG_MAX, is lower: 6 MiB at most).
MAX_STRINGS_BYTES = int(lib.ISO_XS_MAX_STRINGS_BYTES)


def encode_exec(strings: Sequence[str | bytes], n_argv: int, timeout_ms: int, flags: int) -> tuple[bytes, int | None]:
    """An EXEC request: the packet, and a descriptor to send before the command's own when the strings
    (cwd, argv, environment) do not fit in one packet: a sealed memfd holding them (the caller closes it)."""
    try:
        return encode(lib.ISO_XS_EXEC, strings, n_argv=n_argv, timeout_ms=timeout_ms, flags=flags), None
    except _TooLarge:
        pass
    data = b"".join(_nul_terminated(text) for text in strings)
    if len(data) > MAX_STRINGS_BYTES or len(strings) > int(lib.ISO_XS_MAX_FD_STRINGS):
        raise PolicyError(f"the command and its environment take {len(data)} bytes in {len(strings)} strings; at "
                         f"most {MAX_STRINGS_BYTES} bytes in {int(lib.ISO_XS_MAX_FD_STRINGS)} strings go to a "
                         "sandbox (and the kernel runs at most its ARG_MAX)")
    fd = os.memfd_create("isolate-exec-strings", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE)
        req = _header(lib.ISO_XS_EXEC, flags | int(lib.ISO_XS_F_STRINGS_FD), 0, timeout_ms, len(strings), n_argv)
    except BaseException:
        os.close(fd)
        raise
    return req, fd


class _TooLarge(PolicyError):
    pass


def _nul_terminated(text: str | bytes) -> bytes:
    data = os.fsencode(text)
    if b"\0" in data:
        # Bad input (a path, an argument): the policy's error, as a NUL byte in a policy's own fields is.
        raise PolicyError(f"{os.fsdecode(data)[:60]!r} holds a NUL byte, which no path or argument can")
    return data + b"\0"


def _header(op: int, flags: int, mode: int, timeout_ms: int, n_strings: int, n_argv: int) -> bytes:
    try:
        return _REQUEST.pack(_MAGIC, op, flags, mode, timeout_ms, n_strings, n_argv)
    except struct.error:
        raise ValueError(f"a request field is out of range (op {op}, flags {flags}, mode {mode}, "
                         f"timeout_ms {timeout_ms}, {n_strings} strings)") from None


class Connection:
    """One connection to the exec server (a socket file only the caller's user can reach)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        # One request and its answers at a time: the server answers in order, so two threads
        # (AsyncSandbox's workers) sharing this conversation would take each other's answers,
        # and read or write each other's files.
        self._turn = threading.Lock()
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise ServerGone(f"the sandbox does not answer ({path}: {exc.strerror})") from None

    @classmethod
    def pair(cls) -> tuple[Connection, socket.socket]:
        """A command's own conversation, made here: this end, and the far one to send with its EXEC
        (ISO_XS_F_CONVERSATION) on a connection the server has checked already (no connect, no accept)."""
        ours, far = socket.socketpair(socket.AF_UNIX, _SEQPACKET)
        conn = cls.__new__(cls)
        conn.sock = ours
        conn._turn = threading.Lock()
        return conn, far

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def answer(self) -> Reply:
        """The server's prompt answer; a server that gives none in REPLY_TIMEOUT ends the conversation."""
        try:
            return self.receive(REPLY_TIMEOUT)
        except TimeoutError:
            # A late answer would be taken for the next request's: this conversation is over.
            self.close()
            raise ServerGone(f"the sandbox's exec server did not answer within {REPLY_TIMEOUT:g} s (a process of "
                             "the sandbox stopped it, or the sandbox is paused)") from None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, packet: bytes, fds: Sequence[int] = ()) -> None:
        try:
            if fds:
                self.sock.sendmsg([packet], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.send(packet)
        except OSError as exc:
            raise ServerGone(f"the sandbox's exec server is gone ({exc.strerror})") from None

    def receive(self, timeout: float | None = None, size: int = MAX_MESSAGE) -> Reply:
        """The next reply; ServerGone when the server hung up. ``size``: the longest reply expected (a
        command's conversation has no payload: REPLY_SIZE spares a buffer of MAX_MESSAGE per reply);
        a longer one is malformed."""
        # A timeout of 0 (a caller's poll said the socket is readable) is MSG_DONTWAIT: settimeout would
        # cost the socket's flags read and set twice per reply.
        dontwait = timeout == 0
        try:
            if not dontwait:
                self.sock.settimeout(timeout)  # OSError (EBADF) once another thread's close ended the socket
            try:
                data, ancdata, msg_flags, _ = self.sock.recvmsg(size, _FDS_SPACE,
                                                                socket.MSG_DONTWAIT if dontwait else 0)
            except ConnectionResetError:
                # The peer closed with a request of ours unread (a kill that crossed the command's end):
                # the kernel reports that first, once, and what the peer sent before is still queued.
                try:
                    data, ancdata, msg_flags, _ = self.sock.recvmsg(size, _FDS_SPACE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    data, ancdata, msg_flags = b"", [], 0  # nothing was queued: it hung up
        except (TimeoutError, BlockingIOError):
            raise TimeoutError from None
        except OSError as exc:
            raise ServerGone(f"the sandbox's exec server is gone ({exc.strerror})") from None
        finally:
            if not dontwait and self.sock.fileno() >= 0:  # a socket closed meanwhile has nothing to reset
                with contextlib.suppress(OSError):
                    self.sock.settimeout(None)
        fds: list[int] = []
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(blob) - len(blob) % 4
                fds.extend(array.array("i", blob[:usable]))
        for fd in fds:
            os.set_inheritable(fd, False)
        if not data:
            for fd in fds:
                os.close(fd)
            raise ServerGone("the sandbox's exec server hung up")
        if len(data) < REPLY_SIZE or len(fds) > 1 or msg_flags & _TRUNCATED:
            for fd in fds:
                os.close(fd)
            raise ServerGone("the sandbox's exec server sent a malformed reply")
        (magic, kind, err, step, pid, wait_status, reason, count, user_usec, system_usec, maxrss_kib,
         *st) = _REPLY.unpack_from(data)
        if magic != _MAGIC:
            for fd in fds:
                os.close(fd)
            raise ServerGone("the sandbox's exec server sent a malformed reply")
        return Reply(kind, err, step, pid, wait_status, reason, count, user_usec, system_usec, maxrss_kib,
                     Stat(*st) if any(st) else _NO_STAT, data[REPLY_SIZE:], fds[0] if fds else None)

    def send_alone(self, packet: bytes, fds: Sequence[int]) -> None:
        """A request that has no answer here (an EXEC with its own conversation), between the others' turns."""
        with self._turn:
            self.send(packet, fds)

    # -- file operations (answered in order by the server) ---------------------

    def call(self, op: int, strings: Sequence[str] = (), *, flags: int = 0, mode: int = 0) -> Reply:
        with self._turn:
            self.send(encode(op, strings, flags=flags, mode=mode))
            reply = self.answer()
        if reply.kind == lib.ISO_XS_ERROR:
            if reply.fd is not None:
                os.close(reply.fd)
            raise _os_error(reply.err, strings[0] if strings else "")
        if reply.kind != lib.ISO_XS_OK:
            if reply.fd is not None:
                os.close(reply.fd)
            self.close()  # out of step with the server: this conversation is over
            raise ServerGone("the sandbox's exec server sent an unexpected reply")
        return reply

    # -- descriptors the server keeps for the host (csrc/xs_keep.c) -----------

    def keep(self, key: str, fds: Sequence[int], note: int = 0) -> None:
        """Leave copies of ``fds`` (1 to 3) with the server under ``key``, with ``note`` (a number of the
        caller's), in place of what ``key`` held; none: let go of what it held. A host that ends then leaves
        them held (a shell's far ends: the shell sees no end of its input), and the next takes them again."""
        with self._turn:
            self.send(encode(lib.ISO_XS_KEEP, [key], mode=note), fds)
            reply = self.answer()
        if reply.fd is not None:
            os.close(reply.fd)
        if reply.kind == lib.ISO_XS_ERROR:
            raise _os_error(reply.err, key)
        if reply.kind != lib.ISO_XS_OK:
            self.close()
            raise ServerGone("the sandbox's exec server sent an unexpected reply")

    def take(self, key: str, index: int) -> tuple[int, int]:
        """A copy of the ``index``-th descriptor kept under ``key`` (the server keeps its own), and the note."""
        reply = self.call(lib.ISO_XS_TAKE, [key], mode=index)
        if reply.fd is None:
            self.close()
            raise ServerGone("the sandbox's exec server sent no descriptor")
        return reply.fd, reply.pid

    def readdir(self, path: str) -> list[tuple[str, Stat]]:
        """The directory's entries, all of them (read in one turn of the conversation)."""
        entries: list[tuple[str, Stat]] = []
        with self._turn:
            self.send(encode(lib.ISO_XS_READDIR, [path]))
            while True:
                reply = self.answer()
                if reply.fd is not None:
                    os.close(reply.fd)
                if reply.kind == lib.ISO_XS_END:
                    return entries
                if reply.kind == lib.ISO_XS_ERROR:
                    raise _os_error(reply.err, path)
                if reply.kind != lib.ISO_XS_ENTRIES:
                    self.close()  # what follows would be read as the next request's answers
                    raise ServerGone("the sandbox's exec server sent an unexpected reply")
                try:
                    entries.extend(_entries(reply.payload, reply.count))
                except ServerGone:
                    self.close()
                    raise


def probe(connect: Callable[[], Connection], timeout: float = 2.0) -> str:
    """Ask a sandbox's exec server for a ping: "running", "not answering" (stopped, paused) or "gone"."""
    try:
        with connect() as conn:
            conn.send(encode(lib.ISO_XS_PING))
            conn.receive(timeout=timeout)
        return "running"
    except TimeoutError:
        return "not answering"
    except (IsolationError, OSError):
        return "gone"


def _entries(payload: bytes, count: int) -> Iterator[tuple[str, Stat]]:
    offset = 0
    raw = ffi.new("struct iso_xs_dirent *")
    for _ in range(count):
        if offset + DIRENT_SIZE > len(payload):
            raise ServerGone("the sandbox's exec server sent a malformed listing")
        ffi.memmove(raw, payload[offset:offset + DIRENT_SIZE], DIRENT_SIZE)
        length = int(raw.name_len)
        start = offset + DIRENT_SIZE
        name = payload[start:start + length]
        if len(name) != length or b"/" in name or b"\0" in name or name in (b"", b".", b".."):
            raise ServerGone("the sandbox's exec server sent a malformed listing")
        offset += (DIRENT_SIZE + length + 1 + 7) & ~7
        yield os.fsdecode(name), _stat(raw.st)


def _os_error(err: int, path: str) -> OSError:
    """The exception Python raises for this errno (FileNotFoundError, PermissionError ...), naming the path."""
    if err <= 0 or err > 4095:
        err = errno.EIO
    return OSError(err, os.strerror(err), path)
