"""inspect_ai sandbox environment provider ``isolate``: one kept ``isolate.Sandbox`` per sample.

Installed with ``pip install 'isolate[inspect]'``; inspect finds it through the
``inspect_ai`` entry point group, so a task says::

    Task(dataset=..., solver=..., sandbox="isolate")                  # isolate.Policy() defaults
    Task(dataset=..., solver=..., sandbox=("isolate", "profile.toml"))  # an isolate policy profile

    Task(dataset=..., solver=..., sandbox=("isolate", "compose.yaml"))  # a compose service's image:

The profile is the TOML that ``isolate.Policy.load`` reads (``isolate-run
--profile``). A compose file (or inspect's ``ComposeConfig``) of one service
runs that service's ``image:`` natively (isolate's default policy, the
service's ``environment:``), pulled into the caller's image store when it is
not there yet (once, at the task's start); ``build:`` and the fields that
would change what the sandbox may do (volumes, ports, users, capabilities,
limits, ...) are refused, named, rather than left aside. To it the provider adds one thing: a private tmpfs at
``/var/tmp``, where inspect installs the helper its ``bash_session`` and
``text_editor`` tools run (a directory tree with an executable in it). Every
command runs as the one uid the policy gives the program (65534 when the
caller is root, else the caller's own uid); ``user=`` accepts that uid's name
or number and raises ``SandboxUserUnsupportedError`` for anyone else, root
included. Each sample's sandbox is named (``inspect-...``), so
``connection()`` gives ``isolate-run sandbox shell NAME`` and
``inspect sandbox cleanup isolate`` removes what an interrupted run left.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import shlex
import sys
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import anyio.to_thread
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel

from ..kept.sandbox import Sandbox
from ..model.errors import CommandNotFoundError, IsolationError, PolicyError, SetupError, UnsupportedError
from ..model.policy import Policy

__all__ = ["IsolateSandboxEnvironment", "inspect_policy"]

#: Where inspect installs its tool helper (inspect_ai.util._sandbox._cli.SANDBOX_TOOLS_DIR's parent).
TOOLS_PARENT = "/var/tmp"
#: Every sample's sandbox name starts with this (what cli_cleanup removes).
NAME_PREFIX = "inspect-"

T = TypeVar("T")


def inspect_policy(policy: Policy) -> Policy:
    """The policy an inspect sample runs under: ``policy`` plus a private, writable ``/var/tmp``.

    inspect extracts its tool helper under /var/tmp and runs it from there, so
    that place must be writable and executable by the program; a private tmpfs
    is, and shows nothing of the host's /var/tmp.
    """
    covered = {os.path.normpath(p) for p in policy.tmpfs} | {m.target for m in policy.binds}
    if TOOLS_PARENT in covered:
        return policy
    return policy.replace(tmpfs=(*policy.tmpfs, TOOLS_PARENT))


#: Compose service fields a kept sandbox has no use for: its program is isolate's exec server (command,
#: entrypoint), its init isolate's (init), it is ready when made (healthcheck), it never restarts.
_COMPOSE_LEFT_ASIDE = frozenset({"command", "entrypoint", "init", "healthcheck", "stop_grace_period", "restart",
                                 "tty", "stdin_open", "x_default", "pull_policy"})


def compose_policy(compose: Any, what: str) -> Policy:
    """The policy of a compose file's one service (an inspect ``ComposeConfig``): its image, natively."""
    services = dict(compose.services)
    if len(services) != 1:
        raise UnsupportedError(f"{what}: {len(services)} services; the isolate provider runs one sandbox per "
                               "sample (one service)")
    name, service = next(iter(services.items()))
    given = set(service.model_dump(exclude_none=True))
    if service.build is not None:
        raise UnsupportedError(f"{what}: service {name}: build: isolate runs images and does not build them; build "
                               "it with docker or podman and give its name as image: (isolate.Image.from_docker "
                               "takes it from the engine)")
    if not service.image:
        raise UnsupportedError(f"{what}: service {name}: no image:")
    if service.network_mode not in (None, "none"):
        raise UnsupportedError(f"{what}: service {name}: network_mode {service.network_mode!r}: the sandbox has "
                               "no network (isolate's default); give an isolate profile for egress by name")
    refused = sorted(given - _COMPOSE_LEFT_ASIDE - {"image", "environment", "network_mode"})
    if refused:
        raise UnsupportedError(f"{what}: service {name}: {', '.join(refused)}: not taken by the isolate provider "
                               "(it would change what the sandbox may do); leave it out, or use an isolate "
                               "profile")
    env: dict[str, str] = {}
    items = service.environment or {}
    pairs = [item.partition("=")[::2] for item in items] if isinstance(items, list) else list(items.items())
    for key, value in pairs:
        if value is None:
            value = os.environ.get(key)  # compose's "NAME" alone: the caller's value, if any
        if value is not None:
            env[key] = str(value)
    return Policy(image=service.image, env=env)


