"""A smolagents CodeAgent whose code runs in isolate, driven by a model of smolagents' own kind.

The model is a ``smolagents.Model`` subclass that answers with fixed code
actions (no network, no LLM); the agent, its parser, its tools, its
final_answer and its executor protocol are smolagents' own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import NAMESPACES_WHY, policy

smolagents = pytest.importorskip("smolagents", reason="smolagents is not installed (pip install 'isolate[smolagents]')")

from smolagents import CodeAgent, Model, tool  # noqa: E402
from smolagents.models import ChatMessage, MessageRole  # noqa: E402
from smolagents.monitoring import AgentLogger, LogLevel  # noqa: E402
from smolagents.utils import AgentError  # noqa: E402

from isolate import Sandbox  # noqa: E402
from isolate.integrations.smolagents import IsolateExecutor  # noqa: E402
from isolate.model.errors import UnsupportedError  # noqa: E402

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


class ScriptedModel(Model):
    """A smolagents model that answers each call with the next of a fixed list of replies."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.replies = list(replies)
        self.seen: list[Any] = []

    def generate(self, messages: list[Any], stop_sequences: list[str] | None = None,
                 response_format: Any = None, tools_to_call_from: Any = None, **kwargs: Any) -> ChatMessage:
        self.seen.append(messages)
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.replies.pop(0))


@tool
def shout(text: str) -> str:
    """Upper-cases a text.

    Args:
        text: the text to shout
    """
    return text.upper() + "!"


@pytest.fixture
def executor() -> Iterator[IsolateExecutor]:
    ex = IsolateExecutor(logger=AgentLogger(LogLevel.OFF), policy=policy(write=()))
    yield ex
    ex.cleanup()


def test_a_code_agent_runs_its_steps_in_the_sandbox(executor: IsolateExecutor) -> None:
    model = ScriptedModel([
        "Thought: look around first.\n<code>\nimport os\nseen = os.getuid(), os.getcwd()\nprint('in', seen[1])\n"
        "numbers = [n * n for n in range(base)]\n</code>",
        "Thought: now answer.\n<code>\nfinal_answer({'sum': sum(numbers), 'shout': shout('done'), "
        "'cwd': seen[1]})\n</code>",
    ])
    agent = CodeAgent(tools=[shout], model=model, executor=executor, max_steps=4, verbosity_level=LogLevel.OFF)
    answer = agent.run("Sum the squares below base.", additional_args={"base": 5})
    # Variables persisted from one step to the next, the agent's state arrived, the tool ran inside.
    assert answer == {"sum": 30, "shout": "DONE!", "cwd": "/workspace"}, answer
    steps = [s for s in agent.memory.steps if getattr(s, "code_action", None)]
    assert len(steps) == 2 and "in /workspace" in steps[0].observations
    # The code ran in the sandbox's interpreter, not in this process.
    assert executor.interpreter.run("'numbers' in globals() and 'shout' in globals()").value == "True"
    assert executor.interpreter.starts == 1


def test_an_error_in_the_code_is_shown_to_the_agent(executor: IsolateExecutor) -> None:
    model = ScriptedModel([
        "<code>\nprint('before')\n1 / 0\n</code>",
        "<code>\nfinal_answer('recovered')\n</code>",
    ])
    agent = CodeAgent(tools=[], model=model, executor=executor, max_steps=4, verbosity_level=LogLevel.OFF)
    assert agent.run("Divide.") == "recovered"
    failed = [s for s in agent.memory.steps if getattr(s, "error", None)]
    assert failed and "ZeroDivisionError" in str(failed[0].error) and "before" in str(failed[0].error)
    with pytest.raises(AgentError, match="NameError"):
        executor("undefined_name")


def test_a_step_past_its_timeout_is_an_error_and_the_executor_goes_on() -> None:
    ex = IsolateExecutor(logger=AgentLogger(LogLevel.OFF), policy=policy(write=()), timeout=1)
    try:
        ex.send_tools({"shout": shout})
        with pytest.raises(AgentError, match="did not finish within 1 s"):
            ex("kept = 1\nwhile True:\n    pass")
        # A new interpreter: the tools are there again, the step's variables are not.
        assert ex("shout('again')").output == "'AGAIN!'"
        assert ex("'kept' in globals()").output == "False"
        assert ex.interpreter.starts == 2
    finally:
        ex.cleanup()


def test_a_given_sandbox_is_used_and_left_running() -> None:
    with Sandbox(policy(write=())) as box:
        ex = IsolateExecutor(logger=AgentLogger(LogLevel.OFF), sandbox=box, name="agent")
        ex("open('/tmp/mark', 'w').write('x')")
        ex.cleanup()
        assert box.read_file("/tmp/mark") == "x"


def test_pickle_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="allow_pickle"):
        IsolateExecutor(logger=AgentLogger(LogLevel.OFF), allow_pickle=True)


def test_an_image_is_the_sandboxs_root(tmp_path: Any) -> None:
    # IsolateExecutor(image=...): the agent's code runs in the image's python3 (the Debian + python test image,
    # built once per CI run by .ci/run), not the host's.
    import os
    import shutil

    import imagekit as kit

    from isolate.image import Image, Store

    layout = kit.debian_layout(build=False) if shutil.which("mmdebstrap") else None
    if layout is None:
        pytest.skip("the Debian + python test image is not built (`PYTHONPATH=. python3 tests/imagekit.py debian`)")
    with kit.store_env(str(tmp_path / "store")) as store:
        ref = Image.load(layout, store=Store(store)).reference
        ex = IsolateExecutor(logger=AgentLogger(LogLevel.OFF), image=ref)
        try:
            model = ScriptedModel(["Thought: where am I?\n<code>\nimport sys, os\nfinal_answer([sys.executable, "
                                   "open('/etc/debian_version').read().strip()[:3], "
                                   "os.path.exists('/usr/bin/mmdebstrap')])\n</code>"])
            agent = CodeAgent(tools=[], model=model, executor=ex, max_steps=2, verbosity_level=LogLevel.OFF)
            assert agent.run("Say where the code runs.") == ["/usr/bin/python3", "12.", False]
            assert os.path.exists("/usr/bin/mmdebstrap")  # the host's /usr is not what the code saw
        finally:
            ex.cleanup()
