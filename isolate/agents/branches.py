"""A branch per attempt: native or Docker behind one protocol, with a reported fallback."""

from __future__ import annotations

import os
import secrets
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..kept.merge import MergeResult
from ..kept.sandbox import ExecResult, Sandbox
from ..kernel.tree import Changes
from ..model.errors import IsolationError, PolicyError, UnsupportedError
from ..model.policy import Policy
from ..model.workspace import Workspace
from .manager import _close_quietly

# -- a branch per attempt -------------------------------------------------------------------------------------


@runtime_checkable
class BranchStrategy(Protocol):
    """A branch per attempt: each branch a private copy of a source directory, in a sandbox of its own."""

    name: str
    #: Why this strategy runs: "first choice", or what the ones before it failed with.
    reason: str

    def setup_branch(self, source_dir: str | os.PathLike[str]) -> str: ...

    def execute_command(self, branch_id: str, cmd: str | Sequence[str], *,
                        timeout: float | None = None) -> ExecResult: ...

    def execute_python(self, branch_id: str, code: str, *, timeout: float | None = None) -> ExecResult: ...

    def commit_to_host(self, branch_id: str, target_dir: str | os.PathLike[str]) -> Changes: ...

    def setup_verification_branches(self, groups: Mapping[Any, Sequence[str]], *, on_conflict: str = "markers",
                                    discard_unused: bool = True) -> dict[Any, str]: ...

    def clean_up(self, branch_id: str) -> None: ...

    def clean_up_all(self) -> None: ...

    def __enter__(self) -> BranchStrategy: ...

    def __exit__(self, *exc_info: object) -> None: ...


class StrategyFallbackWarning(RuntimeWarning):
    """A branch strategy could not be made and the next one is used (the message says why)."""


class _SandboxBranches:
    """Branches as kept sandboxes of one backend (the two strategies differ only by it)."""

    name: str = ""

    def __init__(self, policy: Policy | None = None, *, exclude: Sequence[str] = (), python: str = "python3") -> None:
        policy = policy if policy is not None else Policy()
        if not isinstance(policy, Policy):
            raise TypeError("policy must be an isolate.Policy")
        self.policy = policy.replace(backend=self.name)
        self.exclude = tuple(exclude)
        self.python = python
        self.reason = "first choice"
        self._branches: dict[str, Sandbox] = {}
        #: What each merged verification branch's merge did (isolate.MergeResult: merged paths, conflicts).
        self.merges: dict[str, MergeResult] = {}
        self._lock = threading.Lock()
        self._probe()

    def _probe(self) -> None:
        """Make (and end) one sandbox as a branch would: raises what keeps this strategy from working here."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="isolate-probe-") as empty:
            box = Sandbox(self.policy, workspace=Workspace(empty, mode="copy", exclude=self.exclude),
                          backend=self.name)
            try:
                box.start()
            finally:
                _close_quietly(box)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(branches={len(self._branches)}, reason={self.reason!r})"

    def __enter__(self) -> _SandboxBranches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.clean_up_all()

    def setup_branch(self, source_dir: str | os.PathLike[str]) -> str:
        """A new branch: a sandbox whose workspace is a private copy of source_dir; its id."""
        workspace = Workspace(os.fspath(source_dir), mode="copy", exclude=self.exclude)
        box = Sandbox(self.policy, workspace=workspace, backend=self.name)
        box.start()
        branch_id = f"{self.name}-{secrets.token_hex(8)}"
        with self._lock:
            self._branches[branch_id] = box
        return branch_id

    def _box(self, branch_id: str) -> Sandbox:
        with self._lock:
            box = self._branches.get(branch_id)
        if box is None:
            raise IsolationError(f"no branch {branch_id!r} here (cleaned up, or made by another strategy)")
        return box

    def execute_command(self, branch_id: str, cmd: str | Sequence[str], *,
                        timeout: float | None = None) -> ExecResult:
        """Run a command (a string goes to /bin/sh -c) in the branch's workspace."""
        return self._box(branch_id).exec(cmd, timeout=timeout)

    def execute_python(self, branch_id: str, code: str, *, timeout: float | None = None) -> ExecResult:
        """Run code with the sandbox's python3, fed on its standard input (no state kept between calls)."""
        return self._box(branch_id).exec([self.python, "-"], input=code, timeout=timeout)

    def commit_to_host(self, branch_id: str, target_dir: str | os.PathLike[str]) -> Changes:
        """Make target_dir equal to the branch's workspace (Sandbox.commit); what was written."""
        return self._box(branch_id).commit(target_dir)

    def setup_verification_branches(self, groups: Mapping[Any, Sequence[str]], *, on_conflict: str = "markers",
                                    discard_unused: bool = True) -> dict[Any, str]:
        """Verification branches after aggregation, as GCRI's seed makes them: for each group (its key, the
        branch ids it comes from), one source is reused as it is; several are merged (``isolate.merge``
        against the source they were set up from) into a new branch, whose ``MergeResult`` is kept in
        ``merges[id]``. With ``discard_unused``, the branches no group uses are cleaned up. Returns each
        group's branch id. ``on_conflict="refuse"`` raises ``MergeConflictError`` for a group whose merge
        conflicts (nothing is discarded then); with "markers" the conflicts stay marked in the files.
        """
        from ..kept.merge import merge

        for key, sources in groups.items():
            if isinstance(sources, str) or not sources:
                raise PolicyError(f"groups[{key!r}]: a non-empty list of branch ids", "groups")
            for branch_id in sources:
                self._box(branch_id)  # every source must exist before anything is made or discarded
        out: dict[Any, str] = {}
        made: list[str] = []
        try:
            for key, sources in groups.items():
                if len(sources) == 1:
                    out[key] = sources[0]
                    continue
                result = merge([self._box(b) for b in sources], policy=self.policy, on_conflict=on_conflict)
                assert result.sandbox is not None and result.snapshot is not None
                result.snapshot.remove()  # the new sandbox holds its own copy of the merged files
                branch_id = f"{self.name}-{secrets.token_hex(8)}"
                with self._lock:
                    self._branches[branch_id] = result.sandbox
                    self.merges[branch_id] = result
                made.append(branch_id)
                out[key] = branch_id
        except BaseException:
            for branch_id in made:
                self.clean_up(branch_id)
            raise
        if discard_unused:
            used = {b for sources in groups.values() for b in sources} | set(out.values())
            with self._lock:
                unused = [b for b in self._branches if b not in used]
            for branch_id in unused:
                self.clean_up(branch_id)
        return out

    def clean_up(self, branch_id: str) -> None:
        """End the branch's sandbox and remove its copy."""
        with self._lock:
            box = self._branches.pop(branch_id, None)
            self.merges.pop(branch_id, None)
        if box is None:
            raise IsolationError(f"no branch {branch_id!r} here (cleaned up already?)")
        box.close()

    def clean_up_all(self) -> None:
        with self._lock:
            boxes = list(self._branches.values())
            self._branches.clear()
        for box in boxes:
            _close_quietly(box)


