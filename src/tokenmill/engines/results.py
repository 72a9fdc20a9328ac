"""What an engine produces: chunks of text, their usage and log probabilities.

These types sit below both the engine interface (:mod:`tokenmill.engines.base`) and
the stream that carries them (:mod:`tokenmill.engines.chunks`), so that each of those
imports them and neither imports the other's importer. ``base`` re-exports them: the
usual place to import them from stays ``tokenmill.engines.base``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Chunk", "FinishReason", "TokenLogprob", "ToolCallDelta", "TopLogprob", "Usage"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position: its bytes and log probability."""

    piece: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token of the completion, its log probability and the likeliest alternatives.

    Log probabilities are of the model's own distribution (a log-softmax of the
    logits), before any sampling step (penalties, logit_bias, temperature) changes it.
    ``offset`` is where the token's text starts in the completion's text, in characters
    (in the prompt's, for the tokens of an echoed prompt).
    """

    piece: bytes
    logprob: float | None  # None: the first token of an echoed prompt
    offset: int
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """A text delta. The last chunk of a stream has ``finish_reason`` and ``usage``.

    With ``echo`` asked for, the first chunk of each choice is its prompt's text (and
    its tokens, with ``logprobs``); ``tokens`` counts none of them. An engine that
    cannot echo refuses the request before its first chunk (``InvalidRequestError``
    naming ``echo``).

    With ``logprobs`` asked for, ``logprobs`` holds the tokens whose text this chunk
    completes: a token leaves with its text, never before it (text held back for a
    stop string holds its tokens back too) and never without it (tokens a stop string
    swallowed are dropped with it).
    """

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # Completion tokens produced so far, this chunk's included, all choices together
    # (0 if the engine can't tell). Lets the gateway bill a stream even if its final
    # usage never arrives.
    tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    # The choice this chunk belongs to (``GenerationRequest.choices`` > 1).
    index: int = 0
    # A choice that ends while others of the same request go on: its own finish
    # reason. The request's final chunk (``finish_reason``) ends the last choice, and
    # any choice still open then (a cancelled request ends them all at once).
    choice_finish: FinishReason | None = None
    # Pieces of tool calls (a request with ``tools``), in OpenAI's delta shape.
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # The chunk that ends a choice (``choice_finish``, or ``finish_reason`` for the
    # choice it belongs to) on a stop string: the request's stop string that matched
    # (the earliest in the text; of two starting there, the first listed). None
    # otherwise, and from an engine that cannot tell (an OpenAI-compatible upstream).
    stop_sequence: str | None = None

    def then(self, later: Chunk) -> Chunk | None:
        """One chunk that says what this one and then ``later`` say (a step that
        wrote several tokens of a choice sends them as one delta), or None where they
        cannot be one: other choices, this one ending its choice or the stream, or
        tool call pieces."""
        if (
            later.index != self.index
            or self.finish_reason is not None
            or self.choice_finish is not None
            or self.tool_calls
            or later.tool_calls
        ):
            return None
        return Chunk(
            self.text + later.text,
            later.finish_reason,
            later.usage,
            max(self.tokens, later.tokens),
            self.logprobs + later.logprobs,
            later.index,
            later.choice_finish,
            stop_sequence=later.stop_sequence,
        )


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call as it streams: the call's ``id`` and ``name`` come with
    its first piece, then ``arguments`` fragments (their concatenation is the
    arguments' JSON text). ``index`` numbers the calls of a choice."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
