"""``policy.preexec_fn``: the same confinement for plain ``subprocess``.

The plan is prepared once, in the parent, when the hook is made; the hook
itself only calls the C core in the child. subprocess cannot carry an
exception out of a hook (it reports a bare "Exception occurred in
preexec_fn"), so on a setup failure the hook writes one line naming the step
to the child's stderr and exits with status 125, as ``isolate-run`` does.

The environment: subprocess called with ``env=None`` execs with the child's
own ``environ``, which the C core points at the policy's minimal one (the
parent's secrets never reach the program); an explicit ``env=`` is what
subprocess passes to execve, so it is the program's environment as given.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .._core import ffi, lib, step_name
from ..backends import native
from ..model.policy import Policy

SETUP_FAILED = 125


class PreexecHook:
    """A callable for ``subprocess``'s ``preexec_fn`` (see ``Policy.preexec_fn``)."""

    def __init__(self, policy: Policy) -> None:
        # The command is unknown here: exec is subprocess's. Only the
        # confinement is planned; argv and an explicit env= stay subprocess's.
        self._prepared = native.prepare(policy, ["/proc/self/exe"], for_preexec=True)
        self._failure = ffi.new("struct iso_failure *")
        # The caller whose death ends the run (without namespaces the hook's
        # init watches it); read here, as the child cannot tell whether the
        # parent it sees is still the one that forked it.
        self._parent_pid = os.getpid()
        self.enforced = self._prepared.enforced
        self.warnings = self._prepared.warnings

    def __call__(self) -> None:
        parent = self._parent_pid if os.getppid() == self._parent_pid else os.getppid()
        if lib.iso_preexec(self._prepared.plan, parent, self._failure) == 0:
            return
        failure = self._failure
        detail = ""
        if failure.step == lib.ISO_STEP_CHDIR:
            detail = " (the working directory is not granted inside the sandbox)"
        message = (
            f"isolate: sandbox setup failed at {step_name(failure.step)}{detail}: "
            f"{os.strerror(failure.err)}\n"
        )
        try:
            os.write(2, message.encode())
        finally:
            os._exit(SETUP_FAILED)

    def __del__(self) -> None:
        prepared = getattr(self, "_prepared", None)
        if prepared is not None:
            prepared.close_child_side()


def make_preexec_fn(policy: Policy) -> Callable[[], None]:
    return PreexecHook(policy)

