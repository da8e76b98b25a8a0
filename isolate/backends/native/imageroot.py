"""An image as the sandbox's root: its layers the read-only lower layers of an overlayfs at the new root.

The child (csrc/mounts.c) binds the store's ``layers`` directory read-only
at a staging point (checking it bound the inode the parent opened), mounts
a tmpfs of its own at another (the upper and work directories: private to
the sandbox, gone with its mount namespace), and mounts the overlay at the
new root before any other step: ``/proc``, ``/dev``, ``/tmp``, the home and
every grant then land on it as they land on the empty root of a host run.
Nothing of the image is exec'd or read by the init (it is the parent's
descriptor): an image of one static binary runs.

Every mount target of the plan is checked against the image: a link, or a
file, on the way to one is refused (the child would follow it, while its
host's root is still at /oldroot).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..._core import lib
from ...image import Image, mapped, view
from ...kernel import hostinfo, mounts, privateids, subids
from ...kernel.hostinfo import userns_error
from ...kernel.links import DIR_FLAGS
from ...kernel.overlay import Step
from ...kernel.privateids import PrivateIds
from ...kernel.subids import SubIds
from ...model.errors import PolicyError, UnsupportedError
from ...model.forks import fork_safe
from ...model.policy import Policy

STAGING_LAYERS = "/.isolate-image"
STAGING_UPPER = "/.isolate-image-upper"
#: What no image's directory gets write rights through (kernel file systems the plan mounts itself).
_NOT_WRITABLE = ("proc", "dev", "sys")


@dataclass
class ImageRoot:
    image: Image
    lowers: list[str]
    top: dict[str, str]
    env: dict[str, str]
    stamps: list[str] = field(default_factory=list)
    #: Each layer's owners.json "mapped" (store.layer_mapping), read once: a layer directory, stamped, never changes.
    mappings: list[tuple[dict[str, list[int]], int] | None] | None = None
    #: The image's record (``stamps[0]``) as it was read: a plan made of this root rests on these bytes. Its
    #: inode is no premise: each pull or load writes a new file renamed over the old one, and the file system
    #: gives a later one the number the first had (ext4 does at once), with another image's config.
    record: bytes = b""


def store_path() -> str:
    """The real path of the caller's image store (made or not): what no sandbox may reach."""
    from ...image.store import STORE_ENV
    from ...kernel.places import state_dir

    explicit = os.environ.get(STORE_ENV)
    return os.path.realpath(os.path.abspath(explicit) if explicit else os.path.join(state_dir(), "images"))


#: Images loaded, by store and name: each taken again while its record and layer directories are the inodes
#: they were (a pull or load under the name writes a new record; a prune removes layer directories). Every
#: sandbox start of a regular caller asks for its image (caller_inside), and a plan made anew does too: each
#: read the store's record, parsed the name, and listed the layers' top levels again.
_LOADED: OrderedDict[tuple[str, str], tuple[tuple[tuple[int, int, int], ...], ImageRoot]] = OrderedDict()
_LOADED_SIZE = 32
_LOADED_LOCK = fork_safe(threading.Lock())


def _stamp(paths: list[str]) -> tuple[tuple[int, int, int], ...] | None:
    """Each path's device, inode and change time (None once one is gone)."""
    found = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            return None
        found.append((info.st_dev, info.st_ino, info.st_ctime_ns))
    return tuple(found)


#: The largest image record read as a premise (a record is a few KiB: its config's Env, Cmd...).
_RECORD_MAX = 1 << 20


def record_bytes(path: str) -> bytes | None:
    """An image record's bytes as they are now (None: gone, or no regular file of a sane size)."""
    from ...model.files import read_input_file

    try:
        return read_input_file(path, limit=_RECORD_MAX, follow=False)
    except (OSError, ValueError):
        return None


def record_unchanged(root: ImageRoot) -> bool:
    """Whether the image's record still holds the bytes ``root`` was made of (the name still means it)."""
    return bool(root.stamps) and record_bytes(root.stamps[0]) == root.record


