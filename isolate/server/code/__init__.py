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

In a kept sandbox (``isolate-run serve --state-dir``) the contexts in
``KEPT`` outlive the server: a Python, Node.js or Java (JDK 16 or later)
driver is a process of the sandbox, connected to again by the next server
(``KeptInterpreter``); a bash context's shell runs on, its ends held by the
sandbox's exec server meanwhile, and is adopted by the next server
(``shell.py``); a Go context, which holds nothing but its id, is made again.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import threading
from typing import Protocol

import psutil

from ...kept.sandbox import Sandbox
from ..background import host_process, of_sandbox
from ..keep import KEPT_LANGUAGES
from . import go, java, node, python, shell
from .driver import Driver, Emit
from .proctree import alive, end_with_descendants

LANGUAGES = ("python", "java", "typescript", "javascript", "go", "bash")
#: The languages whose contexts a kept sandbox keeps past its server (its record names them).
KEPT = KEPT_LANGUAGES


class _Engine(Protocol):
    @property
    def count(self) -> int: ...

    def run(self, code: str, emit: Emit) -> None: ...

    def interrupt(self) -> None: ...

    def close(self) -> None: ...


class CodeContext:
    """One context: its interpreter, run one cell at a time."""

    def __init__(self, box: Sandbox, language: str, context_id: str | None = None, kept: bool = False,
                 fresh: bool = True) -> None:
        """``kept``: its interpreter outlives the server (a context of a kept sandbox, in a language of ``KEPT``);
        ``fresh`` False: the context of an earlier server of the sandbox, connected to at its first use."""
        if language not in LANGUAGES:
            raise ValueError(f"language: {language!r} is not one of {', '.join(LANGUAGES)}")
        self.id = context_id or f"ctx-{secrets.token_hex(8)}"
        self.language = language
        self.lock = threading.Lock()
        #: Its interpreter outlives the server: the sandbox's record names it.
        self.kept = kept and language in KEPT
        if not fresh:
            if not self.kept:
                raise ValueError(f"{language} contexts end with their server")
            # A Go context holds no state: a new one, its toolchain looked for at its first cell.
            self._engine: _Engine = go.GoContext(box, probe=False) if language == "go" else \
                shell.BashContext(box, self.id, kept=True, fresh=False) if language == "bash" else \
                KeptInterpreter(box, language, self.id, fresh=False)
            return
        engine: _Engine
        remote = getattr(box, "remote_code", None)
        if remote is not None:  # a sandbox on a Ray node (serve --ray): its node drives the interpreter
            engine = remote(language, self.id)
            self.kept = False  # the node's host actor holds it: it ends with the server
        elif self.kept and language not in ("go", "bash"):
            try:
                engine = KeptInterpreter(box, language, self.id, fresh=True)
            except java.NotKeepable:  # a JDK before 16: a context that ends with its server
                engine = java.start(box)
                self.kept = False
        elif language == "python":
            engine = python.start(box)
        elif language == "java":
            engine = java.start(box)
        elif language in ("typescript", "javascript"):
            engine = node.start(box, language)
        elif language == "go":
            engine = go.GoContext(box)
        else:
            engine = shell.BashContext(box, self.id, kept=self.kept)
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

    def rebind(self, box: Sandbox) -> None:
        """Use ``box`` from now on: the same sandbox's new handle (a restored one is attached again at its resume,
        and one paused when the last server ended was not attached before)."""
        if isinstance(self._engine, (KeptInterpreter, shell.BashContext, go.GoContext)):
            self._engine.rebind(box)

    @property
    def ends_in_sandbox(self) -> bool:
        """Whether ending it needs the sandbox running: a kept bash context's shell is known by what the sandbox's
        exec server holds (its ends, its pid), which a paused sandbox's frozen server cannot hand back or drop."""
        return self.kept and self.language == "bash"

    def close(self) -> None:
        self._engine.close()

    def detach(self) -> None:
        """Let go of the context without ending a kept interpreter (the next server connects to it)."""
        if isinstance(self._engine, KeptInterpreter) or (self.kept and isinstance(self._engine, shell.BashContext)):
            self._engine.detach()
        else:
            self._engine.close()


