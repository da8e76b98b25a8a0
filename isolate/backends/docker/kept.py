"""Kept containers (used by isolate.sandbox): made once, each command run in them as an exec."""

from __future__ import annotations

import contextlib
import os
import re
import signal as signal_mod
import subprocess
import time
from collections.abc import Mapping
from typing import Any

from ...model.errors import PolicyError, SetupError, UnsupportedError
from .engine import _engine_errors, _short, client
from .runs import _classify, _command_error, _drive, _finish, _oom_events, _raise_start_error, _report
from .spec import LABEL, LABEL_KIND, LABEL_SPEC_HASH, ContainerSpec
from .streams import _EXEC_HOLD, Args, _argv, _Conn, _exec_start, _Streams
from .watch import _Monitor, watchdog

#: Prefix of the container names of kept sandboxes.
KEPT_PREFIX = "isolate-"
#: What a kept container runs between commands (the image must have ``sleep``).
KEEPER_COMMAND: tuple[str, ...] = ("sleep", "infinity")


# --------------------------------------------------------------------------
# Kept containers (used by isolate.sandbox)


def kept_container_name(name: str) -> str:
    return KEPT_PREFIX + name


def ensure_kept(name: str, spec: ContainerSpec) -> tuple[str, str]:
    """(container id, what was done) for the kept sandbox ``name`` under ``spec``.

    What was done is "reused" (running, same spec hash), "restarted" (stopped,
    same hash), "recreated" (the hash changed: removed and made anew) or
    "created".
    """
    api = client().api
    import docker.errors

    cname = kept_container_name(name)
    for _ in range(3):
        try:
            info = api.inspect_container(cname)
        except docker.errors.NotFound:
            info = None
        except Exception as exc:
            with _engine_errors(f"inspect the kept container {cname}"):
                raise exc
        action = "created"
        if info is not None:
            labels = (info.get("Config") or {}).get("Labels") or {}
            if labels.get(LABEL) != "1":
                raise PolicyError(
                    f"sandbox {name!r}: a container named {cname} exists and was not made by isolate; "
                    "choose another sandbox name or remove that container",
                    "name",
                )
            if labels.get(LABEL_SPEC_HASH) == spec.spec_hash():
                if (info.get("State") or {}).get("Running"):
                    return str(info["Id"]), "reused"
                spec.verify_binds()  # a restart binds the host paths again
                try:
                    api.start(info["Id"])
                except docker.errors.NotFound:
                    continue
                except Exception as exc:
                    _raise_start_error(exc, list(KEEPER_COMMAND), spec.image)
                return str(info["Id"]), "restarted"
            with _engine_errors(f"remove the outdated kept container {cname}"):
                try:
                    api.remove_container(info["Id"], force=True, v=True)
                except docker.errors.NotFound:
                    pass
            action = "recreated"
        try:
            created = api.create_container(
                image=spec.image,
                command=list(KEEPER_COMMAND),
                name=cname,
                user=spec.user,
                working_dir=spec.working_dir,
                labels=spec.labels("kept", name),
                host_config=api.create_host_config(**spec.host_config()),
                detach=True,
            )
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                continue  # someone else created it meanwhile: look again
            with _engine_errors(f"create the kept container {cname} from {spec.image}"):
                raise exc
        except Exception as exc:
            with _engine_errors(f"create the kept container {cname} from {spec.image}"):
                raise exc
        try:
            spec.verify_binds()
            api.start(created["Id"])
        except Exception as exc:
            with contextlib.suppress(Exception):
                api.remove_container(created["Id"], force=True, v=True)
            if isinstance(exc, PolicyError):
                raise
            if isinstance(exc, docker.errors.APIError) and "not found" in _short(exc).lower():
                raise UnsupportedError(
                    f"sandbox {name!r}: the image {spec.image} cannot keep a container alive: it has no "
                    f"`{' '.join(KEEPER_COMMAND)}`; choose an image with sleep"
                ) from None
            _raise_start_error(exc, list(KEEPER_COMMAND), spec.image)
        try:
            _probe_keeper(api, created["Id"], spec)
        except BaseException:
            with contextlib.suppress(Exception):
                api.remove_container(created["Id"], force=True, v=True)
            raise
        return str(created["Id"]), action
    raise SetupError(f"sandbox {name!r}: the container {cname} kept changing under isolate; try again", step="docker")


def _probe_keeper(api: Any, container_id: str, spec: ContainerSpec) -> None:
    """Refuse an image whose keeper cannot run. Without ``sleep`` the container's init exits a moment
    after the start, and a command exec'd in that moment ran as if all were well (the next one failed):
    the keeper's own program is run once, as ``sleep 0``, before the container is handed out."""
    import docker.errors

    try:
        exec_id = api.exec_create(container_id, [KEEPER_COMMAND[0], "0"], user=spec.user)["Id"]
        api.exec_start(exec_id)
        code = api.exec_inspect(exec_id).get("ExitCode")
    except docker.errors.APIError as exc:
        if "not found" not in _short(exc).lower() and kept_failure(container_id) is None:
            with _engine_errors(f"start the kept container from {spec.image}"):
                raise exc
        code = 127
    if code in (126, 127):
        raise UnsupportedError(
            f"the image {spec.image} cannot keep a container alive: it has no runnable "
            f"`{' '.join(KEEPER_COMMAND)}`; choose an image with sleep"
        )


