"""What the core gives an API adapter back: neutral events, or the whole result.

Every event names its ``choice`` (0 to ``Generation.choices - 1``). Per choice, in
order: any mix of :class:`TextDelta` and tool calls (each :class:`ToolCallStart`,
its :class:`ToolCallArguments`, then :class:`ToolCallEnd`; calls do not interleave),
then exactly one :class:`ChoiceEnd`. Choices interleave with each other. The stream
ends with one :class:`Finished`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenmill.engines import TokenLogprob, ToolCall, Usage

__all__ = [
    "ChoiceEnd",
    "ChoiceResult",
    "Event",
    "FinishReason",
    "Finished",
    "Result",
    "TextDelta",
    "ToolCallArguments",
    "ToolCallEnd",
    "ToolCallStart",
]

# Why a choice ended: a stop (end of sequence, a stop string, or an abort at
# shutdown), ``max_tokens``, one or more complete tool calls, an engine error.
FinishReason = Literal["stop", "length", "tool_calls", "error"]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text of the answer (JSON, under a JSON response format). With ``echo`` a
    choice's first delta is its prompt (``prompt``), even empty. ``logprobs``: the
    tokens this text completes, when asked for (their ``offset`` counts from the
    choice's first character, an echoed prompt included); text may be empty when a
    delta carries only tokens."""

    choice: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt: bool = False


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A call begins: its name is whole. ``call`` numbers the choice's calls from 0;
    ``id`` is new (``call_`` and 24 hex digits) unless an upstream server gave one."""

    choice: int
    call: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    """A fragment of a call's arguments, as generated: the fragments of a call, joined,
    are its arguments' JSON text."""

    choice: int
    call: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """A call ended (the next call, text or the choice's end follows). ``complete``
    is false for a call cut short by ``max_tokens`` (its arguments may be no JSON)."""

    choice: int
    call: int
    id: str
    name: str
    arguments: str  # the whole JSON text
    complete: bool = True


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """A choice ended. ``stop_sequence``: the request's stop string that ended it
    (``reason`` is then ``stop``), when the engine reports it (an OpenAI-compatible
    upstream does not)."""

    choice: int
    reason: FinishReason
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The request's end, after every choice's: its usage (prompt once, all choices'
    completion tokens)."""

    usage: Usage


Event = TextDelta | ToolCallStart | ToolCallArguments | ToolCallEnd | ChoiceEnd | Finished


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One choice, whole: its text (the echoed prompt first), its calls, its tokens'
    log probabilities (when asked for) and why it ended."""

    text: str
    tool_calls: tuple[ToolCall, ...]
    logprobs: tuple[TokenLogprob, ...]
    reason: FinishReason
    stop_sequence: str | None = None  # as in :class:`ChoiceEnd`


@dataclass(frozen=True, slots=True)
class Result:
    choices: tuple[ChoiceResult, ...]
    usage: Usage