def load(policy: Policy) -> ImageRoot:
    """The policy's image, from the store (ISOLATE_IMAGE_STORE's or the caller's): the last one loaded for the
    same store and name while its record and layers are the ones it was made of."""
    assert policy.image is not None
    key = (store_path(), policy.image)
    with _LOADED_LOCK:
        cached = _LOADED.get(key)
    if cached is not None and _stamp(cached[1].stamps) == cached[0] and record_unchanged(cached[1]):
        with _LOADED_LOCK:
            if key in _LOADED:
                _LOADED.move_to_end(key)
        return cached[1]
    for _ in range(3):
        image = Image.get(policy.image)
        lowers = image.lower_dirs()
        if not lowers:
            raise UnsupportedError(f"image {image.reference}: it has no layers")
        record = image.store._record_path(image.reference)
        stamps = [record, *(os.path.dirname(d) for d in lowers)]
        stamp = _stamp(stamps)
        # The record's bytes, read after the image was, must describe it (a pull or load in between pairs the
        # new record with the old image): then they are the premise of every plan made of this root.
        content = record_bytes(record)
        if content is not None and _describes(content, image):
            break
    else:
        raise UnsupportedError(f"image {policy.image}: its record in the image store changed while it was read, "
                               "three times over: try again")
    assert content is not None
    root = ImageRoot(image, lowers, view.top_level(lowers), image.config.environment(), stamps=stamps,
                     record=content)
    # Kept only when the record read again after the stamp is still this image (one replaced between the
    # first read and the stamp would pair the new record's stamp with the old image).
    again = Image.find(policy.image)
    if stamp is not None and again is not None and (again.digest, again.layers) == (image.digest, image.layers):
        with _LOADED_LOCK:
            _LOADED[key] = (stamp, root)
            _LOADED.move_to_end(key)
            while len(_LOADED) > _LOADED_SIZE:
                _LOADED.popitem(last=False)
    return root


def _describes(content: bytes, image: Image) -> bool:
    """Whether a record's bytes are ``image``'s: its digest, layers and config."""
    import json

    try:
        found = Image._from_record(json.loads(content), image.store)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return (found.reference, found.digest, found.layers, found.config) == (
        image.reference, image.digest, image.layers, image.config)


def program_ids(root: ImageRoot, policy: Policy, uid: int, gid: int, root_caller: bool, enforced: dict[str, Any],
                ranges_allowed: bool = True) -> tuple[int, int, SubIds | PrivateIds | None]:
    """The image's User, where the caller can run the program as another uid: a root caller (in isolate's
    private id range, then returned: _private_ids), or a regular one with subordinate ids (then returned: the
    sandbox maps them through newuidmap, kernel/subids.py); else the ids given, the image's User noted as not
    applied, and why. The ids returned are the program's inside its namespace."""
    owned = None if root_caller else owned_ranges(root, ranges_allowed)
    user = root.image.config.user
    if not user or policy.uid is not None:
        return (0, 0, owned) if owned is not None else (uid, gid, None)  # the caller: root inside its ranges
    name, _, group = user.partition(":")
    found_uid, found_gid = _lookup(root, name, "etc/passwd"), _lookup(root, group, "etc/group") if group else None
    if found_uid is None:
        raise PolicyError(f"image {root.image.reference}: its User {user!r} is not in its /etc/passwd", "image")
    new_gid = found_gid[0] if found_gid else (found_uid[1] if found_uid[1] >= 0 else found_uid[0])
    ranges: SubIds | None = None
    if owned is not None and found_uid[0] == 0:
        enforced["image_user"] = user
        return 0, new_gid, owned
    if found_uid[0] != 0 and not root_caller and (found_uid[0] != uid or owned is not None):
        found = owned or subids.find(os.geteuid(), os.getegid()) if ranges_allowed else (
            "preexec_fn has no parent to run newuidmap: use isolate.run, isolate.Popen or isolate.Sandbox")
        if isinstance(found, str):
            enforced["image_user"] = (f"{user} not applied: the program runs as uid {uid} (the caller's own: a user "
                                      f"namespace of one uid, as {found})")
            return uid, gid, None
        ranges = found
        for kind, number, have in (("uid", found_uid[0], found.uids), ("gid", new_gid, found.gids)):
            if number > have.count:
                raise UnsupportedError(
                    f"image {root.image.reference}: its User {user!r} is {kind} {number}, past the caller's "
                    f"{have.count} subordinate {kind}s (/etc/sub{kind}): add a larger range there, or run as "
                    "another user (uid=)")
    elif found_uid[0] == 0 or not root_caller:
        if found_uid[0] != uid:
            enforced["image_user"] = (f"{user} not applied: the program runs as uid {uid}"
                                      + ("" if root_caller else " (the caller's own: a user namespace of one uid)"))
        return uid, gid, None
    if root_caller:
        return _private_ids(root, policy, user, found_uid[0], new_gid, uid, gid, enforced, ranges_allowed)
    enforced["image_user"] = user
    return found_uid[0], new_gid, ranges


