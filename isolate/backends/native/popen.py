"""``isolate.Popen``: subprocess's Popen, in a sandbox of the native backend.

``Popen`` is a ``subprocess.Popen`` whose child is started by the C core
(clone with CLONE_VM, never a fork of the Python parent), so pipes,
``communicate``, timeouts and the context manager behave exactly as in
subprocess. The process it tracks is the sandbox's init; the program's own
status comes from the init's report, so ``returncode`` is the program's.
"""

from __future__ import annotations

import os
import queue
import select
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..._core import ffi, lib
from ...model.errors import UnsupportedError
from ...model.forks import fork_safe, in_child
from ...model.policy import Policy
from ...model.report import Report, status_for
from .. import native
from . import why

if TYPE_CHECKING:
    from .runupper import RunUpper

_STATUS_SIZE = ffi.sizeof("struct iso_status")


class Popen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen`` with ``policy=``: the child runs in a sandbox.

    ``preexec_fn``, ``user``, ``group``, ``extra_groups`` and ``umask`` are
    refused: the policy decides who the program is. ``report`` is filled in
    when the program has ended. ``pid`` is the sandbox's init: signals sent
    to it are forwarded to the program, and SIGKILL ends the whole sandbox.
    """

    #: An executable (O_PATH descriptor) to run instead of looking args[0] up; -1: none.
    _program_fd = -1
    #: Directories (O_PATH descriptors) bound in place of the stand-ins the policy binds (see native.prepare).
    _bind_sources: dict[str, int] | None = None
    #: An overlay workspace (isolate.kernel.overlay.Layers) mounted at its target instead of the tmpfs there.
    _overlay: Any = None
    _image_upper: Any = None
    #: A one-shot image run's upper layer on disk (runupper.py), removed when the run has ended.
    _run_upper: RunUpper | None = None
    _one_shot_upper = True
    #: Egress by name: run the mediator as a process that outlives this one (a named kept sandbox), its
    #: control socket at this path (None: the mediator runs in this process).
    _egress_detached: str | None = None

    def __init__(self, args: Any, *pargs: Any, policy: Policy | None = None, **kwargs: Any) -> None:
        self.policy = policy if policy is not None else Policy()
        if not isinstance(self.policy, Policy):
            raise TypeError("policy must be an isolate.Policy")
        for name in ("preexec_fn", "user", "group", "extra_groups", "umask"):
            if kwargs.get(name) not in (None, -1):
                raise TypeError(f"isolate.Popen does not take {name}=; the policy decides it")
        self.report: Report | None = None
        self._prepared: native.Prepared | None = None
        self._status: bytes = b""
        self._why: bytes = b""
        self._rusage: Any = None
        self._status_rec: Any = None
        self._limit_hit: str | None = None
        self._started = time.monotonic()
        self._ended: float | None = None
        super().__init__(args, *pargs, **kwargs)

    # -- start ---------------------------------------------------------------

    def _execute_child(
        self, args: Any, executable: Any, preexec_fn: Any, close_fds: bool, pass_fds: Sequence[int], cwd: Any,
        env: Mapping[str, str] | None, startupinfo: Any, creationflags: int, shell: bool,
        p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
        restore_signals: bool, gid: Any, gids: Any, uid: Any, umask: int, start_new_session: bool,
        process_group: Any = None,
    ) -> None:
        if isinstance(args, (str, bytes, os.PathLike)):
            args = [args]
        args = [os.fsdecode(a) for a in args]
        if shell:
            args = ["/bin/sh", "-c", *args]
            if executable:
                args[0] = os.fsdecode(executable)
        image_upper = self._image_upper
        if image_upper is None and self.policy.image is not None and self._one_shot_upper:
            from . import runupper

            self._run_upper = runupper.make(self.policy)  # before Linux 6.6: on disk, not a tmpfs
            image_upper = self._run_upper.host if self._run_upper is not None else None
        try:
            prepared = self._prepare(args, executable, cwd, env, (p2cread, c2pwrite, errwrite), pass_fds, shell,
                                     image_upper)
        except BaseException:
            self._remove_run_upper()
            raise
        self._prepared = prepared
        if self._program_fd < 0:
            # The caller's ignored signals stay ignored in the program, as subprocess leaves them (exec keeps
            # SIG_IGN); restore_signals gives SIGPIPE and SIGXFSZ, which Python ignores itself, their default.
            prepared.plan.keep_ignored = lib.ISO_IGNORED_KEPT if restore_signals else (1 << 64) - 1
        cgroup = prepared.cgroup
        try:
            self._started = time.monotonic()
            self.pid = native.spawn(prepared, args)
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            self._remove_run_upper()
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]
            raise
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]
        if cgroup is not None and prepared.limit_cpu_seconds is not None:
            cgroup.start_watchdog(prepared.limit_cpu_seconds, self._on_limit)

    def _prepare(self, args: list[str], executable: Any, cwd: Any, env: Mapping[str, str] | None,
                 stdio: tuple[int, int, int], pass_fds: Sequence[int], shell: bool, image_upper: Any) -> Any:
        return native.prepare(
            self.policy,
            args,
            executable=os.fsdecode(executable) if executable and not shell else None,
            cwd=os.fsdecode(cwd) if cwd is not None else None,
            env=env,
            stdio=stdio,
            pass_fds=pass_fds,
            program_fd=self._program_fd,
            bind_sources=self._bind_sources,
            overlay=self._overlay,
            image_upper=image_upper,
            egress_detached=self._egress_detached,
        )

    def _remove_run_upper(self) -> None:
        if self._run_upper is not None:
            from . import runupper

            runupper.remove(self._run_upper)
            self._run_upper = None

    def _on_limit(self, limit: str) -> None:
        self._limit_hit = limit

    # -- wait ----------------------------------------------------------------

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        # The init reports the program's end (and the tree's usage) through
        # its status pipe once everything is dead, a moment before its own
        # exit has torn the namespaces down: the end is known from the pipe,
        # and the init is reaped in the background.
        prepared = self._prepared
        if prepared is not None and prepared.status_fd >= 0:
            # poll, not select: a caller holding many sandboxes has descriptors past FD_SETSIZE.
            poller = select.poll()
            poller.register(prepared.status_fd, select.POLLIN | select.POLLHUP)
            ready = poller.poll(None if wait_flags == 0 else 0)
            if not ready:
                return 0, 0
            status = self._read_status()
            if status is not None:
                self._status_rec = status
                _reap_later(self.pid)
                return self.pid, int(status.wait_status)
            # No report: the init itself was killed. Reap it here.
        try:
            pid, sts, rusage = os.wait4(self.pid, wait_flags)
        except ChildProcessError:
            pid, sts = self.pid, 0
        else:
            if pid == self.pid:
                self._rusage = rusage
        return pid, sts

    def _internal_poll(self, _deadstate: Any = None, _waitpid: Any = None, _WNOHANG: int = os.WNOHANG,
                       _ECHILD: int = 10) -> int | None:
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
                return None
            try:
                if self.returncode is not None:
                    return self.returncode
                pid, sts = self._try_wait(_WNOHANG)
                if pid == self.pid:
                    self._handle_exitstatus(sts)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _handle_exitstatus(self, sts: int, *args: Any, **kwargs: Any) -> None:
        self._ended = time.monotonic()
        status = self._status_rec if self._status_rec is not None else self._read_status()
        reason = 0
        if status is not None:
            sts = int(status.wait_status)
            reason = int(status.reason)
        super()._handle_exitstatus(sts, *args, **kwargs)  # type: ignore[misc]
        if self._prepared is not None and self._prepared.lease is not None:
            from ...image import leases

            leases.release(self._prepared.lease)  # the sandbox has ended: its layers are free to prune
            self._prepared.lease = None
        self._remove_run_upper()  # the sandbox's mount namespace has ended with it
        if reason == 1:
            self._limit_hit = "timeout"
        self._finish(status)

    def _read_status(self) -> Any:
        prepared = self._prepared
        if prepared is None or prepared.status_fd < 0:
            return None
        data = b""
        # Denial tracing: the init's table follows the status, written at once; read to its end.
        tracing = prepared.plan is not None and prepared.plan.why != ffi.NULL
        size = _STATUS_SIZE + (why.REPORT_SIZE if tracing else 0)
        try:
            os.set_blocking(prepared.status_fd, tracing)
            while len(data) < size:
                chunk = os.read(prepared.status_fd, size - len(data))
                if not chunk:
                    break
                data += chunk
        except BlockingIOError:
            pass
        finally:
            os.close(prepared.status_fd)
            prepared.status_fd = -1
        if len(data) < _STATUS_SIZE:
            return None
        status = ffi.new("struct iso_status *")
        ffi.memmove(status, data, _STATUS_SIZE)
        if status.magic != 0x150A7E01:
            return None
        self._status = data
        self._why = data[_STATUS_SIZE:] if tracing else b""
        return status

    def _finish(self, status: Any) -> None:
        prepared = self._prepared
        if prepared is None:
            return
        if prepared.why_stream is not None:
            prepared.why_stream.close()  # what it holds stays readable by the commands' reports
        report = Report(backend="native", enforced=dict(prepared.enforced), warnings=list(prepared.warnings),
                        denials_observed={k: dict(v) for k, v in prepared.observed.items()})
        report.wall_seconds = round((self._ended or time.monotonic()) - self._started, 6)
        if status is not None:
            report.user_seconds = round(status.user_usec / 1e6, 6)
            report.system_seconds = round(status.system_usec / 1e6, 6)
            report.cpu_seconds = round((status.user_usec + status.system_usec) / 1e6, 6)
            report.max_rss_bytes = int(status.maxrss_kib) * 1024
        elif self._rusage is not None:
            report.user_seconds = round(self._rusage.ru_utime, 6)
            report.system_seconds = round(self._rusage.ru_stime, 6)
            report.cpu_seconds = round(self._rusage.ru_utime + self._rusage.ru_stime, 6)
            report.max_rss_bytes = int(self._rusage.ru_maxrss) * 1024
        cgroup = prepared.cgroup
        limit = self._limit_hit
        if cgroup is not None:
            try:
                cgroup.stop_watchdog()
                if cgroup.limit_hit and limit is None:
                    limit = cgroup.limit_hit
                usage = cgroup.usage()
                if usage.cpu_user_seconds is not None and usage.cpu_system_seconds is not None:
                    report.user_seconds = round(usage.cpu_user_seconds, 6)
                    report.system_seconds = round(usage.cpu_system_seconds, 6)
                    report.cpu_seconds = round(usage.cpu_user_seconds + usage.cpu_system_seconds, 6)
                if usage.peak_memory_bytes is not None:
                    report.max_rss_bytes = int(usage.peak_memory_bytes)
                report.oom_kills = int(usage.oom_kills)
                if usage.pids_max_hit:
                    report.limits_reached.append("pids")
                # The OOM killer may hit any process of the tree; when the run
                # then failed, the memory limit is what ended it.
                if usage.oom_kills and limit is None and self.returncode:
                    limit = "memory"
            finally:
                cgroup.remove()
        if status is not None:
            from ...kernel import seccomp

            for i in range(int(status.n_denied)):
                nr = int(status.denied[i].nr)
                report.denied.append(
                    {"mechanism": "seccomp", "syscall": seccomp.syscall_name(nr), "nr": nr,
                     "count": int(status.denied[i].count)}
                )
            report.denied.extend(net_denials(status, prepared.mediator))
            if self._why:
                for entry in report.denied:  # a refused connect() names a file access too
                    if entry.get("mechanism") == "unix-socket" and entry.get("path"):
                        entry["access"] = "connect"
                report.denied.extend(why.file_denials(self._why))
                seen = why.calls_seen(self._why)
                if seen is not None and "landlock" in report.denials_observed:
                    report.denials_observed["landlock"]["calls_looked_at"] = seen
        if prepared.mediator is not None:
            from . import egress

            egress.finish(prepared.mediator, report)
        rc = self.returncode if self.returncode is not None else 0
        if limit == "cpu" and rc >= 0:
            limit = None
        report.status, report.exit_code, report.signal = status_for(rc, limit)
        self.report = report

    @property
    def warnings(self) -> list[str]:
        """What the policy asked for and best effort could not enforce."""
        return list(self._prepared.warnings) if self._prepared is not None else []

    @property
    def enforced(self) -> dict[str, Any]:
        """Each protection in force, and the mechanism enforcing it."""
        return dict(self._prepared.enforced) if self._prepared is not None else {}

    def pause(self) -> None:
        """Freeze every process of the sandbox (needs a cgroup)."""
        self._require_cgroup("pause").freeze()

    def resume(self) -> None:
        """Thaw a paused sandbox."""
        self._require_cgroup("resume").thaw()

    def _require_cgroup(self, what: str) -> Any:
        prepared = self._prepared
        if prepared is None or prepared.cgroup is None:
            raise UnsupportedError(
                f"{what} needs the sandbox in a cgroup; set a memory, pids or cpus limit (or run where a cgroup is "
                "writable)"
            )
        return prepared.cgroup


_reap_queue: queue.SimpleQueue[int] = queue.SimpleQueue()
_reaper_lock = fork_safe(threading.Lock())
_reaper_started = False


def _no_reaper() -> None:
    """A forked child has no reaper thread, and its parent's queue names the parent's children."""
    global _reap_queue, _reaper_started
    _reap_queue, _reaper_started = queue.SimpleQueue(), False


in_child(_no_reaper)


def _reaper() -> None:
    while True:
        pid = _reap_queue.get()
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _reap_later(pid: int) -> None:
    """Reap an init whose report is already in: its exit is a formality."""
    global _reaper_started
    with _reaper_lock:
        if not _reaper_started:
            threading.Thread(target=_reaper, name="isolate-reaper", daemon=True).start()
            _reaper_started = True
    _reap_queue.put(pid)


def net_denials(status: Any, mediator: Any = None) -> list[dict[str, Any]]:
    """The connect() calls the init's supervisor refused (csrc/supervise.c), as report entries.

    Under egress by name (a ``mediator``), an address of the mediator's is reported as its name.
    """
    import ipaddress
    import socket

    out: list[dict[str, Any]] = []
    for i in range(min(int(status.n_net_denied), len(status.net_denied))):
        entry = status.net_denied[i]
        kind, count = int(entry.kind), int(entry.count)
        if kind == lib.ISO_NET_DENIAL_UNIX:
            path = ffi.string(entry.path, len(entry.path)).decode(errors="replace")
            out.append({"mechanism": "unix-socket", "path": path, "count": count})
        elif kind == lib.ISO_NET_DENIAL_INET:
            raw = bytes(ffi.buffer(entry.address, 16))
            address = ipaddress.ip_address(raw[:4] if int(entry.family) == socket.AF_INET else raw)
            if mediator is None:
                out.append({"mechanism": "network", "address": str(address), "port": int(entry.port),
                            "count": count})
                continue
            from . import egress

            out.append(egress.connect_denial(mediator, address, int(entry.port), count))
        elif kind == lib.ISO_NET_DENIAL_DGRAM:
            out.append({"mechanism": "unix-socket", "syscall": "socket", "type": "datagram",
                        "reason": "AF_UNIX datagram sockets name their peer on each send", "count": count})
    if int(status.net_denied_dropped):
        out.append({"mechanism": "network", "more": int(status.net_denied_dropped)})
    return out
