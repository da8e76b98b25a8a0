"""Unpacking one layer into a directory of its own, the way overlayfs takes it as a lower layer.

Every entry is written relative to descriptors, never through a path the
archive could redirect: each parent directory is opened component by
component with ``O_NOFOLLOW``, so an entry that would be written through a
link (planted by an earlier entry of the layer) is refused. What is refused,
each with one line naming the entry (``BadImageError``):

- names that are absolute, hold ``..``, or are more than MAX_DEPTH (256) names deep;
- hard links to anything but a regular file this very layer already holds;
- device nodes (whiteouts aside), and ``security.capability``, ``trusted.*``
  and ``user.overlay.*`` extended attributes (a file's capabilities, and
  overlayfs's own metadata forged);
- a layer whose unpacked bytes pass ``max_size``: a decompression bomb ends
  there, with what was read so far thrown away; one whose names together pass
  MAX_NAME_BYTES (its index is held in memory), or whose entries' headers pass
  their bound (tarbound.py).

Whiteouts become what overlayfs reads in a lower layer: ``.wh.NAME`` a 0/0
character device ``NAME`` (unprivileged since Linux 5.8), ``.wh..wh..opq``
the xattr ``user.overlay.opaque`` on its directory (the sandbox's overlay is
mounted with ``userxattr``). Set-id bits are dropped: no copy of a set-id
file lies on the host (and the sandbox's root is mounted nosuid, where they
would do nothing anyway). Other extended attributes are not applied.
Owners are kept for a root caller (the sandbox maps root, and the program's
own uid), and in a user namespace of a regular caller's subordinate ids
(mapped.py's helper: ``id_limits``, an owner past them left root's and
counted); otherwise a regular user's store holds that user's files only. The
layer's index counts the entries the archive gave other owners than root
(``owners``: what a sandbox and ``image inspect`` say of them).

The work is shared out among threads: one decompresses the stream (with
ISA-L where the module isal is installed), one parses its tar headers and
reads small files' contents, and this one, the caller's, checks each entry in
the archive's order and makes its directories. Inodes are made side by side
(writers.py): while a layer only adds names,
each new regular file, symbolic link and hard link is a task of the thread of
its directory, decided here first, in the archive's order, against what the
layer made so far (a name under one that is not a directory is refused as
the kernel would refuse it: the entry written through a link). The first
entry that replaces a name the layer made waits for every task, and the rest
of the layer is unpacked in this thread, entry after entry.

The caller gives a fresh, empty directory; on any error it throws it away.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import importlib
import io
import os
import queue
import stat
import tarfile
import threading
import zlib
from dataclasses import dataclass, field
from typing import IO, Any

from ..kernel.beneath import open_beneath
from ..kernel.links import DIR_FLAGS
from ..model.errors import IsolationError
from .budget import CONTENTS, CONTENTS_BYTES, MAX_WINDOW, SMALL_WINDOW, Account, Slot
from .tarbound import BoundedTarInfo
from .writers import Writers

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "user.overlay.opaque"
#: How many of a layer's directories an unpack keeps open at most (then it closes them all and walks anew).
_OPEN_DIRS = 256
_REFUSED_XATTRS = ("security.capability", "trusted.", "user.overlay.")
#: What each stage of an unpack reads at once (and what its read-ahead holds: _AHEAD of them): what an unpack holds
#: beyond its small files' contents (budget.CONTENTS) and its decompressor's window.
_CHUNK = 256 << 10
_AHEAD = 4
#: Threads making a layer's inodes side by side (writers.py), and the bytes of contents read and not yet written
#: (of one layer: all of them together are bounded by budget.CONTENTS).
_WRITERS = 4
_IN_FLIGHT = CONTENTS_BYTES
#: Tasks given the threads and not yet run: each holds one or two descriptors (within the usual limit of 1024,
#: beside the directories this thread keeps open: _OPEN_DIRS, and MAX_DEPTH for one walk).
_TASKS = 128
#: A file past this is written by the reading thread itself (its contents never held whole).
_SMALL_FILE = 1 << 20


class BadImageError(IsolationError):
    """An image, or one of its layers, refused: the message names the entry and the reason."""


@dataclass
class LayerIndex:
    """What a layer holds, for the checks across layers (links planted by an earlier layer)."""

    links: list[str] = field(default_factory=list)  # symbolic links
    others: list[str] = field(default_factory=list)  # every other non-directory
    dirs: list[str] = field(default_factory=list)
    whiteouts: list[str] = field(default_factory=list)
    opaque: list[str] = field(default_factory=list)
    size: int = 0
    #: Entries the archive gives another owner than root, by "UID:GID" (at most OWNERS ids, the rest counted
    #: under "other"): kept on disk for a root caller only. None: not known (a layer of an earlier isolate).
    owners: dict[str, int] | None = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"links": self.links, "others": self.others, "dirs": self.dirs, "whiteouts": self.whiteouts,
                "opaque": self.opaque, "size": self.size, "owners": self.owners}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerIndex:
        return cls(list(data["links"]), list(data["others"]), list(data["dirs"]), list(data["whiteouts"]),
                   list(data["opaque"]), int(data["size"]), owners_of(data))

    def own(self, member: tarfile.TarInfo) -> None:
        """Count ``member``'s owner when it is not root."""
        if (member.uid or member.gid) and self.owners is not None:
            key = f"{member.uid}:{member.gid}"
            if key not in self.owners and len(self.owners) >= OWNERS:
                key = "other"
            self.owners[key] = self.owners.get(key, 0) + 1


