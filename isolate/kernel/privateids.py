"""The host ids a root caller's image users run as: a range of isolate's own, never a real host user's.

An image's ``User: 1000`` is no user of the host. Run as host uid 1000, the
program would own that user's files under a read grant, share its
RLIMIT_NPROC, and be signalled or traced by it. For a root caller, the
sandbox's user namespace maps the image's uids 1 to COUNT-1 and gids 0 to
COUNT-1 to a private range of host ids (root stays root during the setup, as
ever; the image's group 0 is the range's, never the host's root group), as
``podman --userns=auto`` does, and the image's layers are reached through an
idmapped mount with the same map: inside, each file shows the owner the image
gives it, and the program is the image's user; on the host it is START + uid.

The range: the one ``/etc/subuid`` and ``/etc/subgid`` give the user name
``isolate`` (the administrator's choice, as podman's ``containers``; the
image's id N is START + N), else START = DEFAULT_START: above
systemd's container ranges (up to 0x6FFFFFFF) and SSSD's default id mapping
(up to 2000200000), below systemd's foreign range (0x7FFE0000). Either is
refused where another line of /etc/subuid or /etc/subgid, or an account of
/etc/passwd or /etc/group, lies in it, and the program's own host ids where
the name service knows them (LDAP, SSSD: accounts no file lists): those ids
would be someone's.

Every such sandbox shares the range: sandboxes are apart by their PID, mount
and network namespaces, not by their ids (as with podman's single range).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import subids

#: The range's base where /etc/subuid names no ``isolate``: 2100000000 (0x7D2B7500); the image's id N is BASE + N.
DEFAULT_START = 2_100_000_000
#: Ids 0 to COUNT-1 inside (an image's ids; nobody is 65534).
COUNT = 65536
#: The user name whose /etc/subuid and /etc/subgid lines give the range.
OWNER = "isolate"
PASSWD = "/etc/passwd"
GROUP = "/etc/group"


@dataclass(frozen=True)
class PrivateIds:
    """The image's id N is the host's ``uid_start + N`` (uids 1 to count-1: root stays root) and ``gid_start + N``
    (gids 0 to count-1: an image user's group 0 is no host root group; the setup's host gid 0 is ``count``
    inside, csrc/spawn.c moves the setup to the inside's 0 at once)."""

    uid_start: int
    gid_start: int
    count: int
    source: str  # where the range comes from, for the report

    def uid_map(self) -> str:
        """The map of the sandbox's namespace and of the layers' idmapped mount: root is root."""
        return f"0 0 1\n1 {self.uid_start + 1} {self.count - 1}\n"

    def gid_map(self) -> str:
        """The sandbox's gid map: the range, and the host's 0 (the setup's group until it takes the inside's 0)."""
        return f"0 {self.gid_start} {self.count}\n{self.count} 0 1\n"

    def layers_gid_map(self) -> str:
        """The gid map of the layers' idmapped mount: every group of the image in the range, root's too."""
        return f"0 {self.gid_start} {self.count}\n"

    def host_uid(self, uid: int) -> int:
        return uid if uid == 0 else self.uid_start + uid

    def host_gid(self, gid: int) -> int:
        return self.gid_start + gid

    def image_uid(self, host: int) -> int | None:
        """The image's id a host uid of the range stands for (None: not in it)."""
        return host - self.uid_start if self.uid_start < host < self.uid_start + self.count else None

    def image_gid(self, host: int) -> int | None:
        return host - self.gid_start if self.gid_start <= host < self.gid_start + self.count else None

    def describe(self) -> str:
        return (f"uids 1-{self.count - 1} are host {self.uid_start + 1}-{self.uid_start + self.count - 1} (0 is "
                f"root), gids 0-{self.count - 1} host {self.gid_start}-{self.gid_start + self.count - 1} "
                f"({self.source})")


def known_account(uid: int, gid: int) -> str | None:
    """Who the name service says holds host uid ``uid`` or gid ``gid`` (an account no file lists: LDAP, SSSD),
    or None."""
    import grp
    import pwd

    try:
        return f"uid {uid} is the user {pwd.getpwuid(uid).pw_name}"
    except (KeyError, OverflowError):
        pass
    try:
        return f"gid {gid} is the group {grp.getgrgid(gid).gr_name}"
    except (KeyError, OverflowError):
        return None


def _entries(path: str) -> list[list[str]]:
    text = subids._read(path) or ""
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _overlaps(start: int, count: int, other_start: int, other_count: int) -> bool:
    return start < other_start + other_count and other_start < start + count


def _clash(kind: str, start: int, count: int) -> str | None:
    """Who else holds an id of ``start`` .. ``start + count - 1`` (one clause), or None."""
    for fields in _entries(subids.SUBUID if kind == "uid" else subids.SUBGID):
        if len(fields) == 3 and fields[0] != OWNER:
            other, n = subids._number(fields[1]), subids._number(fields[2])
            if other is not None and n and _overlaps(start, count, other, n):
                path = subids.SUBUID if kind == "uid" else subids.SUBGID
                return f"{path} gives {fields[0]} {other}-{other + n - 1}"
    path = PASSWD if kind == "uid" else GROUP
    for fields in _entries(path):
        number = subids._number(fields[2]) if len(fields) > 2 else None
        if number is not None and start <= number < start + count:
            return f"{path} has {fields[0]} ({kind} {number})"
    return None


def find() -> PrivateIds | str:
    """The range, or why there is none (one clause, with the way out)."""
    way_out = (f"give isolate a range of {COUNT} ids no one else has: a line '{OWNER}:START:{COUNT}' in "
               f"{subids.SUBUID} and in {subids.SUBGID}")
    starts = []
    for path in (subids.SUBUID, subids.SUBGID):
        found = subids.parse(subids._read(path) or "", -1, OWNER, 0)
        if found is not None and found.count < COUNT:
            return f"{path} gives {OWNER} {found.count} ids, fewer than {COUNT}: {way_out}"
        starts.append((found.start, f"{path}'s {OWNER}") if found is not None
                      else (DEFAULT_START, f"isolate's default {DEFAULT_START}+"))
    for kind, (start, _) in zip(("uid", "gid"), starts, strict=True):
        first = start + 1 if kind == "uid" else start  # the image's uid 0 is root; its gid 0 is the range's
        clash = _clash(kind, first, start + COUNT - first)
        if clash:
            return f"the {kind}s {first}-{start + COUNT - 1} are not isolate's alone ({clash}): {way_out}"
    source = starts[0][1] if starts[0][1] == starts[1][1] else f"{starts[0][1]}, {starts[1][1]}"
    return PrivateIds(starts[0][0], starts[1][0], COUNT, source.replace("'s default", "'s default range"))


def files() -> tuple[str, ...]:
    """What find() reads."""
    return subids.SUBUID, subids.SUBGID, PASSWD, GROUP


_CACHE: dict[tuple[tuple[int, int, int, int] | None, ...], PrivateIds | str] = {}


def cached() -> PrivateIds | str:
    """find(), again only once one of the files it reads changed."""
    key = tuple(_stamp(p) for p in files())
    found = _CACHE.get(key)
    if found is None:
        _CACHE.clear()
        found = _CACHE[key] = find()
    return found


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size
