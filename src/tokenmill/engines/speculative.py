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
* :class:`DraftLength`, :func:`best_cap`: **only where it pays**, by the measured
  cost of ubatches by their rows (:class:`StepCosts`, :func:`ubatches`), with no
  constant threshold or length. A sequence drafts while, alone, some draft length
  would write more tokens a second than no draft at its measured acceptance (where a
  verified row costs a third of a step, an acceptance above about a third; where it
  costs a whole step, none), as long a draft as writes the most (up to
  :data:`MAX_DRAFT`: long drafts where rows are cheap and acceptance is high, as in
  copying); and :func:`best_cap` cuts every draft of a step to the length that writes
  the most tokens a second for all the step's sequences together.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Draft at most this many tokens a step for one sequence (llama-server's n-gram modes
# draft up to 64): how many of them are verified is the measured costs' call.
MAX_DRAFT = 64
# The draft lengths weighed (each a whole step's estimate): every length up to 8, then
# roughly a third more each, so a step that drafts weighs a dozen, not 64.
LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
# The n-grams looked up, longest first.
MAX_NGRAM = 4
MIN_NGRAM = 2
# How far back the lookup searches (tokens), so that a long context costs little.
LOOKBACK = 4096
# A row's cost in a ubatch beyond the one size measured, as a share of that size's
# cost a row: a first guess, replaced once a step of more rows is measured.
ROW_PRIOR = 0.5
# Weight of the newest step in a sequence's measured acceptance.
ALPHA = 0.3
# A new sequence's acceptance before it is measured.
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
    """One sequence's draft length, from its measured acceptance (the chance that a
    drafted token is accepted, as a moving average over its verified drafts) and the
    measured cost of steps."""

    acceptance: float = PRIOR

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

    def length(self, costs: StepCosts, limit: int = MAX_DRAFT) -> int:
        """The draft length (at most ``limit``) that writes the most tokens a second
        for this sequence alone: ``1 + expected_accepted(k)`` tokens in the time of a
        ubatch of ``1 + k`` rows, against one token in a ubatch of one. 0 (drafting
        does not pay at this acceptance and these costs: the sequence rests) while
        no step is measured, or where no length beats none."""
        one = costs.ubatch(1)
        if one is None or one <= 0.0:
            return 0
        best, best_rate = 0, 1.0 / one
        for k in LENGTHS:
            if k > limit:
                break
            seconds = costs.ubatch(1 + k)
            if seconds is None or seconds <= 0.0:
                break
            rate = (1.0 + self.expected_accepted(k)) / seconds
            if rate > best_rate:
                best, best_rate = k, rate
        return best


