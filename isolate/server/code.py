"""Code-interpreter contexts (``/code``): a persistent Python (or bash) process per context, inside the sandbox.

A Python context is the sandbox's own ``python3`` running a small driver
that reads length-prefixed cells on stdin, executes each in one namespace
(the value of a last bare expression is the cell's result, as in a
notebook) and ends each with a line of JSON (execution count, result,
error) on a channel of its own: a socket pair whose far end the driver gets
as its descriptor 3 and keeps private. No other process of the sandbox
holds it and a socket cannot be reopened through /proc, so no output can end
or fake a cell (before, the end was a marker on stdout whose token was on
the driver's command line, readable by any process of the sandbox). The
driver flushes the cell's output first: the host has it all with the
answer. No Jupyter: what the image would have provided is the sandbox's
python3 and what its policy lets it import. A bash context is a bash
session (``Sandbox.shell``, framed out of band as well).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..kept.sandbox import Sandbox
from ..kernel.peerchannel import PeerChannel

DRIVER = r'''
import sys
if sys.path and sys.path[0] == "":  # started with -I; a file of the workspace never replaces a module of ours
    del sys.path[0]
import ast, ctypes, fcntl, json, os, signal, traceback
# Non-dumpable: another process of this uid cannot reopen the cells' pipe through /proc/PID/fd.
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    sys.exit("isolate: the code context's driver cannot make itself non-dumpable; it does not start")
channel = fcntl.fcntl(3, fcntl.F_DUPFD_CLOEXEC, 512)  # private: no cell or child of one gets it as 3
os.close(3)
def forget():  # a child a cell forks (without exec) keeps neither the channel nor the cells' input
    os.close(channel)
    os.close(0)
os.register_at_fork(after_in_child=forget)
os.write(channel, b"hello\n")  # before any cell: the host takes answers from this process only
sys.path[0:0] = ["", *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]  # as python3 -c has
try:
    import site
    if os.path.isdir(site.getusersitepackages()):
        site.addsitedir(site.getusersitepackages())
except Exception:
    pass
namespace = {"__name__": "__main__"}
count = 0
source = sys.stdin.buffer
while True:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    header = source.readline()
    if not header:
        break
    code = source.read(int(header)).decode("utf-8", "replace")
    count += 1
    result = error = None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), namespace)
            if value is not None:
                result = repr(value)
    except BaseException as exc:
        error = {"ename": type(exc).__name__, "evalue": str(exc),
                 "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    answer = (json.dumps({"count": count, "result": result, "error": error}) + "\n").encode()
    while answer:
        answer = answer[os.write(channel, answer):]
'''

LANGUAGES = ("python", "bash")
#: How long a Python context's driver has to start.
HELLO_TIMEOUT = 30.0
#: The largest answer (count, result, error) a cell may give.
MAX_ANSWER = 16 << 20
Emit = Callable[[str, Any], None]


class CodeContext:
    """One context: its process, run one cell at a time."""

    def __init__(self, box: Sandbox, language: str, context_id: str | None = None) -> None:
        self.id = context_id or f"ctx-{secrets.token_hex(8)}"
        self.language = language
        self.lock = threading.Lock()
        self.count = 0
        self._shell: Any = None
        self._proc: Any = None
        self._channel: PeerChannel | None = None
        if language == "bash":
            self._shell = box.shell(self.id, pty=False)
        else:
            ours, theirs = PeerChannel.pair()
            try:
                self._proc = box.spawn(["python3", "-I", "-u", "-c", DRIVER], env={"PYTHONUNBUFFERED": "1"},
                                       fd3=theirs.fileno())
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()  # the driver holds its own copy now
            self._channel = PeerChannel(ours)
            for fd in (self._proc.stdout_fd, self._proc.stderr_fd, ours.fileno()):
                os.set_blocking(fd, False)
            # The driver's hello, before any cell: its writer is the only one whose answers count.
            ready, _, _ = select.select([ours], [], [], HELLO_TIMEOUT)
            if not ready or self._channel.read(16) != b"hello\n":
                self.close()
                raise RuntimeError("the code context's python3 did not start (it needs Python 3.7 or later)")

    def run(self, code: str, timeout: float | None, emit: Emit) -> None:
        """Run one cell; emit ("stdout"|"stderr", bytes), then ("done", {count, result, error})."""
        with self.lock:
            if self._shell is not None:
                self.count += 1
                try:
                    output, status = self._shell.run(code, timeout)
                except TimeoutError as exc:
                    output, status = str(exc), 124
                emit("stdout", output.encode())
                error = None if status == 0 else {"ename": "CommandExecError", "evalue": str(status),
                                                   "traceback": [f"exit status {status}"]}
                emit("done", {"count": self.count, "result": None, "error": error})
                return
            try:
                self._run_python(code, emit)
            except Exception as exc:  # the stream always ends, whatever the context did
                emit("done", {"count": self.count, "result": None,
                              "error": {"ename": "ContextError", "evalue": str(exc)[:500], "traceback": []}})

    def _run_python(self, code: str, emit: Emit) -> None:
        data = code.encode()
        self._proc.write(f"{len(data)}\n".encode() + data)
        out, err = self._proc.stdout_fd, self._proc.stderr_fd
        assert self._channel is not None
        channel = self._channel.fileno()
        answer = b""
        watched = [out, err, channel]
        while b"\n" not in answer:
            ready, _, _ = select.select(watched, [], [], 1.0)
            for fd, kind in ((out, "stdout"), (err, "stderr")):
                if fd in ready:
                    chunk = _read(fd)
                    if chunk is None:
                        watched.remove(fd)
                    elif chunk:
                        emit(kind, chunk)
            if channel in ready:
                chunk = self._channel.read()  # only the driver's: what a process it forked writes is dropped
                if chunk is None:
                    continue
                if not chunk:
                    emit("done", {"count": self.count, "result": None,
                                  "error": {"ename": "ContextDied", "evalue": "the interpreter ended",
                                            "traceback": []}})
                    return
                answer += chunk
                if len(answer) > MAX_ANSWER:
                    raise ValueError(f"the interpreter's answer passed {MAX_ANSWER} bytes")
        marker = answer.split(b"\n", 1)[0]
        for fd, kind in ((out, "stdout"), (err, "stderr")):  # what the cell wrote before its answer
            while fd in watched and (chunk := _read(fd)):
                emit(kind, chunk)
        # The answer comes from inside (the cell's own process can write there): take only well-formed parts.
        try:
            info = json.loads(marker)
        except ValueError:
            info = None
        info = info if isinstance(info, dict) else {}
        count = info.get("count")
        self.count = count if isinstance(count, int) and not isinstance(count, bool) else self.count + 1
        result = info.get("result")
        error = info.get("error")
        if not (isinstance(error, dict) and all(isinstance(error.get(k), str) for k in ("ename", "evalue"))):
            error = None
        else:
            trace = error.get("traceback")
            error = {"ename": error["ename"], "evalue": error["evalue"],
                     "traceback": [str(t) for t in trace] if isinstance(trace, list) else []}
        emit("done", {"count": self.count, "result": result if isinstance(result, str) else None, "error": error})

    def interrupt(self) -> None:
        if self._shell is not None:
            self._shell.interrupt()
        else:
            self._proc.signal(signal.SIGINT)

    def close(self) -> None:
        if self._shell is not None:
            self._shell.close()
        else:
            self._proc.kill()
            self._proc.close()
            if self._channel is not None:
                self._channel.close()


def _read(fd: int) -> bytes | None:
    """What is there to read: b"" when nothing now, None at the end."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return b""
    except OSError:
        return None
    return chunk or None
