"""A smolagents executor that runs a ``CodeAgent``'s code in an isolate sandbox (``pip install 'isolate[smolagents]'``).

    from smolagents import CodeAgent, InferenceClientModel
    from isolate.integrations.smolagents import IsolateExecutor

    agent = CodeAgent(tools=[], model=InferenceClientModel(), executor=IsolateExecutor())
    agent.run("How many primes are below 1000?")

The code runs in ``Sandbox.python()``: the sandbox's own ``python3``, with
variables kept between steps, in a kept native sandbox (made from ``policy``,
or the ``sandbox`` you pass). smolagents' ``executor_type=`` takes only its
own names, so the executor is passed as ``executor=``.

As smolagents' own remote executors do, ``send_tools`` defines the tools in
the sandbox and turns ``final_answer`` into an exception carrying the answer
as JSON; the host reads it back with smolagents' safe deserializer. Pickle
never crosses: ``allow_pickle=True`` is refused, since unpickling what the
sandbox sends would run its code on the host.
"""

from __future__ import annotations

import json
import re
from typing import Any

from smolagents.local_python_executor import CodeOutput
from smolagents.monitoring import AgentLogger, LogLevel
from smolagents.remote_executors import RemotePythonExecutor
from smolagents.tools import Tool, get_tools_definition_code
from smolagents.utils import AgentError

from ..kept.sandbox import Sandbox
from ..model.errors import UnsupportedError
from ..model.policy import Policy

__all__ = ["IsolateExecutor"]

#: Module names and the pip packages that provide them, where the two differ.
_PACKAGE_OF = {"PIL": "pillow", "sklearn": "scikit-learn", "cv2": "opencv-python", "yaml": "pyyaml",
               "bs4": "beautifulsoup4"}
_MODULE_OF = {package: module for module, package in _PACKAGE_OF.items()}
#: A plain top-level ``import name`` line, as smolagents writes the imports it lifts out of tools.
_TOP_IMPORT = re.compile(r"^import ([A-Za-z_][A-Za-z0-9_]*)[ \t]*$", re.MULTILINE)

_FIND_MISSING = """
import importlib.util as _isolate_util, json as _isolate_json
print(_isolate_json.dumps([_m for _m in {names!r} if _isolate_util.find_spec(_m) is None]))
"""


