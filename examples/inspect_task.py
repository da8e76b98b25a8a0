"""An inspect_ai task whose tools run in isolate: ``sandbox="isolate"``, with a scripted mock model.

What it shows
    A ``Task`` with ``sandbox="isolate"``: each sample gets its own kept
    ``isolate.Sandbox`` (made by the provider that ``pip install 'isolate[inspect]'``
    registers, removed when the sample ends). The solver is inspect's ``react``
    agent with inspect's ``bash`` tool; the model is inspect's ``mockllm`` told
    what to answer (no API key, no network): it writes and runs a script in the
    sandbox with ``bash``, then submits the output. The scorer runs the script
    again in the same sample's sandbox (``sandbox().exec``) and checks it prints
    the target. Commands run in ``/workspace`` as the sandbox's one unprivileged
    uid (65534 when the caller is root), with no network.

    A profile can say what every sample's sandbox may do:
    ``sandbox=("isolate", "profile.toml")``, where the file is an ``isolate.Policy``
    saved as TOML (``isolate.Policy(network="loopback").save("profile.toml")``).

How to run
    pip install 'isolate[inspect]'
    python examples/inspect_task.py        # Linux; root or not

It ends with "score: 1.0 (C)".
"""

from __future__ import annotations

import sys
import tempfile

from inspect_ai import Task, eval, task
from inspect_ai.agent import react
from inspect_ai.dataset import Sample
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer
from inspect_ai.solver import TaskState
from inspect_ai.tool import bash
from inspect_ai.util import sandbox


@scorer(metrics=[accuracy()])
def script_prints_target() -> Scorer:
    async def score(state: TaskState, target: Target) -> Score:
        # The same sample's sandbox: the file the model's bash call wrote is there.
        run = await sandbox().exec(["python3", "answer.py"], timeout=30)
        printed = run.stdout.strip()
        return Score(value=CORRECT if run.success and printed == target.text else INCORRECT,
                     answer=state.output.completion, explanation=f"answer.py printed {printed!r}")

    return score


@task
def six_times_seven() -> Task:
    return Task(
        dataset=[Sample(input="Write answer.py printing 6 * 7, run it, and submit what it prints.", target="42")],
        solver=react(tools=[bash(timeout=60)]),
        scorer=script_prints_target(),
        sandbox="isolate",
    )


def scripted(tool: str, arguments: dict[str, str]) -> ModelOutput:
    """One turn of the mock model: a call of ``tool``. Its token usage is given, so that mockllm does not
    count tokens with tiktoken (which downloads its encoding the first time: no network here)."""
    output = ModelOutput.for_tool_call("mockllm/model", tool, arguments)
    output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return output


def main() -> int:
    # What the mock model answers, turn by turn: a bash call, then the submission.
    model = get_model("mockllm/model", custom_outputs=[
        scripted("bash", {"command": "printf 'print(6 * 7)\\n' > answer.py && python3 answer.py && id -u && pwd"}),
        scripted("submit", {"answer": "42"}),
    ])
    with tempfile.TemporaryDirectory(prefix="inspect-logs-") as logs:  # the log is read from here: stay inside
        log = eval(six_times_seven(), model=model, log_dir=logs, display="none")[0]
        print("eval:", log.status, log.error or "")
        if log.status != "success" or not log.samples:
            return 1
        sample = log.samples[0]
        for message in sample.messages:
            if message.role == "tool":
                said = message.error.message if message.error else message.text
                print(f"tool {message.function}: {said.strip()!r}")
        for name, score in (sample.scores or {}).items():
            print(f"{name}: {score.explanation}")
        metric = log.results.scores[0].metrics["accuracy"].value if log.results else 0.0
        value = next(iter(sample.scores.values())).value if sample.scores else None
        print(f"score: {metric} ({value})")
        return 0 if metric == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
