"""The Go context: each cell a program, built and run by the sandbox's own ``go``.

Go has no interpreter to keep: a cell is a whole ``main`` package (``package
main`` is added when the cell has no package clause), and nothing but the
files it writes outlives it. The cell reaches ``go run`` on its standard input
through a shell inside the sandbox, which writes it to a temporary directory
and removes it afterwards: the host touches no path of the sandbox's. A build
error or a non-zero exit is the cell's error, with the compiler's or the
program's words on stderr. A Go cell is a command, with a command's
guarantees: no driver answers for it, and as a command's, its file and its
output are within reach of the sandbox's other processes (same uid).
"""

from __future__ import annotations

import re
import signal
import threading

from ...backends.native.commands import SandboxProcess
from ...kept.sandbox import Sandbox
from ...kernel.fdwait import ready
from .driver import POLL, Emit, read_pending, read_some, unavailable

# GOCACHE: go refuses to build without a cache; when the sandbox has no home to keep it in, one under /tmp.
LAUNCH = r'''d=$(mktemp -d) || exit 125
trap 'rm -rf "$d"' EXIT
cat > "$d/main.go" || exit 125
if [ -z "${GOCACHE:-}${XDG_CACHE_HOME:-}${HOME:-}" ]; then export GOCACHE=/tmp/.isolate-go-build; fi
command -v go >/dev/null || { echo "isolate: go: not found" >&2; exit 127; }
go run "$d/main.go"
'''
HINT = "it needs the Go toolchain inside the sandbox (Debian: apt-get install golang-go)"
_PACKAGE = re.compile(r"^\s*package\s+\w+", re.M)


class GoContext:
    def __init__(self, box: Sandbox, probe: bool = True) -> None:
        """``probe`` False: the toolchain is not looked for now (a context served again by a restarted server:
        its first cell says so when it is gone)."""
        self.count = 0
        self._box = box
        self._proc: SandboxProcess | None = None
        self._guard = threading.Lock()
        self._closed = False
        if probe and box.exec(["sh", "-c", "command -v go"]).returncode != 0:
            raise unavailable("go", "go: not found", HINT)

    def rebind(self, box: Sandbox) -> None:
        self._box = box

    def run(self, code: str, emit: Emit) -> None:
        self.count += 1
        source = code if _PACKAGE.search(code) else "package main\n" + code
        with self._guard:  # a run that waited for the context's lock does not start a program after close()
            if self._closed:
                raise RuntimeError("the context is closed")
            proc = self._proc = self._box.spawn(["sh", "-c", LAUNCH, "isolate-go"])
        try:
            proc.write(source)
            proc.close_stdin()
            watched = {proc.stdout_fd: "stdout", proc.stderr_fd: "stderr"}
            # The cell ends when its command does, not when its pipes do: what the program leaves in the
            # background (a server it started) keeps them open, and goes on running once the command has
            # exited, out of reach of interrupt() and close(). What it wrote before is in the pipes then.
            while watched and proc.poll() is None:
                for fd in ready(watched, timeout=POLL):
                    chunk = read_some(fd)
                    if chunk is None:
                        del watched[fd]
                    elif chunk:
                        emit(watched[fd], chunk)
            for fd, kind in watched.items():
                if chunk := read_pending(fd):
                    emit(kind, chunk)
            status = proc.wait()
        finally:
            with self._guard:
                self._proc = None
            proc.close()
        error = None if status == 0 else {"ename": "CommandExecError", "evalue": str(status),
                                          "traceback": [f"exit status {status}"]}
        emit("done", {"count": self.count, "result": None, "error": error})

    def interrupt(self) -> None:
        with self._guard:
            proc = self._proc
        if proc is not None:
            proc.signal(signal.SIGINT, descendants=True)

    def close(self) -> None:
        with self._guard:
            self._closed = True
            proc = self._proc
        if proc is not None:
            proc.kill()
