"""Tar headers read with a bound: every archive isolate reads from someone else goes through ``BoundedTarInfo``.

tarfile reads what one entry's headers need into memory, with no bound of its
own: a pax or GNU long-name header as a whole (its size is the archive's
word), a GNU sparse map (the 1.0 format: as many numbers as the map's first
line says, read on to the end of the stream; the old format: extension blocks
as long as each says another follows), and a chain of extended headers, each
read by a recursion of its own. A gzip stream of a megabyte holds a gigabyte
of any of these: a layer, a ``docker save`` archive, a Dockerfile's ``ADD``
archive or a snapshot's archive of that kind took the host's memory (or ended
in RecursionError). Here the bytes read for one entry's headers, all of them,
are bounded by MAX_HEADER, and its headers by MAX_HEADERS: past either, the
archive is refused (``HeaderTooLarge``, a ``tarfile.ReadError``: every reader
already says those in one line).
"""

from __future__ import annotations

import tarfile
from typing import Any

#: The most one entry's headers (extended headers, long names, a sparse map) may take in the archive.
MAX_HEADER = 1 << 20
#: The most extended headers one entry may have (each is a level of tarfile's recursion).
MAX_HEADERS = 32
_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
             tarfile.SOLARIS_XHDTYPE)


class HeaderTooLarge(tarfile.ReadError):
    """An entry's headers past MAX_HEADER bytes or MAX_HEADERS headers."""


class BadHeaderValue(tarfile.ReadError):
    """An entry's header holds a number no entry can have (a negative size)."""


class _Counted:
    """The archive's stream while one entry's headers are read: its reads counted against MAX_HEADER."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.read_so_far = 0
        self.depth = 0

    def read(self, size: int = -1) -> bytes:
        if size < 0 or self.read_so_far + size > MAX_HEADER + tarfile.BLOCKSIZE:
            raise HeaderTooLarge(f"an entry's tar headers take more than {MAX_HEADER} bytes (an extended header, a "
                                 "long name or a sparse map): refused")
        data: bytes = self.raw.read(size)
        self.read_so_far += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo whose headers are read within MAX_HEADER bytes and MAX_HEADERS headers (the module's docstring);
    give it as ``tarinfo=`` to ``tarfile.open``."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > MAX_HEADER:
            raise HeaderTooLarge(f"an extended tar header of {self.size} bytes (past {MAX_HEADER}): refused")
        stream: Any = tarfile_.fileobj
        counted = stream if isinstance(stream, _Counted) else _Counted(stream)
        counted.depth += 1
        if counted.depth > MAX_HEADERS:
            raise HeaderTooLarge(f"an entry with more than {MAX_HEADERS} extended tar headers: refused")
        tarfile_.fileobj = counted
        try:
            member: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        finally:
            counted.depth -= 1
            tarfile_.fileobj = stream
        # A pax record or a base-256 field may say a negative size, which tarfile takes as it is: a stream's reader
        # read 0 bytes of the entry's data and waited for its contents for ever (the layer unpacker's parser).
        if member.size < 0:
            raise BadHeaderValue(f"entry {member.name[:200]!r}: a negative size ({member.size}): refused")
        return member
