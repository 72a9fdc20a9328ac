"""Anthropic's streaming events, from the core's neutral events.

:class:`MessageEncoder` is a small state machine: it takes the events of one
generation (:mod:`tokenmill.chat.events`) and gives the events Anthropic's SDK reads::

    message_start, ping
    per content block, in order (``index`` from 0):
      text:      content_block_start, content_block_delta (text_delta)...,
                 content_block_stop
      tool_use:  content_block_start, content_block_delta (input_json_delta)...,
                 content_block_stop
    message_delta (stop_reason, usage, the context edits applied), message_stop

A stream with nothing to say for a long while (a long prefill) is kept going by
:meth:`MessageEncoder.activity`: an empty text block opened as the message's first,
then empty text deltas in it. Claude Code (2.1.197) gives up on a stream after 300 s
without an event other than ``ping``, so pings alone do not hold it through minutes of
prefill; the text the model then writes goes on in that block (a call takes the next).

The message builds up as the events go: the non-streamed answer is the same
encoder's :attr:`message` once every event is fed, so the two cannot disagree. An
error after streaming began is :meth:`fail`: an ``error`` event, and the stream ends.
One choice only (the API has no ``n``).
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.chat import (
    ChoiceEnd,
    Event,
    Finished,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from tokenmill.engines import Usage
from tokenmill.errors import ServiceError
from tokenmill.server.errors import anthropic_body

# The core's finish reasons as Anthropic's stop reasons. A stop that names its stop
# string is ``stop_sequence`` instead (an upstream engine names none: ``end_turn``).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def usage_body(usage: Usage) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are those not read from the cache."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object (``{}`` for none, or for arguments
    cut short by ``max_tokens``, which are no JSON object)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageEncoder:
    """Neutral events in, Messages events out (see the module docstring).

    ``message`` is the message as it starts (no content, no stop reason, the prompt's
    usage); the encoder fills its ``content``, ``stop_reason`` and ``usage``.
    """

    def __init__(self, message: dict[str, Any], *, window: bool = False) -> None:
        # window: max_tokens was past the context window, so the output's limit is
        # the window's (``model_context_window_exceeded``), not the client's.
        self.window = window
        self.message = message
        self.content: list[dict[str, Any]] = message["content"]
        self._open: dict[str, Any] | None = None  # the block being written
        self._json: list[str] = []  # the open tool_use block's input so far

    def start(self) -> list[dict[str, Any]]:
        start = {**self.message, "content": []}
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def feed(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            return self._text(event.text)
        if isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            return [*self._close(), *self._begin(block)]
        if isinstance(event, ToolCallArguments):
            return self._arguments(event.text)
        if isinstance(event, ToolCallEnd):
            return self._close(event.arguments)
        if isinstance(event, ChoiceEnd):
            if event.reason == "error":
                raise ServiceError("the generation failed", code="server_error")
            self.message["stop_reason"] = STOP_REASONS[event.reason]
            if event.reason == "length" and self.window:
                self.message["stop_reason"] = "model_context_window_exceeded"
            if event.stop_sequence is not None:
                self.message["stop_reason"] = "stop_sequence"
                self.message["stop_sequence"] = event.stop_sequence
            return self._close()
        assert isinstance(event, Finished)
        return self._finish(event.usage)

    def activity(self) -> list[dict[str, Any]]:
        """Events that say the message is under way and add nothing to it: before any
        content, an empty text block opened (the answer's text goes on in it); in an
        open text block, an empty delta. Elsewhere none (the pings go on)."""
        if self._open is None and not self.content:
            return self._begin({"type": "text", "text": ""})
        if self._open is not None and self._open["type"] == "text":
            delta = {"type": "text_delta", "text": ""}
            return [{"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}]
        return []

    def fail(self, error: ServiceError) -> list[dict[str, Any]]:
        return [anthropic_body(error)]

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = block
        self.content.append(block)
        start = {**block, "text": ""} if block["type"] == "text" else dict(block)
        index = len(self.content) - 1
        return [{"type": "content_block_start", "index": index, "content_block": start}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self._open is None or self._open["type"] != "text":
            events = [*self._close(), *self._begin({"type": "text", "text": ""})]
        assert self._open is not None
        self._open["text"] += text
        delta = {"type": "text_delta", "text": text}
        index = len(self.content) - 1
        return [*events, {"type": "content_block_delta", "index": index, "delta": delta}]

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        if self._open is None or self._open["type"] != "tool_use" or not text:
            return []
        self._json.append(text)
        delta = {"type": "input_json_delta", "partial_json": text}
        return [{"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}]

    def _close(self, arguments: str | None = None) -> list[dict[str, Any]]:
        block = self._open
        if block is None:
            return []
        self._open = None
        if block["type"] == "tool_use":
            block["input"] = tool_input("".join(self._json) if arguments is None else arguments)
            self._json = []
        return [{"type": "content_block_stop", "index": self.content.index(block)}]

    def _finish(self, usage: Usage) -> list[dict[str, Any]]:
        events = self._close()
        if self.message["stop_reason"] is None:
            self.message["stop_reason"] = "end_turn"
        self.message["usage"] = usage_body(usage)
        delta = {
            "stop_reason": self.message["stop_reason"],
            "stop_sequence": self.message["stop_sequence"],
        }
        end: dict[str, Any] = {
            "type": "message_delta",
            "delta": delta,
            "usage": dict(self.message["usage"]),
        }
        if "context_management" in self.message:
            end["context_management"] = self.message["context_management"]
        return [*events, end, {"type": "message_stop"}]