class KeptInterpreter:
    """A Python, Node.js or Java context whose driver is a process of the sandbox, not of the command that started
    it: the server's end (a killed server's included) ends only the relay that connects this server's channel
    and pipes to the driver (``python.RELAY`` hands them over; the Node.js and Java relays, ``node.RELAY`` and
    ``IsolateDriver.java --relay``, carry the protocol through); the next server starts another relay and the
    namespace carries on. A cell that was running when its server ended is interrupted (a Python or Node.js
    driver sees its host's connection end; the Node.js and Java relays send SIGINT first)."""

    def __init__(self, box: Sandbox, language: str, context_id: str, fresh: bool) -> None:
        self._box, self._id, self._language = box, context_id, language
        self._driver: Driver | None = None
        self._pidfd = -1
        self._peer = 0
        self._count = 0
        if fresh:
            if language == "python":
                python.start_kept(box, context_id)
            elif language == "java":
                java.start_kept(box, context_id)
            else:
                node.start_kept(box, language, context_id)
            try:
                self._connect(fresh=True)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.close()
                raise

    @property
    def count(self) -> int:
        return self._driver.count if self._driver is not None else self._count

    def rebind(self, box: Sandbox) -> None:
        self._box = box  # the driver it holds is a process of the sandbox, whatever the handle

    def _connect(self, fresh: bool = False) -> Driver:
        """The driver's channel (``fresh``: the context's first, with no cell of an earlier server to stop)."""
        if self._driver is None:
            try:
                if self._language == "python":
                    driver = python.connect(self._box, self._id)
                elif self._language == "java":
                    driver = java.connect(self._box, self._id, fresh)
                else:
                    driver = node.connect(self._box, self._language, self._id, fresh)
            except Exception as exc:
                raise RuntimeError(f"the context's interpreter did not survive its last server ({exc})") from None
            self._pidfd, self._peer = self._hold_driver(driver)
            driver.count = self._count
            self._driver = driver
        return self._driver

    def _hold_driver(self, driver: Driver) -> tuple[int, int]:
        """A pidfd of the driver and its pid here; (-1, 0) when it is not found. A Python driver's pid is its hello's
        writer's (the kernel's word); a Node.js or Java driver's relay writes its hello, which names the driver by
        its pid in the sandbox, found here among the sandbox's own processes (a name forged from inside names at
        worst another process of the sandbox). Either number is given again once its process ends (the hello's
        writer may end at once): the pidfd is opened first, then its process is checked to be the one found (its
        start time) and the sandbox's, so that the delete that signals it signals no process of the host."""
        listed: psutil.Process | None = None
        if self._language == "python":
            pid = driver.peer or 0
        else:
            listed = host_process(self._box, driver.said_pid) if driver.said_pid else None
            pid = listed.pid if listed is not None else 0
        if pid <= 0:
            return -1, 0
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return -1, 0
        try:
            held = (listed is None or listed.is_running()) and of_sandbox(self._box, pid) and alive(fd)
        except psutil.Error:
            held = False
        if not held:
            os.close(fd)
            return -1, 0
        return fd, pid

    def run(self, code: str, emit: Emit) -> None:
        self._connect().run(code, emit)

    def interrupt(self) -> None:
        if self._driver is not None:
            self._driver.interrupt()

    def detach(self) -> None:
        driver, self._driver = self._driver, None
        if driver is not None:
            self._count = driver.count
            driver.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def close(self) -> None:
        """Ended with its driver (a context of an earlier server is connected to first, to learn which)."""
        if self._driver is None:
            with contextlib.suppress(Exception):
                self._connect()
        pidfd, pid = self._pidfd, (self._peer if self._driver is not None else 0)
        try:
            if pidfd >= 0:
                end_with_descendants(pidfd, pid)
            end_unreached(self._box, self._id)
        finally:
            self.detach()


def end_unreached(box: Sandbox, context_id: str) -> int:
    """End every process of the sandbox started as the kept driver of the context, or as its launcher, reached
    through its socket or not; the number ended. A driver is reached through its socket in the sandbox's /tmp,
    which any process of the sandbox may remove (a ``rm -rf /tmp/*``) or replace: a delete, or the restore of a
    context its last server was starting or ending, then reached nothing and named the context no longer, and the
    driver ran on, named by nothing, for good. (A server killed inside ``start_kept`` leaves no driver that does
    not listen yet: the sandbox's exec server ends a command's whole tree, a driver in a session of its own
    included, when its server goes.) They are found by their arguments (``--kept`` or ``--kept-driver``, then the
    context's socket), which a process has from its exec on. What a process of the sandbox says there chooses at
    most which other process of the sandbox (never its init) is ended: each is held by a pidfd, then checked to
    be the one listed (its start time) and the sandbox's, and ended with what it started."""
    place = python.socket_path(context_id)
    ended = 0
    for listed in box.processes():
        try:
            argv = listed.cmdline()
        except psutil.Error:
            continue
        if not any(flag in ("--kept", "--kept-driver") and then == place for flag, then in itertools.pairwise(argv)):
            continue
        try:
            fd = os.pidfd_open(listed.pid)
        except OSError:
            continue  # ended meanwhile (with a launcher ended before it, say)
        try:
            if listed.is_running() and of_sandbox(box, listed.pid) and alive(fd):
                end_with_descendants(fd, listed.pid)
                ended += 1
        except psutil.Error:
            pass
        finally:
            os.close(fd)
    return ended
