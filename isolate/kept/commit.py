"""``Sandbox.commit_image``: a kept native sandbox's writes to its image's root, as one more layer of that image.

The upper layer is read from the host as something the program wrote (isolate/image/export.py's writer:
descriptors that follow no link, no device, FIFOs as entries), with the sandbox paused; the layer and the
image's config are made by isolate/image/commit.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

from ..image import Image
from ..image.commit import _layer_path, add_layer, mount_points, policy_config
from ..image.export import write_layer
from ..image.store import Store
from ..kernel.links import DIR_FLAGS
from ..model.errors import IsolationError, UnsupportedError


def _owners(impl: Any) -> Any:
    """A build step's files are the program's on the host: root's in the image (as they were shown to it). An
    image User's sandbox (a root caller's) has its files in isolate's private range: each the image's id again."""
    user = impl.report_enforced.get("user") or {}
    uid, gid = user.get("uid"), user.get("gid")
    private = user.get("private_range")
    if private:
        from ..kernel.privateids import PrivateIds

        ids = PrivateIds(int(private["uid_start"]), int(private["gid_start"]), int(private["count"]), "")

        def image_owners(file_uid: int, file_gid: int) -> tuple[int, int]:
            found_uid, found_gid = ids.image_uid(file_uid), ids.image_gid(file_gid)
            return (file_uid if found_uid is None else found_uid, file_gid if found_gid is None else found_gid)

        return image_owners

    def owners(file_uid: int, file_gid: int) -> tuple[int, int]:
        return 0 if file_uid == uid else file_uid, 0 if file_gid == gid else file_gid

    return owners


def _private(impl: Any) -> bool:
    return bool((impl.report_enforced.get("user") or {}).get("private_range"))


def commit_image(sandbox: Any, reference: str | None, *, history: str = "isolate commit_image",
                 config: Mapping[str, Any] | None = None) -> Image:
    """See ``Sandbox.commit_image``; ``config``: the config to set (default: the policy's, policy_config)."""
    from ..backends.native.datadir import fd_identity
    from ..backends.native.kept import NativeSandbox

    impl = sandbox._running("commit_image")
    policy = sandbox.policy
    if policy.image is None:
        raise UnsupportedError("commit_image: this sandbox was not started from an image (Policy(image=...))")
    if not isinstance(impl, NativeSandbox):
        raise UnsupportedError("commit_image: only a native sandbox's upper layer is read back; use backend='native'")
    host = impl.image_upper
    if host is None:
        raise UnsupportedError("commit_image: this sandbox's writes to its image live in a private tmpfs, which "
                               "the host cannot read; start it with isolate.Sandbox(..., image_upper='disk')")
    pid = impl._init_pid()
    if pid is None:
        raise IsolationError("commit_image: the sandbox is no longer running")
    base = Image.get(policy.image)
    store: Store = base.store
    leave_out = mount_points(pid)
    path = _layer_path(store, "commit")
    paused = False
    if not impl.paused:
        # The upper layer is read while nothing of the program runs: a sandbox that cannot be paused is refused
        # (the read withstands a race, but a commit of files still being written is no snapshot of them).
        try:
            sandbox.pause()
        except (IsolationError, OSError) as exc:
            raise IsolationError(f"commit_image: the sandbox could not be paused for the read ({exc}): refused") \
                from None
        paused = True
    try:
        upper_fd = os.open(host.upper, DIR_FLAGS)
        try:
            if fd_identity(upper_fd) != host.identity:
                raise IsolationError(f"commit_image: {host.upper}: replaced since the sandbox was made: refused")
            # Bounded as the store bounds a layer it unpacks, but before a byte is read: a sparse file the program
            # made claims its size, which the host would read, compress and unpack whole.
            blob = write_layer(upper_fd, path, what=f"commit_image {reference or 'built'} (at most max_image_size, "
                               f"{store.max_image_size} bytes)", leave_out=leave_out,
                               owners=_owners(impl) if host.as_owner or _private(impl) else None,
                               max_size=store.max_image_size)
        finally:
            os.close(upper_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    finally:
        if paused:
            with contextlib.suppress(IsolationError, OSError):
                sandbox.resume()
    try:
        return add_layer(base, blob, reference, policy_config(base, policy) if config is None else config, history)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
