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
* :func:`verify`: **exact acceptance**, the rule the engine runs (and
  :func:`accept_greedy`, :func:`accept_sampled` on synthetic rows, for the tests).
  The verification step gives each drafted position's logits; the sequence's own
  sampler chain draws a token from each in turn while each is the drafted one.
  Greedy keeps a draft token only if it is that position's argmax; sampled, a draft
  token ``d`` is kept with probability ``p(d)`` and a token drawn instead is ``p``
  with ``d`` removed: each written token is distributed as the model's ``p``,
  whatever was drafted (speculative sampling, Leviathan et al. 2023, with a
  point-mass draft).
* :class:`DraftLength`: **only where it pays**. A sequence's draft length follows
  its measured acceptance (the expected run of accepted tokens), and
  :func:`pays` weighs the tokens a draft is expected to add against what verifying
  it adds to the step, from the measured cost of steps by their size.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Draft at most this many tokens a step for one sequence.
MAX_DRAFT = 8
# The n-grams looked up, longest first.
MAX_NGRAM = 4
MIN_NGRAM = 2
# How far back the lookup searches (tokens), so that a long context costs little.
LOOKBACK = 4096
# Weight of the newest step in a sequence's measured acceptance.
ALPHA = 0.3
# A new sequence's acceptance before it is measured: drafts of 3 tokens.
PRIOR = 0.8
# A sequence not drafting (its acceptance too low) moves back toward PRIOR by this
# much of the way each step, so that it tries again after a while (the text changes).
RECOVERY = 0.02


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