def ubatches(rows: Sequence[tuple[int, int]], *, unified: bool, n_ubatch: int) -> list[int]:
    """The rows of each ubatch llama.cpp splits a step into: ``rows`` is each
    sequence's (slot, rows) in slot order. A unified pool takes the step in ubatches
    of up to ``n_ubatch`` rows (``split_simple``). With a KV stream per slot
    (``split_equal``, sequential) a ubatch is a run of sequences with consecutive
    slots, the first with rows left first, and the same number of rows from each: as
    many as the one with fewest left has, within ``n_ubatch``. So a step of sixteen
    sequences where one verifies a draft of 4 is a ubatch of 16 rows and 4 ubatches of
    one; sixteen that each verify a draft of 4 are one ubatch of 80."""
    if unified:
        total = sum(n for _, n in rows)
        return [min(n_ubatch, total - i) for i in range(0, total, n_ubatch)]
    left = [[slot, n] for slot, n in rows if n > 0]
    out: list[int] = []
    while left:
        run = [left[0]]
        for item in left[1:]:
            if item[0] != run[-1][0] + 1:
                break
            run.append(item)
        take = max(1, min(min(n for _, n in run), n_ubatch // len(run)))
        for item in run:
            item[1] -= take
        out.append(take * len(run))
        left = [item for item in left if item[1] > 0]
    return out


class StepCosts:
    """Measured seconds of a ubatch by its rows, and from them a step's: the sum of
    its ubatches' (see :func:`ubatches`). A ubatch is one pass over the weights plus
    work for each row: where a row costs a small share of the pass (a GPU, a large
    model) a lone sequence's draft costs little more than its plain step; where it
    costs most of it (SmolLM2's Q4_1 on a small CPU: ~0.6, docs/benchmarks.md) only
    drafts kept nearly always pay; and a draft that adds a ubatch to a full step
    costs a whole pass.

    Every step that is one ubatch measures its row count (a moving average); a row
    count not measured is interpolated between the nearest measured, or extrapolated
    beyond the largest."""

    def __init__(self, *, unified: bool = False, n_ubatch: int = 512) -> None:
        self.unified = unified
        self.n_ubatch = n_ubatch
        self._seconds: dict[int, float] = {}
        self._sizes: list[int] = []  # the sizes measured, in order

    def observe(self, rows: Sequence[tuple[int, int]], seconds: float) -> None:
        split = ubatches(rows, unified=self.unified, n_ubatch=self.n_ubatch)
        if len(split) != 1:
            return  # which of its ubatches took how long is not known
        last = self._seconds.get(split[0])
        if last is None:
            bisect.insort(self._sizes, split[0])
        self._seconds[split[0]] = seconds if last is None else last + ALPHA * (seconds - last)

    def estimate(self, rows: Sequence[tuple[int, int]]) -> float | None:
        """A step's seconds, or None while no ubatch has been measured."""
        total = 0.0
        for n in ubatches(rows, unified=self.unified, n_ubatch=self.n_ubatch):
            seconds = self.ubatch(n)
            if seconds is None:
                return None
            total += seconds
        return total

    def ubatch(self, n: int) -> float | None:
        seconds = self._seconds
        if n in seconds:
            return seconds[n]
        sizes = self._sizes
        i = bisect.bisect_left(sizes, n)  # sizes[:i] < n < sizes[i:]
        below = sizes[i - 1] if i else None
        above = sizes[i] if i < len(sizes) else None
        if below is not None and above is not None:
            f = (n - below) / (above - below)
            return seconds[below] + f * (seconds[above] - seconds[below])
        if below is not None:
            # Beyond the largest measured: on along the line through the two largest,
            # or with one measured, each row half a pass more (a guess that gets a
            # first draft tried, whose step then measures it).
            under = sizes[i - 2] if i >= 2 else None
            if under is None:
                return seconds[below] * (1.0 + ROW_PRIOR * (n - below) / below)
            slope = max(0.0, (seconds[below] - seconds[under]) / (below - under))
            return seconds[below] + slope * (n - below)
        if above is not None:
            return seconds[above]
        return None


def best_cap(
    drafts: Sequence[tuple[int, int, DraftLength]],
    plain: Sequence[int],
    costs: StepCosts,
) -> int:
    """How many draft tokens each drafting sequence verifies this step (0: none):
    the cap that writes the most tokens a second by the measured costs. ``drafts``
    are the drafting sequences' (slot, tokens drafted, length), ``plain`` the slots
    of the other decoding sequences. A step writes a token for every sequence plus
    the draft tokens expected kept, in the time of its ubatches: alone, a sequence
    verifies long drafts (a row costs a fraction of a pass over the weights); beside
    many others, only drafts kept often enough to pay for the pass they add."""
    if not drafts:
        return 0
    sequences = len(drafts) + len(plain)
    deepest = max(n for _, n, _ in drafts)
    best, best_rate = 0, 0.0
    caps = [0, *(k for k in LENGTHS if k < deepest), deepest]
    for cap in caps:
        rows = sorted(
            [(slot, 1) for slot in plain] + [(slot, 1 + min(n, cap)) for slot, n, _ in drafts]
        )
        seconds = costs.estimate(rows)
        if seconds is None or seconds <= 0.0:
            return 0
        written = sequences + sum(length.expected_accepted(min(n, cap)) for _, n, length in drafts)
        rate = written / seconds
        if rate > best_rate:
            best, best_rate = cap, rate
    return best


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


__all__ = [
    "MAX_DRAFT",
    "DraftLength",
    "NgramIndex",
    "Speculation",
    "StepCosts",
    "Verdict",
    "accept_greedy",
    "accept_sampled",
    "best_cap",
    "draft",
    "ubatches",
    "verify",
]
