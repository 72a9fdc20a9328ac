"""Serving Anthropic's Messages API: a request in, one generation of the core, a
message (streamed as events, or whole) out.

:func:`open_message` turns the request into the core's
:class:`~tokenmill.chat.request.ChatRequest` (``system`` first, its per-session
lines apart for the core to place after the tools where the deployment's
``prompt_order`` says so (:mod:`tokenmill.chat.layout`), a ``system`` message in its
place, each ``tool_use`` block an assistant's call, each ``tool_result`` block
a ``tool`` turn naming it; thinking blocks never reach the model), applies its
context edits (:mod:`~tokenmill.server.messages.context`) and opens it with
:func:`tokenmill.chat.open_generation`: the gateway admits, holds credit and meters
it exactly as any chat. A ``max_tokens`` beyond what the context window leaves is
served up to the window, which ends the message with ``stop_reason:
"model_context_window_exceeded"`` (as Anthropic's API does). The router sends the
returned :class:`MessageRun` as events or as one body. Knows nothing of routes.
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
    PromptOrder,
    ResponseFormat,
    SystemBlock,
    SystemSplit,
    Turn,
    count_prompt,
    open_generation,
    split_system,
)
from tokenmill.chat import ToolChoice as CoreToolChoice
from tokenmill.chat.hosted import hosted_tools
from tokenmill.engines import SamplingParams, ToolCall
from tokenmill.errors import ContextLengthError, InvalidRequestError, ServiceError
from tokenmill.gateway import Deployment, Gateway
from tokenmill.identity import Caller
from tokenmill.server.messages.context import clear_thinking, clear_tool_uses, count_tool_uses
from tokenmill.server.messages.events import MessageEncoder
from tokenmill.server.messages.protocol import (
    ClearThinking,
    ClearToolUses,
    CountTokensRequest,
    CustomTool,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from tokenmill.server.sse import encode_typed_event, with_ticks

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
    omitted_tools: tuple[str, ...] = ()  # hosted tools left out of the prompt
    # A quiet stream sends an event Claude Code counts this often (stream_activity_s).
    activity_s: float | None = None

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    async def events(self) -> AsyncIterator[bytes]:
        """The message's events; an error after streaming began is an ``error`` event."""
        encoder = self.encoder
        try:
            for event in encoder.start():
                yield encode_typed_event(event)
            async for e in with_ticks(self.generation.events(), self.activity_s):
                for event in encoder.activity() if e is None else encoder.feed(e):
                    yield encode_typed_event(event)
        except ServiceError as e:
            for event in self.encoder.fail(e):
                yield encode_typed_event(event)

    async def collect(self) -> dict[str, Any]:
        self.encoder.start()
        async for e in self.generation.events():
            self.encoder.feed(e)
        return self.encoder.message

    async def aclose(self) -> None:
        await self.generation.aclose()


def system_prompt(body: CountTokensRequest, order: PromptOrder) -> SystemSplit:
    """``system`` as the text sessions share and this session's lines
    (:func:`tokenmill.chat.split_system`; ``as_sent``: all of it shared, unmoved)."""
    if body.system is None or order == "as_sent":
        return SystemSplit(body.system_text() or "", "")
    if isinstance(body.system, str):
        return split_system([SystemBlock(body.system)])
    return split_system([SystemBlock(b.text, b.cache_control is not None) for b in body.system])


def conversation(body: CountTokensRequest, system: str | None = None) -> tuple[Turn, ...]:
    """The request's messages as the core's turns, ``system`` (the request's, unless
    given) first."""
    turns: list[Turn] = []
    if system is None:
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
            elif message.role == "system":
                raise InvalidRequestError(
                    "a system message holds text blocks only", param=f"messages.{i}.content"
                )
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
            # (A thinking block: an earlier answer's, never shown to the model.)
        if message.role == "assistant":
            turns.append(Turn("assistant", "".join(texts), tuple(calls)))
        elif message.role == "system":
            turns.append(Turn("system", "\n\n".join(texts)))
        elif texts:
            turns.append(Turn("user", "".join(texts)))
    # The answer follows the last turn (system messages after it are instructions).
    last = max(i for i, m in enumerate(body.messages) if m.role != "system")
    if body.messages[last].role == "assistant":
        raise InvalidRequestError(
            "the last message is the assistant's: tokenmill does not continue a prefilled "
            "answer; end with a user message",
            param=f"messages.{last}.role",
        )
    return tuple(turns)


def _tool_choice(choice: ToolChoice | None) -> CoreToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        assert choice.name is not None
        return NamedTool(choice.name)
    return _CHOICES[choice.type]


def chat_request(
    body: CountTokensRequest, sampling: SamplingParams, order: PromptOrder = "as_sent"
) -> ChatRequest:
    """The core's request for ``body`` (``sampling`` without its constraint), its
    system prompt's per-session lines placed as ``order`` says (the deployment's
    ``prompt_order``)."""
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
    system = system_prompt(body, order)
    return ChatRequest(
        sampling=sampling,
        messages=conversation(body, system.stable),
        tools=tools,
        tool_choice=_tool_choice(choice) if tools else None,
        parallel_tool_calls=parallel,
        session_lines=system.session,
    )


