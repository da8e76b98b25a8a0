"""The exec server's KEEP and TAKE (csrc/xs_keep.c): descriptors a host leaves with a kept sandbox's exec server
and takes back after its own restart (a kept bash shell's ends, isolate/server/code/shell.py)."""

from __future__ import annotations

import errno
import os

import pytest
from conftest import NAMESPACES_WHY, policy

from isolate import Sandbox

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")

#: The keys an exec server holds at most (xs_keep.c).
MOST = 64


def test_kept_descriptors_come_back_as_copies_and_are_bounded() -> None:
    with Sandbox(policy()) as box:
        conn = box._conn()
        read, write = os.pipe()
        conn.keep("shell-a", [write, read], note=4242)
        os.close(write)  # the exec server's copy keeps the pipe open
        fd, note = conn.take("shell-a", 0)
        assert note == 4242
        os.write(fd, b"through a copy")
        os.close(fd)
        assert os.read(read, 100) == b"through a copy"
        os.close(read)
        with pytest.raises(OSError) as missing:
            conn.take("shell-b", 0)
        assert missing.value.errno == errno.ENOENT
        with pytest.raises(OSError) as index:
            conn.take("shell-a", 2)  # two were kept
        assert index.value.errno == errno.EINVAL
        pipes = [os.pipe() for _ in range(4)]
        try:
            for bad in ([p[0] for p in pipes], []):  # four descriptors; none for a key never kept
                with pytest.raises(OSError):
                    conn.keep("shell-c", bad)
            with pytest.raises(OSError):
                conn.keep("k" * 65, [pipes[0][1]])
        finally:
            for r, w in pipes:
                os.close(r)
                os.close(w)
        conn.keep("shell-a", [])  # let go
        with pytest.raises(OSError):
            conn.take("shell-a", 0)


def test_a_full_table_lets_go_of_ended_shells_first_then_refuses() -> None:
    """A key whose first descriptor is a pipe's write end with no reader left (its shell ended) makes room; keys
    of live ones do not, and the next is refused (ENOSPC), never dropped silently."""
    with Sandbox(policy()) as box:
        conn = box._conn()
        for i in range(MOST):
            read, write = os.pipe()
            conn.keep(f"ended-{i}", [write])
            os.close(write)
            os.close(read)  # no reader: as a shell that ended
        live: list[int] = []
        try:
            for i in range(MOST):
                read, write = os.pipe()
                live += [read, write]
                conn.keep(f"live-{i}", [write])
            read, write = os.pipe()
            live += [read, write]
            with pytest.raises(OSError) as full:
                conn.keep("one-more", [write])
            assert full.value.errno == errno.ENOSPC
            fd, _ = conn.take(f"live-{MOST - 1}", 0)
            os.close(fd)
        finally:
            for fd in live:
                os.close(fd)
