"""A slot's KV cells copied to another slot, with the real model.

The engine copies cached cells between slots (parking, a prefix from another slot,
the other choices of ``n``) through llama.cpp's sequence state, at once; if llama.cpp
refused it, through ``llama_memory_seq_cp``, queued for the next decode, after which
every copy queues until that decode. Both ways the copy must read as the original:
the next token decoded on top of it gives the same logits, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import llama_cpp as ll
import numpy as np
import pytest

from tokenmill.engines.llamacpp import LlamaCppEngine

PROMPT = "The lighthouse on the rocky northern coast was built in the year"


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppEngine]:
    # Loaded, not started: this test drives llama.cpp on its own thread, as the decode
    # thread would.
    eng = LlamaCppEngine(max_num_seqs=4, adapt_threads=False)
    eng._load()
    try:
        yield eng
    finally:
        eng._unload()


def decode(eng: LlamaCppEngine, seq: int, tokens: list[int], start: int) -> np.ndarray[Any, Any]:
    batch = eng._batch
    batch.n_tokens = len(tokens)
    for i, token in enumerate(tokens):
        batch.token[i] = token
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = i == len(tokens) - 1
    assert ll.llama_decode(eng._ctx, batch) == 0
    eng._copies_queued = False  # as _step does after every decode
    n_vocab = eng.vocab.n_tokens
    return np.ctypeslib.as_array(ll.llama_get_logits_ith(eng._ctx, -1), shape=(n_vocab,)).copy()


def test_copied_cells_read_as_the_original(engine: LlamaCppEngine) -> None:
    tokens = engine.vocab.tokenize(PROMPT)
    assert len(tokens) > 8
    for seq in range(4):
        assert ll.llama_memory_seq_rm(engine._mem, seq, -1, -1)
    decode(engine, 0, tokens, 0)
    # Slot 1 held something else: the copy replaces all of it.
    decode(engine, 1, tokens[::-1], 0)

    engine._copy_seq(0, 1)  # at once, through the sequence state
    assert not engine._copies_queued

    engine._copies_queued = True  # as if llama.cpp had refused a state before
    engine._copy_seq(0, 2)  # queued behind it, done by the next decode
    assert engine._copies_queued

    nxt = engine.vocab.tokenize(" 1")[-1]
    n = len(tokens)
    original = decode(engine, 0, [nxt], n)
    assert not engine._copies_queued
    for seq in (1, 2):
        copy = decode(engine, seq, [nxt], n)
        assert np.array_equal(copy, original), seq
    # The original's cells are its own still: decoding on the copies changed nothing.
    ll.llama_memory_seq_rm(engine._mem, 0, n, -1)
    assert np.array_equal(decode(engine, 0, [nxt], n), original)
