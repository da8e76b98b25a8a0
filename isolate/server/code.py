"""Code-interpreter contexts (``/code``): a persistent Python (or bash) process per context, inside the sandbox.

A Python context is the sandbox's own ``python3`` running a small driver
that reads length-prefixed cells on stdin, executes each in one namespace
(the value of a last bare expression is the cell's result, as in a
notebook) and ends each with a marker line carrying a random token, the
execution count, the result and any error. No Jupyter: what the image would
have provided is the sandbox's python3 and what its policy lets it import.
A bash context is a bash session (``Sandbox.shell``).
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

from ..sandbox import Sandbox

DRIVER = r'''
import ast, json, signal, sys, traceback
token = sys.argv[1]
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
    sys.stdout.write("\n" + token + json.dumps({"count": count, "result": result, "error": error}) + "\n")
    sys.stdout.flush()
'''

LANGUAGES = ("python", "bash")
Emit = Callable[[str, Any], None]


class CodeContext:
    """One context: its process, run one cell at a time."""

    def __init__(self, box: Sandbox, language: str, context_id: str | None = None) -> None:
        self.id = context_id or f"ctx-{secrets.token_hex(8)}"
        self.language = language
        self.lock = threading.Lock()
        self.count = 0
        self._token = f"__isolate_cell_{secrets.token_hex(12)}__"
        self._shell: Any = None
        self._proc: Any = None
        if language == "bash":
            self._shell = box.shell(self.id, pty=False)
        else:
            self._proc = box.spawn(["python3", "-u", "-c", DRIVER, self._token], env={"PYTHONUNBUFFERED": "1"})
            for fd in (self._proc.stdout_fd, self._proc.stderr_fd):
                os.set_blocking(fd, False)

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
        token = self._token.encode()
        pending = b""
        marker: bytes | None = None
        while True:
            ready, _, _ = select.select([out, err], [], [], 1.0)
            if err in ready:
                chunk = _read(err)
                if chunk:
                    emit("stderr", chunk)
            if out in ready:
                chunk = _read(out)
                if chunk is None:
                    emit("done", {"count": self.count, "result": None,
                                  "error": {"ename": "ContextDied", "evalue": "the interpreter ended",
                                            "traceback": []}})
                    return
                if marker is not None:
                    marker += chunk
                else:
                    pending += chunk
                    at = pending.find(token)
                    if at >= 0:
                        emit("stdout", pending[:at])
                        marker, pending = pending[at + len(token):], b""
                    elif len(pending) > len(token):
                        emit("stdout", pending[:-len(token)])  # what cannot be the start of the marker
                        pending = pending[-len(token):]
            if marker is not None and b"\n" in marker:
                marker = marker.split(b"\n", 1)[0]
                break
        while (chunk := _read(err)):  # what the cell wrote to stderr before its marker
            emit("stderr", chunk)
        # The marker comes from inside (a cell can read the token and print its own): take only well-formed parts.
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


def _read(fd: int) -> bytes | None:
    """What is there to read: b"" when nothing now, None at the end."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return b""
    except OSError:
        return None
    return chunk or None
