"""An llm-sandbox backend named ``isolate`` (``pip install 'isolate[llm-sandbox]'``).

    import isolate.integrations.llm_sandbox  # registers the backend
    from llm_sandbox import SandboxSession

    with SandboxSession(backend="isolate", lang="python") as session:
        print(session.run("print(6 * 7)").stdout)

Importing this module calls llm-sandbox's ``register_backend("isolate", ...)``
(llm-sandbox has no entry point for backends). Each session is a kept native
``isolate.Sandbox`` whose workspace is the session's ``workdir``; llm-sandbox's
own language handlers write the code there and run it with the sandbox's own
tools (``python3`` for Python), each ``run`` a new process as with its other
backends (for variables kept between runs, see ``Sandbox.python()``).
``policy=`` (an ``isolate.Policy``) says what the code may do: by default no
network, the host's system directories read-only. ``container_id=`` attaches
to a named sandbox (``isolate-run sandbox create NAME``) instead of making one
(its workspace is then the workdir; ``close()`` leaves it running).

The environment setup of llm-sandbox (a virtualenv, upgraded by pip from the
network) is skipped unless ``skip_environment_setup=False`` is given; then a
virtualenv is made with the sandbox's ``python3`` and ``libraries=`` are
installed into it, which needs a policy with network. A run's timeout is the
sandbox's: it ends the command and everything it started.
"""

from __future__ import annotations

import math
import os
import shlex
import stat
import time
from pathlib import PurePosixPath
from typing import Any

from llm_sandbox import BackendCapabilities, get_backend, register_backend
from llm_sandbox.const import SupportedLanguage
from llm_sandbox.core.config import SessionConfig
from llm_sandbox.core.session_base import BaseSession
from llm_sandbox.data import ConsoleOutput
from llm_sandbox.exceptions import CommandEmptyError, CommandFailedError, NotOpenSessionError, SandboxTimeoutError

from ..kept.sandbox import Sandbox
from ..model.policy import Policy
from ..model.workspace import Workspace

__all__ = ["CAPABILITIES", "IsolateSession"]

#: What the backend offers, in llm-sandbox's terms (Linux; images from isolate's store, no daemon).
CAPABILITIES = BackendCapabilities(platforms=("linux",), filesystem_isolation=True, network_isolation=True,
                                   seccomp=True)