def _private_ids(root: ImageRoot, policy: Policy, user: str, image_uid: int, image_gid: int, uid: int, gid: int,
                 enforced: dict[str, Any], ranges_allowed: bool) -> tuple[int, int, PrivateIds | None]:
    """A root caller's image User (not root): the image's ids inside, isolate's private range on the host
    (kernel/privateids.py), never a real host user's. Where that cannot be, refused, or under best effort the
    program runs as ``uid`` (65534, the documented default) and the report says so."""
    found = privateids.cached() if ranges_allowed else (
        "preexec_fn has no parent to open the image's layers through an idmapped mount for each run: use "
        "isolate.run, isolate.Popen or isolate.Sandbox")
    if isinstance(found, PrivateIds) and (image_uid >= found.count or image_gid >= found.count):
        found = (f"its ids ({image_uid}:{image_gid}) are past isolate's private range of {found.count} ids: run it "
                 "as another user (uid=)")
    if isinstance(found, PrivateIds):
        known = privateids.known_account(found.host_uid(image_uid), found.host_gid(image_gid))
        if known:
            found = f"the name service knows its host ids ({known}): give isolate a range of its own in /etc/subuid"
    if isinstance(found, PrivateIds):
        found = _layers_idmap_problem(os.path.dirname(os.path.dirname(root.lowers[0])), found) or found
    if isinstance(found, str):
        why = (f"image {root.image.reference}: its User {user!r} would run as a real host user; isolate runs a root "
               f"caller's image users in a private id range, which cannot be used here: {found}")
        if not policy.best_effort:
            raise UnsupportedError(why + "; or pass uid= (--uid), or best_effort to run it as uid " + str(uid))
        enforced["image_user"] = f"{user} not applied: the program runs as uid {uid} ({found})"
        return uid, gid, None
    enforced["image_user"] = user  # its host ids, and the range: enforced["user"], enforced["id_map"]
    return image_uid, image_gid, found


def _mappings(root: ImageRoot) -> list[tuple[dict[str, list[int]], int] | None]:
    if root.mappings is None:
        root.mappings = [root.image.store.layer_mapping(d) for d in dict.fromkeys(root.image.layers)]
    return root.mappings


def owned_ranges(root: ImageRoot, ranges_allowed: bool = True) -> SubIds | None:
    """A regular caller's subordinate ids where the image's layers keep their owners through them (the store's
    mapped.py): the sandbox maps them, and shows each file's owner as the image gives it; None where the layers
    are all the caller's. Refused where the layers were unpacked some with ranges and some without, or with
    ranges the caller no longer has: their files would show as no one's, the program could not read them."""
    found = _mappings(root)
    if all(m is None for m in found):
        return None
    again = "remove the image, prune (isolate-run image prune) and pull or load it again"
    name = f"image {root.image.reference}"
    first = found[0]
    if first is None or any(m is None or m[0] != first[0] for m in found):
        raise UnsupportedError(f"{name}: its layers were unpacked some with the caller's subordinate ids (their "
                               f"owners kept) and some without, or with other ranges: {again}")
    if not ranges_allowed:
        raise UnsupportedError(f"{name}: its files keep their owners through the caller's subordinate ids, which "
                               "preexec_fn cannot map (it has no parent to run newuidmap): use isolate.run, "
                               "isolate.Popen or isolate.Sandbox")
    ids = subids.find(os.geteuid(), os.getegid())
    if isinstance(ids, str) or first[0] != mapped.describe(ids):
        start, count = first[0]["uids"]
        raise UnsupportedError(f"{name}: its files keep their owners through the subordinate uids {start}-"
                               f"{start + count - 1} (and gids), which the caller no longer has as they were ("
                               f"{ids if isinstance(ids, str) else ids.describe()}): give them back, or {again}")
    return ids