class IsolateExecutor(RemotePythonExecutor):
    """Runs a smolagents agent's code in ``Sandbox.python()``.

    ``additional_imports``: modules the code may import; those the sandbox's
    Python cannot import are installed with its pip when the policy has a
    network (else, or when pip fails, the missing ones are logged and the
    code's import fails as it would). ``executable``: the interpreter inside
    (a virtualenv's python, say, with what the agent needs). ``image``: an image of isolate's store as the
    sandbox's root (``isolate.Image.pull``/``load`` it first; its ``python3`` runs the code).
    ``policy``/``sandbox_options`` make the sandbox (closed by ``cleanup()``); or pass a started ``sandbox`` of yours
    (left running). ``timeout``: seconds per code step (None: none); a step
    past it ends the interpreter, and the agent sees the error.
    """

    def __init__(self, additional_imports: list[str] | None = None, logger: Any = None, *,
                 policy: Policy | None = None, sandbox: Sandbox | None = None, name: str = "smolagents",
                 executable: str = "python3", timeout: float | None = 300.0, allow_pickle: bool = False,
                 image: str | None = None, **sandbox_options: Any) -> None:
        if allow_pickle:
            raise UnsupportedError("IsolateExecutor: allow_pickle=True is refused: unpickling what the sandbox "
                                   "sends would run its code on the host; final answers travel as JSON")
        if sandbox is not None and (policy is not None or sandbox_options or image is not None):
            raise ValueError("IsolateExecutor: give a sandbox, or a policy, image and options to make one, not both")
        if image is not None:
            # The sandbox's root is the image, from isolate's store (Image.pull or load it first): its python3.
            policy = (policy if policy is not None else Policy()).replace(image=image)
        super().__init__(list(additional_imports or []), logger or AgentLogger(LogLevel.INFO), allow_pickle=False)
        self.timeout = timeout
        self._setup: list[str] = []  # what send_tools defined: again in a new interpreter
        self._owns_sandbox = sandbox is None
        self.sandbox = sandbox if sandbox is not None else Sandbox(policy, **sandbox_options)
        try:
            self.sandbox.start()
            self.interpreter = self.sandbox.python(name, executable)
            self.installed_packages = self.install_packages(self.additional_imports)
        except BaseException:
            if self._owns_sandbox:
                self.sandbox.close()
            raise
        self.logger.log(f"isolate sandbox is running (Python {self.interpreter.python_version})",
                        level=LogLevel.INFO)

    def run_code_raise_errors(self, code: str) -> CodeOutput:
        """Run one step's code; its printed output is the logs, its last expression's repr the output.

        After a step that ended the interpreter (its timeout, a crash), the
        next starts a new one: the tools are defined in it again first (the
        step's own variables are gone, as the error said).
        """
        if self._setup and not self.interpreter.alive:
            for setup in self._setup:
                self._run_step(setup)
        return self._run_step(code)

    def _run_step(self, code: str) -> CodeOutput:
        result = self.interpreter.run(code, timeout=self.timeout)
        logs = result.stdout + result.stderr
        error = result.error
        if error is None:
            return CodeOutput(output=result.value, logs=logs, is_final_answer=False)
        if error.type == self.FINAL_ANSWER_EXCEPTION and not result.ended:
            answer = self._deserialize_final_answer(error.message, allow_pickle=False)
            return CodeOutput(output=answer, logs=logs, is_final_answer=True)
        raise AgentError(f"{logs}\nExecuting code yielded an error:\n{error.type}\n{error.message}\n"
                         f"{error.traceback}", self.logger)

    def _missing(self, modules: list[str]) -> list[str]:
        """Those of the modules the sandbox's Python cannot import."""
        if not modules:
            return []
        found = self.interpreter.run(_FIND_MISSING.format(names=modules), timeout=60)
        try:
            said = json.loads(found.stdout) if found.ok else modules
        except ValueError:
            said = modules
        return [n for n in modules if n in said] if isinstance(said, list) else list(modules)

    def install_packages(self, additional_imports: list[str]) -> list[str]:
        """Install, with the sandbox's pip, the modules its Python cannot import yet."""
        names = sorted({_MODULE_OF.get(name, name).split(".")[0] for name in additional_imports
                        if name and name != "*" and not name.startswith(".")})
        missing = self._missing(names)
        if not missing:
            return additional_imports
        packages = [_PACKAGE_OF.get(n, n) for n in missing]
        if self.sandbox.policy.network == "none":
            self.logger.log(f"isolate: the sandbox's Python has no {', '.join(missing)}, and its policy has no "
                            "network to install them (policy network=, or a Python that has them)",
                            level=LogLevel.INFO)
            return additional_imports
        pip = self.sandbox.exec([self.interpreter.executable, "-m", "pip", "install", *packages], timeout=600)
        if pip.returncode != 0:
            self.logger.log(f"isolate: could not install {', '.join(packages)} in the sandbox (pip exited "
                            f"{pip.returncode}; a system Python may refuse, a virtualenv given as "
                            f"executable= does not): {(pip.stderr or pip.stdout)[-500:]}", level=LogLevel.INFO)
        return additional_imports

    def send_tools(self, tools: dict[str, Tool]) -> None:
        """Define the tools in the sandbox, as smolagents' remote executors do.

        smolagents lifts every import of a tool's methods to the top of the
        code it sends, also those its final_answer serializer only tries
        (numpy, PIL); a sandbox without them would fail on the first line. So
        the top-level imports of modules the sandbox lacks are made optional
        (logged): a tool that needs one fails when it uses it, with the name.
        """
        if "final_answer" in tools:
            self._patch_final_answer_with_exception(tools["final_answer"])
        wanted = {pkg for one in tools.values() for pkg in one.to_dict()["requirements"]}
        wanted -= {*self.installed_packages, "smolagents"}
        if wanted:
            self.installed_packages += self.install_packages(sorted(wanted))
        code = get_tools_definition_code(tools)
        if not code:
            return
        top = sorted({m.group(1) for m in _TOP_IMPORT.finditer(code)})
        missing = set(self._missing(top))
        if missing:
            self.logger.log(f"isolate: the sandbox's Python has no {', '.join(sorted(missing))}: the tools' "
                            "imports of them are made optional", level=LogLevel.INFO)
            code = _TOP_IMPORT.sub(lambda m: (f"try:\n    import {m.group(1)}\nexcept ImportError:\n    pass"
                                              if m.group(1) in missing else m.group(0)), code)
        self.logger.log(self.run_code_raise_errors(code).logs)
        self._setup.append(code)

    def cleanup(self) -> None:
        """End the interpreter, and the sandbox if this executor made it."""
        interpreter = getattr(self, "interpreter", None)
        if interpreter is not None:
            interpreter.close()
        if self._owns_sandbox and getattr(self, "sandbox", None) is not None:
            self.sandbox.close()

    def delete(self) -> None:
        self.cleanup()