def kept_failure(container_id: str) -> str | None:
    """Why a kept container does not stay up, when its keeper could not run; else None."""
    try:
        state = client().api.inspect_container(container_id)["State"]
    except Exception:
        return None
    if state.get("Running") or int(state.get("ExitCode") or 0) not in (126, 127):
        return None
    return (
        f"the kept container exits at once: its image has no runnable `{' '.join(KEEPER_COMMAND)}` "
        f"(exit status {state.get('ExitCode')}); choose an image with sleep"
    )


def exec_run(
    container_id: str,
    spec: ContainerSpec,
    args: Args,
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
    environ: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[Any]:
    """Run ``args`` in the kept container ``container_id`` (made from ``spec``).

    Same arguments and result as ``run``; ``cwd`` is a directory inside the
    container (default: the sandbox's working directory). A deadline or the
    CPU limit kills the whole container (the next command restarts it), since
    the engine cannot kill one exec.
    """
    argv = _argv(args)
    streams = _Streams.from_args(
        input=input, stdin=stdin, stdout=stdout, stderr=stderr, capture_output=capture_output,
        text=text, encoding=encoding, errors=errors,
    )  # fmt: skip
    api = client().api
    env = dict(spec.environment)
    if environ is not None:
        env = dict(environ)
    workdir = os.fspath(cwd) if cwd is not None else spec.working_dir
    with _engine_errors("create an exec in the kept container"):
        exec_id = api.exec_create(
            container_id, argv, stdin=streams.open_stdin, stdout=True, stderr=True, tty=False,
            user=spec.user, environment=env, workdir=workdir,
        )["Id"]  # fmt: skip
    if spec.die_with_parent:
        watchdog.arm(container_id, "kill")
    monitor = _Monitor(api, container_id, spec.cpu_seconds, lambda: api.kill(container_id))
    conn: _Conn | None = None
    since = time.time()
    try:
        with _engine_errors("start the exec"):
            conn = _exec_start(api, exec_id)
        started = time.monotonic()
        monitor.start(baseline=True)
        outcome = _drive(
            conn, streams, kill=lambda: api.kill(container_id), timeout=timeout, wall=spec.wall_seconds,
            monitor=monitor, hold=_EXEC_HOLD, started=started,
        )  # fmt: skip
        code = _exec_exit_code(api, exec_id)
    finally:
        monitor.stop()
        if conn is not None:
            conn.close()
        if spec.die_with_parent:
            watchdog.disarm(container_id, "kill")
    if outcome.held_error is not None and code in (126, 127):
        raise _command_error(outcome.held_error, argv, spec.image, code)
    oom_kills = 0
    if code == 128 + signal_mod.SIGKILL and outcome.killed_for is None:
        oom_kills = _oom_events(api, container_id, since)
    returncode, limit = _classify(code, oom=oom_kills > 0, outcome=outcome, spec=spec, monitor=monitor)
    report = _report(returncode, limit, spec=spec, outcome=outcome, monitor=monitor, oom_kills=oom_kills)
    return _finish(args, returncode, streams, report, outcome=outcome, timeout=timeout, check=check)


def _exec_exit_code(api: Any, exec_id: str) -> int:
    deadline = time.monotonic() + 10.0
    delay = 0.001
    while True:
        with _engine_errors("read the exit status of the exec"):
            info = api.exec_inspect(exec_id)
        if not info.get("Running") or time.monotonic() > deadline:
            code = info.get("ExitCode")
            return int(code) if code is not None else 128 + signal_mod.SIGKILL
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def remove_container(id_or_name: str) -> bool:
    """Remove a container (and its anonymous volumes); False when it did not exist."""
    api = client().api
    import docker.errors

    try:
        api.remove_container(id_or_name, force=True, v=True)
    except docker.errors.NotFound:
        return False
    except Exception as exc:
        with _engine_errors(f"remove the container {id_or_name}"):
            raise exc
    return True


def list_containers(kind: str | None = None) -> list[dict[str, Any]]:
    """The engine's containers made by isolate (``kind`` "run" or "kept" to narrow)."""
    labels = [f"{LABEL}=1"] + ([f"{LABEL_KIND}={kind}"] if kind else [])
    with _engine_errors("list the isolate containers"):
        found = client().api.containers(all=True, filters={"label": labels})
    return list(found)


def ended_runs(older_than: float, now: float | None = None) -> list[str]:
    """Ids of one-shot containers that ended more than ``older_than`` seconds ago (leftovers)."""
    now = time.time() if now is None else now
    api = client().api
    found = []
    for container in list_containers("run"):
        if container.get("State") not in ("exited", "dead"):
            continue  # created or running: some process may still be driving it
        try:
            state = api.inspect_container(container["Id"])["State"]
        except Exception:
            continue
        finished = _epoch(str(state.get("FinishedAt") or ""))
        if finished is not None and now - finished >= older_than:
            found.append(str(container["Id"]))
    return found


def _epoch(stamp: str) -> float | None:
    """Seconds since the epoch from the engine's RFC 3339 time (nanoseconds allowed)."""
    import datetime

    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp, re.ASCII)
    if not match or stamp.startswith("0001-"):
        return None
    base = datetime.datetime.fromisoformat(match.group(1) + (match.group(3).replace("Z", "+00:00")))
    return base.timestamp() + float("0." + (match.group(2) or "0"))