def owners_note(root: ImageRoot, program_uid: int, ranges: SubIds | None) -> str | None:
    """What a regular caller's sandbox shows of the owners the image gives its files (its store keeps none where
    it has no subordinate ids: every file is the caller's), where the image gives some other than root; None
    where it gives none or the store keeps them (a root's, or through the caller's ranges, all of them)."""
    if root.image.store.owners_kept:
        return None
    if ranges is not None and (found := _mappings(root)) and all(m is not None for m in found):
        unkept = sum(m[1] for m in found if m is not None)
        return None if not unkept else (
            f"kept through the caller's subordinate ids, but for {unkept} entries whose owner is past them (uids "
            f"1-{ranges.uids.count}, gids 1-{ranges.gids.count}): those are root's in this sandbox")
    others = root.image.foreign_owners()
    if others == {}:
        return None
    given = "owners the image gives other than root are not known (layers of an earlier isolate)" if others is None \
        else (f"{sum(others.values())} entries of the image belong to other owners than root ("
              + ", ".join(f"{key} x{count}" for key, count in sorted(others.items(), key=lambda kv: -kv[1])[:4])
              + (", ..." if len(others) > 4 else "") + ")")
    shown = (f"root's: the program (uid {program_uid}) reads and writes only what their modes let others, its "
             "own user's files of the image too" if ranges is not None else
             f"uid {program_uid}'s, the program's own: it may read and write them all, whatever their modes")
    why = ("a regular user's store holds that user's files only, unless it has subordinate ids (/etc/subuid) and "
           "ISOLATE_IMAGE_OWNERS=subids when the image is pulled")
    return f"not kept ({why}): {given}; in this sandbox every file of the image is {shown}"


def caller_inside(policy: Policy) -> int:
    """The uid the caller is seen as inside a sandbox of ``policy`` (an exec server checks its peers by it):
    0 where a regular caller's subordinate ids are mapped (program_ids), else its own."""
    caller = os.geteuid()
    if policy.image is None or caller == 0 or policy.uid is not None or not policy.namespaces:
        return caller
    _, _, ranges = program_ids(load(policy), policy, caller, os.getegid(), False, {})
    return caller if ranges is None else 0


#: The largest uid or gid a user namespace maps ((uid_t)-1 means "no change" to the kernel).
_MAX_ID = 2**32 - 2


def _id(text: str) -> int | None:
    """A uid or gid written in ASCII digits within the kernel's range; None otherwise (``str.isdigit`` and
    ``int`` take other scripts' digits, and a number past 32 bits ends in OverflowError, not a refusal)."""
    if not text or len(text) > 10 or not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if value <= _MAX_ID else None


def _lookup(root: ImageRoot, name: str, table: str) -> tuple[int, int] | None:
    """(id, primary gid or -1) of a name or number in the image's passwd or group file; a number out of
    the kernel's range is refused (the image's config is the image author's, never trusted)."""
    if name.isdigit() or (name.isascii() and name[:1].isdigit()):
        number = _id(name)
        if number is None:
            raise PolicyError(f"image {root.image.reference}: its User {root.image.config.user!r} names the id "
                              f"{name[:40]!r}, not a number from 0 to {_MAX_ID}: refused", "image")
        return number, -1
    data = view.read_file(root.lowers, table) or b""
    for line in data.decode(errors="replace").splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[0] == name and (found := _id(fields[2])) is not None:
            primary = _id(fields[3]) if table == "etc/passwd" and len(fields) > 3 else None
            return found, -1 if primary is None else primary
    return None


def steps(root: ImageRoot, store_fd: int, upper_options: str) -> list[Step]:
    """The mount steps that make the image the new root (they come before all others)."""
    layers_dir = os.path.dirname(os.path.dirname(root.lowers[0]))
    lowerdir = ":".join(f"{STAGING_LAYERS}/{os.path.basename(os.path.dirname(d))}/root" for d in root.lowers)
    if len(lowerdir) > 3800:
        raise UnsupportedError(f"image {root.image.reference}: {len(root.lowers)} layers, more than an overlay's "
                               "options can name (about 45)")
    return [
        Step(lib.ISO_MOUNT_DIR, STAGING_LAYERS),
        Step(lib.ISO_MOUNT_BIND, STAGING_LAYERS, source=mounts.OLDROOT + layers_dir,
             flags=lib.ISO_MOUNT_F_READONLY, fd=store_fd),
        Step(lib.ISO_MOUNT_DIR, STAGING_UPPER),
        Step(lib.ISO_MOUNT_TMPFS, STAGING_UPPER, source=upper_options),
        Step(lib.ISO_MOUNT_DIR, STAGING_UPPER + "/upper", mode=0o755),
        Step(lib.ISO_MOUNT_DIR, STAGING_UPPER + "/work", mode=0o700),
        Step(lib.ISO_MOUNT_OVERLAY, mounts.NEWROOT, source=lowerdir, flags=lib.ISO_MOUNT_F_IMAGE_ROOT,
             upper=STAGING_UPPER + "/upper", work=STAGING_UPPER + "/work"),
    ]


