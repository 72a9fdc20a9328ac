"""Chat completions and completions over the generation core: a wire request in, the
core's events out as OpenAI's shapes.

:func:`open_generation` turns a validated body into the core's
:class:`~tokenmill.chat.ChatRequest` and opens it; :class:`OpenAIGeneration` shapes
the core's events as ``chat.completion.chunk`` / ``text_completion`` server-sent
events (``events``), or its result as one body (``collect``). Knows nothing of routes.

A call goes out once its name is whole, as ``{"index", "id", "type": "function",
"function": {"name", "arguments": ""}}``, then its arguments as ``function.arguments``
fragments; text as ``content`` deltas. A choice that called tools ends with
``finish_reason: "tool_calls"``; not streamed, its message has ``tool_calls`` and
``content: null`` (unless it also wrote text).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill import chat
from tokenmill.engines.base import PromptItem, TokenLogprob, Usage
from tokenmill.errors import TokenmillError
from tokenmill.gateway.core import Gateway
from tokenmill.gateway.deployment import Deployment
from tokenmill.identity import Caller
from tokenmill.server.openai.protocol import Message, SamplingFields
from tokenmill.server.openai.tools import ToolFields, tool_choice
from tokenmill.server.sse import DONE, encode_event

Route = Literal["chat", "completion"]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs``: one entry a token, with its likeliest alternatives."""
    return {
        "content": [
            {
                "token": _text(t.piece),
                "logprob": t.logprob,
                "bytes": list(t.piece),
                "top_logprobs": [
                    {"token": _text(a.piece), "logprob": a.logprob, "bytes": list(a.piece)}
                    for a in t.top
                ],
            }
            for t in tokens
        ]
    }


