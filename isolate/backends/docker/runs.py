"""Driving one run (streams, deadlines, exit status, report) and one-shot runs in a fresh container."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal as signal_mod
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ...kernel.fdwait import ready
from ...model.errors import CommandNotExecutableError, CommandNotFoundError, IsolationError, SetupError
from ...model.policy import Policy
from ...model.report import Report, status_for
from .engine import _engine_errors, _short, client
from .spec import ContainerSpec, prepare
from .streams import _TINI_HOLD, Args, _argv, _attach, _Conn, _Demux, _feed_stdin, _Holder, _HoldRule, _Streams
from .watch import _Monitor, watchdog

#: Prefix of the container names of one-shot runs (a random suffix follows).
RUN_PREFIX = "isolate-run-"
CompletedProcess = subprocess.CompletedProcess


# --------------------------------------------------------------------------
# Driving one run


@dataclass
class _Outcome:
    killed_for: str | None = None  # "timeout" | "wall" | "cpu"
    wall_seconds: float = 0.0
    held_error: bytes | None = None


def _drive(
    conn: _Conn,
    streams: _Streams,
    *,
    kill: Callable[[], None],
    timeout: float | None,
    wall: float | None,
    monitor: _Monitor,
    hold: _HoldRule | None,
    started: float,
) -> _Outcome:
    """Move stdin in and stdout/stderr out until the stream ends; kill at the deadline."""
    outcome = _Outcome()
    stop = threading.Event()
    feeder: threading.Thread | None = None
    if streams.open_stdin:
        feeder = threading.Thread(
            target=_feed_stdin, args=(conn, streams, stop), name="isolate-docker-stdin", daemon=True
        )
        feeder.start()
    demux = _Demux()
    holders = {
        1: _Holder(hold if hold is not None and hold.stream == 1 else None, streams.out),
        2: _Holder(hold if hold is not None and hold.stream == 2 else None, streams.err),
    }
    deadlines = [(started + t, why) for t, why in ((timeout, "timeout"), (wall, "wall")) if t is not None]
    deadline, deadline_reason = min(deadlines) if deadlines else (None, None)
    killed_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if monitor.hit_cpu_limit and outcome.killed_for is None:
                outcome.killed_for, killed_at = "cpu", now
            if deadline is not None and now >= deadline and outcome.killed_for is None:
                outcome.killed_for, killed_at = deadline_reason, now
                with contextlib.suppress(Exception):
                    kill()
            if killed_at is not None and now - killed_at > 10.0:
                break  # the engine did not end the stream after the kill: give up on the rest
            wait = 0.5 if deadline is None or outcome.killed_for else max(0.0, min(0.5, deadline - now))
            data = conn.recv()
            if data is None:
                ready([conn.sock.fileno()], timeout=wait)
                continue
            if not data:
                break
            for stream, payload in demux.feed(data):
                holder = holders.get(stream)
                if holder is not None:
                    holder.feed(payload)
        for holder in holders.values():
            holder.finish()
            if holder.held is not None:
                outcome.held_error = holder.held
    finally:
        stop.set()
        outcome.wall_seconds = time.monotonic() - started
        if feeder is not None:
            feeder.join(timeout=1.0)
    return outcome


def _command_error(held: bytes, argv: list[str], image: str, code: int) -> IsolationError:
    detail = held.decode(errors="replace").strip()
    if code == 127 or "not found" in detail or "No such file" in detail:
        return CommandNotFoundError(
            f"{argv[0]}: command not found in the container (image {image}): {detail}; "
            "use a path that exists in the image or another image"
        )
    return CommandNotExecutableError(
        f"{argv[0]}: cannot be executed in the container (image {image}): {detail}; check its permissions"
    )


def _oom_events(api: Any, container_id: str, since: float) -> int:
    """How many OOM kills the engine saw in the container since ``since`` (epoch seconds)."""
    try:
        events = api.events(
            since=f"{since - 1:.6f}",
            until=f"{time.time() + 0.5:.6f}",
            filters={"container": container_id, "event": "oom"},
            decode=True,
        )
        return sum(1 for _ in events)
    except Exception:
        return 0


def _classify(
    code: int, *, oom: bool, outcome: _Outcome, spec: ContainerSpec, monitor: _Monitor
) -> tuple[int, str | None]:
    """(subprocess-style returncode, limit that ended the run) from the engine's exit code.

    The engine reports death by signal N as 128+N, indistinguishable from an
    exit with that code; it is read as a signal only when isolate knows why:
    its own kill (deadline, CPU), the OOM killer, or the signal of a limit the
    policy set (SIGXCPU for cpu_seconds, SIGXFSZ for file_size).
    """
    if outcome.killed_for is not None:
        limit = {"timeout": "timeout", "wall": "timeout", "cpu": "cpu"}[outcome.killed_for]
        return -signal_mod.SIGKILL, limit
    if oom and code != 0:
        return (-(code - 128) if code > 128 else code), "memory"
    if code > 128:
        sig = code - 128
        if sig == signal_mod.SIGXCPU and spec.cpu_seconds is not None:
            return -sig, None
        if sig == signal_mod.SIGXFSZ and spec.file_size is not None:
            return -sig, None
        if sig == signal_mod.SIGKILL and spec.cpu_seconds is not None and monitor.cpu_total >= spec.cpu_seconds * 0.9:
            return -sig, "cpu"
    return code, None


def _report(
    returncode: int, limit: str | None, *, spec: ContainerSpec, outcome: _Outcome, monitor: _Monitor, oom_kills: int
) -> Report:
    status, exit_code, sig = status_for(returncode, limit)
    warnings = list(spec.warnings)
    if monitor.samples == 0:
        warnings.append("the run ended before the engine's first stats sample: cpu and memory figures are unknown")
    return Report(
        status=status,
        exit_code=exit_code,
        signal=sig,
        wall_seconds=round(outcome.wall_seconds, 6),
        cpu_seconds=round(monitor.cpu_total, 6),
        user_seconds=round(monitor.cpu_user, 6),
        system_seconds=round(monitor.cpu_system, 6),
        max_rss_bytes=monitor.max_memory,
        oom_kills=oom_kills,
        backend="docker",
        enforced=dict(spec.enforced),
        warnings=warnings,
        denials_observed={"seccomp": {"observed": False, "detail": "the engine does not report seccomp denials"}},
    )


def _finish(
    args: Any,
    returncode: int,
    streams: _Streams,
    report: Report,
    *,
    outcome: _Outcome,
    timeout: float | None,
    check: bool,
) -> subprocess.CompletedProcess[Any]:
    out = streams.decode(streams.out.value())
    err = streams.decode(streams.err.value()) if streams.err is not streams.out else None
    if outcome.killed_for == "timeout":
        assert timeout is not None
        raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
    result: subprocess.CompletedProcess[Any] = subprocess.CompletedProcess(args, returncode, out, err)
    result.report = report  # type: ignore[attr-defined]
    if check and returncode != 0:
        raise subprocess.CalledProcessError(returncode, args, out, err)
    return result


# --------------------------------------------------------------------------
# One-shot runs


def run(
    args: Args,
    *,
    policy: Policy,
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
    spec: ContainerSpec | None = None,
) -> subprocess.CompletedProcess[Any]:
    """Run ``args`` in a fresh container under ``policy``, like ``subprocess.run``.

    stdout/stderr ``None`` pass through to this process's fds 1 and 2, PIPE
    captures; stdin ``None`` feeds this process's fd 0 to the program. The
    result carries ``.report`` (``isolate.model.report.Report``, backend "docker").
    ``timeout`` kills the container and raises ``subprocess.TimeoutExpired``;
    ``policy.limits.wall_seconds`` kills it with report status "timeout".
    ``spec`` (from ``prepare``) skips the mapping, for callers that run one
    policy many times.
    """
    argv = _argv(args)
    streams = _Streams.from_args(
        input=input, stdin=stdin, stdout=stdout, stderr=stderr, capture_output=capture_output,
        text=text, encoding=encoding, errors=errors,
    )  # fmt: skip
    if spec is None:
        spec = prepare(policy, cwd=cwd)
    api = client().api
    # A fresh name, armed before the container exists: a death at any point leaves nothing behind.
    name = f"{RUN_PREFIX}{secrets.token_hex(8)}"
    if spec.die_with_parent:
        watchdog.arm(name, "rm")
    monitor: _Monitor | None = None
    conn: _Conn | None = None
    try:
        with _engine_errors(f"create a container from {spec.image}"):
            created = api.create_container(
                image=spec.image,
                command=argv,
                name=name,
                user=spec.user,
                environment=dict(spec.environment),
                working_dir=spec.working_dir,
                labels=spec.labels("run"),
                stdin_open=streams.open_stdin,
                host_config=api.create_host_config(**spec.host_config()),
            )
        container_id: str = created["Id"]
        engine_warnings = [str(w) for w in created.get("Warnings") or []]
        with _engine_errors("attach to the container"):
            conn = _attach(api, container_id, streams.open_stdin)
        spec.verify_binds()  # the engine binds the paths at start: the last moment to look
        since = time.time()
        try:
            api.start(container_id)
        except Exception as exc:
            _raise_start_error(exc, argv, spec.image)
        started = time.monotonic()
        monitor = _Monitor(api, container_id, spec.cpu_seconds, lambda: api.kill(container_id))
        monitor.start()
        outcome = _drive(
            conn, streams, kill=lambda: api.kill(container_id), timeout=timeout, wall=spec.wall_seconds,
            monitor=monitor, hold=_TINI_HOLD if spec.init else None, started=started,
        )  # fmt: skip
        with _engine_errors("wait for the container"):
            api.wait(container_id)
            state = api.inspect_container(container_id)["State"]
    finally:
        if monitor is not None:
            monitor.stop()
        if conn is not None:
            conn.close()
        with contextlib.suppress(Exception):
            api.remove_container(name, force=True, v=True)
        if spec.die_with_parent:
            watchdog.disarm(name, "rm")
    code = int(state.get("ExitCode") or 0)
    if outcome.held_error is not None and code in (126, 127):
        raise _command_error(outcome.held_error, argv, spec.image, code)
    oom = bool(state.get("OOMKilled"))
    if not oom and code == 128 + signal_mod.SIGKILL and spec.memory is not None:
        # The engine sets OOMKilled from the cgroup's event as the container ends: on a busy host the exit came
        # first (a shell whose child the OOM killer took exits 137 on its own). The event itself is kept.
        oom = _oom_events(api, container_id, since) > 0
    returncode, limit = _classify(code, oom=oom, outcome=outcome, spec=spec, monitor=monitor)
    report = _report(returncode, limit, spec=spec, outcome=outcome, monitor=monitor, oom_kills=int(oom))
    report.warnings.extend(engine_warnings)
    return _finish(args, returncode, streams, report, outcome=outcome, timeout=timeout, check=check)


_START_EXEC_FAILURE = re.compile(
    r'exec: "?(.*?)"?: (executable file not found|no such file or directory|permission denied)'
)


def _raise_start_error(exc: Exception, argv: list[str], image: str) -> NoReturn:
    """Map an engine error from starting a container: the runtime's exec failure, or a setup error."""
    if isinstance(exc, IsolationError):
        raise exc
    message = _short(exc)
    failure = _START_EXEC_FAILURE.search(message)
    if failure and failure.group(2) == "permission denied":
        raise CommandNotExecutableError(
            f"{argv[0]}: cannot be executed in the container (image {image}); check its permissions"
        ) from None
    if failure:
        raise CommandNotFoundError(
            f"{argv[0]}: command not found in the container (image {image}); "
            "use a path that exists in the image or another image"
        ) from None
    raise SetupError(f"docker: the engine could not start the container: {message}", step="docker-start") from None

