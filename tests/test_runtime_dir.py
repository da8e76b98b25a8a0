"""Another local user cannot refuse a caller its runtime directory by making ``/tmp/isolate-UID`` first.

Without ``XDG_RUNTIME_DIR`` the runtime directory (kept sandboxes' sockets, the CLI's cached plans) is
``/tmp/isolate-UID``, a name anyone can take in the sticky /tmp. Taken by another user, a fresh private
directory stands in (kernel/places.py), the same one for every process of the caller's, and the native
isolate-run finds it too. Root plants the name for a caller that is neither it nor 65534 (whose own runtime
directory the other tests use), so these tests need a root caller.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from conftest import ISOLATE_RUN, ROOT, skip_unless_runnable

import isolate

VICTIM = 64321  # no user of the system's; its runtime directory is no other test's
TAKEN = f"/tmp/isolate-{VICTIM}"
TREE = os.path.dirname(os.path.dirname(os.path.abspath(isolate.__file__)))
PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(not ROOT or not shutil.which("setpriv") or not os.path.exists(PYTHON),
                                reason="root plants the name for another user (setpriv, the system's python3)")


def _clear() -> None:
    for entry in os.listdir("/tmp"):
        if entry == os.path.basename(TAKEN) or entry.startswith(os.path.basename(TAKEN) + "."):
            path = os.path.join("/tmp", entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)


@pytest.fixture
def home() -> Iterator[str]:
    """The victim's home (its state directory is in it), and /tmp clear of its runtime directories."""
    _clear()
    path = tempfile.mkdtemp(prefix="isolate-victim-", dir="/tmp")
    os.chown(path, VICTIM, VICTIM)
    try:
        yield path
    finally:
        shutil.rmtree(path)
        _clear()


def _as_victim(home: str, *command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONPATH": TREE, **(env or {})}
    return subprocess.run(["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups", *command],
                          cwd=home, env=environment, capture_output=True, text=True, timeout=120)


def _runtime_dir(home: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = ("import sys; from isolate.kernel.places import runtime_dir\n"
            "try: print(runtime_dir())\n"
            "except Exception as exc: print(type(exc).__name__, exc, file=sys.stderr); sys.exit(3)\n")
    return _as_victim(home, PYTHON, "-c", code, env=env)


def _others_can_run(path: str) -> bool:
    real = os.path.realpath(path)
    parts = real.split("/")
    folders = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(folder).st_mode & 0o001 for folder in folders) and bool(os.stat(real).st_mode & 0o001)


def _private_of_victim(path: str) -> bool:
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == VICTIM and stat.S_IMODE(info.st_mode) == 0o700


@pytest.mark.parametrize("planted", ["directory", "file", "link"])
def test_a_name_another_user_took_gets_a_private_stand_in(home: str, planted: str) -> None:
    # Before: "runtime directory /tmp/isolate-UID is not a directory owned by uid UID ...: remove it", which the
    # caller cannot (a sticky /tmp): no kept sandbox, no cached plan, until the owner (or root) removed it.
    if planted == "directory":
        os.mkdir(TAKEN, 0o755)
    elif planted == "file":
        with open(TAKEN, "w"):
            pass
    else:
        os.symlink("/etc", TAKEN)
    first = _runtime_dir(home)
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert os.path.dirname(path) == "/tmp" and path.startswith(TAKEN + ".") and len(path) > len(TAKEN) + 6, path
    assert _private_of_victim(path)
    # Every process of the caller's finds the same one (the sockets and plans are there).
    again = _runtime_dir(home)
    assert again.returncode == 0 and again.stdout.strip() == path, again.stderr
    assert os.lstat(TAKEN).st_uid == 0  # the squatter's name left as it was


def test_a_link_to_a_directory_not_the_callers_is_never_followed(home: str) -> None:
    # The link in the state directory is trusted only for a private directory of the caller's by the stand-in's
    # name: anyone else's (or one of another name) is replaced by a fresh one.
    os.mkdir(TAKEN, 0o700)
    decoy = f"{TAKEN}.decoy123"
    os.mkdir(decoy, 0o700)  # root's
    state = os.path.join(home, ".local", "state", "isolate")
    os.makedirs(state, 0o700)
    for path in (os.path.join(home, ".local"), os.path.join(home, ".local", "state"), state):
        os.chown(path, VICTIM, VICTIM)
    os.symlink(decoy, os.path.join(state, "runtime-dir"))
    done = _runtime_dir(home)
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert path != decoy and path.startswith(TAKEN + ".") and _private_of_victim(path)
    assert os.readlink(os.path.join(state, "runtime-dir")) == path


def test_when_no_stand_in_can_be_made_the_message_names_who_took_it(home: str) -> None:
    os.mkdir(TAKEN, 0o700)
    refused = _runtime_dir(home, env={"ISOLATE_STATE_DIR": "/proc/no-state-here"})
    assert refused.returncode == 3
    assert f"runtime directory {TAKEN} belongs to uid 0 (root)" in refused.stderr, refused.stderr
    assert "XDG_RUNTIME_DIR" in refused.stderr


def test_the_native_isolate_run_caches_its_plans_in_the_stand_in(home: str) -> None:
    # The binary looked only at /tmp/isolate-UID: with the name taken it never replayed a plan (each run went
    # through the Python side, some 100 ms more).
    skip_unless_runnable(["--", "true"])
    if not _others_can_run(sys.executable) or not _others_can_run(ISOLATE_RUN):
        pytest.skip(f"another user cannot run {sys.executable} (the Python side of {ISOLATE_RUN}) here")
    os.mkdir(TAKEN, 0o755)
    trace = {"ISOLATE_RUN_TRACE": "1"}
    runs = [_as_victim(home, ISOLATE_RUN, "--", "true", env=trace) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr
    assert "trace: replaying the cached plan" in runs[1].stderr.splitlines()[0], runs[1].stderr
    found = _runtime_dir(home).stdout.strip()
    assert os.listdir(os.path.join(found, "cli")), found