def _param(param: str | None) -> str | None:
    """A field's name as the core spells it (chat's), as this API spells it."""
    if param is None:
        return None
    if param.startswith("tools.") and ".function." in param:
        name = param.replace(".function.", ".", 1)
        return name.replace(".parameters", ".input_schema")
    return {"response_format": "output_config.format"}.get(param, param)


def check_model(deployment: Deployment, body: CountTokensRequest) -> tuple[str, ...]:
    """What the deployment cannot serve of ``body`` (a 400), and the hosted tools it
    leaves out. The models served do not reason: ``thinking`` ``adaptive`` and
    ``disabled`` ask for nothing they could do, a thinking budget for something
    they cannot."""
    if body.thinking is not None and body.thinking.type == "enabled":
        raise InvalidRequestError(
            f"thinking.type 'enabled' asks for a thinking budget, and the model of "
            f'{deployment.id!r} does not reason; send thinking {{"type": "adaptive"}} '
            'or {"type": "disabled"} (no thinking blocks), or leave it out',
            param="thinking.type",
        )
    offered = [(f"tools.{i}.type", t.name or t.type) for i, t in body.server_tools()]
    policy = deployment.config.hosted_tools
    return hosted_tools(policy, deployment.id, offered, "offer custom tools (with input_schema)")


async def _count(deployment: Deployment, body: CountTokensRequest) -> int:
    try:
        order = deployment.config.prompt_order
        request = chat_request(body, SamplingParams(max_tokens=1), order)
        return await count_prompt(deployment, request)
    except InvalidRequestError as e:
        e.param = _param(e.param)
        raise


async def edit_context(
    deployment: Deployment, body: CountTokensRequest
) -> tuple[CountTokensRequest, list[dict[str, Any]] | None, int | None]:
    """``body`` with its context edits applied, the edits applied (None: none asked
    for) and the prompt's size before them (None: not counted)."""
    if body.context_management is None:
        return body, None, None
    applied: list[dict[str, Any]] = []
    messages = body.messages
    original: int | None = None
    for edit in body.context_management.edits:
        if isinstance(edit, ClearThinking):
            messages, turns = clear_thinking(messages, edit)
            if turns:
                applied.append(
                    {"type": edit.type, "cleared_thinking_turns": turns, "cleared_input_tokens": 0}
                )
        elif isinstance(edit, ClearToolUses):
            current = body.model_copy(update={"messages": messages})
            if edit.trigger.type == "tool_uses":
                if count_tool_uses(messages) < edit.trigger.value:
                    continue
                before = None
            else:
                before = await _count(deployment, current)
                original = before if original is None else original
                if before < edit.trigger.value:
                    continue
            edited, uses = clear_tool_uses(messages, edit)
            if not uses:
                continue
            if before is None:
                before = await _count(deployment, current)
                original = before if original is None else original
            after = await _count(deployment, body.model_copy(update={"messages": edited}))
            cleared = before - after
            if cleared <= 0:
                continue  # results shorter than the placeholder: nothing gained
            if edit.clear_at_least is not None and cleared < edit.clear_at_least.value:
                continue  # not worth losing the cached prefix for
            messages = edited
            applied.append(
                {"type": edit.type, "cleared_tool_uses": uses, "cleared_input_tokens": cleared}
            )
    return body.model_copy(update={"messages": messages}), applied, original


async def count_message(deployment: Deployment, body: CountTokensRequest) -> tuple[int, int | None]:
    """The prompt tokens a message with ``body`` would be billed for (its
    ``input_tokens`` plus ``cache_read_input_tokens``): tools and calls included,
    context edits applied, however long (no room to generate is asked for); and the
    count before the edits, where they changed it."""
    check_model(deployment, body)
    edited, applied, original = await edit_context(deployment, body)
    count = await _count(deployment, edited)
    return count, original if applied else None


async def open_message(
    gateway: Gateway,
    deployment: Deployment,
    body: MessagesRequest,
    request_id: str,
    caller: Caller,
) -> MessageRun:
    """Build the core's request and open it through the gateway (may raise)."""
    omitted = check_model(deployment, body)
    edited, applied, _ = await edit_context(deployment, body)
    assert isinstance(edited, MessagesRequest)
    sampling = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()),
    )
    try:
        # A max_tokens past what the context leaves is served up to the window.
        request = chat_request(edited, sampling, deployment.config.prompt_order)
        generation = await open_generation(
            gateway, deployment, request, request_id, caller, up_to_window=True
        )
    except InvalidRequestError as e:
        if isinstance(e, ContextLengthError) and e.param == "max_tokens":
            e.param = "messages"  # the prompt alone fills the window
        e.param = _param(e.param)
        raise
    # max_tokens went past the context: the window ends the message.
    window = generation.stream.request.sampling.max_tokens < sampling.max_tokens
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
    if applied is not None:
        message["context_management"] = {"applied_edits": applied}
    encoder = MessageEncoder(message, window=window)
    return MessageRun(generation, encoder, omitted, gateway.settings.stream_activity_s)
