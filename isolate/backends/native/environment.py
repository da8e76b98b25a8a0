"""The program's environment, its PATH and command as seen inside, and its home."""

from __future__ import annotations

import errno as errno_mod
import os
import stat
from collections.abc import Callable, Mapping, Sequence

from ...kernel import grants
from ...model.errors import CommandNotFoundError, PolicyError, UnsupportedError
from ...model.policy import DEFAULT_HOME, Policy
from .common import _Refusals

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def program_environment(policy: Policy, extra: Mapping[str, str] | None, home: str | None = None,
                        base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The minimal environment: ``base`` (an image's Env), keep_env names from the caller, HOME the
    program's own home, then policy.env, then ``extra``."""
    env = dict(base or {})
    # The caller's PATH names the host's directories: an image's own (or the default) stands instead.
    env.update({name: os.environ[name] for name in policy.keep_env
                if name in os.environ and not (base is not None and name == "PATH")})
    if home is not None:
        env["HOME"] = home
    env.update(policy.env)
    if extra:
        env.update({os.fsdecode(k): os.fsdecode(v) for k, v in extra.items()})
    env.setdefault("PATH", DEFAULT_PATH)
    return env


#: Without namespaces, a root caller's program keeps its home here (one directory per uid).
NO_NS_HOME_ROOT = "/var/lib/isolate/home"


def _plan_home(
    policy: Policy,
    use_ns: bool,
    granted: list[str],
    tmpfs: list[str],
    run_cwd: str,
    uid: int,
    gid: int,
    refusals: _Refusals,
    open_source: Callable[[str, str], str],
) -> tuple[str | None, list[tuple[str, str]]]:
    """The program's home and the (host real path, path inside) of each home file.

    With namespaces the home is a tmpfs of its own at ``policy.home`` (mode 0700, owned by the
    program): private to the run. Without them nothing can be mounted, so it is a real directory
    the program owns, private to its uid and kept between runs (``NO_NS_HOME_ROOT``/UID for a root
    caller, whose program cannot reach root's home; else isolate's state directory).
    """
    home = policy.home
    if home is None:
        return None, []
    if not use_ns:
        if policy.home_files:
            refusals.refuse("home_files: sharing files into the home needs namespaces (a read-only bind "
                            "into the private home); without them grant the files with read=")
        return _no_ns_home(uid, gid), []
    for path in granted:
        real = grants.host_symlinks(path)[1]
        if home == real or home.startswith(real.rstrip("/") + "/"):
            message = (f"home: the private home {home} would be inside the granted {real}; choose another "
                       "home (home=, --home PATH) or none (--home none)")
            if home != DEFAULT_HOME:
                raise PolicyError(message, "home")
            refusals.warnings.append(f"no private home: {message.split('; ')[0].split(': ', 1)[1]}; "
                                     "HOME is the caller's (choose one with --home PATH)")
            return None, []
    files: list[tuple[str, str]] = []
    caller_home = os.path.expanduser("~")
    for name in policy.home_files:
        source = os.path.normpath(os.path.join(caller_home if not os.path.isabs(name) else "/", name))
        if not os.path.lexists(source):
            raise PolicyError(f"home_files: {source} does not exist; create it or drop it", "home_files")
        real = open_source(source, "home_files")
        target = os.path.join(home, os.path.basename(source))
        if any(target == t for _, t in files):
            raise PolicyError(f"home_files: two files would be {target}; share one of them", "home_files")
        files.append((real, target))
    return home, files


def _no_ns_tmpdir(home: str, uid: int, gid: int) -> str | None:
    """A run without namespaces has no private /tmp: TMPDIR is a ``tmp`` directory in its private home.

    Made by the parent with mkdir (which never follows a link the program may
    have left at that name) and handed to the program's uid; whatever is
    already there is left as it is (it is the program's own).
    """
    path = os.path.join(home, "tmp")
    try:
        os.mkdir(path, 0o700)
        if os.geteuid() == 0:
            os.chown(path, uid, gid, follow_symlinks=False)
    except FileExistsError:
        pass
    except OSError:
        return None
    return path


def _no_ns_home(uid: int, gid: int) -> str:
    """A directory owned by ``uid`` (created 0700 if missing), never reached through a link."""
    if os.geteuid() == 0:
        base = NO_NS_HOME_ROOT
        leaf = os.path.join(base, str(uid))
    else:
        from ...kernel.places import state_path

        base = state_path()  # reached without a link a program could have planted (see open_state_dir)
        leaf = os.path.join(base, "home")
    try:
        os.makedirs(base, mode=0o755, exist_ok=True)
        try:
            os.mkdir(leaf, 0o700)
            if os.geteuid() == 0:
                os.lchown(leaf, uid, gid)
        except FileExistsError:
            pass
        info = os.lstat(leaf)
    except OSError as exc:
        raise UnsupportedError(f"home: cannot make the program's home {leaf}: {exc.strerror}; "
                               "choose another (--home none keeps no home)") from None

    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise UnsupportedError(f"home: {leaf} is not a private directory of uid {uid} (a link, another owner "
                               "or open permissions); remove it, or run with --home none")
    return leaf


def _inside(path: str, granted: Sequence[str]) -> bool:
    return any(path == g or path.startswith(g.rstrip("/") + "/") for g in granted)


#: reduced_path's answers: a function of its two arguments' text alone (no file is looked at), asked
#: for on every run with the same PATH and grants (20 µs each time; a dict lookup once known).
_REDUCED: dict[tuple[str, tuple[str, ...]], str] = {}


def reduced_path(search_path: str, granted: Sequence[str]) -> str:
    """``search_path`` without the directories the program cannot see (an empty result: the
    granted part of the default PATH)."""
    key = (search_path, tuple(granted))
    answer = _REDUCED.get(key)
    if answer is None:
        kept = [d for d in search_path.split(":") if d and os.path.isabs(d) and _inside(os.path.normpath(d), granted)]
        if not kept:
            kept = [d for d in DEFAULT_PATH.split(":") if _inside(d, granted)] or DEFAULT_PATH.split(":")[:1]
        answer = ":".join(dict.fromkeys(kept))
        if len(_REDUCED) >= 64:
            _REDUCED.clear()
        _REDUCED[key] = answer
    return answer


def check_command(program: str, search_path: str, granted: Sequence[str], cwd: str) -> None:
    """Refuse, naming its directory and the way to grant it, a command that exists on the host
    only outside the grants (a venv's, pyenv's or conda's binary, say)."""
    if "/" in program:
        host = os.path.normpath(os.path.join(cwd, program))
        if os.path.exists(host) and not _inside(host, granted) and not _inside(os.path.realpath(host), granted):
            directory = os.path.dirname(host)
            raise CommandNotFoundError(
                errno_mod.ENOENT, f"{program}: its directory {directory} is not granted to the sandbox; "
                f"grant it with --ro {directory} (read=)", program)
        return
    inside = which(program, search_path)
    outside = which(program, os.environ.get("PATH", DEFAULT_PATH))
    if outside is not None and outside != inside and not _inside(os.path.normpath(outside), granted):
        # The caller would run this one: running another (or none) silently would surprise.
        directory = os.path.dirname(outside)
        other = f", or name {inside} to run that one" if inside else ""
        raise CommandNotFoundError(
            errno_mod.ENOENT, f"{program}: found at {outside}, whose directory is not granted to the sandbox; "
            f"grant it with --ro {directory} (read=){other}", program)


def which(program: str, search_path: str) -> str | None:
    for directory in search_path.split(":"):
        candidate = os.path.join(directory, program)
        if directory and os.path.isabs(directory) and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None
