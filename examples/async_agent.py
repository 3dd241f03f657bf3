"""An asyncio tool-calling agent loop, the shape of the OpenAI Agents SDK, LangGraph or pydantic-ai.

A real agent asks a language model for its next step; here a scripted
*policy* plays the model, so the test suite is reproducible. The loop is the
real thing: each step the policy reads the transcript and answers with tool
calls (several at once, which the loop runs concurrently, as agent frameworks
do) or with a final answer. The tools are ``exec``, ``read_file`` and
``write_file`` on an :class:`~pytest_forkd.AsyncVM`, so a tool call never
blocks the event loop: three agents in three VMs make progress together.
"""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pytest_forkd import AsyncVM

PROJECT = "/srv/project"


@dataclass(frozen=True)
class ToolCall:
    tool: str  # "exec", "read_file" or "write_file"
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    output: str
    ok: bool = True


@dataclass(frozen=True)
class Step:
    """What the policy answers: tool calls to run now, or the final answer."""

    calls: tuple[ToolCall, ...] = ()
    answer: str | None = None


class Policy(Protocol):
    """Plays the language model: the next step, given the task and the results so far."""

    def next_step(self, task: str, transcript: list[list[ToolResult]]) -> Step: ...


class AsyncAgent:
    """Runs a policy's tool calls in ``vm`` until it answers; keeps the transcript, one list per step."""

    def __init__(self, vm: AsyncVM, policy: Policy, *, max_steps: int = 10) -> None:
        self.vm = vm
        self.policy = policy
        self.max_steps = max_steps
        self.transcript: list[list[ToolResult]] = []

    async def run(self, task: str) -> str:
        for _ in range(self.max_steps):
            step = self.policy.next_step(task, self.transcript)
            if step.answer is not None:
                return step.answer
            # Tool calls of one step run concurrently, like parallel tool calls of a model.
            self.transcript.append(list(await asyncio.gather(*(self.call(call) for call in step.calls))))
        raise RuntimeError(f"no answer after {self.max_steps} steps")

    async def call(self, call: ToolCall) -> ToolResult:
        if call.tool == "exec":
            result = await self.vm.exec(call.args["command"], timeout=call.args.get("timeout", 60))
            return ToolResult(call, result.stdout + result.stderr, result.ok)
        if call.tool == "read_file":
            return ToolResult(call, (await self.vm.read_file(call.args["path"])).decode())
        if call.tool == "write_file":
            await self.vm.write_file(call.args["path"], call.args["content"])
            return ToolResult(call, f"wrote {len(call.args['content'])} characters to {call.args['path']}")
        return ToolResult(call, f"unknown tool {call.tool!r}", ok=False)


class FixAttempt:
    """A scripted policy that tries one fix of the buggy ``add`` in the project, then scores it.

    1. read calc.py and check.py (two tool calls at once);
    2. write calc.py with its ``return`` line replaced by ``fix``;
    3. run the checks;
    4. answer with the number of checks that pass.
    """

    def __init__(self, fix: str) -> None:
        self.fix = fix

    def next_step(self, task: str, transcript: list[list[ToolResult]]) -> Step:
        if not transcript:
            return Step(
                calls=(
                    ToolCall("read_file", {"path": f"{PROJECT}/calc.py"}),
                    ToolCall("read_file", {"path": f"{PROJECT}/check.py"}),
                )
            )
        if len(transcript) == 1:
            source = transcript[0][0].output
            fixed = (
                "\n".join(
                    f"    {self.fix}" if line.strip().startswith("return") else line for line in source.splitlines()
                )
                + "\n"
            )
            return Step(calls=(ToolCall("write_file", {"path": f"{PROJECT}/calc.py", "content": fixed}),))
        if len(transcript) == 2:
            return Step(calls=(ToolCall("exec", {"command": f"cd {shlex.quote(PROJECT)} && python3 -S check.py"}),))
        return Step(answer=transcript[2][0].output.strip())


class Notes:
    """A scripted policy that keeps notes in a file: write it, read it back, answer with its line count."""

    def __init__(self, path: str, lines: list[str]) -> None:
        self.path = path
        self.lines = lines

    def next_step(self, task: str, transcript: list[list[ToolResult]]) -> Step:
        if not transcript:
            return Step(calls=(ToolCall("exec", {"command": f"mkdir -p {shlex.quote(self.path.rsplit('/', 1)[0])}"}),))
        if len(transcript) == 1:
            return Step(calls=(ToolCall("write_file", {"path": self.path, "content": "\n".join(self.lines) + "\n"}),))
        if len(transcript) == 2:
            return Step(calls=(ToolCall("exec", {"command": f"wc -l < {shlex.quote(self.path)}"}),))
        return Step(answer=transcript[2][0].output.strip())
