"""A scripted Agents SDK model for offline tests: it answers by the conversation so far, never over the network.

``ScriptedModel(step)`` calls ``step(outputs)`` with the outputs of the tool
calls made so far (in order) and turns its answer into the model's reply: a
dict is a call of the sandbox shell tool ``exec_command`` with those
arguments (``{"cmd": "..."}``), a str is the final answer.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelTracing
from agents.tool import Tool
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from openai.types.responses.response_prompt_param import ResponsePromptParam

Step = Callable[[list[str]], "dict[str, Any] | str"]


def tool_outputs(items: str | list[TResponseInputItem]) -> list[str]:
    """The outputs of the function calls in a conversation, in order."""
    if isinstance(items, str):
        return []
    outputs = []
    for item in items:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            output = item.get("output")
            outputs.append(output if isinstance(output, str) else json.dumps(output))
    return outputs


class ScriptedModel(Model):
    """A Model whose every answer is ``step(tool outputs so far)``; ``calls`` lists the tools it was offered."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.offered: list[list[str]] = []

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        self.offered.append([tool.name for tool in tools])
        answer = self.step(tool_outputs(input))
        output: list[Any]
        if isinstance(answer, str):
            text = ResponseOutputText(type="output_text", text=answer, annotations=[])
            output = [
                ResponseOutputMessage(
                    id=f"msg_{uuid.uuid4().hex}", type="message", role="assistant", status="completed", content=[text]
                )
            ]
        else:
            output = [
                ResponseFunctionToolCall(
                    type="function_call",
                    id=f"fc_{uuid.uuid4().hex}",
                    call_id=f"call_{uuid.uuid4().hex}",
                    name="exec_command",
                    arguments=json.dumps(answer),
                    status="completed",
                )
            ]
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("ScriptedModel answers Runner.run, not Runner.run_streamed")
