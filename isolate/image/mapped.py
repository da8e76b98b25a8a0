"""A regular caller's layers with their owners: unpacked, exported and removed in a user namespace of its ranges.

A regular user cannot chown. Where it has subordinate ids (kernel/subids.py:
``/etc/subuid``, ``/etc/subgid`` and the set-id helpers) and asks for it
(``ISOLATE_IMAGE_OWNERS=subids``), its store keeps the owners a layer's
archive gives, as rootless podman does: the layer is
unpacked by a helper process (``python -m isolate.image.mapped``) in a user
namespace whose maps the parent writes through newuidmap/newgidmap, the caller
as 0 and its ranges as 1 to COUNT. The archive's owner U lands on disk as the
subordinate id START + U - 1; a sandbox of the image maps the same ranges, and
shows U again. An owner past the ranges is left the caller's (root's inside),
and counted: the sandbox says so.

The parent prepares and the child applies: the parent (a threaded process:
pulls unpack layers side by side) never forks, it starts the helper with
posix_spawn; the helper, single-threaded when it calls unshare(2), waits on its
standard input until its maps are written, then reads the layer's blob from
there (the parent reads and hashes it). The same helper removes such a layer
(its directories are a subordinate id's, which the caller may not empty) and
writes it back as a layer blob (``image push``: read as the image's ids).

Protocol on the helper's stdout: one byte ``u`` once unshared, then one JSON
line, the result or ``{"error": ..., "bad": bool}``.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from ..kernel import subids
from ..kernel.subids import SubIds
from ..model.errors import IsolationError

if TYPE_CHECKING:
    from .export import LayerBlob
    from .unpack import Unpacked

CLONE_NEWUSER = 0x10000000
_CHUNK = 256 << 10


#: Set to ``subids``: a regular caller's store keeps the image's owners through its subordinate ids. Opt-in:
#: such an image's sandboxes map the ranges, and an upper layer on disk (a build's RUN, commit_image, a
#: snapshot) is refused for them, which a store of the caller's files (the default, ``caller``) allows; a
#: Debian or Ubuntu user has a range by default, and their builds must not start failing. Read when a Store
#: first unpacks or removes a layer.
OWNERS_ENV = "ISOLATE_IMAGE_OWNERS"
OWNERS_KEPT = "subids"


def ranges(removal: bool = False) -> SubIds | None:
    """The caller's subordinate ids where its store keeps owners through them (a regular caller with some that
    asked for it: OWNERS_ENV); ``removal``: whatever OWNERS_ENV says (to remove what was unpacked through them)."""
    if os.geteuid() == 0 or (os.environ.get(OWNERS_ENV) != OWNERS_KEPT and not removal):
        return None
    found = subids.find(os.geteuid(), os.getegid())
    if not isinstance(found, SubIds):
        return None
    from ..kernel.hostinfo import userns_error

    # No user namespace for this caller (a sysctl, a container's seccomp, AppArmor): the layers are unpacked as
    # the caller's, as without a range (its sandboxes say so), rather than not at all.
    return None if userns_error() else found


def describe(ids: SubIds) -> dict[str, list[int]]:
    """What a layer's owners.json records of the ranges its owners were written through."""
    return {"uids": [ids.uids.start, ids.uids.count], "gids": [ids.gids.start, ids.gids.count]}


