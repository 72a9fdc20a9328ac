"""Serving logic for chat and text completions: wire request in, OpenAI shapes out.

Knows the OpenAI response formats; knows nothing of routes. ``open_generation``
returns a :class:`Generation`; the router streams it as SSE (``events``) or awaits
``collect`` for one JSON body. ``tokenize``, ``detokenize`` and ``tokenizer_info``
answer vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` with the
deployment's own tokenizer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal

from tokenmill.engines.base import (
    GenerationRequest,
    PromptItem,
    TokenizeRequest,
    TokenLogprob,
    Usage,
)
from tokenmill.errors import TokenmillError
from tokenmill.gateway.core import Gateway, RequestStream
from tokenmill.gateway.deployment import Deployment
from tokenmill.gateway.metering import Caller
from tokenmill.server.protocol import (
    DetokenizeBody,
    Detokenized,
    Message,
    SamplingFields,
    TokenizeBody,
    Tokenized,
    TokenizerInfoBody,
)
from tokenmill.server.sse import DONE, encode_event
from tokenmill.server.structured import instruct
from tokenmill.server.tools import chat_template, plan_tools

Route = Literal["chat", "completion"]


def usage_body(usage: Usage | None, prompt_tokens: int) -> dict[str, Any]:
    if usage is None:
        usage = Usage(prompt_tokens, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_logprobs(tokens: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
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


def completion_logprobs(
    tokens: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
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
class Generation:
    route: Route
    stream: RequestStream
    model: str
    include_usage: bool
    created: int
    logprobs: bool = False
    # Each choice's first chunk is its prompt (``echo``): it goes out first, and the
    # completion's text offsets count from the prompt's start.
    echo: bool = False
    choices: int = 1  # ``n`` times the prompts; chunks carry their choice's index

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    @property
    def response_id(self) -> str:
        prefix = "chatcmpl" if self.route == "chat" else "cmpl"
        return f"{prefix}-{self.request_id.removeprefix('req-')}"

    def _choices(self) -> dict[int, _Choice]:
        return {i: _Choice(prompt=self.echo) for i in range(self.choices)}

    def _frame(self, choice: dict[str, Any]) -> bytes:
        return encode_event(
            {
                "id": self.response_id,
                "object": "chat.completion.chunk" if self.route == "chat" else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def _logprobs(self, tokens: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> Any:
        if not self.logprobs:
            return None
        return chat_logprobs(tokens) if self.route == "chat" else completion_logprobs(tokens)

    def _text_frame(
        self,
        text: str,
        finish_reason: str | None = None,
        tokens: tuple[TokenLogprob, ...] = (),
        index: int = 0,
    ) -> bytes:
        logprobs = self._logprobs(tokens) if tokens else None
        if self.route == "chat":
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
            return self._frame(
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            )
        return self._frame(
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        )

    async def events(self) -> AsyncIterator[bytes]:
        """SSE frames; an error after streaming began becomes an ``error`` event."""
        try:
            choices = self._choices()
            if self.route == "chat":
                for index in choices:
                    yield self._frame(
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
            async for chunk in self.stream:
                index = chunk.index
                choice = choices[index]
                if choice.prompt:
                    choice.prompt = False
                    choice.base = len(chunk.text)
                    yield self._text_frame(chunk.text, tokens=chunk.logprobs, index=index)
                    continue
                if chunk.text or chunk.logprobs:
                    tokens = _shifted(chunk.logprobs, choice.base)
                    yield self._text_frame(chunk.text, tokens=tokens, index=index)
                if chunk.choice_finish is not None:
                    choice.finished = True
                    yield self._text_frame("", _public_reason(chunk.choice_finish), index=index)
                if chunk.finish_reason is not None:
                    # The request's end: its last choice's, and any still open (an abort).
                    reason = _public_reason(chunk.finish_reason)
                    for i in [index, *(i for i, c in choices.items() if i != index)]:
                        if not choices[i].finished:
                            choices[i].finished = True
                            yield self._text_frame("", reason, index=i)
            if self.include_usage:
                usage = usage_body(self.stream.usage, self.stream.prompt_tokens)
                frame: dict[str, Any] = {
                    "id": self.response_id,
                    "object": "chat.completion.chunk"
                    if self.route == "chat"
                    else "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage,
                }
                yield encode_event(frame)
        except TokenmillError as e:
            yield encode_event(e.to_openai_body())
        yield DONE

    async def collect(self) -> dict[str, Any]:
        """The whole completion as one OpenAI response body."""
        choices = self._choices()
        async for chunk in self.stream:
            choice = choices[chunk.index]
            if choice.prompt:
                choice.prompt = False
                choice.base = len(chunk.text)
            else:
                chunk = replace(chunk, logprobs=_shifted(chunk.logprobs, choice.base))
            if chunk.text:
                choice.parts.append(chunk.text)
            choice.tokens.extend(chunk.logprobs)
            if chunk.choice_finish is not None:
                choice.reason = _public_reason(chunk.choice_finish)
            if chunk.finish_reason is not None:
                for c in choices.values():  # the last choice's end, and any still open
                    if c is choice or c.reason is None:
                        c.reason = _public_reason(chunk.finish_reason)
        bodies = [self._choice_body(i, c) for i, c in choices.items()]
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.route == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": bodies,
            "usage": usage_body(self.stream.usage, self.stream.prompt_tokens),
        }

    def _choice_body(self, index: int, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.parts)
        logprobs = self._logprobs(choice.tokens)
        if self.route == "chat":
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": choice.reason,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.reason}


@dataclass
class _Choice:
    """One choice of a response while its chunks come in."""

    prompt: bool = False  # its echoed prompt is still to come
    base: int = 0  # its echoed prompt's length: where the completion's offsets start
    finished: bool = False
    reason: str | None = None
    parts: list[str] = field(default_factory=list)
    tokens: list[TokenLogprob] = field(default_factory=list)


def _shifted(tokens: tuple[TokenLogprob, ...], chars: int) -> tuple[TokenLogprob, ...]:
    """``tokens`` with their text offsets moved ``chars`` on (past an echoed prompt)."""
    if not chars:
        return tokens
    return tuple(replace(t, offset=t.offset + chars) for t in tokens)


def _public_reason(reason: str | None) -> str | None:
    # An engine-side abort only reaches a client that is still listening at
    # shutdown; OpenAI clients know "stop" and "length".
    if reason == "abort":
        return "stop"
    return reason


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
    messages: list[Message] | None = None,
) -> Generation:
    """Build the engine request and open it through the gateway (may raise)."""
    if route == "chat" and messages is None:
        assert prompt is not None
        messages, prompt = [Message(role="user", content=prompt)], None
    sampling = body.sampling_params(body.max_tokens or 0)
    template = await chat_template(body, deployment) if route == "chat" else None
    engine = deployment.config.engine
    tools = plan_tools(body, route, messages, engine, sampling.constraint, template)
    chat = None
    if tools is not None:
        chat = tools.messages
        if tools.constraint is not None:  # the tool format, the answer branch included
            sampling = replace(sampling, constraint=tools.constraint)
        elif sampling.constraint is not None:
            chat = instruct(chat, sampling.constraint)
    elif messages is not None:
        chat = tuple(m.to_chat_message() for m in messages)
        if sampling.constraint is not None:
            chat = instruct(chat, sampling.constraint)
    request = GenerationRequest(
        request_id=request_id,
        sampling=sampling,
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        prompts=prompts,
        messages=chat,
        chat_template=body.chat_template,
        n=body.n,
        tools=None if tools is None else tools.spec,
    )
    stream = await gateway.open(deployment, request, caller)
    kind: Callable[..., Generation] = Generation
    if tools is not None and tools.reads_calls:
        # Imported here: tool_serving builds on this module.
        from tokenmill.server.tool_serving import ToolGeneration

        kind = partial(ToolGeneration, output=tools.output)
    return kind(
        route=route,
        stream=stream,
        model=body.model or deployment.id,
        include_usage=body.include_usage,
        created=int(time.time()),
        logprobs=body.logprob_alternatives() is not None,
        echo=request.sampling.echo,
        choices=request.choices,
    )


async def tokenize(deployment: Deployment, body: TokenizeBody) -> Tokenized:
    """The prompt's token ids, as a generation with the same prompt would see them."""
    host = await deployment.any_host()
    messages = None
    if body.messages is not None:
        messages = tuple(m.to_chat_message() for m in body.messages)
    request = TokenizeRequest(
        prompt=body.prompt,
        messages=messages,
        chat_template=body.chat_template,
        add_generation_prompt=body.add_generation_prompt,
    )
    tokens = await host.tokenize(request)
    return Tokenized(tokens=tokens, count=len(tokens), max_model_len=host.context_length())


async def detokenize(deployment: Deployment, body: DetokenizeBody) -> Detokenized:
    host = await deployment.any_host()
    return Detokenized(prompt=await host.detokenize(body.tokens))


async def tokenizer_info(deployment: Deployment) -> TokenizerInfoBody:
    """vLLM's ``/tokenizer_info``: what lm-evaluation-harness's remote tokenizer reads."""
    host = await deployment.any_host()
    info = await host.tokenizer_info()
    return TokenizerInfoBody.model_validate(dataclasses.asdict(info))
