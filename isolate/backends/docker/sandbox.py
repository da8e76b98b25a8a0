"""Kept sandboxes: a container that lives across commands, and the registry of them.

``Sandbox(policy, backend="docker", name="build")`` keeps a container named
``isolate-build``; each ``sandbox.run(args)`` executes in it (far cheaper than
a fresh container). The container is reused while its configuration hash
matches and recreated when the policy (or the image, or the working directory
it was resolved against) changed. Without a name the sandbox is private to the
object and removed on ``close()``.

Kept sandboxes are recorded in a small SQLite registry under the user's state
directory (``$ISOLATE_STATE_DIR``, else ``$XDG_STATE_HOME/isolate``, else
``~/.local/state/isolate``): name, hashes, image, created, last used. ``prune``
removes the idle and the old; ``cli_main`` serves ``isolate-run sandbox``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from ...model.errors import IsolationError, UnsupportedError
from ...model.policy import Policy
from ..registry import Registry, SandboxRecord, _check_name

#: ``prune`` without options removes sandboxes unused for a day or created more than a week ago.
DEFAULT_IDLE_SECONDS = 24 * 3600.0
DEFAULT_AGE_SECONDS = 7 * 24 * 3600.0
#: ``last_used`` is written at most this often per sandbox object (a write per command would cost a sync).
TOUCH_INTERVAL = 1.0

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class DockerSandbox:
    """A kept container that runs many commands under one policy.

    ``backend`` must be "docker" (or "auto", which means docker here): the
    native backend has no process to keep. ``cwd`` is the host directory that
    relative paths of the policy are resolved against (default: the current
    one); it is the working directory of commands unless ``policy.cwd`` or
    ``run(cwd=...)`` says otherwise. ``image`` overrides ``policy.image``.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        backend: str = "docker",
        name: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        image: str | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.policy = policy if policy is not None else Policy()
        if backend not in ("docker", "auto") or self.policy.backend == "native":
            raise UnsupportedError(
                f"Sandbox: kept sandboxes need the docker backend (got backend={backend!r}, "
                f"policy.backend={self.policy.backend!r}); use isolate.run for native one-shot runs"
            )
        self.ephemeral = name is None
        self.name = _check_name(name) if name is not None else f"tmp-{secrets.token_hex(6)}"
        self.cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
        self.image = image
        self.registry = registry or Registry()
        #: What the last ``start`` did: "created", "reused", "restarted" or "recreated".
        self.last_action: str | None = None
        self._container_id: str | None = None
        self._spec: Any = None
        self._touched = 0.0
        self._armed_id: str | None = None

    def __repr__(self) -> str:
        return f"DockerSandbox(name={self.name!r}, container={(self._container_id or '')[:12]!r})"

    def __enter__(self) -> DockerSandbox:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def container_id(self) -> str | None:
        return self._container_id

    @property
    def container_name(self) -> str:
        from .. import docker as backend

        return backend.kept_container_name(self.name)

    def start(self) -> str:
        """Make sure the container runs (create, reuse, restart or recreate it); its id."""
        from .. import docker as backend

        spec = backend.prepare(self.policy, cwd=self.cwd, image=self.image)
        container_id, action = backend.ensure_kept(self.name, spec)
        now = time.time()
        engine = backend.engine_address()
        previous = self.registry.get(engine, self.name)
        created = now if previous is None or action in ("created", "recreated") else previous.created
        self.registry.record(
            SandboxRecord(engine, self.name, container_id, spec.config_hash, spec.spec_hash(), spec.image, created, now)
        )
        if self.ephemeral and spec.die_with_parent and self._armed_id != container_id:
            if self._armed_id is not None:
                backend.watchdog.disarm(self._armed_id, "rm")
            backend.watchdog.arm(container_id, "rm")  # an unnamed sandbox dies with this process
            self._armed_id = container_id
        self._touched = now
        self._spec = spec
        self._container_id = container_id
        self.last_action = action
        return container_id

    def run(
        self,
        args: Any,
        *,
        input: bytes | str | None = None,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        capture_output: bool = False,
        timeout: float | None = None,
        check: bool = False,
        cwd: str | os.PathLike[str] | None = None,
        text: bool | None = None,
        encoding: str | None = None,
        errors: str | None = None,
    ) -> Any:
        """Run ``args`` in the kept container, like ``subprocess.run``; the result has ``.report``.

        ``cwd`` is a directory inside the container. A deadline or the CPU
        limit kills the whole container; the next ``run`` starts it again.
        """
        from .. import docker as backend

        if self._container_id is None:
            self.start()
        import docker.errors  # importable now: start() reached the engine through it

        environ = {key: os.environ[key] for key in self.policy.keep_env if key in os.environ}
        if self.policy.home is not None:
            environ["HOME"] = self.policy.home  # the container's private home, as for a single run
        environ.update(self.policy.env)
        kwargs: dict[str, Any] = dict(
            input=input, stdin=stdin, stdout=stdout, stderr=stderr, capture_output=capture_output,
            timeout=timeout, check=check, cwd=cwd, text=text, encoding=encoding, errors=errors, environ=environ,
        )  # fmt: skip
        for attempt in (1, 2):
            assert self._container_id is not None
            try:
                result = backend.exec_run(self._container_id, self._spec, args, **kwargs)
            except IsolationError as exc:
                cause = exc.__context__
                gone = isinstance(cause, docker.errors.NotFound) or "is not running" in str(exc)
                if attempt == 2 or not gone:
                    reason = backend.kept_failure(self._container_id) if gone else None
                    if reason:
                        raise UnsupportedError(f"sandbox {self.name!r}: {reason}") from None
                    raise
                self.start()  # stopped (a deadline killed it) or removed (pruned): bring it back once
                continue
            break
        now = time.time()
        if now - self._touched >= TOUCH_INTERVAL:
            self._touched = now
            with contextlib.suppress(IsolationError):
                self.registry.touch(backend.engine_address(), self.name, now)
        return result

    def remove(self) -> None:
        """Remove the container and its registry entry."""
        from .. import docker as backend

        backend.remove_container(self.container_name)
        if self._armed_id is not None:
            backend.watchdog.disarm(self._armed_id, "rm")
            self._armed_id = None
        self.registry.forget(backend.engine_address(), self.name)
        self._container_id = None

    def close(self) -> None:
        """End the use of this object: an unnamed sandbox is removed, a named one is kept."""
        if self.ephemeral and self._container_id is not None:
            self.remove()


