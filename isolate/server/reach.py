"""What the server reads of a native kept sandbox beyond ``Sandbox``'s public methods: its cgroup
(for metrics) and its egress mediator (for a runtime change of its allow-list).

Both belong to the sandbox's server process as the native backend started
it; ``Sandbox`` has no public accessor for them yet, so they are looked up
here, in one place, and None stands for "this sandbox has none" (another
backend, no limits, no allow-list). A named sandbox's mediator is a process
of its own (it outlives the server that started it): it is reached at its
control socket in the server user's private runtime directory, found by the
sandbox's name.
"""

from __future__ import annotations

from typing import Any

from ..kept.sandbox import Sandbox


def _prepared(box: Sandbox) -> Any:
    process = getattr(getattr(box, "_impl", None), "process", None)
    return getattr(process, "_prepared", None)


def run_cgroup(box: Sandbox) -> Any:
    """The sandbox's own cgroup (isolate.kernel.cgroup.RunCgroup), or None."""
    return getattr(_prepared(box), "cgroup", None)


class _KeptMediator:
    """A named sandbox's mediator process: its allow-list changes through its control socket; a credential
    vault cannot be handed to it (its values would leave this process), so none is: refused."""

    def __init__(self, control: Any) -> None:
        self._control = control

    def update_rules(self, rules: Any) -> int:
        closed: int = self._control.update_rules(rules)
        return closed

    def summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = self._control.summary()
        return summary

    @property
    def vault(self) -> None:
        return None

    @vault.setter
    def vault(self, value: Any) -> None:
        from ..model.errors import UnsupportedError

        raise UnsupportedError("a kept sandbox's egress mediator is a process of its own, which a credential vault "
                               "is never handed to")


def mediator(box: Sandbox) -> Any:
    """The sandbox's egress mediator (isolate.egress.Mediator, in this process; a named native sandbox's
    mediator process, reached at its control socket), or None."""
    found = getattr(_prepared(box), "mediator", None)
    if found is not None:
        return found
    from ..model.policy import Egress

    name = box.name
    if name is None or box.backend != "native" or not isinstance(box.policy.network, Egress):
        return None
    from ..backends.native.egress import MediatorControl
    from ..backends.native.kept import Paths

    return _KeptMediator(MediatorControl(Paths.of(name).egress))
