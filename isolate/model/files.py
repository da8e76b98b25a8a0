"""Files a caller names as input (a profile), and bytes written out whole: safely, whatever lies there.

A profile may lie in a directory an earlier sandbox could write: reading it
must not hang on a FIFO, read a device or load a huge file. Nothing here
follows a path for a sandbox or runs anything.
"""

from __future__ import annotations

import os
import stat

#: The largest policy input read from a file (a TOML profile, a seccomp JSON profile).
MAX_INPUT_BYTES = 4 << 20


def read_input_file(path: str | os.PathLike[str], *, limit: int = MAX_INPUT_BYTES, follow: bool = True) -> bytes:
    """The bytes of a file the caller named as input (a profile), read safely.

    The file may lie in a directory an earlier sandbox could write: a FIFO
    planted there must not hang the host, a device must not be read, and a
    huge file must not be loaded. Opened non-blocking, accepted only when it
    is a regular file, read up to ``limit`` bytes (``ValueError`` beyond);
    ``OSError`` (with ``strerror``) for anything else. ``follow=False``: a
    link as the last component is refused (``ELOOP``), not followed.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", os.fspath(path))
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        raise ValueError(f"{os.fspath(path)}: larger than {limit} bytes" if limit != MAX_INPUT_BYTES
                         else f"{os.fspath(path)}: larger than {MAX_INPUT_BYTES >> 20} MiB")
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (os.write may write less than it was given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
