"""A slot's KV cells copied to another slot, with the real model.

The engine copies cached cells between slots (parking, a prefix from another slot,
the other choices of ``n``) through llama.cpp's sequence state, at once; if llama.cpp
refused it, through ``llama_memory_seq_cp``, queued for the next decode, after which
every copy queues until that decode. Both ways the copy must read as the original:
the next token decoded on top of it gives the same logits, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.llamacpp.context import LlamaContext

PROMPT = "The lighthouse on the rocky northern coast was built in the year"


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaContext]:
    # The engine's llama.cpp context alone, no decode loop: this test drives it on its
    # own thread, as the decode thread would.
    ctx = LlamaContext(
        embedded_model_path(),
        n_slots=4,
        n_ctx_seq=2048,
        n_threads=2,
        batch_size=512,
        unified=False,  # a KV stream a slot: copies between streams
    )
    try:
        yield ctx
    finally:
        ctx.close()


@contextmanager
def small_pool() -> Iterator[LlamaContext]:
    """A context alone whose 3 slots share one pool of 512 cells (llama.cpp's unified
    KV), one thread."""
    ctx = LlamaContext(
        embedded_model_path(),
        n_slots=3,
        n_ctx_seq=512,
        n_threads=1,
        batch_size=512,
        pool_tokens=512,
    )
    try:
        assert ctx.unified
        yield ctx
    finally:
        ctx.close()


def decode(ctx: LlamaContext, seq: int, tokens: list[int], start: int) -> np.ndarray[Any, Any]:
    for i, token in enumerate(tokens):
        ctx.add(i, token, start + i, seq, i == len(tokens) - 1)
    assert ctx.decode(len(tokens)) == 0
    return ctx.logits(len(tokens) - 1).copy()


def test_copied_cells_read_as_the_original(engine: LlamaContext) -> None:
    tokens = engine.vocab.tokenize(PROMPT)
    assert len(tokens) > 8
    for seq in range(4):
        assert engine.drop(seq, -1)
    decode(engine, 0, tokens, 0)
    # Slot 1 held something else: the copy replaces all of it.
    decode(engine, 1, tokens[::-1], 0)

    engine.copy_seq(0, 1)  # at once, through the sequence state
    assert not engine.copies_queued

    engine.copies_queued = True  # as if llama.cpp had refused a state before
    engine.copy_seq(0, 2)  # queued behind it, done by the next decode
    assert engine.copies_queued

    nxt = engine.vocab.tokenize(" 1")[-1]
    n = len(tokens)
    original = decode(engine, 0, [nxt], n)
    assert not engine.copies_queued
    for seq in (1, 2):
        copy = decode(engine, seq, [nxt], n)
        assert np.array_equal(copy, original), seq
    # The original's cells are its own still: decoding on the copies changed nothing.
    assert engine.drop(0, n)
    assert np.array_equal(decode(engine, 0, [nxt], n), original)


def test_in_a_unified_pool_a_copy_replaces_what_the_slot_held() -> None:
    """``copy_seq`` into a slot that held other cells, in one pool: the slot reads as
    the source, bit for bit, as a copy between KV streams does. llama.cpp's ``seq_cp``
    inside one pool adds the source's cells to the destination's: without removing
    them first the slot attended to two cells at each position (issue 46, found by
    test_kv_oracle.py)."""
    with small_pool() as ctx:
        tokens = ctx.vocab.tokenize("The lighthouse on the rocky northern coast was built in")
        n = len(tokens)
        decode(ctx, 0, tokens, 0)
        decode(ctx, 1, tokens[::-1], 0)  # slot 1 holds other cells at the same positions
        nxt = ctx.vocab.tokenize(" 1")[-1]
        ctx.copy_seq(0, 1)
        assert ctx.held(1) == n
        copy = decode(ctx, 1, [nxt], n)
        assert ctx.drop(1, -1)
        original = decode(ctx, 0, [nxt], n)
        assert np.array_equal(copy, original)
