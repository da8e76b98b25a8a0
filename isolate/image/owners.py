"""``COPY --chown`` and ``--chmod``: their values read, and names resolved in the image's own account files.

A name is looked up in the ``/etc/passwd`` and ``/etc/group`` the image so
far shows, read from its layers on the host (view.read_file: the entry the
merged root shows, a regular file, never reached through a link, so a link
planted at ``/etc/passwd`` or ``/etc`` leads nowhere out of the image). As
Docker (BuildKit) takes them: ``USER`` alone, a name, is that user's uid and
primary group; a number alone is the uid and the gid; ``USER:GROUP`` each
resolved. A number is taken as it is (no account needed).
"""

from __future__ import annotations

import re

from . import Image
from .build import DockerfileError
from .view import read_file

MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "unchanged" to chown(2): never an owner
MAX_ACCOUNTS_FILE = 4 << 20
_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?$")
_MODE = re.compile(r"^[0-7]{1,4}$")


def parse_chown(value: str, what: str) -> tuple[str, str | None]:
    """``USER[:GROUP]``, each a name or a number, checked (resolved later, in the image the copy lands in)."""
    user, sep, group = value.partition(":")
    for part, kind in ((user, "user"), *(((group, "group"),) if sep else ())):
        if not part:
            raise DockerfileError(f"{what}: --chown={value!r}: no {kind} given (USER[:GROUP])")
        if part.isdigit():
            if int(part) > MAX_ID:
                raise DockerfileError(f"{what}: --chown={value!r}: {kind} id {part} is past {MAX_ID}")
        elif not _NAME.match(part):
            raise DockerfileError(f"{what}: --chown={value!r}: {part!r} is neither a {kind} name nor a number")
    return user, group if sep else None


def parse_chmod(value: str, what: str) -> int:
    """An octal mode (``0644``, ``755``); set-id bits refused (no layer of isolate's carries them)."""
    if not _MODE.match(value):
        raise DockerfileError(f"{what}: --chmod={value!r}: not an octal mode (such as 0644 or 755)")
    mode = int(value, 8)
    if mode & 0o6000:
        raise DockerfileError(f"{what}: --chmod={value!r}: set-user-id and set-group-id bits are refused "
                              "(isolate's images carry none)")
    return mode


def _accounts(image: Image, name: str, what: str) -> list[list[str]]:
    data = read_file(image.lower_dirs(), f"etc/{name}", MAX_ACCOUNTS_FILE + 1)
    if data is None:
        return []
    if len(data) > MAX_ACCOUNTS_FILE:
        raise DockerfileError(f"{what}: the image's /etc/{name} is past {MAX_ACCOUNTS_FILE} bytes: refused")
    return [line.split(":") for line in data.decode("utf-8", errors="replace").splitlines()
            if line and not line.startswith("#")]


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) <= MAX_ID else None


def resolve(image: Image, user: str, group: str | None, what: str) -> tuple[int, int]:
    """(uid, gid) of ``--chown=user[:group]`` in ``image`` (its /etc/passwd and /etc/group for names)."""
    flag = f"--chown={user}" + (f":{group}" if group is not None else "")
    if user.isdigit():
        uid, gid = int(user), int(user)
    else:
        found = [f for f in _accounts(image, "passwd", what) if len(f) >= 4 and f[0] == user]
        ids = (_number(found[0][2]), _number(found[0][3])) if found else (None, None)
        if ids[0] is None or ids[1] is None:
            raise DockerfileError(f"{what}: {flag}: no user {user!r} in the image's /etc/passwd"
                                  if not found else f"{what}: {flag}: {user!r} has no valid ids in /etc/passwd")
        uid, gid = ids[0], ids[1]
    if group is not None:
        if group.isdigit():
            gid = int(group)
        else:
            groups = [f for f in _accounts(image, "group", what) if len(f) >= 3 and f[0] == group]
            number = _number(groups[0][2]) if groups else None
            if number is None:
                raise DockerfileError(f"{what}: {flag}: no group {group!r} in the image's /etc/group"
                                      if not groups else f"{what}: {flag}: {group!r} has no valid id in /etc/group")
            gid = number
    return uid, gid