def _ensure_image(policy: Policy) -> None:
    """The policy's image in the caller's image store: pulled from its registry when it is not there."""
    if policy.image is None:
        return
    from ..image import Image

    if Image.find(policy.image) is None:
        Image.pull(policy.image)


def _load_policy(config: SandboxEnvironmentConfigType | None) -> Policy:
    from inspect_ai.util import ComposeConfig, is_compose_yaml, parse_compose_yaml

    if config is None:
        return inspect_policy(Policy())
    if isinstance(config, ComposeConfig):
        return inspect_policy(compose_policy(config, "sandbox config"))
    if is_compose_yaml(config):
        try:
            compose = parse_compose_yaml(config, multiple_services=False)
        except ValueError as exc:
            raise PolicyError(f"{config}: {exc}", "config") from None
        return inspect_policy(compose_policy(compose, config))
    if isinstance(config, str):
        policy = Policy.load(config)
        if policy.backend == "docker":
            raise UnsupportedError(
                f"{config}: backend = \"docker\": this provider runs inspect's samples on the native backend only "
                "(its tool helper and limits are proven there); use backend = \"native\", or inspect's own docker "
                "provider for an image"
            )
        return inspect_policy(policy)
    if isinstance(config, BaseModel):
        raise PolicyError(
            f"sandbox config: the isolate provider takes the path of a TOML policy profile, not "
            f"{type(config).__name__}; write the policy with isolate.Policy(...).save('profile.toml')",
            "config",
        )
    raise PolicyError(f"sandbox config: expected a TOML profile path, got {config!r}", "config")


async def _in_thread(fn: Callable[..., T], *args: Any, abandon: bool = False, **kwargs: Any) -> T:
    result: T = await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), abandon_on_cancel=abandon)
    return result


def _with_name(exc: OSError, file: str) -> OSError:
    """The same error, naming the file (inspect's contract: the message names it)."""
    if exc.errno == errno.EROFS:  # a read-only mount: for inspect, a write it may not do
        return PermissionError(errno.EACCES, f"{os.strerror(errno.EROFS)} (not writable in this sandbox)", file)
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), file)