class NgramIndex:
    """:func:`draft` for a sequence that grows a token at a time, in constant time a
    token: for each ``n``, where the latest occurrence of each n-gram ended, counting
    only occurrences before the current tail (the tail itself is what is looked up)."""

    def __init__(
        self,
        tokens: Sequence[int] = (),
        *,
        max_ngram: int = MAX_NGRAM,
        min_ngram: int = MIN_NGRAM,
    ) -> None:
        self.tokens: list[int] = []
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        tokens = self.tokens
        end = len(tokens)
        # The n-grams that ended the sequence until now are earlier than its new tail.
        for n in self.sizes:
            if end >= n:
                self._ends[n][tuple(tokens[end - n :])] = end
        tokens.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def draft(self, k: int) -> list[int]:
        """What :func:`draft` returns for these tokens (without its lookback bound)."""
        tokens = self.tokens
        if k <= 0:
            return []
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            end = self._ends[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None and end < len(tokens):
                return tokens[end : end + k]
        return []


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a verified draft writes: the accepted draft tokens, then one token of the
    model's own (the correction after a rejection, or the next after a full accept)."""

    accepted: int
    tokens: tuple[int, ...]


def verify(drafted: Sequence[int], draw: Callable[[int], int | None]) -> int:
    """The one acceptance rule: ``draw(i)`` writes the token at drafted position ``i``
    (the sequence's own sampler on the logits after its tokens and ``drafted[:i]``),
    or returns None where the sequence ended; drawing goes on while each token drawn
    is the drafted one. The number of draft tokens kept.

    Greedy keeps a draft token only if it is the argmax. Sampled, the drafted token
    is kept with probability ``p(d)``, and a token drawn instead is distributed as
    ``p`` with ``d`` removed: each written token is distributed as the model's
    (speculative sampling with a point-mass draft, Leviathan et al. 2023, in its
    draw-and-compare form). After a fully kept draft one more token is drawn from the
    last row: a step never writes fewer than one token."""
    for i in range(len(drafted) + 1):
        token = draw(i)
        if token is None or i == len(drafted) or token != drafted[i]:
            return i
    raise AssertionError("unreachable")


def accept_greedy(drafted: Sequence[int], argmax: Sequence[int]) -> Verdict:
    """:func:`verify` where ``argmax[i]`` is the greedy token at drafted position
    ``i``; ``len(argmax) == len(drafted) + 1``."""
    assert len(argmax) == len(drafted) + 1
    kept = verify(drafted, argmax.__getitem__)
    return Verdict(kept, (*drafted[:kept], argmax[kept]))


Distribution = Sequence[float]  # probabilities over the vocabulary, summing to 1


def accept_sampled(
    drafted: Sequence[int],
    target: Callable[[int], Distribution],
    rng: random.Random,
) -> Verdict:
    """:func:`verify` where ``target(i)`` is the model's distribution at drafted
    position ``i`` after the whole sampler chain (only asked for the positions
    reached), each token drawn from it with ``rng``."""
    written: list[int] = []

    def draw(i: int) -> int:
        written.append(_draw(target(i), rng))
        return written[-1]

    return Verdict(verify(drafted, draw), tuple(written))


def _draw(p: Distribution, rng: random.Random) -> int:
    """A token from ``p``."""
    x = rng.random()
    last = None
    for token, weight in enumerate(p):
        if weight <= 0.0:
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

    acceptance: float = PRIOR
    max_draft: int = MAX_DRAFT

    def rest(self) -> None:
        """A step without a draft: the acceptance drifts back toward :data:`PRIOR`."""
        self.acceptance += RECOVERY * (PRIOR - self.acceptance)

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


class StepCosts:
    """Measured seconds of a decode step by its shape: how many sequences it holds,
    and its depth, the most rows any one of them has (1 for a step of next tokens
    only; 1 + k with a draft of k). Depth matters apart from the row count: where each
    slot has a KV stream of its own, llama.cpp computes a step as one pass over the
    weights per row of depth, so one sequence's draft of 4 makes the whole step 5
    passes, while at one sequence it is one pass of 5 rows.

    A moving average for each shape seen; a shape not seen is estimated from the same
    depth at the nearest sequence count, scaled as depth-1 steps scale between the two
    counts (interpolated over the counts measured), or None: not measured yet."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, int], float] = {}

    def observe(self, sequences: int, depth: int, seconds: float) -> None:
        key = (sequences, depth)
        last = self._seconds.get(key)
        self._seconds[key] = seconds if last is None else last + ALPHA * (seconds - last)

    def estimate(self, sequences: int, depth: int) -> float | None:
        seconds = self._seconds
        if (sequences, depth) in seconds:
            return seconds[(sequences, depth)]
        if depth == 1:
            return self._plain(sequences)
        known = [b for b, d in seconds if d == depth]
        if not known:
            return None
        nearest = min(known, key=lambda b: (abs(b - sequences), b))
        here, there = self._plain(sequences), self._plain(nearest)
        scale = here / there if here is not None and there else 1.0
        return seconds[(nearest, depth)] * scale

    def _plain(self, sequences: int) -> float | None:
        """A depth-1 step of ``sequences``: measured, or interpolated between the
        nearest counts measured (scaled from the nearest one beyond them)."""
        plain = {b: s for (b, d), s in self._seconds.items() if d == 1}
        if sequences in plain:
            return plain[sequences]
        if not plain:
            return None
        below = max((b for b in plain if b < sequences), default=None)
        above = min((b for b in plain if b > sequences), default=None)
        if below is not None and above is not None:
            f = (sequences - below) / (above - below)
            return plain[below] + f * (plain[above] - plain[below])
        if below is not None:
            return plain[below] * sequences / below
        assert above is not None
        return plain[above]


@dataclass
class Speculation:
    """One sequence's drafting: its tokens' n-gram index, its draft length, and what
    it drafted and kept."""

    index: NgramIndex
    length: DraftLength = field(default_factory=DraftLength)
    drafted: int = 0
    accepted: int = 0

    def verified(self, drafted: int, accepted: int) -> None:
        self.length.observe(drafted, accepted)
        self.drafted += drafted
        self.accepted += accepted


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
    "NgramIndex",
    "Speculation",
    "StepCosts",
    "Verdict",
    "accept_greedy",
    "accept_sampled",
    "draft",
    "pays",
    "verify",
]
