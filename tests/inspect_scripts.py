"""A scripted model for Inspect evals in tests: it answers as a function of the conversation, offline.

Each sample's input is a JSON list of shell commands; the model asks Inspect's
``bash`` tool to run them one by one (the number of tool results so far says
which is next) and then answers with every tool result joined, so a scorer
or a test reads what each command printed in that sample's VM. Answering
from the conversation, not from a shared list of outputs, keeps concurrent
samples apart.

The outputs carry their token usage, so Inspect's mock model never counts
tokens with tiktoken (which would download its encoding); :func:`offline_tokens`
replaces the count as well, for any other caller.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

#: What the final answer puts between the outputs of consecutive commands.
SEPARATOR = "\n--- next command ---\n"


def scripted_outputs(messages: list[Any], tools: list[Any], tool_choice: Any, config: Any) -> Any:
    """The next output for one sample's conversation: a bash call per command, then the joined results."""
    from inspect_ai.model import ChatMessageTool, ChatMessageUser, ModelOutput, ModelUsage

    prompt = next(message for message in messages if isinstance(message, ChatMessageUser))
    commands = json.loads(prompt.text)
    results = [message for message in messages if isinstance(message, ChatMessageTool)]
    usage = ModelUsage(input_tokens=len(messages), output_tokens=1, total_tokens=len(messages) + 1)
    if len(results) < len(commands):
        output = ModelOutput.for_tool_call(
            model="mockllm/model", tool_name="bash", tool_arguments={"command": commands[len(results)]}
        )
    else:
        answer = SEPARATOR.join(
            message.error.message if message.error is not None else message.text for message in results
        )
        output = ModelOutput.from_content(model="mockllm/model", content=answer)
    output.usage = usage
    return output


def scripted_model() -> Any:
    from inspect_ai.model import get_model

    return get_model("mockllm/model", custom_outputs=scripted_outputs)


def outputs_of(sample: Any) -> list[str]:
    """The output of each command a sample ran, from its final answer."""
    return str(sample.output.completion).split(SEPARATOR)


def offline_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count tokens without tiktoken (which downloads its encoding on first use): 1 per 4 characters."""
    import inspect_ai.model._model as model_module

    monkeypatch.setattr(model_module, "count_text_tokens", lambda text: max(1, len(text) // 4))