class NativeBranches(_SandboxBranches):
    """Branches as native kept sandboxes (namespaces, Landlock, seccomp; nothing needed inside)."""

    name = "native"


class DockerBranches(_SandboxBranches):
    """Branches as kept containers of the local Docker engine."""

    name = "docker"

    def _probe(self) -> None:
        from ..backends.docker import available

        ok, why = available()
        if not ok:
            raise UnsupportedError(why)
        super()._probe()


STRATEGIES: dict[str, type[_SandboxBranches]] = {"native": NativeBranches, "docker": DockerBranches}


def branches(policy: Policy | None = None, *, prefer: Sequence[str] = ("native", "docker"),
             exclude: Sequence[str] = (), python: str = "python3") -> BranchStrategy:
    """The first strategy of ``prefer`` that can make a sandbox here.

    Falling back is never silent: a ``StrategyFallbackWarning`` names the
    strategy that runs and why the ones before it could not, and so does the
    returned strategy's ``reason`` (its ``name`` says which runs). When none
    can be made, ``UnsupportedError`` gives each one's reason.
    """
    if isinstance(prefer, str) or not prefer:
        raise PolicyError("prefer: a non-empty list of strategies, e.g. ('native', 'docker')", "prefer")
    failures: list[str] = []
    for name in prefer:
        kind = STRATEGIES.get(name)
        if kind is None:
            raise PolicyError(f"prefer: {name!r} is not one of {', '.join(STRATEGIES)}", "prefer")
        try:
            strategy = kind(policy, exclude=exclude, python=python)
        except (IsolationError, OSError) as exc:
            failures.append(f"{name}: {exc}")
            continue
        if failures:
            strategy.reason = f"fallback: {'; '.join(failures)}"
            warnings.warn(f"isolate.agents: branches run on the {name} strategy, because {'; '.join(failures)}",
                          StrategyFallbackWarning, stacklevel=2)
        return strategy
    raise UnsupportedError(f"no branch strategy can make a sandbox here: {'; '.join(failures)}")
