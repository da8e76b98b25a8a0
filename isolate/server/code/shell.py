"""The bash context: a bash session of the sandbox's (``Sandbox.shell``), its status framed out of band."""

from __future__ import annotations

from ...kept.sandbox import Sandbox
from .driver import Emit


class BashContext:
    def __init__(self, box: Sandbox, name: str) -> None:
        self.count = 0
        self._shell = box.shell(name, pty=False)

    def run(self, code: str, emit: Emit) -> None:
        self.count += 1
        try:
            output, status = self._shell.run(code, None)
        except TimeoutError as exc:
            output, status = str(exc), 124
        emit("stdout", output.encode())
        error = None if status == 0 else {"ename": "CommandExecError", "evalue": str(status),
                                          "traceback": [f"exit status {status}"]}
        emit("done", {"count": self.count, "result": None, "error": error})

    def interrupt(self) -> None:
        self._shell.interrupt()

    def close(self) -> None:
        self._shell.close()
