"""LogitRow against a plain float64 log-softmax and a full sort."""

from __future__ import annotations

import math

import numpy as np

from tokenmill.engines.llamacpp.logits import LogitRow


def reference(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    peak = x.max()
    result: np.ndarray = x - (peak + np.log(np.exp(x - peak).sum()))
    return result


def test_log_probabilities_match_a_float64_log_softmax() -> None:
    rng = np.random.default_rng(7)
    for scale in (0.5, 5.0, 40.0):  # flat, peaked, nearly one-hot
        logits = (rng.standard_normal(49_152) * scale).astype(np.float32)
        ref = reference(logits)
        row = LogitRow(logits)
        for token in (0, 17, int(ref.argmax()), int(ref.argmin()), 49_151):
            assert abs(row.logprob(token) - ref[token]) < 1e-5
        order = np.argsort(-ref, kind="stable")
        top = row.top(20)
        assert [t for t, _ in top] == [int(t) for t in order[:20]]
        assert all(abs(lp - ref[t]) < 1e-5 for t, lp in top)
        # The row is left as it was: asking again gives the same.
        assert row.top(20) == top


def test_ties_take_the_lowest_id_first_and_k_is_bounded() -> None:
    logits = np.array([1.0, 3.0, 3.0, -np.inf], dtype=np.float32)
    row = LogitRow(logits)
    assert [t for t, _ in row.top(10)] == [1, 2, 0, 3]
    assert row.logprob(3) == -math.inf
    assert math.isclose(sum(math.exp(lp) for _, lp in row.top(4)), 1.0, rel_tol=1e-6)


def test_the_row_is_a_copy() -> None:
    logits = np.array([0.0, 1.0], dtype=np.float32)
    row = LogitRow(logits)
    before = row.logprob(1)
    logits[:] = [5.0, -5.0]  # the engine's buffer, rewritten by the next decode
    assert row.logprob(1) == before
