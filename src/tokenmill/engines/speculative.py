"""Speculative decoding without a draft model: the pure parts (issue 39).

Pure (no model, no llama.cpp), so each rule is tested on synthetic distributions;
an engine that verifies drafts inside its batch uses these to decide what to draft,
what to keep, and when drafting pays.

* :func:`draft`: **prompt lookup**. The sequence's own tokens (prompt and output so
  far) are searched for the latest earlier occurrence of its last ``n`` tokens
  (``n`` from ``max_ngram`` down to ``min_ngram``); the tokens that followed it are
  the draft. Copy-heavy work (an edit of given code, a repaired JSON, a quote)
  repeats long runs of its prompt, which is what this finds; ordinary chat finds
  little, and drafts nothing.
* :func:`accept_greedy` and :func:`accept_sampled`: **exact acceptance**. The
  verification step gives the target distribution after the sequence's whole
  sampler chain at each drafted position. Greedy keeps a draft token only if it is
  that position's argmax. Sampling keeps draft token ``d`` with probability
  ``p(d)`` (the draft is one token for sure: ``q(d) = 1``), and on a rejection draws
  from ``p`` with ``d`` removed, renormalized: each written token is distributed as
  the model's ``p``, whatever was drafted (speculative sampling, Leviathan et al.
  2023, with a point-mass draft). After a fully accepted draft one more token comes
  from the last position's distribution: a step never writes fewer than one token.
* :class:`DraftLength`: **only where it pays**. A sequence's draft length follows
  its measured acceptance (the expected run of accepted tokens), and
  :func:`pays` weighs the tokens a draft is expected to add against what verifying
  it adds to the step, from the measured cost of steps by their size.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Draft at most this many tokens a step for one sequence.
MAX_DRAFT = 8
# The n-grams looked up, longest first.
MAX_NGRAM = 4
MIN_NGRAM = 2
# How far back the lookup searches (tokens), so that a long context costs little.
LOOKBACK = 4096
# Weight of the newest step in a sequence's measured acceptance.
ALPHA = 0.3


def draft(
    tokens: Sequence[int],
    k: int,
    *,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = MIN_NGRAM,
    lookback: int = LOOKBACK,
) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last
    ``n`` tokens of ``tokens`` (longest ``n`` first); none when nothing repeats."""
    if k <= 0:
        return []
    end = len(tokens)
    start = max(0, end - lookback)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        tail = list(tokens[end - n :])
        # The latest occurrence that ends before the tail itself does.
        for i in range(end - n - 1, start - 1, -1):
            if tokens[i] == tail[0] and list(tokens[i : i + n]) == tail:
                follow = list(tokens[i + n : i + n + k])
                if follow:
                    return follow
                break
    return []


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a verified draft writes: the accepted draft tokens, then one token of the
    model's own (the correction after a rejection, or the next after a full accept)."""

    accepted: int
    tokens: tuple[int, ...]


def accept_greedy(drafted: Sequence[int], argmax: Sequence[int]) -> Verdict:
    """``argmax[i]``: the greedy token at drafted position ``i`` (after the sequence's
    tokens and ``drafted[:i]``); ``len(argmax) == len(drafted) + 1``."""
    assert len(argmax) == len(drafted) + 1
    n = 0
    while n < len(drafted) and drafted[n] == argmax[n]:
        n += 1
    return Verdict(n, (*drafted[:n], argmax[n]))


Distribution = Sequence[float]  # probabilities over the vocabulary, summing to 1


def accept_sampled(
    drafted: Sequence[int],
    target: Callable[[int], Distribution],
    rng: random.Random,
) -> Verdict:
    """``target(i)``: the model's distribution at drafted position ``i`` after the
    whole sampler chain (only asked for the positions reached). Each token written is
    distributed as the model's (see the module docstring)."""
    out: list[int] = []
    for i, d in enumerate(drafted):
        p = target(i)
        if rng.random() < p[d]:
            out.append(d)
            continue
        return Verdict(i, (*out, _draw(p, rng, without=d)))
    return Verdict(len(drafted), (*out, _draw(target(len(drafted)), rng)))


def _draw(p: Distribution, rng: random.Random, without: int | None = None) -> int:
    """A token from ``p`` (with ``without`` removed and the rest renormalized)."""
    total = 1.0 - (p[without] if without is not None else 0.0)
    if total <= 0.0:  # all of p was on the removed token: p(d) = 1 never rejects
        raise ValueError("nothing left to draw from")
    x = rng.random() * total
    last = None
    for token, weight in enumerate(p):
        if token == without or weight <= 0.0:
            continue
        last = token
        x -= weight
        if x < 0.0:
            return token
    assert last is not None
    return last  # rounding left a hair: the last token with weight


@dataclass
class DraftLength:
    """One sequence's draft length, from its measured acceptance: the chance that a
    drafted token is accepted, as a moving average over its verified drafts."""

    acceptance: float = 0.5
    max_draft: int = MAX_DRAFT

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        # Accepted of the positions reached (a rejection ends the run).
        reached = min(drafted, accepted + 1)
        rate = accepted / reached
        self.acceptance += ALPHA * (rate - self.acceptance)

    def expected_accepted(self, k: int) -> float:
        """Tokens of a ``k``-token draft expected to be kept: a run of accepts."""
        a = self.acceptance
        if a >= 1.0:
            return float(k)
        return a * (1.0 - a**k) / (1.0 - a)

    def length(self) -> int:
        """The draft length whose last token is still more likely kept than not
        reached: the longest ``k`` with ``acceptance ** k >= 1/2`` (at least 1 while
        acceptance is above a half, else 0: drafting off for this sequence)."""
        a = self.acceptance
        if a <= 0.5:
            return 0
        if a >= 1.0:
            return self.max_draft
        return max(1, min(self.max_draft, math.floor(math.log(0.5) / math.log(a))))


def pays(expected_accepted: float, step_s: float, verify_s: float, sequences: int = 1) -> bool:
    """Whether verifying drafts in a step is worth it: the step writes ``sequences``
    tokens in ``step_s`` without them, and ``expected_accepted`` more in ``verify_s``
    with them (every sequence of the batch waits for the longer step). It pays when the
    tokens a second come out ahead: ``(sequences + expected) / verify_s >
    sequences / step_s``. One sequence alone: the draft must cost less than the steps
    it saves; in a full batch, a draft's extra cells slow every sequence, and pay
    only for a high acceptance."""
    if step_s <= 0.0 or verify_s <= 0.0:
        return False
    return (sequences + expected_accepted) / verify_s > sequences / step_s


__all__ = [
    "MAX_DRAFT",
    "DraftLength",
    "Verdict",
    "accept_greedy",
    "accept_sampled",
    "draft",
    "pays",
]