def upper_limits() -> str:
    """What the private tmpfs upper layer cannot do on this kernel ("" where nothing)."""
    from ...kernel import overlay

    if overlay._kernel() >= (6, 6):
        return ""
    # A tmpfs keeps user.* extended attributes from Linux 6.6 on; before, overlayfs has no opaque directory
    # and no redirect in the upper layer, and fails (EIO, EXDEV then EIO for a rename) rather than show wrong.
    return ("; before Linux 6.6 a tmpfs keeps no user.* attributes: removing or renaming a non-empty directory "
            "of the image fails (EIO)")


def disk_by_default(policy: Policy) -> bool:
    """Whether an image's upper layer not asked for goes on disk: before Linux 6.6 (upper_limits()), unless the
    policy asks for a tmpfs size, which bounds the image root's writes on the tmpfs and which a disk would not
    (a bound asked for is kept, the tmpfs's limit reported, rather than dropped silently)."""
    return policy.limits.tmpfs_size is None and bool(upper_limits())


def check_targets(root: ImageRoot, plan_steps: list[mounts.MountStep]) -> None:
    """Refuse a plan whose mount or directory would go through a link (or a file) of the image."""
    for step in plan_steps:
        parts = [p for p in step.target.split("/") if p]
        last = len(parts) if step.kind != lib.ISO_MOUNT_SYMLINK else len(parts) - 1
        for i in range(1, last + 1):
            rel = "/".join(parts[:i])
            found = view.kind(root.lowers, rel)
            if found is None or found == "dir" or (i == len(parts) and step.kind == lib.ISO_MOUNT_FILE
                                                   and found == "file"):
                continue
            raise UnsupportedError(f"image {root.image.reference}: /{rel} is a {'link' if found == 'link' else found}"
                                   f" in the image, where the sandbox mounts /{'/'.join(parts)}: refused (a mount "
                                   "is never made through an image's link)")


def landlock_rules(root: ImageRoot, read_rights: int, write_rights: int, whole_root: bool,
                   resolve_unix: int = 0) -> list[tuple[str, int]]:
    """Read and execute everywhere in the image; write in the image's root itself (``whole_root``: new top-level
    entries, as a container's root takes them) or else in its top-level directories; their writes land in the
    private upper layer.

    A Landlock rule holds for the whole hierarchy under the inode it is on, mounts included (the kernel's walk
    goes up through mount points): a rule on ``/`` reaches /proc, /dev and every bind. What keeps them is
    the mount, not the rule: /proc is mounted read-only, /dev's nodes take no ioctl and no new device from
    this rule (``write_rights`` holds neither), a read-only bind refuses every write to its files and
    directories. It does not refuse a write to a FIFO or a unix socket in it (no mount flag does): so the
    root is granted whole only where no host path is granted read-only (``whole_root``), and the right to
    connect to a named socket (``resolve_unix``, Landlock ABI 9) never on ``/``: only in the image's own
    top-level directories (a server's socket in /run or /var), whose lower layers are the image's."""
    rules = [("/", read_rights | (write_rights if whole_root else 0))]
    for name, found in root.top.items():
        if found == "dir" and name not in _NOT_WRITABLE:
            rules.append(("/" + name, write_rights | resolve_unix))
    return rules


#: How the report's image root says that the root itself takes no new entry (see whole_root_refusal).
NO_NEW_ENTRY = "; no new entry in /"


def whole_root_refusal(read_only_grants: list[str]) -> str:
    """Why the image's root takes no new top-level entry ("" where it does): see landlock_rules."""
    if not read_only_grants:
        return ""
    return (f"{NO_NEW_ENTRY} (only in its directories): {read_only_grants[0]} is granted read-only, and "
            "Landlock's write rule on / would reach a FIFO or socket under it")


