"""An Inspect task whose sandbox is a compose file that builds a project image: each sample in a forkd VM of it.

``compose.yaml`` is what a task ships for Inspect's docker sandbox: a
``build:`` of ``image/Dockerfile`` (a small inventory tool on a Python base),
its ``working_dir`` and ``environment``, and container keys forkd has no use
for. ``sandbox=("forkd", "compose.yaml")`` builds the image once with the
host's podman (or docker, or buildah), boots it once, and gives each sample a
copy-on-write child of it.

Run it::

    python examples/frameworks/images/make_images.py   # offline only: prints FORKD_EXAMPLE_BASE=...
    export FORKD_EXAMPLE_BASE=oci-archive:$PWD/examples/frameworks/images/base.tar
    python examples/frameworks/inspect_compose/task.py

Without ``FORKD_EXAMPLE_BASE`` the image builds ``FROM python:3.12-slim``
(Docker Hub). Offline (no OPENAI_API_KEY) a scripted model plays the agent:
it runs the tool with Inspect's ``bash`` tool and answers what it printed.
With OPENAI_API_KEY set, a real model (``FORKD_EXAMPLE_MODEL``, default
``openai/gpt-4.1-mini``) does it its own way. The Inspect CLI runs it too::

    inspect eval examples/frameworks/inspect_compose/task.py --model openai/gpt-4.1-mini

and so does Docker, unchanged: ``-T sandbox=docker``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from inspect_ai import Task, task
from inspect_ai import eval as inspect_eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageTool, ChatMessageUser, Model, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, system_message, use_tools
from inspect_ai.tool import bash

HERE = Path(__file__).resolve().parent
COMPOSE = str(HERE / "compose.yaml")
#: Item -> what the project's stock.csv adds up to (in the unit its environment sets).
STOCK = {"bolts": "150 items", "nuts": "95 items", "washers": "45 items", "screws": "200 items"}
SYSTEM = "You work in a Linux sandbox with a project in your working directory. Use the bash tool, then answer."
PROMPT = "How many {item} are in stock? Run `python3 inventory.py stock.csv {item}` and answer with what it prints."


@task
def inventory(sandbox: str = "forkd") -> Task:
    """Four samples, each asking the project's tool a question in a VM (or container) of the compose file's image."""
    return Task(
        dataset=[Sample(id=item, input=PROMPT.format(item=item), target=answer) for item, answer in STOCK.items()],
        solver=[system_message(SYSTEM), use_tools(bash(timeout=60)), generate()],
        scorer=includes(),
        sandbox=(sandbox, COMPOSE),
    )


def scripted_agent(messages: list[Any], tools: Any, tool_choice: Any, config: Any) -> ModelOutput:
    """The offline model: one bash call running the tool the prompt names, then its output as the answer."""
    prompt = next(message.text for message in messages if isinstance(message, ChatMessageUser))
    command = re.search(r"`([^`]+)`", prompt)
    results = [message for message in messages if isinstance(message, ChatMessageTool)]
    if not results and command:
        output = ModelOutput.for_tool_call(
            model="mockllm/model", tool_name="bash", tool_arguments={"command": command.group(1)}
        )
    else:
        answer = results[-1].text.strip() if results else "I could not run it."
        output = ModelOutput.from_content(model="mockllm/model", content=f"In stock: {answer}")
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
    parser.add_argument("--max-samples", type=int, default=2, help="samples run at once (default: %(default)s)")
    args = parser.parse_args(argv)
    options: dict[str, Any] = {"log_dir": args.log_dir} if args.log_dir else {}
    [log] = inspect_eval(inventory(), model=model(), max_samples=args.max_samples, display="plain", **options)
    if log.status != "success" or log.results is None:
        print(f"eval {log.status}: {log.error}", file=sys.stderr)
        return 1
    accuracy = log.results.scores[0].metrics["accuracy"].value
    print(f"accuracy {accuracy:.2f} over {len(STOCK)} samples, each in a forkd VM of the compose file's image")
    return 0 if accuracy == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
