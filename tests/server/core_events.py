"""The generation core's event sequences every API encoder is fed in its tests: one
script of each shape (text, a tool call, text then a call, cut at max_tokens, empty)."""

from __future__ import annotations

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

USAGE = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
ARGS = '{"city": "Paris"}'

TEXT: list[Event] = [
    TextDelta(0, "Hel"),
    TextDelta(0, ""),
    TextDelta(0, "lo"),
    ChoiceEnd(0, "stop"),
    Finished(USAGE),
]
CALL: list[Event] = [
    ToolCallStart(0, 0, "call_1", "weather"),
    ToolCallArguments(0, 0, ARGS[:5]),
    ToolCallArguments(0, 0, ARGS[5:]),
    ToolCallEnd(0, 0, "call_1", "weather", ARGS),
    ChoiceEnd(0, "tool_calls"),
    Finished(USAGE),
]
TEXT_THEN_CALL: list[Event] = [TextDelta(0, "Let me look."), *CALL]
CUT: list[Event] = [TextDelta(0, "Once upon"), ChoiceEnd(0, "length"), Finished(USAGE)]
NOTHING: list[Event] = [ChoiceEnd(0, "stop"), Finished(USAGE)]
