"""The pure rules of speculative decoding (tokenmill.engines.speculative), on synthetic
token sequences and distributions: drafts by prompt lookup, exact acceptance (greedy,
and sampling whose written tokens are distributed as the model's, over many seeded
draws), and when drafting pays (llama.cpp's ubatches and their measured costs)."""

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
    best_cap,
    draft,
    ubatches,
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


def test_draft_length_follows_acceptance_and_the_measured_costs() -> None:
    # Rows a third of a step each (SmolLM2's Q8_0 on 2 cores: a 16-row step costs ~6.7
    # one-row steps, a 64-row one ~23), measured up to 65 rows.
    costs = _costs({n: 0.009 * (1 + 0.35 * (n - 1)) for n in (1, 2, 5, 9, 17, 33, 65)})
    seq = DraftLength()
    assert seq.length(costs) == 3  # the prior acceptance (0.8): short drafts
    assert seq.length(StepCosts()) == 0  # nothing measured: no draft
    for _ in range(20):
        seq.observe(drafted=4, accepted=4)
    assert seq.acceptance > 0.99 and seq.length(costs) >= 32  # copying: long drafts
    assert seq.length(costs, 10) <= 10  # within max_tokens and the context
    assert seq.expected_accepted(4) > 3.9
    for _ in range(20):
        seq.observe(drafted=4, accepted=0)
    assert seq.acceptance < 0.1 and seq.length(costs) == 0
    seq.observe(drafted=0, accepted=0)  # nothing drafted: nothing learned
    assert seq.length(costs) == 0
    steps = 0
    while seq.length(costs) == 0:  # resting, it tries again after a while
        seq.rest()
        steps += 1
    # No constant threshold: it drafts again once its acceptance beats a row's cost.
    assert 5 < steps < 200 and 0.35 < seq.acceptance < 0.5 and seq.length(costs) == 1
    # Where a verified row costs a whole step (no batching gain), nothing pays.
    flat = _costs({n: 0.009 * n for n in (1, 2, 9, 65)})
    assert DraftLength(acceptance=0.9).length(flat) == 0
    # Where rows are nearly free, even a middling acceptance drafts.
    cheap = _costs({n: 0.009 + 0.0001 * n for n in (1, 65)})
    assert DraftLength(acceptance=0.5).length(cheap) >= 1


def _costs(per_ubatch: dict[int, float], *, unified: bool = False) -> StepCosts:
    costs = StepCosts(unified=unified, n_ubatch=512)
    for n, seconds in per_ubatch.items():
        costs.observe([(0, n)], seconds)
    return costs


def test_drafting_pays_alone_and_not_beside_many_for_a_middling_acceptance() -> None:
    # A pass over the weights 10 ms, each row 0.5 ms more (as one thread on a CPU).
    costs = _costs({n: 0.010 + 0.0005 * n for n in (1, 16, 64, 160)})
    middling = DraftLength(acceptance=0.75)
    # One sequence: a draft of 7 adds 3.5 ms for ~2.6 tokens more: long drafts pay.
    assert best_cap([(0, 8, middling)], [], costs) >= 6
    # Sixteen, one of them drafting: its draft is a ubatch of its own (a pass more
    # for all sixteen): a loss.
    assert best_cap([(0, 8, middling)], list(range(1, 16)), costs) == 0
    # Sixteen all drafting: one ubatch of 16 x (1 + k) rows, each row slows every
    # sequence; a middling acceptance pays for short drafts only, a long accepted run
    # for long ones.
    everyone = [(slot, 8, middling) for slot in range(16)]
    assert best_cap(everyone, [], costs) in (1, 2)
    sure = [(slot, 8, DraftLength(acceptance=0.98)) for slot in range(16)]
    assert best_cap(sure, [], costs) >= 6
    # Nothing measured yet: no drafts (a plain step comes first and measures).
    assert best_cap([(0, 8, middling)], [], StepCosts()) == 0


def test_ubatches_follow_llama_cpps_split() -> None:
    # A KV stream per slot: runs of consecutive slots, equal rows from each.
    assert ubatches([(0, 1), (1, 1), (2, 1)], unified=False, n_ubatch=512) == [3]
    assert ubatches([(0, 5), (1, 1), (2, 1)], unified=False, n_ubatch=512) == [3, 4]
    assert ubatches([(0, 3), (1, 3)], unified=False, n_ubatch=512) == [6]
    assert ubatches([(0, 1), (2, 1), (3, 1)], unified=False, n_ubatch=512) == [1, 2]
    assert ubatches([(0, 300), (1, 300)], unified=False, n_ubatch=512) == [512, 88]
    # One pool: ubatches of n_ubatch rows, whatever the sequences.
    assert ubatches([(0, 5), (1, 1), (2, 1)], unified=True, n_ubatch=512) == [7]
    assert ubatches([(0, 600)], unified=True, n_ubatch=512) == [512, 88]


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


def test_step_costs_are_their_ubatches_measured_and_interpolated() -> None:
    costs = StepCosts(n_ubatch=512)
    assert costs.estimate([(0, 1)]) is None
    costs.observe([(0, 1)], 0.010)
    assert costs.estimate([(0, 1)]) == 0.010
    # One size measured: beyond it each row half a pass more (a first guess).
    assert costs.estimate([(0, 4)]) == pytest.approx(0.025)
    costs.observe([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1)], 0.018)
    assert costs.ubatch(5) == pytest.approx(0.014)
    # Beyond the largest measured: on along the line through the two largest.
    assert costs.ubatch(13) == pytest.approx(0.022)
    # A step of two ubatches costs both, and measures neither.
    two, four = costs.ubatch(2), costs.ubatch(4)
    assert two is not None and four is not None
    assert costs.estimate([(0, 5), (1, 1)]) == pytest.approx(two + four)
    costs.observe([(0, 5), (1, 1)], 1.0)
    assert costs.ubatch(2) == pytest.approx(0.011)
    costs.observe([(0, 1)], 0.020)  # a moving average
    assert 0.010 < (costs.ubatch(1) or 0) < 0.020