# --------------------------------------------------------------------------
# Listing and pruning


@dataclass(frozen=True)
class SandboxStatus:
    """A kept sandbox with the engine's view of its container."""

    record: SandboxRecord
    state: str  # the engine's State.Status, or "missing"
    registered: bool = True  # False: a kept container of this engine that this registry does not know


def list_sandboxes(registry: Registry | None = None) -> list[SandboxStatus]:
    """The kept sandboxes of the current engine, with their containers' states.

    Kept containers that this registry does not know (another user's, or a
    registry file that was removed) are listed too, rebuilt from their labels,
    with ``registered`` False; ``prune`` leaves them alone.
    """
    from .. import docker as backend

    registry = registry or Registry()
    engine = backend.engine_address()
    records = {rec.name: rec for rec in registry.all(engine)}
    states: dict[str, str] = {}
    orphans: set[str] = set()
    for container in backend.list_containers("kept"):
        labels = container.get("Labels") or {}
        name = labels.get(backend.LABEL_NAME)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            continue  # not a name isolate gave (it would become paths)
        states[name] = str(container.get("State") or "unknown")
        if name not in records:
            created = float(container.get("Created") or 0)
            orphans.add(name)
            records[name] = SandboxRecord(
                engine, name, str(container.get("Id")), labels.get(backend.LABEL_CONFIG_HASH, ""),
                labels.get(backend.LABEL_SPEC_HASH, ""), str(container.get("Image") or ""), created, created,
            )  # fmt: skip
    return [SandboxStatus(records[n], states.get(n, "missing"), n not in orphans) for n in sorted(records)]


def remove_sandbox(name: str, registry: Registry | None = None) -> bool:
    """Remove the kept sandbox ``name`` (container and record); False when neither existed."""
    from .. import docker as backend

    _check_name(name)
    registry = registry or Registry()
    from .served import DockerPaths, remove_files

    removed = backend.remove_container(backend.kept_container_name(name))
    forgotten = registry.forget(backend.engine_address(), name)
    described = os.path.lexists(DockerPaths.of(name).meta)
    remove_files(name)  # a Sandbox(backend="docker")'s socket directory and workspace
    return removed or forgotten or described


def prune(
    idle: float | None = DEFAULT_IDLE_SECONDS,
    age: float | None = DEFAULT_AGE_SECONDS,
    *,
    registry: Registry | None = None,
    now: float | None = None,
) -> list[tuple[str, str]]:
    """Remove the registered kept sandboxes unused for ``idle`` seconds or created ``age`` seconds ago.

    Also forgets records whose container is gone, and removes one-shot
    containers that ended more than a minute ago (left by a process that died
    before it could remove them). Returns (name, why) for each.
    """
    from .. import docker as backend
    from .served import remove_files

    registry = registry or Registry()
    now = time.time() if now is None else now
    done: list[tuple[str, str]] = []
    for entry in list_sandboxes(registry):
        rec = entry.record
        if not entry.registered:
            continue
        if entry.state == "missing":
            registry.forget(rec.engine, rec.name)
            remove_files(rec.name)
            done.append((rec.name, "container gone"))
            continue
        why = ""
        if idle is not None and now - rec.last_used >= idle:
            why = f"idle {_duration(now - rec.last_used)}"
        elif age is not None and now - rec.created >= age:
            why = f"age {_duration(now - rec.created)}"
        if why:
            backend.remove_container(backend.kept_container_name(rec.name))
            registry.forget(rec.engine, rec.name)
            remove_files(rec.name)
            done.append((rec.name, why))
    for container_id in backend.ended_runs(older_than=60.0, now=now):
        backend.remove_container(container_id)
        done.append((container_id[:12], "leftover one-shot container"))
    return done


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
