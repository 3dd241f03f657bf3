"""An Inspect task whose agent works with bash in forkd microVMs: 8 samples, each in a VM of its own.

Each sample asks the agent to write the factorial of a number to
``/root/answer.txt``; the scorer reads that file back from the sample's own
VM. Every sample writes the same path, four at a time, and each still
finds its own answer: that is the isolation a forked VM per sample gives.

Run it::

    python examples/frameworks/inspect/task.py

Offline (no OPENAI_API_KEY) a scripted model plays the agent: it runs one
command with Inspect's real ``bash`` tool, in a real VM, then answers. With
OPENAI_API_KEY set, a real model (``FORKD_EXAMPLE_MODEL``, default
``openai/gpt-4.1-mini``) does the job its own way. The Inspect CLI runs the
task too, with any model Inspect knows::

    inspect eval examples/frameworks/inspect/task.py --model openai/gpt-4.1-mini

``sandbox="forkd"`` needs no import: pytest-forkd registers it with Inspect
(``pip install "pytest-forkd[inspect]"``). Nothing of the VMs is left when
the eval ends.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any

from inspect_ai import Task, task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageTool, ChatMessageUser, Model, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, system_message, use_tools
from inspect_ai.tool import bash
from inspect_ai.util import SandboxEnvironmentType, sandbox

NUMBERS = [3, 5, 7, 10, 12, 15, 20, 25]
ANSWER_FILE = "/root/answer.txt"
SYSTEM = "You are working in a Linux sandbox. Use the bash tool to do what you are asked, then say you are done."
PROMPT = "Compute the factorial of {n} with a shell command and write it, as a plain integer, to " + ANSWER_FILE + "."


@scorer(metrics=[accuracy()])
def answer_file() -> Scorer:
    """Correct when the sample's own VM holds the right answer in ANSWER_FILE."""

    async def score(state: TaskState, target: Target) -> Score:
        try:
            answer = (await sandbox().read_file(ANSWER_FILE)).strip()
        except FileNotFoundError:
            return Score(value=INCORRECT, explanation=f"the agent wrote no {ANSWER_FILE}")
        return Score(value=CORRECT if answer == target.text else INCORRECT, answer=answer)

    return score


@task
def factorials(sandbox: SandboxEnvironmentType = "forkd") -> Task:
    """Eight samples, each an agent with bash in a forked microVM of its own."""
    return Task(
        dataset=[Sample(id=f"n{n}", input=PROMPT.format(n=n), target=str(math.factorial(n))) for n in NUMBERS],
        solver=[system_message(SYSTEM), use_tools(bash(timeout=60)), generate()],
        scorer=answer_file(),
        sandbox=sandbox,
    )


def scripted_agent(messages: list[Any], tools: Any, tool_choice: Any, config: Any) -> ModelOutput:
    """The offline model: one bash call that computes the answer in the guest's Python, then 'done'.

    It answers from the sample's own conversation, so concurrent samples never
    mix; its outputs carry their token usage, so Inspect counts no tokens
    (which would download a tokenizer).
    """
    prompt = next(message.text for message in messages if isinstance(message, ChatMessageUser))
    match = re.search(r"factorial of (\d+)", prompt)
    number = int(match.group(1)) if match else 0
    results = [message for message in messages if isinstance(message, ChatMessageTool)]
    if not results:
        command = f"python3 -c 'import math; print(math.factorial({number}))' > {ANSWER_FILE} && cat {ANSWER_FILE}"
        output = ModelOutput.for_tool_call(model="mockllm/model", tool_name="bash", tool_arguments={"command": command})
    else:
        output = ModelOutput.from_content(model="mockllm/model", content=f"Done: {results[-1].text.strip()}")
    output.usage = ModelUsage(input_tokens=len(messages), output_tokens=1, total_tokens=len(messages) + 1)
    return output


def model() -> Model:
    """A real model when OPENAI_API_KEY is set, else the scripted one."""
    if os.environ.get("OPENAI_API_KEY"):
        return get_model(os.environ.get("FORKD_EXAMPLE_MODEL", "openai/gpt-4.1-mini"))
    return get_model("mockllm/model", custom_outputs=scripted_agent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--log-dir", default=None, help="where Inspect writes its log (default: Inspect's ./logs)")
    parser.add_argument("--max-samples", type=int, default=4, help="samples run at once (default: %(default)s)")
    args = parser.parse_args(argv)
    options: dict[str, Any] = {"log_dir": args.log_dir} if args.log_dir else {}
    [log] = inspect_eval(factorials(), model=model(), max_samples=args.max_samples, display="plain", **options)
    if log.status != "success" or log.results is None:
        print(f"eval {log.status}: {log.error}", file=sys.stderr)
        return 1
    accuracy_value = log.results.scores[0].metrics["accuracy"].value
    print(f"accuracy {accuracy_value:.2f} over {len(NUMBERS)} samples, each in its own forkd VM")
    return 0 if accuracy_value == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