def _mapped(ids: SubIds, argv: list[str], pass_fds: tuple[int, ...] = (),
            feed: Callable[[IO[bytes]], None] | None = None) -> dict[str, Any]:
    """Run the helper with ``argv`` in a user namespace of ``ids``; its JSON result (an error raised)."""
    from .unpack import BadImageError

    # This very interpreter, importing the modules this process imported (its sys.path): by its path, or where
    # the caller may run it only as it runs now (a path through a directory it cannot search), as /proc/self/exe.
    python = sys.executable if sys.executable and os.access(sys.executable, os.X_OK) else "/proc/self/exe"
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # isolate's parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package, *(p for p in sys.path if p)]))
    helper = subprocess.Popen([python, "-m", "isolate.image.mapped", *argv], stdin=subprocess.PIPE, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds, close_fds=True)
    assert helper.stdin is not None and helper.stdout is not None and helper.stderr is not None
    try:
        if helper.stdout.read(1) != b"u":
            helper.wait()
            raise IsolationError(f"image store: the helper unpacking with subordinate ids failed to start: "
                                 f"{helper.stderr.read(4096).decode(errors='replace').strip()[-300:]}")
        for tool, text in ((ids.newuidmap, ids.uid_map(os.geteuid())), (ids.newgidmap, ids.gid_map(os.getegid()))):
            numbers = [n for line in text.splitlines() for n in line.split()]
            done = subprocess.run([tool, str(helper.pid), *numbers], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                said = " ".join((done.stderr or done.stdout or f"exit status {done.returncode}").split())[:200]
                raise IsolationError(f"image store: {ids.newuidmap} or {ids.newgidmap} refused the caller's "
                                     f"subordinate ids, through which its layers keep their owners ({said}): check "
                                     "the caller's lines in /etc/subuid and /etc/subgid")
        with contextlib.suppress(BrokenPipeError):
            helper.stdin.write(b"g")
            helper.stdin.flush()
            if feed is not None:
                feed(helper.stdin)
        with contextlib.suppress(BrokenPipeError):
            helper.stdin.close()
        out = helper.stdout.read()
        err = helper.stderr.read(1 << 16)
        helper.wait()
    except BaseException:
        helper.kill()
        helper.wait()
        raise
    finally:
        for stream in (helper.stdin, helper.stdout, helper.stderr):
            with contextlib.suppress(OSError):
                stream.close()
    try:
        result = json.loads(out.decode().splitlines()[-1])
        assert isinstance(result, dict)
    except (ValueError, IndexError, AssertionError):
        raise IsolationError(f"image store: the helper working with subordinate ids failed (exit "
                             f"{helper.returncode}): {err.decode(errors='replace').strip()[-300:]}") from None
    if "error" in result:
        raise (BadImageError if result.get("bad") else IsolationError)(str(result["error"]))
    return result


def unpack(ids: SubIds, blob: io.RawIOBase, root_fd: int, *, what: str,
           max_size: int | None) -> tuple[Unpacked, int]:
    """The layer read from ``blob`` unpacked into ``root_fd`` by the helper (owners kept through ``ids``): its
    Unpacked, and how many entries had an owner past the ranges (left the caller's)."""
    from .unpack import LayerIndex, Unpacked

    def feed(stdin: IO[bytes]) -> None:
        while chunk := blob.read(_CHUNK):
            stdin.write(chunk)

    result = _mapped(ids, ["unpack", str(root_fd), what, str(max_size if max_size is not None else -1),
                           str(ids.uids.count), str(ids.gids.count)], (root_fd,), feed)
    return Unpacked(LayerIndex.from_json(result["index"]), str(result["diff_id"])), int(result["unkept"])


def remove(ids: SubIds, path: str) -> None:
    """rm -r ``path`` from inside the ranges' namespace (its files may be subordinate ids')."""
    _mapped(ids, ["remove", path])


def export(ids: SubIds, root: str, path: str, what: str) -> LayerBlob:
    """The tree ``root`` (a layer of the store) written as a layer blob at ``path``, its owners the image's."""
    from .export import LayerBlob

    result = _mapped(ids, ["export", root, path, what])
    return LayerBlob(path, str(result["digest"]), str(result["diff_id"]), int(result["size"]))


# -- the helper ---------------------------------------------------------------


def _enter() -> None:
    """unshare(CLONE_NEWUSER), say so, and wait for the parent's maps (its ``g``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER) != 0:
        raise IsolationError(f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}")
    os.write(1, b"u")
    if os.read(0, 1) != b"g":
        raise SystemExit(1)
    if os.geteuid() != 0:
        raise IsolationError("the parent wrote no maps")


def _run(argv: list[str]) -> dict[str, Any]:
    from .export import write_layer
    from .unpack import remove_tree
    from .unpack import unpack as plain_unpack

    command = argv[0]
    if command == "unpack":
        root_fd, what, max_size, uid_count, gid_count = int(argv[1]), argv[2], int(argv[3]), int(argv[4]), int(argv[5])
        stdin = open(0, "rb", buffering=0, closefd=False)  # the process's own, left open
        done = plain_unpack(stdin, root_fd, what=what, max_size=None if max_size < 0 else max_size,
                            id_limits=(uid_count, gid_count))
        while os.read(0, _CHUNK):  # the rest of the blob (its digest is the parent's to check)
            pass
        return {"index": done.index.to_json(), "diff_id": done.diff_id, "unkept": done.unkept}
    if command == "remove":
        remove_tree(argv[1])
        return {}
    if command == "export":
        from ..kernel.links import DIR_FLAGS

        root_fd = os.open(argv[1], DIR_FLAGS)
        try:
            blob = write_layer(root_fd, argv[2], what=argv[3])
        finally:
            os.close(root_fd)
        return {"digest": blob.digest, "diff_id": blob.diff_id, "size": blob.size}
    raise IsolationError(f"unknown command {command!r}")


def main(argv: list[str]) -> int:
    from .unpack import BadImageError

    _enter()
    try:
        result = _run(argv)
    except IsolationError as exc:
        result = {"error": str(exc), "bad": isinstance(exc, BadImageError)}
    except OSError as exc:
        result = {"error": f"{argv[0]}: {exc.strerror or exc}", "bad": False}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
