"""A smolagents CodeAgent whose code runs through smolagents' own ``E2BExecutor``, unchanged.

Run by tests/e2b/test_consumers_smolagents.py with the python of a virtualenv
holding ``smolagents[e2b]`` (not the suite's), and the environment of a forkd
E2B server. A scripted model stands in for the LLM: it answers with the code
blocks a CodeAgent expects, and the executor runs them with the code
interpreter SDK's ``run_code`` in a sandbox of the server: one cell that
computes and writes a file, one that fails (its error comes back to the agent
as an observation), one that calls ``final_answer`` with a variable the first
cell made (smolagents reads it from the ``FinalAnswerException`` the cell
raises). The program prints ``RESULT {json}``, waits for a line on stdin
(the test looks into the sandbox's VM meanwhile), then cleans the agent up,
which kills the sandbox, and prints ``CLEANED``.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from typing import Any

from smolagents import CodeAgent, LogLevel, Model
from smolagents.models import ChatMessage, MessageRole

STEPS = [
    "Thought: I will find the primes below 30 and keep them in a file.\n<code>\n"
    "import os\n"
    "primes = [n for n in range(2, 30) if all(n % d for d in range(2, n))]\n"
    "with open('/tmp/smolagents-primes.txt', 'w') as out:\n"
    "    out.write(' '.join(map(str, primes)))\n"
    "print('found', len(primes), 'primes on', os.uname().sysname)\n"
    "</code>",
    "Thought: Let me look at the hundredth prime.\n<code>\nprint(primes[100])\n</code>",
    "Thought: There are only ten; I answer with them and their sum.\n<code>\n"
    "final_answer({'primes': primes, 'total': sum(primes)})\n"
    "</code>",
]


class ScriptedModel(Model):
    """The agent's replies, in order: an offline stand-in for an LLM."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.replies = list(replies)
        self.calls = 0

    def generate(self, messages: list[Any], stop_sequences: list[str] | None = None, **kwargs: Any) -> ChatMessage:
        reply = self.replies[self.calls]
        self.calls += 1
        return ChatMessage(role=MessageRole.ASSISTANT, content=reply)


def main() -> None:
    agent = CodeAgent(tools=[], model=ScriptedModel(STEPS), executor_type="e2b", verbosity_level=LogLevel.OFF)
    try:
        answer = agent.run("List the primes below 30 and add them up.", max_steps=len(STEPS))
        observations = [getattr(step, "observations", None) for step in agent.memory.steps]
        errors = [str(step.error) for step in agent.memory.steps if getattr(step, "error", None) is not None]
        sandbox_id = agent.python_executor.sandbox.sandbox_id
        result = {
            "answer": answer,
            "sandbox_id": sandbox_id,
            "observations": observations,
            "errors": errors,
            "versions": {name: metadata.version(name) for name in ("smolagents", "e2b", "e2b-code-interpreter")},
        }
        print("RESULT " + json.dumps(result), flush=True)
        sys.stdin.readline()
    finally:
        agent.cleanup()
    print("CLEANED", flush=True)


if __name__ == "__main__":
    main()
