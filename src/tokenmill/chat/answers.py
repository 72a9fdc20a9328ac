"""One choice's answer while its chunks come in: the chunks in, the core's events out.

A :class:`TextAnswer` passes the text on (an echoed prompt first, the completion's
log-probability offsets counted from the prompt's start). A :class:`CallingAnswer`
reads tool calls out of the text as it streams: the generic format's JSON
(:class:`~tokenmill.chat.toolcalls.ToolCallReader`), a template's markup
(:class:`~tokenmill.chat.toolcalls.MarkupReader`, which holds back anything that may
be a tag, so no markup reaches the text), or the chunks' own ``tool_calls`` (an
upstream server's, with their ids: ``forwarded``), whose text is the answer's.

Pure: no I/O, no clock; fed chunk by chunk by :class:`~tokenmill.chat.generation.
Generation`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import Literal

from tokenmill.chat.events import (
    ChoiceEnd,
    Event,
    FinishReason,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from tokenmill.chat.toolcalls import (
    ArgumentsDelta,
    CallOpened,
    ContentDelta,
    MarkupReader,
    ToolCallReader,
    ToolEvent,
)
from tokenmill.engines import Chunk, TokenLogprob

# Where an answer's calls are: nowhere ("text"), in the generic format's JSON
# ("generic"), in the template's markup ("markup"), in the engine's own calls
# ("forwarded": an upstream's).
ToolOutput = Literal["text", "generic", "markup", "forwarded"]


def call_id() -> str:
    """A new call's id, in OpenAI's form (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


def public_reason(engine_reason: str) -> FinishReason:
    # An engine-side abort only reaches a client that is still listening at
    # shutdown; clients know "stop" and "length".
    if engine_reason == "length":
        return "length"
    if engine_reason == "error":
        return "error"
    return "stop"


@dataclass
class TextAnswer:
    """A choice whose answer is its text (with its tokens, when asked for)."""

    index: int
    prompt: bool = False  # its echoed prompt is still to come
    base: int = 0  # its echoed prompt's length: where the completion's offsets start
    finished: bool = False

    def take(self, chunk: Chunk) -> tuple[list[Event], bool]:
        """What ``chunk`` adds, and whether its finish reasons still apply (an echoed
        prompt's chunk is only the prompt)."""
        if self.prompt:
            self.prompt = False
            self.base = len(chunk.text)
            return [TextDelta(self.index, chunk.text, chunk.logprobs, prompt=True)], False
        if chunk.text or chunk.logprobs:
            tokens = _shifted(chunk.logprobs, self.base)
            return [TextDelta(self.index, chunk.text, tokens)], True
        return [], True

    def end(self, engine_reason: str, stop: str | None = None) -> list[Event]:
        """The choice ended; ``stop``: the stop string that ended it."""
        self.finished = True
        reason = public_reason(engine_reason)
        return [ChoiceEnd(self.index, reason, stop if reason == "stop" else None)]


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    ended: bool = False


@dataclass
class CallingAnswer:
    """A choice whose answer may be tool calls. ``reader`` reads calls out of the
    text; without one (an engine that reports its calls) the text is the answer's."""

    index: int
    reader: ToolCallReader | MarkupReader | None
    calls: list[_Call] = field(default_factory=list)
    finished: bool = False

    @classmethod
    def reading(cls, index: int, output: ToolOutput) -> CallingAnswer:
        if output == "markup":
            return cls(index, MarkupReader())
        return cls(index, None if output == "forwarded" else ToolCallReader())

    def take(self, chunk: Chunk) -> tuple[list[Event], bool]:
        found: list[ToolEvent] = []
        if chunk.text:
            if self.reader is None:
                found.append(ContentDelta(chunk.text))
            else:
                found += self.reader.feed(chunk.text)
        for d in chunk.tool_calls:
            opened = sum(isinstance(e, CallOpened) for e in found)
            if d.index >= len(self.calls) + opened:
                found.append(CallOpened(d.index, d.name or "", d.id))
            if d.arguments:
                found.append(ArgumentsDelta(d.index, d.arguments))
        return self._events(found), True

    def end(self, engine_reason: str, stop: str | None = None) -> list[Event]:
        """The choice ended: what its reader still held, its open call's end, and its
        finish reason (``stop``: the stop string that ended it)."""
        self.finished = True
        held = [] if self.reader is None else self.reader.close()
        # A call still open when max_tokens ends the output was cut, unless the
        # reader saw the whole output (the calls' JSON closed just in time).
        cut = engine_reason == "length" and not (self.reader is not None and self.reader.complete)
        events = [*self._events(held), *self._end_call(complete=not cut)]
        reason = self._reason(engine_reason)
        return [*events, ChoiceEnd(self.index, reason, stop if reason == "stop" else None)]

    def _reason(self, engine_reason: str) -> FinishReason:
        if engine_reason in ("length", "error"):
            return public_reason(engine_reason)
        if self.calls and (self.reader is None or self.reader.complete):
            return "tool_calls"
        return "stop"  # an abort too

    def _events(self, found: list[ToolEvent]) -> list[Event]:
        events: list[Event] = []
        for e in found:
            if isinstance(e, ContentDelta):
                events += self._end_call()
                events.append(TextDelta(self.index, e.text))
            elif isinstance(e, CallOpened):
                events += self._end_call()
                self.calls.append(_Call(e.id or call_id(), e.name))
                events.append(ToolCallStart(self.index, e.index, self.calls[-1].id, e.name))
            else:
                self.calls[e.index].arguments.append(e.text)
                events.append(ToolCallArguments(self.index, e.index, e.text))
        return events

    def _end_call(self, complete: bool = True) -> list[Event]:
        if not self.calls or self.calls[-1].ended:
            return []
        call = self.calls[-1]
        call.ended = True
        n = len(self.calls) - 1
        arguments = "".join(call.arguments)
        return [ToolCallEnd(self.index, n, call.id, call.name, arguments, complete)]


Answer = TextAnswer | CallingAnswer


def _shifted(tokens: tuple[TokenLogprob, ...], chars: int) -> tuple[TokenLogprob, ...]:
    """``tokens`` with their text offsets moved ``chars`` on (past an echoed prompt)."""
    if not chars:
        return tokens
    return tuple(replace(t, offset=t.offset + chars) for t in tokens)
