"""A regular caller's subordinate ids (``/etc/subuid``, ``/etc/subgid``) and the set-id helpers that map them.

A process may map into a user namespace it made only its own uid and gid.
An administrator can give a user more: a range of host ids of its own in
``/etc/subuid`` and ``/etc/subgid`` (``NAME_OR_UID:START:COUNT``), which the
set-id helpers ``newuidmap`` and ``newgidmap`` (Debian's ``uidmap``) check
and write for it. With them a sandbox maps its root to the caller and ids
1 to COUNT to the range: an image's ``User: 33`` runs as 33 there.

The files are the administrator's, but read as untrusted text all the same:
a line that is malformed, empty (count 0), past the kernel's ids, holding the
host's uid 0 or the caller's own id is skipped, and a range is cut to
MAX_COUNT ids. The helpers check the ranges again themselves, as root; a
helper missing, or not set-user-id root, means no range (the one-uid map).
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass

SUBUID = "/etc/subuid"
SUBGID = "/etc/subgid"
HELPER_DIRS = ("/usr/bin", "/bin", "/usr/sbin", "/sbin")
#: Ids 1 to MAX_COUNT inside are mapped at most (an image's ids: nobody is 65534).
MAX_COUNT = 65536
#: The largest id a user namespace maps ((uid_t)-1 means "no change" to the kernel).
MAX_ID = 2**32 - 2
#: /etc/subuid past this is refused as a whole (read as untrusted text: its size is not).
MAX_FILE = 1 << 20


@dataclass(frozen=True)
class Range:
    """Host ids ``start`` to ``start + count - 1``: ids 1 to ``count`` inside."""

    start: int
    count: int


@dataclass(frozen=True)
class SubIds:
    """A caller's subordinate uids and gids, and the helpers that map them."""

    uids: Range
    gids: Range
    newuidmap: str
    newgidmap: str

    def uid_map(self, caller_uid: int) -> str:
        return f"0 {caller_uid} 1\n1 {self.uids.start} {self.uids.count}\n"

    def gid_map(self, caller_gid: int) -> str:
        return f"0 {caller_gid} 1\n1 {self.gids.start} {self.gids.count}\n"

    def describe(self) -> str:
        u, g = self.uids, self.gids
        return (f"{os.path.basename(self.newuidmap)}/{os.path.basename(self.newgidmap)} (subordinate ids): "
                f"0 is the caller, uids 1-{u.count} are {u.start}-{u.start + u.count - 1}, "
                f"gids 1-{g.count} are {g.start}-{g.start + g.count - 1}")


def _number(text: str) -> int | None:
    """ASCII digits within the kernel's ids, else None (``int`` takes other scripts' digits, signs and spaces,
    which the helpers may read otherwise: such a line is skipped)."""
    if not text or len(text) > 10 or not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if value <= MAX_ID else None


def parse(text: str, owner_id: int, owner_name: str | None, avoid: int) -> Range | None:
    """The first usable range of ``text`` (a subuid or subgid file) for the user ``owner_id``/``owner_name``,
    never one holding id 0 or ``avoid`` (the caller's own id, mapped as 0 inside), cut to MAX_COUNT ids."""
    owners = {str(owner_id)} | ({owner_name} if owner_name else set())
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) != 3 or fields[0] not in owners:
            continue
        start, count = _number(fields[1]), _number(fields[2])
        if start is None or count is None or start == 0 or count == 0 or start + count - 1 > MAX_ID:
            continue
        count = min(count, MAX_COUNT)
        if start <= avoid < start + count:
            continue
        return Range(start, count)
    return None


def _read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_FILE + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if len(data) > MAX_FILE else data.decode("utf-8", errors="replace")


def helper(name: str) -> str | None:
    """The path of a set-id map helper that can work: a regular file owned by root, set-user-id and
    executable by anyone (Debian's uidmap installs them so); None where there is none."""
    for directory in HELPER_DIRS:
        path = os.path.join(directory, name)
        try:
            info = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == 0 and info.st_mode & stat.S_ISUID and info.st_mode & 0o001:
            return path
    return None


def find(caller_uid: int, caller_gid: int) -> SubIds | str:
    """The caller's subordinate ids and helpers, or why there are none (one clause, with the way out)."""
    if caller_uid == 0:
        return "root writes its maps itself"
    try:
        name: str | None = pwd.getpwuid(caller_uid).pw_name
    except KeyError:
        name = None
    uids = parse(_read(SUBUID) or "", caller_uid, name, caller_uid)
    gids = parse(_read(SUBGID) or "", caller_uid, name, caller_gid)
    who = name or str(caller_uid)
    if uids is None or gids is None:
        missing = " and ".join(p for p, r in ((SUBUID, uids), (SUBGID, gids)) if r is None)
        return (f"the caller ({who}) has no usable range in {missing}: add one "
                f"(usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {who})")
    newuidmap, newgidmap = helper("newuidmap"), helper("newgidmap")
    if newuidmap is None or newgidmap is None:
        return ("newuidmap and newgidmap, set-user-id root, are not installed: install them "
                "(apt-get install uidmap)")
    return SubIds(uids, gids, newuidmap, newgidmap)