@sandboxenv(name="isolate")
class IsolateSandboxEnvironment(SandboxEnvironment):
    """One sample's ``isolate.Sandbox`` (see the module's docstring)."""

    #: The sandboxes this process started and has not closed yet: name -> (task, sandbox), task_cleanup's list.
    _live: dict[str, tuple[str, Sandbox]] = {}
    _live_lock = threading.Lock()

    def __init__(self, box: Sandbox, uid: int, names: frozenset[str]) -> None:
        super().__init__()
        self.box = box
        self.uid = uid
        self.user_names = names

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def config_files(cls) -> list[str]:
        return []

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        policy = _load_policy(config)  # a bad profile fails the task before its first sample
        await _in_thread(_ensure_image, policy)  # a compose service's image, pulled once for every sample

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        policy = _load_policy(config)
        env = await _in_thread(cls._start, task_name, policy)
        return {"default": env}

    @classmethod
    def _start(cls, task_name: str, policy: Policy) -> IsolateSandboxEnvironment:
        name = NAME_PREFIX + secrets.token_hex(6)
        box = Sandbox(policy, name=name)
        box.start()
        with cls._live_lock:
            cls._live[name] = (task_name, box)
        try:
            uid = _program_uid(box)
            names = _names_of(box, uid)
        except BaseException:
            cls._close(box)
            raise
        return cls(box, uid, names)

    @classmethod
    def _close(cls, box: Sandbox) -> None:
        with cls._live_lock:
            if box.name is not None:
                cls._live.pop(box.name, None)
        box.close()

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        for env in environments.values():
            await _in_thread(cls._close, env.as_type(IsolateSandboxEnvironment).box)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        if not cleanup:
            return  # --no-sandbox-cleanup: they stay, for isolate-run sandbox shell/rm
        with cls._live_lock:  # this task's only: other tasks of the same eval may still be running
            boxes = [box for task, box in cls._live.values() if task == task_name]
        for box in boxes:
            await _in_thread(cls._close, box)

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup isolate [NAME]``: remove this user's inspect sandboxes (or that one)."""
        from ..backends.native.named import native_names, remove_native

        def remove() -> None:
            ours = [n for n in native_names() if n.startswith(NAME_PREFIX)]  # never a sandbox inspect did not make
            for name in ours if id is None else [n for n in ours if n == id]:
                remove_native(name)

        await _in_thread(remove)

    # -- commands ----------------------------------------------------------------------

    def _check_user(self, user: str | None) -> None:
        if user is None:
            return
        try:
            uid: int | None = int(user) if user.isascii() and user.isdecimal() else None
        except ValueError:
            uid = None
        if user != "root" and uid != 0 and (uid == self.uid or (uid is None and user in self.user_names)):
            return
        who = "/".join(sorted(self.user_names)) or "no name"
        raise SandboxUserUnsupportedError(
            f"isolate runs every command of this sandbox as uid {self.uid} ({who}), never as root or another "
            f"user; cannot run as {user!r} (leave user unset, or give another uid in the policy profile)"
        )

    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        self._check_user(user)
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        limit_str = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR
        if timeout is not None and timeout <= 0:
            raise TimeoutError(f"Command timed out after {timeout} seconds")
        # abandon on cancel: a cancelled sample goes on to sample_cleanup, whose close() ends the command.
        return await _in_thread(self._exec, list(cmd), input, cwd, dict(env or {}), timeout, limit, limit_str,
                                abandon=True)

    def _exec(self, cmd: list[str], input: str | bytes | None, cwd: str | None, env: dict[str, str],
              timeout: int | None, limit: int, limit_str: str) -> ExecResult[str]:
        if not cmd:
            raise ValueError("exec: empty command")
        try:
            result = self.box.exec(cmd, cwd=cwd, env=env, input=input, timeout=timeout, output_limit=limit)
        except CommandNotFoundError as exc:
            # inspect's contract: a missing executable is the command's failure, not the provider's.
            return ExecResult(False, 127, "", f"{exc}\n")
        except SetupError as exc:
            if exc.step != "chdir":
                raise SandboxUnavailableError(f"isolate could not start the command: {exc}") from exc
            return ExecResult(False, 126, "", f"{exc}\n")
        except PermissionError:
            raise  # CommandNotExecutableError: inspect expects a PermissionError
        except IsolationError as exc:  # the sandbox ended (ttl, killed, its server gone)
            raise SandboxUnavailableError(f"the isolate sandbox {self.box.name} cannot run commands: {exc}") from exc
        if result.report.status == "timeout":
            error = TimeoutError(f"Command timed out after {timeout} seconds")
            partial = (result.stdout or "") + (result.stderr or "")
            if partial:
                error.truncated_output = partial  # type: ignore[attr-defined]  # what inspect's docker sets
            raise error
        if result.truncated:
            raise OutputLimitExceededError(limit_str, truncated_output=result.stdout + result.stderr)
        return ExecResult(result.returncode == 0, result.returncode, result.stdout, result.stderr)

    # -- files ---------------------------------------------------------------------------

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
        await _in_thread(self._write, file, data)

    def _write(self, file: str, data: bytes) -> None:
        try:
            self.box.write_file(file, data, make_parents=True)
        except OSError as exc:
            raise _with_name(exc, file) from exc

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        limit_str = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR
        data = await _in_thread(self._read, file, limit, limit_str)
        return data.decode("utf-8") if text else data  # newlines kept as they are (crlf stays crlf)

    def _read(self, file: str, limit: int, limit_str: str) -> bytes:
        try:
            data: bytes = self.box.read_file(file, text=False, limit=limit)
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise OutputLimitExceededError(limit_str, truncated_output=None) from exc
            raise _with_name(exc, file) from exc
        return data

    # -- connection ------------------------------------------------------------------

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        self._check_user(user)
        assert self.box.name is not None
        # The isolate-run of this very install (another one on PATH may speak another protocol).
        beside = os.path.join(os.path.dirname(sys.executable), "isolate-run")
        prefix = [beside] if os.access(beside, os.X_OK) else [sys.executable, "-m", "isolate.cli"]
        return SandboxConnection(type="isolate", command=shlex.join([*prefix, "sandbox", "shell", self.box.name]))

    def default_polling_interval(self) -> float:
        return 0.2  # a command starts in milliseconds here, as inspect's local provider assumes


def _program_uid(box: Sandbox) -> int:
    """The uid every command of the sandbox runs as (the exec server's own: it is confined as the program)."""
    status = box.read_file("/proc/self/status")
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise IsolationError("cannot tell the sandbox's uid: no Uid line in /proc/self/status")


def _names_of(box: Sandbox, uid: int) -> frozenset[str]:
    """The user names the sandbox's own /etc/passwd gives that uid (none when it cannot be read)."""
    try:
        passwd = box.read_file("/etc/passwd")
    except (OSError, UnicodeDecodeError):
        return frozenset()
    names = set()
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2] == str(uid) and fields[0]:
            names.add(fields[0])
    return frozenset(names - {"root"})
