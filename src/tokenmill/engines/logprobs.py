"""Keeping each token's log probability with the token's text.

A :class:`~tokenmill.engines.textstream.TextStream` holds text back (a character
split across tokens, a tail that may become a stop string) and swallows stop
strings. Log probabilities belong to tokens, so a token must leave with its text:
:class:`TokenAligner` holds each token until all of its characters have been
emitted, and a token whose text is never emitted (swallowed by a stop string, or
the token a stop string begins in) is never reported.

Pure: no llama.cpp, no numpy. The engine computes the numbers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenmill.engines.base import TokenLogprob, TopLogprob

# JSON has no -Infinity: a token the model gives no chance at all is reported with
# this, as OpenAI does.
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


@dataclass(slots=True)
class _Waiting:
    token: TokenLogprob
    end: int  # the character offset its text ends at


class TokenAligner:
    """Tokens waiting for their text. See the module docstring."""

    __slots__ = ("_decoded", "_emitted", "_pending")

    def __init__(self) -> None:
        self._pending: deque[_Waiting] = deque()
        self._decoded = 0  # characters decoded so far (emitted or not)
        self._emitted = 0  # characters emitted so far

    def add(
        self,
        piece: bytes,
        logprob: float,
        top: tuple[TopLogprob, ...],
        decoded: int,
        partial: bool = False,
    ) -> None:
        """A sampled token; ``decoded`` counts the characters decoded once it is fed,
        and ``partial`` says its bytes end inside the next character.

        A token that ends inside a character is completed by the token that finishes
        the character, and leaves with that character: never before it (a stop string
        may begin at that character, and then the token's text was never all sent).
        """
        start = self._decoded
        token = TokenLogprob(piece, finite(logprob), start, top)
        if decoded > start:
            for waiting in reversed(self._pending):
                if waiting.token.offset != start:  # it has characters of its own
                    break
                waiting.end = decoded  # an earlier part of the same character
        # Part of a character: it waits for that character, which starts at ``start``
        # (and is dropped with it if the character is never completed).
        end = decoded + 1 if partial else max(decoded, start + 1)
        self._pending.append(_Waiting(token, end))
        self._decoded = decoded

    def release(self, emitted: int) -> tuple[TokenLogprob, ...]:
        """``emitted`` more characters went out: the tokens whose text is now all out."""
        self._emitted += emitted
        out: list[TokenLogprob] = []
        pending = self._pending
        while pending and pending[0].end <= self._emitted:
            out.append(pending.popleft().token)
        return tuple(out)
