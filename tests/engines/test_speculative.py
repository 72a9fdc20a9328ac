"""The pure rules of speculative decoding (tokenmill.engines.speculative), on synthetic
token sequences and distributions: drafts by prompt lookup, exact acceptance (greedy,
and sampling whose written tokens are distributed as the model's, over many seeded
draws), and when drafting pays."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from tokenmill.engines.speculative import (
    DraftLength,
    NgramIndex,
    StepCosts,
    Verdict,
    accept_greedy,
    accept_sampled,
    draft,
    pays,
)


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_tail() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4]
    assert draft(tokens, 3) == [5, 6, 7]
    assert draft(tokens, 20) == [5, 6, 7, 9, 2, 3, 4]  # up to where the tail begins again
    # The latest occurrence wins: 2 3 4 came twice before the tail.
    assert draft([2, 3, 4, 8, 2, 3, 4, 5, 2, 3, 4], 2) == [5, 2]
    # The longest n-gram first: "3 4" alone would find 3 4 6, the 3-gram finds 3 4 5.
    assert draft([2, 3, 4, 5, 0, 3, 4, 6, 2, 3, 4], 1) == [5]


def test_nothing_repeated_drafts_nothing() -> None:
    assert draft(list(range(50)), 4) == []
    assert draft([1, 2, 3, 1, 2, 3], 0) == []
    assert draft([7], 4) == []
    # A repeat only past the lookback is not searched.
    far = [1, 2, 3, 4, *range(100, 200), 1, 2, 3]
    assert draft(far, 1) == [4]
    assert draft(far, 1, lookback=50) == []


def test_greedy_keeps_the_drafted_tokens_that_are_the_argmax_then_the_models_own() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 8, 2]) == Verdict(2, (5, 6, 8))
    assert accept_greedy([5, 6, 7], [5, 6, 7, 2]) == Verdict(3, (5, 6, 7, 2))
    assert accept_greedy([5, 6, 7], [1, 6, 7, 2]) == Verdict(0, (1,))
    assert accept_greedy([], [4]) == Verdict(0, (4,))


def within(counts: Counter[int], n: int, p: list[float], sigmas: float = 5.0) -> bool:
    """Every token's frequency within ``sigmas`` standard errors of ``p``."""
    return all(
        abs(counts[t] / n - q) <= sigmas * math.sqrt(q * (1 - q) / n) + 1e-12
        for t, q in enumerate(p)
    )


P0 = [0.1, 0.2, 0.3, 0.4]
P1 = [0.5, 0.0, 0.25, 0.25]
P2 = [0.05, 0.05, 0.8, 0.1]
DRAWS = 40_000


@pytest.mark.parametrize("drafted", [[0], [3], [1, 0], [2, 2], [3, 1, 2]])
def test_sampled_tokens_are_distributed_as_the_model_whatever_the_draft(
    drafted: list[int],
) -> None:
    positions = [P0, P1, P2, P0]
    rng = random.Random(1234)
    first: Counter[int] = Counter()
    second: dict[int, Counter[int]] = {}
    written = 0
    for _ in range(DRAWS):
        verdict = accept_sampled(drafted, lambda i: positions[i], rng)
        assert 1 <= len(verdict.tokens) <= len(drafted) + 1
        assert list(verdict.tokens[: verdict.accepted]) == drafted[: verdict.accepted]
        written += len(verdict.tokens)
        first[verdict.tokens[0]] += 1
        if len(verdict.tokens) > 1:  # the first was the draft's, accepted
            second.setdefault(verdict.tokens[0], Counter())[verdict.tokens[1]] += 1
    # The first token written is the model's first distribution's...
    assert within(first, DRAWS, P0), (drafted, first)
    # ... and the second, given the first, the model's second (for the drafted prefix).
    for given, counts in second.items():
        assert given == drafted[0]
        assert within(counts, sum(counts.values()), P1), (drafted, counts)
    # A step writes more than one token a draw on average only when drafts are kept.
    assert written > DRAWS


def test_a_rejected_token_is_never_written_in_its_place() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        verdict = accept_sampled([3], lambda i: P0, rng)
        if verdict.accepted == 0:
            assert verdict.tokens[0] != 3


def test_draft_length_follows_acceptance() -> None:
    seq = DraftLength()
    assert seq.length() == 3  # the prior: drafts of 3
    for _ in range(20):
        seq.observe(drafted=4, accepted=4)
    assert seq.acceptance > 0.9 and seq.length() >= 6
    assert seq.expected_accepted(4) > 3.0
    for _ in range(20):
        seq.observe(drafted=4, accepted=0)
    assert seq.acceptance < 0.1 and seq.length() == 0
    seq.observe(drafted=0, accepted=0)  # nothing drafted: nothing learned
    assert seq.length() == 0
    steps = 0
    while seq.length() == 0:  # resting, it tries again after a while
        seq.rest()
        steps += 1
    assert 20 < steps < 200 and seq.length() == 1


def test_drafting_pays_alone_and_not_in_a_full_batch_for_a_middling_acceptance() -> None:
    # One sequence: 3 draft cells add 10 % to its step and bring 1.5 tokens.
    assert pays(1.5, step_s=0.010, verify_s=0.011, sequences=1)
    # Sixteen: the same 10 % slows all sixteen for 1.5 tokens more: a loss.
    assert not pays(1.5, step_s=0.010, verify_s=0.011, sequences=16)
    # A long accepted run pays even there.
    assert pays(4.0, step_s=0.010, verify_s=0.011, sequences=16)
    assert not pays(1.0, step_s=0.0, verify_s=0.0)


def test_the_incremental_index_drafts_what_the_search_does() -> None:
    rng = random.Random(5)
    # A sequence that repeats itself in pieces, over a small vocabulary (many matches).
    tokens: list[int] = []
    while len(tokens) < 600:
        if tokens and rng.random() < 0.4:
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + rng.randrange(1, 12)]
        else:
            tokens.append(rng.randrange(6))
    index = NgramIndex()
    for i, token in enumerate(tokens):
        index.append(token)
        for k in (1, 4):
            assert index.draft(k) == draft(tokens[: i + 1], k, lookback=10**6), (i, k)


def test_step_costs_by_shape_estimate_from_the_nearest_measured() -> None:
    costs = StepCosts()
    assert costs.estimate(4, 1) is None
    costs.observe(1, 1, 0.010)
    assert costs.estimate(1, 1) == 0.010 and costs.estimate(4, 1) == pytest.approx(0.040)
    costs.observe(9, 1, 0.018)
    assert costs.estimate(5, 1) == pytest.approx(0.014)
    # A depth never measured: unknown, whatever the count.
    assert costs.estimate(9, 4) is None
    # Depth 4 measured at 9 sequences: at 5, scaled as plain steps scale (14 / 18).
    costs.observe(9, 4, 0.072)
    assert costs.estimate(5, 4) == pytest.approx(0.072 * 0.014 / 0.018)
    costs.observe(1, 1, 0.020)  # a moving average
    assert 0.010 < (costs.estimate(1, 1) or 0) < 0.020