def image_refusal(policy: Policy) -> str | None:
    """Why the native backend cannot run ``policy.image`` (None: no image, or it can).

    Never dropped for best effort: an image is not a protection to weaken but
    the file system the program runs on, and the host's root in its place
    would be another program's world.
    """
    if policy.image is None:
        return None
    import platform

    from ...kernel import overlay

    way_out = "; use --backend docker (backend='docker')"
    if not policy.namespaces:
        return f"image: an image's root needs namespaces (a mount namespace of its own){way_out}"
    if overlay._kernel() < (5, 11):
        return (f"image: this kernel ({platform.release()}) mounts no overlayfs in a user namespace "
                f"(Linux 5.11 does){way_out}")
    if userns_error():
        return (f"image: this caller cannot create a user namespace ({os.strerror(userns_error())}): "
                + hostinfo.userns_advice(userns_error()) + way_out)
    return None


# -- a kept sandbox's upper layer on the host (what commit_image reads) ------------------------------


@dataclass(frozen=True)
class HostUpper:
    """A kept sandbox's upper layer in its data directory: ``<data>/image/upper`` and ``work``, made by the
    host (0700 above them), bound at the staging point in place of the private tmpfs, so that the host can
    read the program's writes to the image's root (``Sandbox.commit_image``)."""

    state: str
    identity: tuple[int, int]  # the upper directory's (st_dev, st_ino) when it was made
    #: A root caller's build step: the image's root-owned files are shown as the program's own (an idmapped
    #: mount of the layers, 0 shown as the program's uid), as they are a regular caller's; commit maps back.
    as_owner: bool = False
    #: Started from a snapshot of an image sandbox: ``<state>/base``, the snapshot's root layer (hard links:
    #: never written), lies between the image's layers and the upper layer (kept/snapshots.py).
    base: bool = False
    #: Why the upper layer is on disk, for the report.
    purpose: str = "on disk: the host reads it back for commit_image"

    @property
    def upper(self) -> str:
        return os.path.join(self.state, "upper")


def make_host_upper(data_fd: int, data: str, as_owner: bool = False) -> HostUpper:
    """Make ``image/upper`` and ``image/work`` in a kept sandbox's fresh data directory (its descriptor); refused
    where its file system keeps no user.* extended attributes (overlayfs's metadata in the upper layer)."""
    from ...kernel.overlay import xattr_problem

    flags = DIR_FLAGS
    os.mkdir("image", 0o700, dir_fd=data_fd)
    state = os.open("image", flags, dir_fd=data_fd)
    try:
        problem = xattr_problem(state, os.path.join(data, "image"))
        if problem:
            raise UnsupportedError(f"image_upper='disk': {problem}")
        os.mkdir("upper", 0o755, dir_fd=state)
        os.mkdir("work", 0o700, dir_fd=state)
        upper = os.stat("upper", dir_fd=state, follow_symlinks=False)
    finally:
        os.close(state)
    return HostUpper(os.path.join(data, "image"), (upper.st_dev, upper.st_ino), as_owner)


