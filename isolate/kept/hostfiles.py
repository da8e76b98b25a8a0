"""Files that cross between the host and a sandbox on the host's side: upload, download, commit.

Shared by ``isolate.Sandbox`` and the remote sandbox of ``isolate.ray``: each
takes a box with ``mkdir``/``write_file`` or a workspace's descriptor, and
does the host's part the same way (no link followed, no FIFO written to, the
refusals of ``isolate.kernel.tree``).
"""

from __future__ import annotations

import os
from typing import Any

from ..kernel.tree import Changes, apply, check_target, diff, entries_of, walk
from ..model.workspace import Workspace


def commit_tree(ws_fd: int, target: str | os.PathLike[str], workspace: Workspace, workspace_host: str) -> Changes:
    """Make ``target`` match the tree at ``ws_fd`` (a copied workspace, at ``workspace_host``); what was written."""
    real = check_target(os.fspath(target), [workspace_host])
    entries = walk(ws_fd, workspace)
    tgt_fd, _ = entries_of(real, workspace)
    try:
        changes = diff(ws_fd, tgt_fd, workspace)
        apply(ws_fd, tgt_fd, changes, entries)
        return changes
    finally:
        os.close(tgt_fd)


def upload_tree(box: Any, host_src: str | os.PathLike[str], dst: str) -> None:
    """``Sandbox.upload`` for any box with ``mkdir`` and ``write_file`` (a local or a remote sandbox)."""
    src = os.fspath(host_src)
    _upload(box, os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), src, dst)


def _upload(box: Any, fd: int, label: str, dst: str) -> None:
    import errno
    import stat as stat_mod

    try:
        info = os.fstat(fd)
        if stat_mod.S_ISDIR(info.st_mode):
            box.mkdir(dst)
            for name in sorted(os.listdir(fd)):
                try:
                    child = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        continue  # a link: not copied
                    raise OSError(exc.errno, exc.strerror, os.path.join(label, name)) from None
                _upload(box, child, os.path.join(label, name), os.path.join(dst, name))
            return
        if not stat_mod.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file or directory", label)
        os.set_blocking(fd, True)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        box.write_file(dst, b"".join(chunks), mode=stat_mod.S_IMODE(info.st_mode) & 0o777)
    finally:
        os.close(fd)


def save_download(data: bytes, host_dst: str | os.PathLike[str]) -> None:
    """Write a downloaded file at host_dst, never through a link or onto a FIFO there."""
    from ..model.report import ReportTarget

    target = ReportTarget(os.fspath(host_dst), label="download")
    try:
        target.write_bytes(data)
    finally:
        target.close()
