"""A greedy choice's token is read off its logits without the sampler chain
(outputs.py): it must be the token llama.cpp's greedy sampler picks, row for row."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp as ll
import numpy as np
import pytest

from tokenmill.engines import SamplingParams
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.sampling import build_sampler, only_greedy

PROMPT = (
    "<|im_start|>user\nList the planets of the solar system, nearest first, and say "
    "which one has the most moons.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def context() -> Iterator[LlamaContext]:
    ctx = LlamaContext(embedded_model_path(), n_slots=1, n_ctx_seq=512, n_threads=2, batch_size=64)
    try:
        yield ctx
    finally:
        ctx.close()


def test_only_a_chain_of_greedy_alone_takes_the_shortcut() -> None:
    assert only_greedy(SamplingParams(8, temperature=0.0))
    assert not only_greedy(SamplingParams(8, temperature=0.7))
    assert not only_greedy(SamplingParams(8, temperature=0.0, logit_bias=((5, 1.0),)))
    assert not only_greedy(SamplingParams(8, temperature=0.0, repetition_penalty=1.1))
    assert not only_greedy(SamplingParams(8, temperature=0.0, frequency_penalty=0.5))
    assert not only_greedy(SamplingParams(8, temperature=0.0, presence_penalty=0.5))


def test_the_argmax_is_the_greedy_samplers_token_on_every_row(context: LlamaContext) -> None:
    tokens = context.vocab.tokenize(PROMPT, bos=False, special=True)
    assert 20 < len(tokens) <= 64
    for i, token in enumerate(tokens):  # every row's logits: many distributions
        context.add(i, token, i, 0, True)
    assert context.decode(len(tokens)) == 0
    chain = build_sampler(SamplingParams(8, temperature=0.0), context.vocab.n_tokens)
    try:
        for idx in range(len(tokens)):
            logits = context.logits(idx)
            assert int(np.argmax(logits)) == context.sample(chain, idx)
        # Ties go to the lowest id in both.
        logits = context.logits(0)
        top = int(np.argmax(logits))
        logits[top + 1 :] = logits[top]
        assert context.sample(chain, 0) == int(np.argmax(logits)) == top
    finally:
        ll.llama_sampler_free(chain)
