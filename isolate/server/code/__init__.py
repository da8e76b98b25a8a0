"""Code-interpreter contexts (``/code``): a persistent interpreter per context, inside the sandbox.

No Jupyter: what an OpenSandbox image's kernels would have provided, each
context takes from the sandbox's own toolchains, and a context whose
toolchain the sandbox lacks is refused with the package that brings it.

==========  ================================================  =========================
language    what runs inside the sandbox                      state between cells
==========  ================================================  =========================
python      ``python3`` with a driver (``python.py``)         one namespace
java        JShell in ``java`` (``java.py``)                   snippets and imports
typescript  a Node.js realm, ``typescript`` transpiles         top-level declarations
javascript  a Node.js realm (``node.py``)                      top-level declarations
go          ``go run``, a program per cell (``go.py``)         none (files only)
bash        a bash session (``shell.py``)                      variables, cwd, functions
==========  ================================================  =========================

Python, Java and Node.js share one driver protocol (``driver.py``): cells and
answers go on a socket only the driver holds, and only the driver's answers
count.
"""

from __future__ import annotations

import secrets
import threading
from typing import Protocol

from ...kept.sandbox import Sandbox
from . import go, java, node, python, shell
from .driver import Emit

LANGUAGES = ("python", "java", "typescript", "javascript", "go", "bash")


class _Engine(Protocol):
    count: int

    def run(self, code: str, emit: Emit) -> None: ...

    def interrupt(self) -> None: ...

    def close(self) -> None: ...


class CodeContext:
    """One context: its interpreter, run one cell at a time."""

    def __init__(self, box: Sandbox, language: str, context_id: str | None = None) -> None:
        if language not in LANGUAGES:
            raise ValueError(f"language: {language!r} is not one of {', '.join(LANGUAGES)}")
        self.id = context_id or f"ctx-{secrets.token_hex(8)}"
        self.language = language
        self.lock = threading.Lock()
        engine: _Engine
        remote = getattr(box, "remote_code", None)
        if remote is not None:  # a sandbox on a Ray node (serve --ray): its node drives the interpreter
            engine = remote(language, self.id)
        elif language == "python":
            engine = python.start(box)
        elif language == "java":
            engine = java.start(box)
        elif language in ("typescript", "javascript"):
            engine = node.start(box, language)
        elif language == "go":
            engine = go.GoContext(box)
        else:
            engine = shell.BashContext(box, self.id)
        self._engine = engine

    def run(self, code: str, emit: Emit) -> None:
        """Run one cell; emit ("stdout"|"stderr", bytes), then ("done", {count, result, error})."""
        with self.lock:
            try:
                self._engine.run(code, emit)
            except Exception as exc:  # the stream always ends, whatever the context did
                emit("done", {"count": self._engine.count, "result": None,
                              "error": {"ename": "ContextError", "evalue": str(exc)[:500], "traceback": []}})

    def interrupt(self) -> None:
        self._engine.interrupt()

    def close(self) -> None:
        self._engine.close()