def completion_logprobs(tokens: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion's ``logprobs``: the sampled token is always among ``top_logprobs``.

    An echoed prompt's first token has neither a log probability nor alternatives.
    """
    top: list[dict[str, float] | None] = []
    for t in tokens:
        if t.logprob is None:
            top.append(None)
            continue
        alternatives = {_text(a.piece): a.logprob for a in t.top}
        alternatives.setdefault(_text(t.piece), t.logprob)
        top.append(alternatives)
    return {
        "tokens": [_text(t.piece) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": top,
        "text_offset": [offset + t.offset for t in tokens],
    }


def _text(piece: bytes) -> str:
    # A token can hold part of a character; its ``bytes`` say exactly what it holds.
    return piece.decode("utf-8", errors="replace")


@dataclass
class OpenAIGeneration:
    """A core :class:`~tokenmill.chat.Generation` in OpenAI's shapes (``route``'s)."""

    route: Route
    generation: chat.Generation
    model: str
    include_usage: bool
    created: int
    logprobs: bool = False

    @property
    def request_id(self) -> str:
        return self.generation.request_id

    @property
    def response_id(self) -> str:
        prefix = "chatcmpl" if self.route == "chat" else "cmpl"
        return f"{prefix}-{self.request_id.removeprefix('req-')}"

    async def aclose(self) -> None:
        await self.generation.aclose()

    def _frame(self, choices: list[dict[str, Any]], **more: Any) -> bytes:
        return encode_event(
            {
                "id": self.response_id,
                "object": "chat.completion.chunk" if self.route == "chat" else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **more,
            }
        )

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> Any:
        if not self.logprobs:
            return None
        return chat_logprobs(tokens) if self.route == "chat" else completion_logprobs(tokens)

    def _delta(
        self, index: int, delta: dict[str, Any], logprobs: Any = None, reason: str | None = None
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._frame([choice])

    def _text(self, index: int, text: str, tokens: Sequence[TokenLogprob] = ()) -> bytes:
        logprobs = self._logprobs(tokens) if tokens else None
        if self.route == "chat":
            return self._delta(index, {"content": text}, logprobs)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return self._frame([choice])

    def _end(self, index: int, reason: str) -> bytes:
        if self.route == "chat":
            return self._delta(index, {}, reason=reason)
        return self._frame(
            [{"index": index, "text": "", "logprobs": None, "finish_reason": reason}]
        )

    def _frame_of(self, e: chat.Event) -> bytes | None:
        if isinstance(e, chat.TextDelta):
            return self._text(e.choice, e.text, e.logprobs)
        if isinstance(e, chat.ToolCallStart):
            function = {"name": e.name, "arguments": ""}
            opened = {"index": e.call, "id": e.id, "type": "function", "function": function}
            return self._delta(e.choice, {"tool_calls": [opened]})
        if isinstance(e, chat.ToolCallArguments):
            piece = {"index": e.call, "function": {"arguments": e.text}}
            return self._delta(e.choice, {"tool_calls": [piece]})
        if isinstance(e, chat.ChoiceEnd):
            return self._end(e.choice, e.reason)
        if isinstance(e, chat.Finished) and self.include_usage:
            return self._frame([], usage=usage_body(e.usage))
        return None  # a call's end: OpenAI's stream does not mark it

    async def events(self) -> AsyncIterator[bytes]:
        """SSE frames; an error after streaming began becomes an ``error`` event."""
        try:
            if self.route == "chat":
                for index in range(self.generation.choices):
                    yield self._delta(index, {"role": "assistant", "content": ""})
            async for e in self.generation.events():
                frame = self._frame_of(e)
                if frame is not None:
                    yield frame
        except TokenmillError as e:
            yield encode_event(e.to_openai_body())
        yield DONE

    async def collect(self) -> dict[str, Any]:
        """The whole completion as one OpenAI response body."""
        result = await self.generation.collect()
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.route == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice_body(i, c) for i, c in enumerate(result.choices)],
            "usage": usage_body(result.usage),
        }

    def _choice_body(self, index: int, choice: chat.ChoiceResult) -> dict[str, Any]:
        logprobs = self._logprobs(choice.logprobs)
        reason = choice.reason
        if self.route != "chat":
            return {
                "index": index,
                "text": choice.text,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.tool_calls:
            message["content"] = choice.text or None
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in choice.tool_calls
            ]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def chat_request(
    body: SamplingFields,
    route: Route,
    *,
    prompt: str | None = None,
    prompt_tokens: tuple[int, ...] | None = None,
    prompts: tuple[PromptItem, ...] | None = None,
    messages: Sequence[Message] | None = None,
) -> chat.ChatRequest:
    """The body as the core's neutral request."""
    tools: tuple[chat.FunctionTool, ...] = ()
    choice: chat.ToolChoice | None = None
    parallel = None
    if isinstance(body, ToolFields):
        tools = tuple(t.function_tool() for t in body.tools or ())
        choice = None if body.tool_choice is None else tool_choice(body.tool_choice)
        parallel = body.parallel_tool_calls
    return chat.ChatRequest(
        sampling=body.sampling_params(body.max_tokens or 0),
        kind=route,
        messages=None if messages is None else tuple(m.to_turn() for m in messages),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        prompts=prompts,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template=body.chat_template,
        n=body.n,
    )


async def open_generation(
    gateway: Gateway,
    deployment: Deployment,
    body: SamplingFields,
    route: Route,
    request_id: str,
    caller: Caller,
    *,
    prompt: str | None = None,
    prompt_tokens: tuple[int, ...] | None = None,
    prompts: tuple[PromptItem, ...] | None = None,
    messages: Sequence[Message] | None = None,
    session: str | None = None,
) -> OpenAIGeneration:
    """Open the generation through the core (may raise); ``session`` is the routing's
    affinity hint (``x-session-id``, else ``user``)."""
    request = chat_request(
        body, route, prompt=prompt, prompt_tokens=prompt_tokens, prompts=prompts, messages=messages
    )
    generation = await chat.open_generation(
        gateway, deployment, request, request_id, caller, session=session
    )
    return OpenAIGeneration(
        route=route,
        generation=generation,
        model=body.model or deployment.id,
        include_usage=body.include_usage,
        created=int(time.time()),
        logprobs=body.logprob_alternatives() is not None and not generation.tool_calls,
    )