#: Distinct owners a layer's index names at most (an archive may give each entry another).
OWNERS = 16


def owners_of(data: Any) -> dict[str, int] | None:
    """The ``owners`` of a layer's index (or of its owners.json), None where it does not say."""
    found = data.get("owners") if isinstance(data, dict) else None
    if not isinstance(found, dict):
        return None
    return {str(k): int(v) for k, v in found.items() if isinstance(v, int)}


class _Counting(io.RawIOBase):
    """A stream read through: its bytes counted and hashed, and a bound on how many may come."""

    def __init__(self, raw: IO[bytes], limit: int | None, what: str) -> None:
        self.raw, self.limit, self.what = raw, limit, what
        self.count = 0
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.chunk(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def chunk(self, size: int, hashed: bool = True) -> bytes:
        """Up to size bytes, as read (no copy); not hashed when not ``hashed`` (the reader hashes them)."""
        data = self.raw.read(size)
        self.count += len(data)
        if self.limit is not None and self.count > self.limit:
            raise BadImageError(f"{self.what}: past max_image_size ({self.limit} bytes) once decompressed "
                                "(a decompression bomb, or an image too large): refused")
        if hashed:
            self.sha.update(data)
        return data


class _Ahead(io.RawIOBase):
    """A stream read ahead by a thread of its own (``depth`` chunks at most): the layer's decompression (zlib
    lets other threads run) goes on while others parse the archive and make its files. Its chunks are hashed
    into the source's ``sha`` as they are read from here (the hashing shared out: the thread decompressing is
    the busiest). The thread's error is raised here, where the stream is read; ``stop()`` ends the thread."""

    def __init__(self, source: _Counting, depth: int = _AHEAD) -> None:
        super().__init__()
        self.source = source
        self.chunks: queue.Queue[bytes | BaseException] = queue.Queue(depth)
        self.left = memoryview(b"")
        self.ended = False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._read, name="isolate-unpack-read", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        item: bytes | BaseException
        try:
            while True:
                item = self.source.chunk(_CHUNK, hashed=False)
                if not self._put(item) or not item:
                    return
        except BaseException as exc:  # raised in the reading thread, where the stream is read
            self._put(exc)

    def _put(self, item: bytes | BaseException) -> bool:
        while not self.stopping.is_set():
            try:
                self.chunks.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self.left:
            if self.ended:
                return 0
            item = self.chunks.get()
            if isinstance(item, BaseException):
                self.ended = True
                raise item
            if not item:
                self.ended = True
                return 0
            self.source.sha.update(item)
            self.left = memoryview(item)
        n = min(len(buffer), len(self.left))
        buffer[:n] = self.left[:n]
        self.left = self.left[n:]
        return n

    def stop(self) -> None:
        """End the thread (at once when it waits to hand a chunk over; after its read otherwise)."""
        self.stopping.set()
        self.thread.join()


def _gzip_reader() -> tuple[Any, tuple[type[Exception], ...]]:
    """The gzip reader: ISA-L's (the Python module isal, of ``isolate[images]``: the same format read with about
    half the CPU of zlib's, which was the busiest thread of a pull) where installed, else the standard library's;
    and the errors each raises for a damaged stream beyond EOFError and BadGzipFile."""
    try:
        igzip = importlib.import_module("isal.igzip")
        isal_error = importlib.import_module("isal.isal_zlib").error
    except ImportError:
        return gzip.GzipFile, (zlib.error,)
    return igzip.GzipFile, (zlib.error, isal_error)


_GZIP, _DAMAGED = _gzip_reader()


def _zstd_errors() -> tuple[type[Exception], ...]:
    try:
        return (importlib.import_module("zstandard").ZstdError,)
    except ImportError:
        return ()


_DAMAGED += _zstd_errors()  # a damaged zstd frame, or one whose window is past MAX_WINDOW


def _decompressed(raw: io.RawIOBase, what: str, slot: Slot | None) -> IO[bytes]:
    """The layer's tar stream, whatever its compression (told by its first bytes). A zstd frame's decoder holds
    its whole window: past budget.SMALL_WINDOW (the first frame's), the layer unpacks alone (``slot``), and a
    frame past MAX_WINDOW, or past SMALL_WINDOW when the first was not, is refused."""
    buffered = io.BufferedReader(raw, _CHUNK)
    magic = buffered.peek(4)[:4]
    if magic[:2] == b"\x1f\x8b":
        return _GZIP(fileobj=buffered, mode="rb")  # type: ignore[no-any-return]
    if magic == b"\x28\xb5\x2f\xfd":
        try:
            zstandard = importlib.import_module("zstandard")
        except ImportError:
            raise BadImageError(f"{what}: a zstd layer, and the Python module zstandard is not installed "
                                "(pip install 'isolate[images]')") from None
        try:
            window = int(zstandard.get_frame_parameters(buffered.peek(18)[:18]).window_size)
        except zstandard.ZstdError as exc:
            raise BadImageError(f"{what}: its compressed stream is damaged ({exc})") from None
        if window > MAX_WINDOW:
            raise BadImageError(f"{what}: a zstd frame whose window is {window} bytes, past {MAX_WINDOW}: refused")
        bound = SMALL_WINDOW
        if window > SMALL_WINDOW:
            bound = MAX_WINDOW
            if slot is not None:
                slot.alone()
        return zstandard.ZstdDecompressor(max_window_size=bound).stream_reader(buffered)  # type: ignore[no-any-return]
    return buffered


#: Names in one entry's path: the walk to it holds a descriptor per directory, and so does the removal of its tree,
#: which recurses once per directory (Linux's PATH_MAX, 4096 bytes, holds 2048 at most).
MAX_DEPTH = 256
#: Entries of one layer (each costs an inode, and a line of the layer's index).
MAX_ENTRIES = 2_000_000
#: The characters of one layer's entry names, together: each name is held in memory while the layer unpacks (its
#: index), and written to its index.json. A name may be 256 names of 255 bytes deep, and compresses well: a
#: layer blob of 100 MB held 16 GB of names (the decompressed stream's bound) in a pull's memory.
MAX_NAME_BYTES = 256 << 20


@dataclass
class Unpacked:
    index: LayerIndex
    diff_id: str  # sha256 of the uncompressed tar stream
    unkept: int = 0  # entries whose owner is past ``id_limits`` (left the caller's)


class _Parser:
    """The archive's entries parsed by a thread of its own (tarfile's headers cost as much as the checks), in
    order, each with its contents when it is a regular file of at most _SMALL_FILE bytes (read, ``depth``
    entries ahead at most, their bytes taken from ``account``: given back once written). A larger one is read by
    the caller from ``archive`` (its ``extractfile``) while this thread waits, until ``next()`` is called again.
    The thread's error is raised by ``next()``."""

    _END = object()

    def __init__(self, stream: IO[bytes], what: str, account: Account, depth: int = 16) -> None:
        self.stream, self.what, self.account = stream, what, account
        self.entries: queue.Queue[Any] = queue.Queue(depth)
        self.stopping = threading.Event()
        self.turn = threading.Event()  # set: the caller is done with a large file's contents
        self.archive: tarfile.TarFile | None = None
        self.waiting = False
        self.thread = threading.Thread(target=self._parse, name="isolate-unpack-parse", daemon=True)
        self.thread.start()

    def _parse(self) -> None:
        try:
            with tarfile.open(fileobj=self.stream, mode="r|", tarinfo=BoundedTarInfo) as archive:
                self.archive = archive
                for count, member in enumerate(archive, 1):
                    if count > MAX_ENTRIES:
                        raise BadImageError(f"{self.what}: more than {MAX_ENTRIES} entries: refused")
                    # tarfile keeps every entry it read (for a random access a stream never makes): a layer's
                    # headers would all be held to its end. Its iteration reads on past a list emptied.
                    archive.members.clear()  # type: ignore[attr-defined]
                    data = None
                    if member.isreg() and member.size <= _SMALL_FILE:
                        # Its bytes taken from the process's budget first (given back once written); 0 taken of
                        # more than 0 only when stopping.
                        if member.size > 0 and not self.account.take(member.size, self.stopping):
                            return
                        source = archive.extractfile(member)
                        assert source is not None
                        data = source.read()
                    if not self._put((member, data)):
                        return
                    if member.isreg() and data is None:
                        self.turn.wait()  # the caller reads it from the archive
                        self.turn.clear()
                        if self.stopping.is_set():
                            return
            self._put(self._END)
        except BaseException as exc:  # raised in the caller's thread, by next()
            self._put(exc)

    def _put(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self.entries.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> tuple[tarfile.TarInfo, bytes | None] | None:
        """The next entry and its contents (None: read them from ``archive``), or None at the end."""
        if self.waiting:
            self.waiting = False
            self.turn.set()
        while True:
            try:
                item = self.entries.get(timeout=0.5)
                break
            except queue.Empty:
                # The thread says its end (an entry, the end, its error) unless it was stopped: one that ended
                # without a word (a path of it not thought of) must not leave its caller waiting for ever.
                if not self.thread.is_alive() and self.entries.empty():
                    raise BadImageError(f"{self.what}: the archive's reader ended without its entries: "
                                        "refused") from None
        if isinstance(item, BaseException):
            raise item
        if item is self._END:
            self.thread.join()  # done with the stream: the caller reads on from it
            return None
        member, data = item
        self.waiting = member.isreg() and data is None
        return member, data

    def stop(self) -> None:
        self.stopping.set()
        self.turn.set()
        self.thread.join()


def unpack(blob: io.RawIOBase, root_fd: int, *, what: str, max_size: int | None, slot: Slot | None = None,
           id_limits: tuple[int, int] | None = None) -> Unpacked:
    """Unpack the layer read from ``blob`` into the empty directory ``root_fd``. ``slot``: the caller's hold on
    budget.SLOTS (taken for all of them where the layer's decompression needs a large window). ``id_limits``:
    the last uid and gid the user namespace maps (mapped.py's helper): an entry owned past them is left root's."""
    account = CONTENTS.account()
    unpacker = _Unpacker(root_fd, what, max_size, account)
    unpacker.limits = id_limits
    ahead = parser = None
    try:
        try:
            tar_stream = _Counting(_decompressed(blob, what, slot), max_size, what)
        except _DAMAGED as exc:
            raise BadImageError(f"{what}: its compressed stream is damaged ({exc})") from None
        # Decompressed and hashed by a thread of its own, parsed by another, ahead of the checks here.
        ahead = _Ahead(tar_stream)
        parser = _Parser(io.BufferedReader(ahead, _CHUNK), what, account)
        return _unpack(ahead, parser, tar_stream, unpacker, what)
    finally:
        if parser is not None:
            parser.stop()  # first: it may wait for a chunk from ahead
        if ahead is not None:
            ahead.stop()  # before the caller reads the blob on (its digest), or throws the layer away
        unpacker.stop()
        unpacker.forget()
        account.close()  # what its threads held when it ended (each stopped above)


def _unpack(ahead: _Ahead, parser: _Parser, tar_stream: _Counting, unpacker: _Unpacker, what: str) -> Unpacked:
    try:
        while (item := parser.next()) is not None:
            assert parser.archive is not None
            unpacker.entry(parser.archive, *item)
        unpacker.serial()  # every file made
        while ahead.readinto(bytearray(_CHUNK)):  # the diff id covers the whole stream, its trailing blocks too
            pass
    except BadImageError as exc:
        if not str(exc).startswith(what):
            raise BadImageError(f"{what}: {exc}") from None
        raise
    except tarfile.TarError as exc:
        raise BadImageError(f"{what}: not a valid layer archive ({exc})") from None
    except (ValueError, OverflowError) as exc:
        # A number of a header the kernel or tarfile cannot take (an mtime NaN or past time_t, an owner past
        # 32 bits or negative, a pax sparse map cut short): the archive's, never a traceback.
        raise BadImageError(f"{what}: not a valid layer archive (a header's value: {exc})") from None
    except _DAMAGED as exc:  # ISA-L's "invalid deflate block" and the like (tarfile words zlib's only while it parses)
        raise BadImageError(f"{what}: its compressed stream is damaged ({exc})") from None
    except (EOFError, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, BadImageError):
            raise
        if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, gzip.BadGzipFile):
            raise IsolationError(f"{what}: cannot unpack: {exc.strerror or exc}") from None
        raise BadImageError(f"{what}: its compressed stream is damaged ({exc})") from None
    unpacker.finish()
    return Unpacked(unpacker.index, "sha256:" + tar_stream.sha.hexdigest(), unpacker.unkept)


def entry_name(name: str, what: str) -> str:
    """The entry's path inside the layer, or a refusal (absolute names, ``..``)."""
    if name.startswith("/"):
        raise BadImageError(f"{what}: entry {name!r} has an absolute name: refused")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise BadImageError(f"{what}: entry {name!r} climbs out with '..': refused")
    if "\0" in name:
        raise BadImageError(f"{what}: entry {name!r} has a NUL byte in its name: refused")
    if len(parts) > MAX_DEPTH:
        raise BadImageError(f"{what}: entry {name[:80]!r}... is {len(parts)} names deep (past {MAX_DEPTH}): refused")
    return "/".join(parts)


class _Unpacker:
    def __init__(self, root_fd: int, what: str, max_size: int | None, account: Account) -> None:
        self.root_fd, self.what, self.max_size, self.account = root_fd, what, max_size, account
        self.index = LayerIndex()
        self.name_bytes = 0  # of the entries' names (MAX_NAME_BYTES)
        self.files: set[str] = set()  # regular files written, the only targets a hard link may have
        self.dir_modes: list[tuple[str, int, float]] = []
        self.root = os.geteuid() == 0
        self.limits: tuple[int, int] | None = None  # the last uid and gid mapped (mapped.py), when not all are
        self.unkept = 0  # entries whose owner is past them
        self.dirs: dict[str, int] = {}  # directories parent() walked, open, by path in the layer
        #: While the layer only adds names: the threads making them, and what each name made is ("d": a
        #: directory, "f": a regular file, "o": anything else). None once an entry replaced one (see the
        #: module's docstring): from there on, each entry is made in this thread.
        self.writers: Writers | None = Writers(_WRITERS, _IN_FLIGHT, _TASKS, account.give)
        self.made: dict[str, str] = {}

    def refuse(self, name: str, why: str) -> BadImageError:
        return BadImageError(f"{self.what}: entry {name!r} {why}: refused")

    def parent(self, rel: str) -> tuple[int, str]:
        """A descriptor of rel's parent (made as needed, no link followed) and rel's last name. The directories
        walked stay open, by their path in the layer (a layer lists a directory's entries together: each is a
        dup, not a walk); a directory is only ever replaced after clear() removed it, which forgets them all."""
        if len(self.dirs) >= _OPEN_DIRS:
            self.forget()
        parts = rel.split("/")
        depth = start = len(parts) - 1
        while start and "/".join(parts[:start]) not in self.dirs:
            start -= 1
        fd = self.dirs["/".join(parts[:start])] if start else self.root_fd
        for i in range(start, depth):
            part = parts[i]
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = "/".join(parts[:i + 1])
                    raise self.refuse(rel, f"is written through {where!r}, which is not a directory "
                                      "(a link planted by an earlier entry)") from None
                raise
            self.dirs["/".join(parts[:i + 1])] = fd = child
        return os.dup(fd), parts[-1]

    def serial(self) -> None:
        """Every task run (its error raised), and the rest of the layer made in this thread."""
        if self.writers is not None:
            try:
                self.writers.drain()
            finally:
                self.stop()

    def stop(self) -> None:
        if self.writers is not None:
            self.writers.close()
            self.writers = None
            self.made.clear()

    def through(self, rel: str, shown: str) -> None:
        """Refuse rel when a name above it was made as no directory (before the task making it may have run:
        the refusal the kernel gives, O_NOFOLLOW, in serial order). While the layer only adds names, a directory
        made has only directories above it: a known directory ends the walk."""
        end = rel.rfind("/")
        while end != -1:
            kind = self.made.get(rel[:end])
            if kind == "d":
                return
            if kind is not None:
                raise self.refuse(shown, f"is written through {rel[:end]!r}, which is not a directory "
                                  "(a link planted by an earlier entry)")
            end = rel.rfind("/", 0, end)

    def mark(self, rel: str, kind: str) -> None:
        """rel made (kind), and its parents (parent() makes the missing ones)."""
        if self.writers is None:
            return
        end = rel.rfind("/")
        while end != -1 and rel[:end] not in self.made:
            self.made[rel[:end]] = "d"
            end = rel.rfind("/", 0, end)
        self.made[rel] = kind

    def forget(self) -> None:
        """Close the directories parent() keeps open."""
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs.clear()

    def clear(self, dir_fd: int, name: str, keep_dir: bool) -> None:
        """Remove what an earlier entry of this layer left at name (a later entry replaces it)."""
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode):
            if keep_dir:
                return
            self.forget()  # those kept open may be in the tree removed, and their paths another's next
            _remove_tree_at(dir_fd, name)
        else:
            os.unlink(name, dir_fd=dir_fd)

    def entry(self, archive: tarfile.TarFile, member: tarfile.TarInfo, data: bytes | None) -> None:
        """Make member (its contents: data, or read from archive when None)."""
        rel = entry_name(member.name, self.what)
        if not rel:
            return  # the layer's root itself
        self.name_bytes += len(rel)
        if self.name_bytes > MAX_NAME_BYTES:
            raise self.refuse(member.name[:80], f"takes the layer's names past {MAX_NAME_BYTES} characters together")
        for key in member.pax_headers:
            if key.startswith("SCHILY.xattr."):
                attr = key[len("SCHILY.xattr."):]
                if attr.startswith(_REFUSED_XATTRS):
                    raise self.refuse(member.name, f"carries the extended attribute {attr}")
        base = rel.rsplit("/", 1)[-1]
        if member.ischr() or member.isblk():
            raise self.refuse(member.name, "is a device node")
        if base.startswith(WHITEOUT_PREFIX):
            self.whiteout(rel, base, member)
            return
        self.index.own(member)
        if not self.keeps(member) and (member.uid or member.gid):
            self.unkept += 1
        if member.issym():
            if "\0" in member.linkname:
                raise self.refuse(member.name, "is a link with a NUL byte")
        if self.writers is not None:
            kind = self.made.get(rel)
            if kind is not None and not (kind == "d" and member.isdir()):
                self.serial()  # a name replaced: what it was must be there to be removed, and what follows waits
            elif self.added(rel, member, data):
                return
        dir_fd, name = self.parent(rel)
        self.files.discard(rel)
        try:
            self.clear(dir_fd, name, keep_dir=member.isdir())
            mode = member.mode & 0o1777  # set-id bits dropped (see the module's docstring)
            if member.isdir():
                try:
                    os.mkdir(name, 0o700, dir_fd=dir_fd)
                except FileExistsError:
                    pass
                self.dir_modes.append((rel, mode, float(member.mtime)))
                self.index.dirs.append(rel)
                self.own(dir_fd, name, member)
            elif member.isreg() and data is not None:
                self.grow(member.size, member.name)
                self.write_file(dir_fd, name, data, member)
                self.account.give(len(data))
                self.files.add(rel)
                self.index.others.append(rel)
            elif member.isreg():
                self.grow(member.size, member.name)
                source = archive.extractfile(member)
                assert source is not None
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dir_fd)
                try:
                    while chunk := source.read(_CHUNK):
                        os.write(fd, chunk)
                    self.own_fd(fd, member)
                    os.fchmod(fd, mode)
                    os.utime(fd, (member.mtime, member.mtime))
                finally:
                    os.close(fd)
                self.files.add(rel)
                self.index.others.append(rel)
            elif member.issym():
                os.symlink(member.linkname, name, dir_fd=dir_fd)
                self.own(dir_fd, name, member)
                self.index.links.append(rel)
            elif member.islnk():
                target = entry_name(member.linkname, self.what)
                if target not in self.files:
                    raise self.refuse(member.name, f"is a hard link to {member.linkname!r}, which is no file "
                                      "of this layer")
                target_fd, target_name = self.parent(target)
                try:
                    # The kind of what lies there now, not of what was written there first: a file replaced by
                    # a link later in the layer made a hard link that is a symbolic link, unseen by the index.
                    if not stat.S_ISREG(os.stat(target_name, dir_fd=target_fd, follow_symlinks=False).st_mode):
                        raise self.refuse(member.name, f"is a hard link to {member.linkname!r}, which is no longer "
                                          "a regular file")
                    os.link(target_name, name, src_dir_fd=target_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                finally:
                    os.close(target_fd)
                self.index.others.append(rel)
            elif member.isfifo():
                os.mkfifo(name, mode, dir_fd=dir_fd)
                os.chmod(name, mode, dir_fd=dir_fd)  # not the umask's: a layer exported again is the same
                self.own(dir_fd, name, member)
                self.index.others.append(rel)
            else:
                raise self.refuse(member.name, f"is of a kind no layer holds (tar type {member.type!r})")
        finally:
            os.close(dir_fd)

    def added(self, rel: str, member: tarfile.TarInfo, data: bytes | None) -> bool:
        """A new name, or a directory again: made, or given to the threads (True), or left to entry() (False)."""
        assert self.writers is not None
        self.through(rel, member.name)
        key = rel.rpartition("/")[0]
        if member.isreg() and data is not None:
            self.grow(member.size, member.name)
            dir_fd, name = self.parent(rel)
            self.writers.submit(key, lambda: self.write_file(dir_fd, name, data, member), len(data), (dir_fd,))
            self.mark(rel, "f")
            self.files.add(rel)
            self.index.others.append(rel)
            return True
        if member.issym():
            dir_fd, name = self.parent(rel)
            self.writers.submit(key, lambda: self.symlink(dir_fd, name, member), 0, (dir_fd,))
            self.mark(rel, "o")
            self.index.links.append(rel)
            return True
        if member.islnk():
            target = entry_name(member.linkname, self.what)
            if target not in self.files:
                raise self.refuse(member.name, f"is a hard link to {member.linkname!r}, which is no file of this "
                                  "layer")
            dir_fd, name = self.parent(rel)
            try:
                target_fd, target_name = self.parent(target)
            except BaseException:
                os.close(dir_fd)
                raise
            # The thread that made the target (its directory's): the link is made after it.
            self.writers.submit(target.rpartition("/")[0], lambda: self.hard_link(target_fd, target_name, dir_fd,
                                                                                  name, member), 0, (dir_fd, target_fd))
            self.mark(rel, "o")
            self.index.others.append(rel)
            return True
        self.mark(rel, "d" if member.isdir() else "o")  # made below, in this thread (the name is new)
        return False

    def write_file(self, dir_fd: int, name: str, data: bytes, member: tarfile.TarInfo) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self.own_fd(fd, member)
            os.fchmod(fd, member.mode & 0o1777)  # set-id bits dropped (see the module's docstring)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)

    def symlink(self, dir_fd: int, name: str, member: tarfile.TarInfo) -> None:
        os.symlink(member.linkname, name, dir_fd=dir_fd)
        self.own(dir_fd, name, member)

    def hard_link(self, target_fd: int, target_name: str, dir_fd: int, name: str, member: tarfile.TarInfo) -> None:
        # The kind of what lies there now, not of what was written there first: a file replaced by a link later
        # in the layer made a hard link that is a symbolic link, unseen by the index.
        if not stat.S_ISREG(os.stat(target_name, dir_fd=target_fd, follow_symlinks=False).st_mode):
            raise self.refuse(member.name, f"is a hard link to {member.linkname!r}, which is no longer a regular file")
        os.link(target_name, name, src_dir_fd=target_fd, dst_dir_fd=dir_fd, follow_symlinks=False)

    def whiteout(self, rel: str, base: str, member: tarfile.TarInfo) -> None:
        directory = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if self.writers is not None:
            self.through(rel, member.name)
        if base == OPAQUE_MARKER:
            if directory:
                self.mark(directory, "d")  # made here when no entry named it: a later entry of its name replaces it
            fd = self.open_dir(directory, member.name)
            try:
                os.setxattr(fd, OPAQUE_XATTR, b"y")
            finally:
                os.close(fd)
            self.index.opaque.append(directory)
            return
        hidden = base[len(WHITEOUT_PREFIX):]
        if not hidden or hidden in (".", "..") or hidden.startswith(WHITEOUT_PREFIX):
            raise self.refuse(member.name, "is a whiteout of no valid name")
        target = f"{directory}/{hidden}" if directory else hidden
        if self.writers is not None and target in self.made:
            self.serial()  # a name replaced
        self.mark(target, "o")
        dir_fd, name = self.parent(target)
        try:
            self.clear(dir_fd, name, keep_dir=False)
            os.mknod(name, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=dir_fd)
        except PermissionError:
            raise IsolationError(f"{self.what}: cannot make the whiteout {target!r}: this kernel lets no regular "
                                 "user make one (Linux 5.8 does)") from None
        finally:
            os.close(dir_fd)
        self.index.whiteouts.append(target)

    def open_dir(self, rel: str, name: str) -> int:
        if not rel:
            return os.dup(self.root_fd)
        dir_fd, last = self.parent(rel + "/x")
        if last != "x":
            os.close(dir_fd)
        return dir_fd

    def dir_if_there(self, rel: str) -> int | None:
        """A descriptor of the directory rel, walked from the root with no link followed and nothing made; None
        when a name on the way is not a directory (now)."""
        parent, _, last = rel.rpartition("/")
        start = self.dirs.get(parent) if parent else self.root_fd
        try:
            return open_beneath(self.root_fd, rel, DIR_FLAGS) if start is None else \
                open_beneath(start, last, DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return None
            raise

    def grow(self, size: int, name: str) -> None:
        self.index.size += size
        if self.max_size is not None and self.index.size > self.max_size:
            raise self.refuse(name, f"takes the layer past max_image_size ({self.max_size} bytes)")

    def keeps(self, member: tarfile.TarInfo) -> bool:
        """Whether member's owner is written (root's owners all; within the namespace's ranges, see limits)."""
        return self.root and (self.limits is None or (member.uid <= self.limits[0] and member.gid <= self.limits[1]))

    def own(self, dir_fd: int, name: str, member: tarfile.TarInfo) -> None:
        if self.keeps(member):
            os.chown(name, member.uid, member.gid, dir_fd=dir_fd, follow_symlinks=False)

    def own_fd(self, fd: int, member: tarfile.TarInfo) -> None:
        if self.keeps(member):
            os.fchown(fd, member.uid, member.gid)

    def finish(self) -> None:
        """Directories get their modes last (one made read-only early would refuse what goes in it), each the
        mode and time of its last entry (as tar gives them); one a later entry replaced (a link, a file, a
        whiteout) is left as it is, never opened through (nor made again)."""
        last: dict[str, tuple[int, float]] = {}
        for rel, mode, mtime in self.dir_modes:
            last[rel] = (mode, mtime)
        self.forget()
        for rel, (mode, mtime) in reversed(last.items()):
            fd = self.dir_if_there(rel)
            if fd is None:
                continue
            try:
                os.fchmod(fd, mode | (0 if self.root else 0o700))
                os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)


def _remove_tree_at(dir_fd: int, name: str) -> None:
    """rm -r of dir_fd/name, no link followed (a directory of the store's owner, made writable first)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            os.unlink(name, dir_fd=dir_fd)
            return
        if exc.errno == errno.ENOENT:
            return
        raise
    try:
        os.fchmod(fd, 0o700)
        for child in os.listdir(fd):
            info = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                _remove_tree_at(fd, child)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_tree(path: str) -> None:
    """rm -r path (no link followed); nothing there is fine."""
    parent, name = os.path.split(path.rstrip("/"))
    try:
        fd = os.open(parent or "/", DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        _remove_tree_at(fd, name)
    finally:
        os.close(fd)