def plan_host_upper(host: HostUpper, cmounts: Any, n_mounts: int, program_uid: int, program_gid: int,
                    cstr: Any) -> list[int]:
    """Bind ``host.state`` where the plan mounts the image's private tmpfs, and have the child check the
    overlay's upper directory is the one made; the descriptors the steps use (closed once the child has them)."""
    from ...kernel import mounts as mounts_mod

    fds: list[int] = []
    try:
        state_fd = os.open(host.state, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fds.append(state_fd)
        upper_fd = os.open("upper", DIR_FLAGS, dir_fd=state_fd)
        fds.append(upper_fd)
        info = os.fstat(upper_fd)
        if (info.st_dev, info.st_ino) != host.identity:
            raise PolicyError(f"image: {host.upper}: replaced since the sandbox was made: refused", "image")
        if os.geteuid() == 0:
            os.fchown(upper_fd, program_uid, program_gid)  # overlayfs copies up as the program
        from ..._core import ffi

        found = 0
        for i in range(n_mounts):
            step = cmounts[i]
            if step.kind == lib.ISO_MOUNT_TMPFS and ffi.string(step.target) == STAGING_UPPER.encode():
                step.kind, step.flags, step.fd = lib.ISO_MOUNT_BIND, 0, state_fd
                step.source = cstr(mounts_mod.OLDROOT + os.path.realpath(host.state))
                found += 1
            elif step.kind == lib.ISO_MOUNT_OVERLAY and step.flags & lib.ISO_MOUNT_F_IMAGE_ROOT:
                step.fd = upper_fd
                if host.base:  # the snapshot's root layer, over the image's (bound with the upper layer)
                    step.source = cstr(f"{STAGING_UPPER}/base:" + os.fsdecode(ffi.string(step.source)))
                found += 1
            elif (host.as_owner and os.geteuid() == 0 and step.kind == lib.ISO_MOUNT_BIND
                  and ffi.string(step.target) == STAGING_LAYERS.encode()):
                fds.append(_owned_layers(os.fsdecode(ffi.string(step.source))[len(mounts_mod.OLDROOT):],
                                         program_uid, program_gid))
                step.kind, step.fd = lib.ISO_MOUNT_MOVE, fds[-1]
        if found != 2:
            raise PolicyError("image: the plan has no image root to put the sandbox's upper layer under", "image")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


@lru_cache(maxsize=4)
def _range_userns(uid_map: str, gid_map: str) -> int:
    """A user namespace of isolate's private range's maps, for the layers' idmapped trees (made once)."""
    from ..._core import ffi

    fd = int(lib.iso_make_userns_maps(uid_map.encode(), gid_map.encode()))
    if fd < 0:
        raise UnsupportedError(f"image: the user namespace of isolate's private id range cannot be made "
                               f"({os.strerror(ffi.errno)})")
    return fd


#: Whether a store's layers directory (by device) takes an idmapped mount: None, or why not.
_IDMAP_PROBED: dict[int, str | None] = {}


def _layers_idmap_problem(layers_dir: str, private: PrivateIds) -> str | None:
    """Why the image's layers cannot be shown through the private range's idmapped mount (None: they can):
    probed once per file system, with the very call each run makes (idmapped_layers)."""
    from ..._core import ffi

    try:
        device = os.stat(layers_dir).st_dev
    except OSError as exc:
        return f"{layers_dir}: {exc.strerror}"
    if device not in _IDMAP_PROBED:
        try:
            userns = _range_userns(private.uid_map(), private.layers_gid_map())
        except UnsupportedError as exc:
            return str(exc)
        tree = int(lib.iso_open_idmapped_tree(os.fsencode(layers_dir), userns))
        err = ffi.errno
        if tree >= 0:
            os.close(tree)
        _IDMAP_PROBED[device] = None if tree >= 0 else (
            f"the image store's file system ({hostinfo.filesystem_type(layers_dir)}) takes no idmapped mount "
            f"({os.strerror(err)}), through which the image's files would show their owners")
    return _IDMAP_PROBED[device]


def idmapped_layers(cmounts: Any, n_mounts: int, private: PrivateIds) -> list[int]:
    """Mount this run's image layers through an idmapped tree of the store's layers directory (the descriptor the
    plan's bind holds), whose map is the sandbox's: each file shows, inside, the owner the image gives it. Made
    for each run (attaching a tree consumes it); the descriptors the steps use (closed once the child has them).
    """
    from ..._core import ffi

    for i in range(n_mounts):
        step = cmounts[i]
        if step.kind == lib.ISO_MOUNT_BIND and ffi.string(step.target) == STAGING_LAYERS.encode():
            userns = _range_userns(private.uid_map(), private.layers_gid_map())
            tree = int(lib.iso_open_idmapped_tree(f"/proc/self/fd/{step.fd}".encode(), userns))
            if tree < 0:
                err = ffi.errno
                where = os.fsdecode(ffi.string(step.source))[len(mounts.OLDROOT):]
                raise UnsupportedError(
                    f"image: its User runs in isolate's private id range, whose owners the image's layers show "
                    f"through an idmapped mount of the store ({where}), and its file system takes none "
                    f"({os.strerror(err)}): run it as another user (uid=)")
            step.kind, step.fd = lib.ISO_MOUNT_MOVE, tree
            return [tree]
    raise PolicyError("image: the plan has no image layers to mount through isolate's private id range", "image")


def _owned_layers(layers_dir: str, program_uid: int, program_gid: int) -> int:
    """An idmapped clone of the store's layers directory where root's files are the program's (consumed by the
    child's move)."""
    from ..._core import ffi
    from ...kernel.overlay import _lower_userns

    userns = _lower_userns(0, 0, program_uid, program_gid)
    tree = int(lib.iso_open_idmapped_tree(os.fsencode(layers_dir), userns))
    if tree < 0:
        raise UnsupportedError(f"image: a build step owns the image's files through an idmapped mount of the store "
                               f"({layers_dir}), and its file system takes none ({os.strerror(ffi.errno)})")
    return tree
