"""What ``isolate-run learn`` never learns, and where its learned write grants are tried.

A program under learn is untrusted: whatever it is refused becomes, without a
rule, a grant of the next run. Three things bound that:

- the system calls the default seccomp filter refuses for the sandbox's safety
  (kernel modules, kexec, bpf, perf, keyrings, mounts, ptrace, userfaultfd,
  io_uring ...: every name of its refusal rules, those refused with some
  arguments only, unshare, clone, socket, ioctl, personality, too) are never learned: the
  profile names each in a comment with why it stays refused;
- credentials and shell start-up paths (``NEVER_LEARNED_HOME``,
  ``NEVER_LEARNED_PATHS``) are never granted by learning, nor any directory
  that holds one: a refusal there is a comment naming the one file;
- a learned write grant is tried on a copy-on-write view of its directory: an
  overlayfs whose lower layer is the directory and whose upper layer, in
  learn's own state directory, is thrown away after the run
  (isolate/kernel/overlay.py, the overlay workspaces' machinery). Nothing the
  program writes while learning reaches the host outside the grants it was
  given; only the profile, once a person has read it, grants the directory.
"""

from __future__ import annotations

import os
import pwd
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from ..kernel.links import DIR_FLAGS
from ..kernel.overlay import Layers, host_refusal, make_layers
from ..model.errors import UnsupportedError

#: Under the caller's home: credentials, and what a shell or a login runs.
NEVER_LEARNED_HOME: tuple[str, ...] = (
    ".ssh", ".gnupg", ".aws", ".azure", ".config", ".kube", ".docker", ".netrc", ".pgpass", ".git-credentials",
    ".npmrc", ".pypirc", ".password-store", ".cargo/credentials", ".cargo/credentials.toml", ".local/bin",
    ".local/share/keyrings", ".bashrc", ".bash_aliases", ".bash_profile", ".bash_login", ".bash_logout", ".profile",
    ".zshrc", ".zshenv", ".zprofile", ".zlogin", ".zlogout", ".cshrc", ".tcshrc", ".login", ".xprofile", ".xinitrc",
    ".xsession", ".xsessionrc", ".pam_environment", ".inputrc", ".vimrc", ".emacs", ".gitconfig",
)
#: Anywhere: the system's configuration, root's home, scheduled jobs, what boots and what loads in the kernel.
NEVER_LEARNED_PATHS: tuple[str, ...] = (
    "/etc", "/root", "/var/spool/cron", "/var/spool/at", "/var/spool/anacron", "/boot", "/lib/modules",
    "/usr/lib/modules", "/lib/systemd", "/usr/lib/systemd", "/var/lib/systemd",
)


def homes() -> tuple[str, ...]:
    """The caller's home as $HOME says and as the password database says (both, when they differ)."""
    found = [os.path.expanduser("~")]
    try:
        found.append(pwd.getpwuid(os.geteuid()).pw_dir)
    except KeyError:
        pass
    return tuple(dict.fromkeys(os.path.realpath(h) for h in found if h and h.startswith("/")))


def sensitive_paths() -> tuple[str, ...]:
    """Every path learning never grants (nor a directory that holds one), as real absolute paths."""
    own = homes()
    paths = [os.path.join(home, name) for home in own for name in NEVER_LEARNED_HOME]
    # /root is the caller's own home when root calls: then its credentials and start-up files are the
    # ones above, and the rest is the home's (a file, never the directory: learn.py's _broad).
    return tuple(dict.fromkeys([*(p for p in NEVER_LEARNED_PATHS if p not in own), *paths]))


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def sensitive(path: str) -> str | None:
    """The never-learned path that path lies in (or is), else None."""
    return next((p for p in sensitive_paths() if _under(path, p)), None)


def holds_sensitive(directory: str) -> bool:
    """Whether granting directory would grant a never-learned path in it (or it lies in one)."""
    return any(_under(p, directory) or _under(directory, p) for p in sensitive_paths())


@lru_cache(maxsize=1)
def never_learned_syscalls() -> dict[str, str]:
    """{system call: why} for each call a rule of the default seccomp profile refuses: learning never lets
    one through, whatever the program does.

    A call the default refuses only with some arguments (``unshare`` or ``clone`` of a namespace,
    ``ioctl(TIOCSTI)``, ``socket`` of some families) is in it too: learned, it became an unconditional
    allow in a profile whose default action refuses (``strict``), every namespace and family with it.
    Under the default profile its refusal is the conditional rule, which every learned profile keeps."""
    from ..kernel.seccomp import oci_profile

    refused: dict[str, str] = {}
    for rule in oci_profile("default").get("syscalls", []):
        if rule.get("action") != "SCMP_ACT_ALLOW":
            why = str(rule.get("comment") or "refused by the default profile")
            if rule.get("args"):
                why = (f"{why}; the default filter refuses it with some arguments only, and a learned rule "
                       "would let every call through")
            for name in rule.get("names", []):
                refused.setdefault(name, why)
    return refused


class Views:
    """The copy-on-write views of one run's learned write grants: an overlay per directory, its upper
    layer in a fresh directory of learn's state directory, removed when the run is over."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.stand_in_root: str | None = None

    def stand_in(self, below: list[str]) -> str:
        """An empty directory, shown read-only where the command starts while nothing granted holds it,
        with a directory at each of ``below`` (relative paths: the grants the run mounts in it).

        On a tmpfs where the host has one: the denial tracer names what is absent in a directory of the
        sandbox's own root or tmpfs mounts only (csrc/why.c), so a read or a write the command makes in
        its working directory is named, and learned, as anywhere else.
        """
        if self.stand_in_root is None:
            from ..kernel.hostinfo import filesystem_type

            base = next((d for d in ("/dev/shm", self.root) if os.path.isdir(d) and os.access(d, os.W_OK)
                         and (filesystem_type(d) == "tmpfs" or d == self.root)), self.root)
            self.stand_in_root = tempfile.mkdtemp(prefix="isolate-learn-", dir=base)
        path = os.path.join(self.stand_in_root, "cwd")
        if os.path.isdir(path):
            remove(path)
        os.mkdir(path, 0o755)
        for rel in below:
            os.makedirs(os.path.join(path, rel), 0o755, exist_ok=True)
        return path

    def close(self) -> None:
        if self.stand_in_root is not None:
            remove(self.stand_in_root)

    @contextmanager
    def for_run(self, directories: list[str]) -> Iterator[list[Layers]]:
        scratch = tempfile.mkdtemp(prefix="run-", dir=self.root)
        try:
            layers = []
            for index, directory in enumerate(directories):
                data = os.path.join(scratch, str(index))
                os.mkdir(data, 0o700)
                view = Layers(directory, directory, os.path.join(data, "overlay"))
                refusal = host_refusal(view)
                if refusal:
                    raise UnsupportedError(f"{directory}: {refusal}")
                fd = os.open(data, DIR_FLAGS)
                try:
                    make_layers(view, fd)
                finally:
                    os.close(fd)
                layers.append(view)
            yield layers
        finally:
            remove(scratch)


def remove(path: str) -> None:
    """Remove a directory learn made, whatever the overlay left in it (its work directory is mode 000)."""
    from ..kernel.tree import _remove_tree

    parent = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _remove_tree(parent, os.path.basename(path))
    finally:
        os.close(parent)


@contextmanager
def views() -> Iterator[Views]:
    """Learn's own state directory for the views of its runs (removed at the end)."""
    from ..kernel.places import state_path

    root = tempfile.mkdtemp(prefix="learn-", dir=state_path())
    made = Views(root)
    try:
        yield made
    finally:
        made.close()
        remove(root)
