"""OpenAI's chat completion and completion shapes, from the core's neutral events.

Two small pure encoders, one per route, each taking the events of one generation
(:mod:`tokenmill.chat.events`) and giving the chunks OpenAI's SDK reads, or taking
its whole :class:`~tokenmill.chat.events.Result` and giving the one response body.

:class:`ChatEncoder` (``chat.completion.chunk``, ``chat.completion``)::

    per choice: a delta with the role and empty content
    text: a ``content`` delta
    a call, once its name is whole: ``tool_calls: [{"index", "id", "type":
      "function", "function": {"name", "arguments": ""}}]``, then its arguments as
      ``function.arguments`` fragments (a call's end is not marked)
    a choice's end: an empty delta with its ``finish_reason`` (``tool_calls`` when it
      called tools)
    with ``include_usage``: a last chunk with no choices and the usage

Whole, a choice that called tools has ``tool_calls`` and ``content: null`` (unless it
also wrote text).

:class:`CompletionEncoder` (``text_completion``, streamed or not): per text delta a
choice with its ``text``; a choice's end, a choice with empty text and its
``finish_reason``; the usage chunk as chat's.

An error after streaming began is :meth:`~_Encoder.fail`: the error body as a chunk
(the router ends the stream with ``data: [DONE]``). Knows nothing of HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.chat import (
    ChoiceEnd,
    ChoiceResult,
    Event,
    Finished,
    Result,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
)
from tokenmill.engines import TokenLogprob, Usage
from tokenmill.errors import ServiceError


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


def completion_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
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
        "text_offset": [t.offset for t in tokens],
    }


def _text(piece: bytes) -> str:
    # A token can hold part of a character; its ``bytes`` say exactly what it holds.
    return piece.decode("utf-8", errors="replace")


class _Encoder:
    """What both routes' encoders share: the chunk's frame, the usage chunk, the
    in-band error. ``logprobs``: whether the request asked for them (and they are
    reported: not when the answer is read for tool calls)."""

    ID_PREFIX = ""  # the response id's, before the request's own
    CHUNK = ""  # the ``object`` of a streamed chunk
    BODY = ""  # the ``object`` of the whole response

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        *,
        choices: int = 1,
        include_usage: bool = False,
        logprobs: bool = False,
    ) -> None:
        self.response_id = f"{self.ID_PREFIX}-{request_id.removeprefix('req-')}"
        self.model = model
        self.created = created
        self.choices = choices
        self.include_usage = include_usage
        self.logprobs = logprobs

    def _chunk(self, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self.CHUNK,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **more,
        }

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        raise NotImplementedError

    def start(self) -> list[dict[str, Any]]:
        """The chunks before the first event."""
        return []

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """The chunks of one event (none for a call's end: OpenAI's stream does not
        mark it, nor the request's end without ``include_usage``)."""
        if isinstance(event, Finished):
            if not self.include_usage:
                return []
            return [self._chunk([], usage=usage_body(event.usage))]
        return self._choice_event(event)

    def _choice_event(self, event: Event) -> list[dict[str, Any]]:
        raise NotImplementedError

    def fail(self, error: ServiceError) -> list[dict[str, Any]]:
        """What a stream says of an error after it began: OpenAI's error body."""
        return [error.to_openai_body()]

    def body(self, result: Result) -> dict[str, Any]:
        """The whole response, as one body."""
        return {
            "id": self.response_id,
            "object": self.BODY,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice_body(i, c) for i, c in enumerate(result.choices)],
            "usage": usage_body(result.usage),
        }

    def _choice_body(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        raise NotImplementedError


class ChatEncoder(_Encoder):
    """Neutral events in, ``chat.completion.chunk`` out; a result in, a
    ``chat.completion`` out (see the module docstring)."""

    ID_PREFIX = "chatcmpl"
    CHUNK = "chat.completion.chunk"
    BODY = "chat.completion"

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(tokens) if self.logprobs else None

    def _delta(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._chunk([choice])

    def start(self) -> list[dict[str, Any]]:
        return [self._delta(i, {"role": "assistant", "content": ""}) for i in range(self.choices)]

    def _choice_event(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            logprobs = self._logprobs(event.logprobs) if event.logprobs else None
            return [self._delta(event.choice, {"content": event.text}, logprobs)]
        if isinstance(event, ToolCallStart):
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.call, "id": event.id, "type": "function", "function": function}
            return [self._delta(event.choice, {"tool_calls": [call]})]
        if isinstance(event, ToolCallArguments):
            piece = {"index": event.call, "function": {"arguments": event.text}}
            return [self._delta(event.choice, {"tool_calls": [piece]})]
        if isinstance(event, ChoiceEnd):
            return [self._delta(event.choice, {}, reason=event.reason)]
        return []  # a call's end

    def _choice_body(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
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
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": choice.reason,
        }


class CompletionEncoder(_Encoder):
    """Neutral events in, ``text_completion`` chunks out; a result in, one
    ``text_completion`` out (see the module docstring)."""

    ID_PREFIX = "cmpl"
    CHUNK = "text_completion"
    BODY = "text_completion"

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        return completion_logprobs(tokens) if self.logprobs else None

    def _text(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return self._chunk([choice])

    def _choice_event(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            logprobs = self._logprobs(event.logprobs) if event.logprobs else None
            return [self._text(event.choice, event.text, logprobs)]
        if isinstance(event, ChoiceEnd):
            return [self._text(event.choice, "", reason=event.reason)]
        return []  # a completion offers no tools: no calls

    def _choice_body(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        return {
            "index": index,
            "text": choice.text,
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": choice.reason,
        }
