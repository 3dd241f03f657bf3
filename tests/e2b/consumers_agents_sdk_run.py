"""The OpenAI Agents SDK's E2B sandbox client (``agents.extensions.sandbox.e2b``), unchanged, with its pinned SDK.

Run by tests/e2b/test_consumers_agents_sdk.py with the python of a
virtualenv holding ``openai-agents[e2b]`` (e2b 2.31.0, e2b-code-interpreter
2.8.1: older than the suite's), and the environment of a forkd E2B server.
It creates a session from a manifest, runs commands (one that fails), writes
and reads a file through the session, and runs a SandboxAgent whose scripted
model calls the SDK's ``exec_command`` tool. It prints ``RESULT {json}``,
waits for a line on stdin (the test looks into the sandbox's VM meanwhile),
then leaves the session, which kills the sandbox, and prints ``CLEANED``.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import uuid
from collections.abc import AsyncIterator
from importlib import metadata
from pathlib import Path
from typing import Any

from agents import Model, Runner, set_tracing_disabled
from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
from agents.items import ModelResponse, TResponseStreamEvent
from agents.run import RunConfig
from agents.sandbox import Manifest, SandboxAgent, SandboxRunConfig
from agents.sandbox.capabilities import Shell
from agents.sandbox.entries import File
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

MANIFEST = Manifest(entries={"greeting.txt": File(content=b"hello from the manifest\n")})
AGENT_COMMAND = "python3 -c 'import platform; print(6 * 7, platform.system())' && cat greeting.txt"


class ScriptedShell(Model):
    """One ``exec_command`` call, then a final answer quoting its output."""

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        seen = [item for item in input if isinstance(item, dict) and item.get("type") == "function_call_output"]
        if not seen:
            call = ResponseFunctionToolCall(
                type="function_call",
                id=f"fc_{uuid.uuid4().hex}",
                call_id=f"call_{uuid.uuid4().hex}",
                name="exec_command",
                arguments=json.dumps({"cmd": AGENT_COMMAND}),
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", annotations=[], text=f"The shell said: {seen[-1]['output']}")
        message = ResponseOutputMessage(
            id=f"msg_{uuid.uuid4().hex}", type="message", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the scripted model answers Runner.run only")


async def main() -> None:
    set_tracing_disabled(True)
    client = E2BSandboxClient()
    session = await client.create(options=E2BSandboxClientOptions(sandbox_type="e2b"), manifest=MANIFEST)
    try:
        async with session:
            listed = await session.exec("cat greeting.txt && pwd")
            failed = await session.exec("echo to-stderr >&2; exit 3")
            await session.write(Path("out/answer.txt"), io.BytesIO(b"42\n"))
            read_back = (await session.read(Path("out/answer.txt"))).read()
            catted = await session.exec("cat out/answer.txt")
            agent = SandboxAgent(
                name="shell", instructions="Use the shell.", model=ScriptedShell(), capabilities=[Shell()]
            )
            run = await Runner.run(
                agent, "Compute 6*7 in the sandbox.", run_config=RunConfig(sandbox=SandboxRunConfig(session=session))
            )
            result = {
                "sandbox_id": session.state.sandbox_id,
                "listed": [listed.exit_code, listed.stdout.decode(), listed.stderr.decode()],
                "failed": [failed.exit_code, failed.stdout.decode(), failed.stderr.decode()],
                "read_back": read_back.decode(),
                "catted": catted.stdout.decode(),
                "agent": str(run.final_output),
                "versions": {name: metadata.version(name) for name in ("openai-agents", "e2b", "e2b-code-interpreter")},
            }
            print("RESULT " + json.dumps(result), flush=True)
            await asyncio.to_thread(sys.stdin.readline)
    finally:
        await client.delete(session)
    print("CLEANED", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
