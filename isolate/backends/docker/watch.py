"""The resource monitor (engine stats) and the watchdog that outlives the caller (die_with_parent)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from ...model.errors import IsolationError, UnsupportedError
from .streams import _write_all

# --------------------------------------------------------------------------
# Resource monitor and watchdog


class _Monitor:
    """Follows the container's engine stats: peak memory, CPU time, the tree-wide CPU limit."""

    def __init__(self, api: Any, container_id: str, cpu_limit: float | None, on_cpu_limit: Callable[[], None]) -> None:
        self.api = api
        self.container_id = container_id
        self.cpu_limit = cpu_limit
        self.on_cpu_limit = on_cpu_limit
        self.max_memory = 0
        self.cpu_total = 0.0
        self.cpu_user = 0.0
        self.cpu_system = 0.0
        self.samples = 0
        self.hit_cpu_limit = False
        self._base: tuple[float, float, float] | None = None
        self._baseline = False
        self._response: Any = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="isolate-docker-stats", daemon=True)

    def start(self, baseline: bool = False) -> None:
        self._baseline = baseline
        self._thread.start()

    def _follow(self) -> None:
        response: Any = None
        try:
            response = self.api._get(
                self.api._url("/containers/{0}/stats", self.container_id), params={"stream": True}, stream=True
            )
            self._response = response
            if self._stopped.is_set():
                return
            for line in response.iter_lines():
                if self._stopped.is_set():
                    break
                if line:
                    self._sample(json.loads(line))
        except Exception:  # the stream ends when the run ends; a lost sample only loses numbers
            return
        finally:
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()

    def _sample(self, stats: dict[str, Any]) -> None:
        usage = (stats.get("cpu_stats") or {}).get("cpu_usage") or {}
        total = float(usage.get("total_usage") or 0) / 1e9
        user = float(usage.get("usage_in_usermode") or 0) / 1e9
        system = float(usage.get("usage_in_kernelmode") or 0) / 1e9
        if not total and not (stats.get("memory_stats") or {}):
            return  # the container is gone: an empty sample
        if self._base is None:
            self._base = (total, user, system) if self._baseline else (0.0, 0.0, 0.0)
        self.samples += 1
        memory = stats.get("memory_stats") or {}
        self.max_memory = max(self.max_memory, int(memory.get("max_usage") or memory.get("usage") or 0))
        self.cpu_total = max(self.cpu_total, total - self._base[0])
        self.cpu_user = max(self.cpu_user, user - self._base[1])
        self.cpu_system = max(self.cpu_system, system - self._base[2])
        if self.cpu_limit is not None and self.cpu_total >= self.cpu_limit and not self.hit_cpu_limit:
            self.hit_cpu_limit = True
            with contextlib.suppress(Exception):
                self.on_cpu_limit()

    def stop(self) -> None:
        """End the stats stream without waiting for its next sample (the reader holds its lock)."""
        self._stopped.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.raw._fp.fp.raw._sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG_CODE = r"""
import json, sys, time
sys.path[:0] = json.loads(sys.argv[1])
armed = {}
for line in sys.stdin:
    parts = line.split()
    if len(parts) == 3 and parts[0] == "arm":
        armed[parts[1]] = parts[2]
    elif len(parts) == 2 and parts[0] == "disarm":
        armed.pop(parts[1], None)
if armed:
    import docker
    import docker.errors
    api = docker.from_env(timeout=60).api
    for attempt in (1, 2):
        missing = {}
        for cid, action in armed.items():
            try:
                if action == "rm":
                    api.remove_container(cid, force=True, v=True)
                else:
                    api.kill(cid)
            except docker.errors.NotFound:
                missing[cid] = action  # a create still on its way to the engine: look once more
            except Exception:
                pass
        armed = missing
        if armed and attempt == 1:
            time.sleep(2)
"""


class _Watchdog:
    """A small process that kills or removes armed containers when this process dies.

    It reads ``arm ID ACTION`` / ``disarm ID`` lines from a pipe; when the pipe
    closes (this process exited or was killed) it acts on what is still armed:
    "rm" removes the container, "kill" kills it. One per process, spawned on
    first use; it lives in its own session, so a Ctrl-C on the terminal reaches
    the caller, not the watchdog. A container may be armed several times (an
    unnamed kept sandbox for its life, each of its commands for theirs): "rm"
    wins over "kill", and it stays armed until every arming is undone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._fd = -1
        self._armed: dict[str, list[str]] = {}

    def _spawn(self) -> None:
        if not sys.executable:
            raise UnsupportedError("die_with_parent: no Python executable to run the docker watchdog with")
        read_end, write_end = os.pipe()
        try:
            os.posix_spawn(
                sys.executable,
                [sys.executable, "-c", _WATCHDOG_CODE, json.dumps([p for p in sys.path if p])],
                dict(os.environ),
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, read_end, 0),
                    (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                ],
                setsid=True,
            )
        except OSError as exc:
            os.close(write_end)
            raise UnsupportedError(f"die_with_parent: cannot start the docker watchdog ({exc.strerror})") from None
        finally:
            os.close(read_end)
        if self._fd >= 0 and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = write_end
        self._pid = os.getpid()
        for cid in self._armed:
            self._send(self._line(cid))

    def _line(self, container_id: str) -> str:
        actions = self._armed.get(container_id)
        if not actions:
            return f"disarm {container_id}\n"
        return f"arm {container_id} {'rm' if 'rm' in actions else 'kill'}\n"

    def _send(self, line: str) -> None:
        _write_all(self._fd, line.encode())

    def _update(self, container_id: str) -> None:
        if self._pid != os.getpid():
            if self._pid != -1:  # a forked child: the parent's containers are the parent's business
                self._armed = {cid: actions for cid, actions in self._armed.items() if cid == container_id}
            self._spawn()
            return
        try:
            self._send(self._line(container_id))
        except OSError:
            self._spawn()

    def arm(self, container_id: str, action: str) -> None:
        """On this process's death: ``action`` "rm" removes the container, "kill" kills it."""
        with self._lock:
            self._armed.setdefault(container_id, []).append(action)
            self._update(container_id)

    def disarm(self, container_id: str, action: str) -> None:
        """Undo one ``arm(container_id, action)``."""
        with self._lock:
            actions = self._armed.get(container_id)
            if not actions or action not in actions:
                return
            actions.remove(action)
            if not actions:
                del self._armed[container_id]
            with contextlib.suppress(OSError, IsolationError):
                self._update(container_id)


watchdog = _Watchdog()