class IsolateSession(BaseSession):
    """An llm-sandbox session in a kept isolate sandbox (see the module's docstring)."""

    is_open: bool

    def __init__(self, *, policy: Policy | None = None, lang: str = SupportedLanguage.PYTHON,
                 workdir: str | None = "/sandbox", verbose: bool = False, stream: bool = False,
                 container_id: str | None = None, env_vars: dict[str, str] | None = None,
                 libraries: list[str] | None = None, default_timeout: float | None = 60,
                 execution_timeout: float | None = None, session_timeout: float | None = None,
                 skip_environment_setup: bool = True, encoding_errors: Any = "strict",
                 security_policy: Any = None, python: str = "python3", image: str | None = None,
                 dockerfile: str | None = None, keep_template: bool = False, commit_container: bool = False,
                 runtime_configs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        container_only = {"dockerfile": dockerfile, "keep_template": keep_template,
                          "commit_container": commit_container, "runtime_configs": runtime_configs}
        given = [name for name, value in container_only.items() if value]
        if given:
            raise ValueError(f"the isolate backend builds and commits no container images: {', '.join(given)} "
                             "cannot be used; give image= (an image in isolate's store) or policy= instead")
        if kwargs:
            raise TypeError(f"the isolate backend does not know {', '.join(sorted(kwargs))}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError("policy must be an isolate.Policy")
        for name, value in (("default_timeout", default_timeout), ("execution_timeout", execution_timeout),
                            ("session_timeout", session_timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a finite positive number of seconds, or None")
        workdir = workdir or "/sandbox"
        if not workdir.startswith("/") or ".." in PurePosixPath(workdir).parts or workdir == "/":
            raise ValueError(f"workdir must be an absolute path below / without '..', not {workdir!r}")
        config = SessionConfig(lang=SupportedLanguage(lang), workdir=workdir, verbose=verbose,
                               container_id=container_id, default_timeout=default_timeout,
                               execution_timeout=execution_timeout, session_timeout=session_timeout,
                               skip_environment_setup=skip_environment_setup, encoding_errors=encoding_errors,
                               security_policy=security_policy)
        super().__init__(config, libraries=libraries)
        self.policy = policy if policy is not None else Policy()
        if image is not None:
            # The sandbox's root is the image (isolate-run image load/pull it first); the policy's the rest.
            self.policy = self.policy.replace(image=image)
        self.stream = stream
        self.python = python
        self.env_vars = dict(env_vars or {})
        self.sandbox: Sandbox | None = None
        self._attached = False
        self._venv = False
        self._deadline: float | None = None

    @property
    def python_executable_path(self) -> str:
        """The virtualenv's python once environment_setup made one, else the sandbox's own."""
        return f"{self._python_env_dir}/bin/python" if self._venv else self.python

    @property
    def pip_executable_path(self) -> str:
        return f"{self._python_env_dir}/bin/pip" if self._venv else f"{self.python} -m pip"

    # -- lifecycle ---------------------------------------------------------------

    def open(self) -> None:
        if self.is_open:
            return
        if self.config.container_id is not None:
            self._connect_to_existing_container(self.config.container_id)
        else:
            self.sandbox = Sandbox(self.policy, workspace=Workspace(target=self.config.workdir)).start()
        self.container = self.sandbox
        self.is_open = True
        self._start_session_timer()
        try:
            self.environment_setup()
        except BaseException:
            self.close()
            raise

    def _connect_to_existing_container(self, container_id: str) -> None:
        self.sandbox = Sandbox.attach(container_id)
        self._attached = True
        self.config.workdir = self.sandbox.workspace.target  # where its commands start
        self._python_env_dir = f"{self.config.workdir}/.sandbox-venv"
        self._python_pip_cache_dir = f"{self.config.workdir}/.sandbox-pip-cache"

    def close(self) -> None:
        self._stop_session_timer()
        sandbox, self.sandbox, self.container = self.sandbox, None, None
        self.is_open = False
        if sandbox is not None:
            sandbox.detach() if self._attached else sandbox.close()

    def environment_setup(self) -> None:
        """llm-sandbox's setup for Python, with the sandbox's own python3 (see the module's docstring)."""
        if self.language_handler.name != SupportedLanguage.PYTHON or self.config.skip_environment_setup \
                or self.using_existing_container:
            super().environment_setup()
            return
        made = self.execute_command(f"{self.python} -m venv --system-site-packages {self._python_env_dir} && "
                                    f"mkdir -p {self._python_pip_cache_dir}")
        if made.exit_code:
            raise CommandFailedError(f"{self.python} -m venv", made.exit_code, made.stderr or made.stdout)
        self._venv = True
        if self._initial_libraries:
            self.install(self._initial_libraries)

    def install(self, libraries: list[str] | None = None) -> None:
        """llm-sandbox's install, but a library that fails to install raises (it does not pass silently)."""
        if not libraries:
            return
        if self.config.skip_environment_setup or self.language_handler.name != SupportedLanguage.PYTHON:
            super().install(libraries)  # refuses (skip) or runs the language's own commands
            return
        for library in libraries:
            super().install([library])
            check = self.execute_command(f"{self.pip_executable_path} show {shlex.quote(str(library))}")
            if check.exit_code:
                raise CommandFailedError(f"pip install {library}", check.exit_code,
                                         "not installed (the policy needs a network for pip)")

    def _handle_timeout(self) -> None:
        """Nothing to do: the sandbox ended the command and everything it started at its timeout."""

    # -- commands --------------------------------------------------------------------

    def _execute_with_timeout(self, func: Any, *args: Any, timeout: float | None = None,
                              force_kill_on_timeout: bool = True, **kwargs: Any) -> Any:
        """A deadline the sandbox enforces on each command, instead of llm-sandbox's watcher thread."""
        previous = self._deadline
        if timeout is not None:
            deadline = time.monotonic() + timeout
            self._deadline = deadline if previous is None else min(previous, deadline)
        try:
            return func(*args, **kwargs)
        finally:
            self._deadline = previous

    def run(self, code: str, libraries: list[Any] | None = None, timeout: float | None = None,
            on_stdout: Any = None, on_stderr: Any = None) -> ConsoleOutput:
        if self.language_handler.name == SupportedLanguage.PYTHON:
            # llm-sandbox's handler says "python", which many systems (Debian) do not have.
            self.language_handler.config.execution_commands = [f"{self.python} {{file}}"]
        return super().run(code, libraries, timeout, on_stdout, on_stderr)

    def execute_command(self, command: str, workdir: str | None = None, on_stdout: Any = None,
                        on_stderr: Any = None) -> ConsoleOutput:
        """Run a command line (``/bin/sh -c``) in the sandbox; callbacks get the output when it ends."""
        if not command:
            raise CommandEmptyError
        sandbox = self._require_open()
        timeout = self.config.get_execution_timeout()
        if self._deadline is not None:
            timeout = self._deadline - time.monotonic()
            if timeout <= 0:
                raise SandboxTimeoutError("the isolate sandbox's run passed its timeout", timeout_duration=0)
        result = sandbox.exec(command, cwd=workdir or self.config.workdir, env=self.env_vars or None,
                              timeout=timeout, text=False)
        stdout = result.stdout.decode(errors=self.config.encoding_errors)
        stderr = result.stderr.decode(errors=self.config.encoding_errors)
        if on_stdout is not None and stdout:
            on_stdout(stdout)
        if on_stderr is not None and stderr:
            on_stderr(stderr)
        if result.timed_out:
            raise SandboxTimeoutError(f"the command did not finish within {timeout:g} s; it was ended with "
                                      "everything it started", timeout_duration=timeout)
        return ConsoleOutput(exit_code=result.returncode, stdout=stdout, stderr=stderr)

    def _process_non_stream_output(self, output: Any) -> tuple[str, str]:
        stdout, stderr = output
        return str(stdout), str(stderr)

    def _process_stream_output(self, output: Any, on_stdout: Any = None, on_stderr: Any = None) -> tuple[str, str]:
        return self._process_non_stream_output(output)

    # -- files -----------------------------------------------------------------------

    def _require_open(self) -> Sandbox:
        if not self.is_open or self.sandbox is None:
            raise NotOpenSessionError
        self._check_session_timeout()
        return self.sandbox

    def copy_to_runtime(self, src: str, dest: str) -> None:
        """Copy a host file or directory into the sandbox, written as the program (never as root)."""
        sandbox = self._require_open()
        dest = self._validate_container_path(dest)
        if not os.path.exists(src):
            raise FileNotFoundError(f"Source path {src} does not exist or is not accessible")
        sandbox.upload(src, dest)

    def copy_from_runtime(self, src: str, dest: str) -> None:
        """Copy a file of the sandbox to the host; a directory: its files and directories, not its links."""
        sandbox = self._require_open()
        src = self._validate_container_path(src)
        info = sandbox.stat(src, follow_symlinks=False)
        if stat.S_ISREG(info.mode):
            sandbox.download(src, dest)
            return
        if not stat.S_ISDIR(info.mode):
            raise FileNotFoundError(f"{src} is not a regular file or directory in the sandbox")
        os.makedirs(dest, exist_ok=True)
        for entry in sandbox.list_dir(src):
            name = PurePosixPath(entry.path).name
            if entry.type not in ("file", "dir") or name in ("", ".", "..") or "/" in name:
                continue  # links (as llm-sandbox's own backends skip them), devices, FIFOs
            self.copy_from_runtime(str(PurePosixPath(src) / name), os.path.join(dest, name))

    def _ensure_directory_exists(self, path: str) -> None:
        self._require_open().mkdir(path)

    def _ensure_ownership(self, paths: list[str]) -> None:
        """Nothing to do: files are written by the program's own uid."""


def _factory(*args: Any, **kwargs: Any) -> IsolateSession:
    return IsolateSession(*args, **kwargs)


def _register() -> None:
    try:
        register_backend("isolate", _factory, capabilities=CAPABILITIES)
    except ValueError:
        if get_backend("isolate").factory is not _factory:
            raise


_register()
