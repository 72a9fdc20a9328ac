"""Serving logic for chat and text completions: wire request in, OpenAI shapes out.

Knows the OpenAI response formats; knows nothing of routes. ``open_generation``
returns a :class:`Generation`; the router streams it as SSE (``events``) or awaits
``collect`` for one JSON body. ``tokenize`` and ``detokenize`` answer vLLM's
``/tokenize`` and ``/detokenize`` with the deployment's own tokenizer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from tokenmill.engines.base import (
    GenerationRequest,
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
)
from tokenmill.server.sse import DONE, encode_event

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
    # The stream's first chunk is the prompt (``echo``): it goes out first, and the
    # completion's text offsets count from the prompt's start.
    echo: bool = False

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    @property
    def response_id(self) -> str:
        prefix = "chatcmpl" if self.route == "chat" else "cmpl"
        return f"{prefix}-{self.request_id.removeprefix('req-')}"

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
    ) -> bytes:
        logprobs = self._logprobs(tokens) if tokens else None
        if self.route == "chat":
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
            return self._frame(
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            )
        return self._frame(
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        )

    async def events(self) -> AsyncIterator[bytes]:
        """SSE frames; an error after streaming began becomes an ``error`` event."""
        try:
            if self.route == "chat":
                yield self._frame(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            prompt = self.echo
            base = 0
            async for chunk in self.stream:
                if prompt:
                    prompt = False
                    base = len(chunk.text)
                    yield self._text_frame(chunk.text, tokens=chunk.logprobs)
                    continue
                if chunk.text or chunk.logprobs:
                    yield self._text_frame(chunk.text, tokens=_shifted(chunk.logprobs, base))
                if chunk.finish_reason is not None:
                    yield self._text_frame("", _public_reason(chunk.finish_reason))
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
        parts: list[str] = []
        tokens: list[TokenLogprob] = []
        reason: str | None = None
        prompt = self.echo
        base = 0
        async for chunk in self.stream:
            if prompt:
                prompt = False
                base = len(chunk.text)
            else:
                chunk = replace(chunk, logprobs=_shifted(chunk.logprobs, base))
            if chunk.text:
                parts.append(chunk.text)
            tokens.extend(chunk.logprobs)
            if chunk.finish_reason is not None:
                reason = _public_reason(chunk.finish_reason)
        text = "".join(parts)
        logprobs = self._logprobs(tokens)
        if self.route == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            obj = "text_completion"
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_body(self.stream.usage, self.stream.prompt_tokens),
        }


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
    messages: list[Message] | None = None,
) -> Generation:
    """Build the engine request and open it through the gateway (may raise)."""
    if route == "chat" and messages is None:
        assert prompt is not None
        messages, prompt = [Message(role="user", content=prompt)], None
    chat = None
    if messages is not None:
        chat = tuple(m.to_chat_message() for m in messages)
    request = GenerationRequest(
        request_id=request_id,
        sampling=body.sampling_params(body.max_tokens or 0),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        messages=chat,
        chat_template=body.chat_template,
    )
    stream = await gateway.open(deployment, request, caller)
    return Generation(
        route=route,
        stream=stream,
        model=body.model or deployment.id,
        include_usage=body.include_usage,
        created=int(time.time()),
        logprobs=body.logprob_alternatives() is not None,
        echo=request.sampling.echo,
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
