"""The exceptions of isolate: one root, one class per kind of failure.

Every message names the cause and the way out, so that the CLI can print it as
one line and a caller can show it as is.
"""

from __future__ import annotations


class IsolationError(Exception):
    """Root of every error isolate raises on purpose."""


class PolicyError(IsolationError, ValueError):
    """A policy (or a CLI flag, or a profile file) holds bad input.

    ``field`` names the policy field at fault, when there is one.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedError(IsolationError):
    """A protection was asked for and this host cannot enforce it."""


class SetupError(IsolationError):
    """A step of the sandbox setup failed in the child, before exec.

    ``step`` is the name of the step (``"landlock"``, ``"mount-bind"`` ...),
    ``errno`` the error number the kernel returned, ``detail`` what the step
    was working on (a path, a resource), when known.
    """

    def __init__(self, message: str, step: str = "", errno: int = 0, detail: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.errno = errno
        self.detail = detail


class CommandNotFoundError(IsolationError, FileNotFoundError):
    """The command does not exist inside the sandbox (CLI exit status 127)."""


class CommandNotExecutableError(IsolationError, PermissionError):
    """The command exists but cannot be executed inside the sandbox (exit 126)."""


class SandboxEndedError(IsolationError):
    """A call's sandbox ended under it (the command's monitor went away with the sandbox's processes)."""


class SandboxLostError(IsolationError):
    """The sandbox is gone with the machine (or the process) that held it: a Ray node died or its actor did.

    ``node_id`` names the node it ran on.
    """

    def __init__(self, message: str, node_id: str = "") -> None:
        super().__init__(message)
        self.node_id = node_id
