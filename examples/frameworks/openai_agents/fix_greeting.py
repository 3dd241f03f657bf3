"""A SandboxAgent (OpenAI Agents SDK) that fixes a bug in a file, with its shell running in a forkd VM.

Run it::

    python examples/frameworks/openai_agents/fix_greeting.py

Offline (no OPENAI_API_KEY) a scripted model plays the agent: it looks at
the file, fixes it with ``sed`` and runs it, through the SDK's real
``exec_command`` tool, in a real VM. With OPENAI_API_KEY set, a real model
(``FORKD_EXAMPLE_MODEL``, default ``gpt-4.1-mini``) does the same job its
own way. Either way the workspace is the VM's ``/workspace``, seeded from
the manifest below, and nothing of the VM is left when the program ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agents import Model, Runner, set_tracing_disabled
from agents.items import ModelResponse, TResponseStreamEvent
from agents.run import RunConfig
from agents.sandbox import Manifest, SandboxAgent, SandboxRunConfig
from agents.sandbox.capabilities import Filesystem, Shell
from agents.sandbox.entries import File
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from pytest_forkd.integrations.openai_agents import ForkdSandboxClient

#: The workspace the agent starts with: a greeting with a typo in it.
MANIFEST = Manifest(entries={"greeting.py": File(content=b'def greet(name):\n    return "Hello, " + nme\n')})

INSTRUCTIONS = (
    "greeting.py in your workspace has a bug. Fix it with the shell, run "
    "`python3 -c 'from greeting import greet; print(greet(\"forkd\"))'` to check, and say what you changed."
)


class ScriptedFixer(Model):
    """The agent's moves, scripted by how many tool results it has seen: look, fix and test, report."""

    MOVES = [
        "cat greeting.py",
        "sed -i 's/+ nme/+ name/' greeting.py && python3 -c 'from greeting import greet; print(greet(\"forkd\"))'",
    ]

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        seen = [item for item in input if isinstance(item, dict) and item.get("type") == "function_call_output"]
        if len(seen) < len(self.MOVES):
            call = ResponseFunctionToolCall(
                type="function_call",
                id=f"fc_{uuid.uuid4().hex}",
                call_id=f"call_{uuid.uuid4().hex}",
                name="exec_command",
                arguments=json.dumps({"cmd": self.MOVES[len(seen)]}),
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        report = f"Fixed the typo nme -> name; the check printed: {seen[-1]['output']}"
        text = ResponseOutputText(type="output_text", annotations=[], text=report)
        message = ResponseOutputMessage(
            id=f"msg_{uuid.uuid4().hex}", type="message", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the scripted fixer answers Runner.run only")


def choose_model(offline: bool = False) -> Model | str:
    """A real model when OPENAI_API_KEY is set (and ``offline`` is not), else the scripted one."""
    if os.environ.get("OPENAI_API_KEY") and not offline:
        return os.environ.get("FORKD_EXAMPLE_MODEL", "gpt-4.1-mini")
    set_tracing_disabled(True)  # offline: nothing may try to upload traces
    return ScriptedFixer()


async def fix_greeting(client: ForkdSandboxClient, model: Model | str) -> tuple[str, bytes]:
    """Run the agent in a fresh forkd session; return its final answer and greeting.py as it left it."""
    agent = SandboxAgent(name="fixer", instructions=INSTRUCTIONS, model=model, capabilities=[Shell(), Filesystem()])
    session = await client.create(manifest=MANIFEST)
    try:
        async with session:  # applies the manifest; leaving persists the workspace and stops the VM
            run_config = RunConfig(sandbox=SandboxRunConfig(session=session))
            result = await Runner.run(agent, "Please fix greeting.py.", run_config=run_config, max_turns=12)
            fixed = (await session.read(Path("greeting.py"))).read()
        return str(result.final_output), fixed
    finally:
        await client.delete(session)


async def main() -> None:
    async with ForkdSandboxClient() as client:  # opens the built-in "base" snapshot, one child per session
        answer, fixed = await fix_greeting(client, choose_model())
    print(answer)
    print("greeting.py now:\n" + fixed.decode())


if __name__ == "__main__":
    asyncio.run(main())
