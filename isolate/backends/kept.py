"""The one interface ``isolate.Sandbox`` uses: a kept sandbox backend.

Both backends keep the same exec server (csrc/execserver.c) running inside
the sandbox and speak its protocol (``native.protocol``); they differ in how
the sandbox is made, found again, frozen and ended:

- ``native.kept.NativeSandbox``: namespaces made by isolate, the server a
  child of isolate's init, its listening socket handed over as a descriptor;
- ``docker.served.DockerKept``: a container whose main process is the same
  server (bound in read-only), listening on a socket in a host directory
  bound into the container.

``Sandbox`` holds one of them and never asks which: commands and file
operations go through ``connect()`` and ``files()``, ``diff``/``commit``
through ``open_workspace()`` and ``workspace_host``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..model.policy import Mount, Policy
    from ..model.workspace import Workspace
    from .native.protocol import Connection


class KeptBackend(Protocol):
    """What a kept sandbox backend provides (see the module's docstring)."""

    #: "native" or "docker": the ``backend`` of every report.
    backend: str
    policy: Policy
    workspace: Workspace
    mounts: tuple[Mount, ...]
    name: str | None
    #: The environment every command starts with (``exec(env=...)`` adds to it).
    environment: dict[str, str]
    #: What the sandbox enforces and by which mechanism (the ``enforced`` of every report).
    report_enforced: dict[str, Any]

    @property
    def workspace_host(self) -> str:
        """The workspace's directory on the host (what ``diff`` and ``commit`` read)."""
        ...

    @property
    def data_dir(self) -> str:
        """The host directory of what start() made for the sandbox (commit never writes into it)."""
        ...

    def start(self) -> None:
        """Make the sandbox and wait for its exec server (a named one is recorded in the registry)."""
        ...

    def close(self) -> None:
        """End the sandbox and everything in it; remove what start() made (and forget a named one)."""
        ...

    def detach(self) -> None:
        """Let go of the sandbox without ending it (a named one stays for attach, rm or prune)."""
        ...

    #: True between this object's pause() and resume().
    paused: bool
    #: True between this object's pause() and resume() when the pause is the cgroup freezer, which
    #: nothing inside can undo (SIGSTOP can be: a process the stop rounds missed sends SIGCONT).
    frozen: bool
    #: time.monotonic() of this object's last resume() of a frozen sandbox (None: none): a command's
    #: timeout is enforced by its monitor inside, which could not act while the sandbox was frozen.
    resumed_at: float | None

    def pause(self) -> str:
        """Stop every process of the sandbox; the mechanism ("cgroup-freezer" or "sigstop")."""
        ...

    def egress_summary(self) -> dict[str, Any] | None:
        """What the sandbox's egress mediator has seen so far (None: no egress by name, or not known to
        this process); a command's report holds what it gained while the command ran."""
        ...

    def end(self, reason: str) -> bool:
        """End everything running in the sandbox now, from the host (its files stay until close()): what
        the host does when a command's monitor inside no longer answers for it. False when it had ended
        already. Later operations fail naming ``reason``."""
        ...

    def resume(self) -> str:
        ...

    def processes(self) -> list[Any]:
        """psutil.Process objects of the sandbox's processes, its first process first."""
        ...

    def state(self) -> str:
        """"running", "ended", or "not answering" (paused, or its server killed from inside)."""
        ...

    def connect(self) -> Connection:
        """A new conversation with the exec server, its peer checked (one per command)."""
        ...

    def files(self) -> Connection:
        """The conversation file operations share (made again if it was dropped)."""
        ...

    def open_workspace(self) -> int:
        """A descriptor of ``workspace_host`` (a copied one: only the directory start() made)."""
        ...


def make_backend(backend: str, policy: Policy, workspace: Workspace, mounts: tuple[Mount, ...], name: str | None,
                 ttl: float | None, idle_timeout: float | None, start_from: Any = None,
                 image_upper: str | None = None) -> KeptBackend:
    """The kept sandbox of that backend ("native" or "docker"), not started; ``start_from``: a snapshot whose
    files it starts with (native only); ``image_upper``: "disk" keeps an image's upper layer in the state
    directory, where commit_image reads it (native only), "tmpfs" in a private tmpfs, None: as the kernel
    allows (native/kept.py)."""
    if backend == "docker" and image_upper == "disk" and policy.image is not None:
        from ..model.errors import UnsupportedError

        raise UnsupportedError("image_upper='disk': the Docker backend's container keeps its own layers; use "
                               "backend='native'")
    if backend == "docker":
        if start_from is not None:
            from ..model.errors import UnsupportedError

            raise UnsupportedError("snapshot: the Docker backend keeps no snapshots (its workspace is a host "
                                   "directory bound into a container, which docker commit does not capture); "
                                   "use backend='native'")
        from .docker.served import DockerKept

        return DockerKept(policy, workspace, mounts, name, ttl, idle_timeout)
    from .native.kept import NativeSandbox

    sandbox = NativeSandbox(policy, workspace, mounts, name, ttl, idle_timeout, start_from)
    sandbox.image_upper_wanted = image_upper
    return sandbox


def attach_backend(name: str, ping: bool = True) -> KeptBackend:
    """The running named sandbox: the native one of that name, else the Docker one."""
    import os

    from .native.kept import NativeSandbox, Paths

    if os.path.lexists(Paths.of(name).meta):
        return NativeSandbox.attach(name, ping)
    from .docker.served import DockerKept

    return DockerKept.attach(name, ping)
