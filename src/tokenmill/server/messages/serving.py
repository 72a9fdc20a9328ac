"""Serving Anthropic's Messages API: a request in, one generation of the core, a
message (streamed as events, or whole) out.

:func:`open_message` turns the request into the core's
:class:`~tokenmill.chat.request.ChatRequest` (``system`` first, each ``tool_use``
block an assistant's call, each ``tool_result`` block a ``tool`` turn naming it) and
opens it with :func:`tokenmill.chat.open_generation`: the gateway admits, holds
credit and meters it exactly as any chat. The router sends the returned
:class:`MessageRun` as events or as one body. Knows nothing of routes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.chat import (
    ChatRequest,
    FunctionTool,
    Generation,
    NamedTool,
    ResponseFormat,
    Turn,
    count_prompt,
    open_generation,
)
from tokenmill.chat import ToolChoice as CoreToolChoice
from tokenmill.engines import SamplingParams, ToolCall
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.gateway import Deployment, Gateway
from tokenmill.identity import Caller
from tokenmill.server.messages.events import MessageEncoder
from tokenmill.server.messages.protocol import (
    CountTokensRequest,
    CustomTool,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from tokenmill.server.sse import encode_typed_event

# Anthropic's tool_choice types as the core's.
_CHOICES: dict[str, CoreToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


@dataclass
class MessageRun:
    """One message being generated: send :meth:`events` or await :meth:`collect`, and
    :meth:`aclose` always (it settles the bill)."""

    generation: Generation
    encoder: MessageEncoder

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    async def events(self) -> AsyncIterator[bytes]:
        """The message's events; an error after streaming began is an ``error`` event."""
        try:
            for event in self.encoder.start():
                yield encode_typed_event(event)
            async for e in self.generation.events():
                for event in self.encoder.feed(e):
                    yield encode_typed_event(event)
        except TokenmillError as e:
            for event in self.encoder.fail(e):
                yield encode_typed_event(event)

    async def collect(self) -> dict[str, Any]:
        self.encoder.start()
        async for e in self.generation.events():
            self.encoder.feed(e)
        return self.encoder.message

    async def aclose(self) -> None:
        await self.generation.aclose()


def conversation(body: CountTokensRequest) -> tuple[Turn, ...]:
    """The request's messages as the core's turns, ``system`` first."""
    turns: list[Turn] = []
    system = body.system_text()
    if system:
        turns.append(Turn("system", system))
    names: dict[str, str] = {}  # tool_use id -> the tool's name
    for i, message in enumerate(body.messages):
        texts: list[str] = []
        calls: list[ToolCall] = []
        for block in message.blocks():
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise InvalidRequestError(
                        "tool_use blocks are the assistant's: send them in an assistant message",
                        param=f"messages.{i}.content",
                    )
                names[block.id] = block.name
                calls.append(ToolCall(block.id, block.name, json.dumps(block.input)))
            elif isinstance(block, ToolResultBlock):
                if message.role != "user" or block.tool_use_id not in names:
                    raise InvalidRequestError(
                        f"tool_result for {block.tool_use_id!r} answers no tool_use block of "
                        "an earlier assistant message; send it in the user message after it",
                        param=f"messages.{i}.content",
                    )
                result = block.text()
                if block.is_error:
                    result = f"Error: {result}"
                name = names[block.tool_use_id]
                turns.append(Turn("tool", result, tool_call_id=block.tool_use_id, name=name))
        if message.role == "assistant":
            turns.append(Turn("assistant", "".join(texts), tuple(calls)))
        elif texts:
            turns.append(Turn("user", "".join(texts)))
    if body.messages[-1].role == "assistant":
        raise InvalidRequestError(
            "the last message is the assistant's: tokenmill does not continue a prefilled "
            "answer; end with a user message",
            param=f"messages.{len(body.messages) - 1}.role",
        )
    return tuple(turns)


def _tool_choice(choice: ToolChoice | None) -> CoreToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        assert choice.name is not None
        return NamedTool(choice.name)
    return _CHOICES[choice.type]


def chat_request(body: CountTokensRequest, sampling: SamplingParams) -> ChatRequest:
    """The core's request for ``body`` (``sampling`` without its constraint)."""
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        spec = ResponseFormat("json_schema", fmt.schema_, name="output")
        sampling = replace(sampling, constraint=spec.constraint("output_config.format"))
    tools = tuple(
        FunctionTool(t.name, t.description, t.input_schema)
        for t in body.tools or []
        if isinstance(t, CustomTool)
    )
    choice = body.tool_choice
    parallel = None
    if choice is not None and choice.disable_parallel_tool_use:
        parallel = False
    return ChatRequest(
        sampling=sampling,
        messages=conversation(body),
        tools=tools,
        tool_choice=_tool_choice(choice) if tools else None,
        parallel_tool_calls=parallel,
    )


def _param(param: str | None) -> str | None:
    """A field's name as the core spells it (chat's), as this API spells it."""
    if param is None:
        return None
    if param.startswith("tools.") and ".function." in param:
        name = param.replace(".function.", ".", 1)
        return name.replace(".parameters", ".input_schema")
    return {"response_format": "output_config.format"}.get(param, param)


async def count_message(deployment: Deployment, body: CountTokensRequest) -> int:
    """The prompt tokens a message with ``body`` would be billed for (its
    ``input_tokens`` plus ``cache_read_input_tokens``): tools and calls included."""
    try:
        return await count_prompt(deployment, chat_request(body, SamplingParams(max_tokens=1)))
    except InvalidRequestError as e:
        e.param = _param(e.param)
        raise


async def open_message(
    gateway: Gateway,
    deployment: Deployment,
    body: MessagesRequest,
    request_id: str,
    caller: Caller,
) -> MessageRun:
    """Build the core's request and open it through the gateway (may raise)."""
    sampling = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
    )
    try:
        generation = await open_generation(
            gateway, deployment, chat_request(body, sampling), request_id, caller
        )
    except InvalidRequestError as e:
        e.param = _param(e.param)
        raise
    message: dict[str, Any] = {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": body.model or deployment.id,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": generation.stream.prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    return MessageRun(generation, MessageEncoder(message))
