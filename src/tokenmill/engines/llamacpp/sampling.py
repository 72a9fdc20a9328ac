"""The sampling chain of one sequence, as llama.cpp samplers.

OpenAI's fields map onto llama.cpp's samplers in the order OpenAI applies them:
``logit_bias`` on the raw logits first, then the repetition, frequency and presence
penalties, then greedy (``temperature`` 0) or top-k, top-p, min-p, temperature and a
seeded draw. This module imports ``llama_cpp``; it is loaded with the engine.
"""

from __future__ import annotations

import math
import random
from typing import Any

import llama_cpp as ll

from tokenmill.engines.base import SamplingParams

# Penalties look back this many generated tokens (llama.cpp's default).
PENALTY_LAST_N = 64
# OpenAI's range of logit_bias values; its lower end bans the token.
MAX_LOGIT_BIAS = 100.0


def only_greedy(p: SamplingParams) -> bool:
    """Whether ``p``'s chain is greedy alone (no bias, no penalty): its token is then
    the first of the largest logits, read without the chain (llama_sampler_sample
    copies the whole vocabulary into candidates first: ~0.1 ms a token here)."""
    return (
        p.temperature <= 0.0
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
    )


def build_sampler(p: SamplingParams, n_vocab: int) -> Any:
    """A llama.cpp sampler chain for one sequence (free it with ``llama_sampler_free``)."""
    sparams = ll.llama_sampler_chain_default_params()
    sparams.no_perf = True
    chain = ll.llama_sampler_chain_init(sparams)
    add = ll.llama_sampler_chain_add
    if p.logit_bias:
        # First, as OpenAI applies it to the logits themselves. -100 is a ban: a
        # finite bias can lose to a logit past 100.
        biases = (ll.llama_logit_bias * len(p.logit_bias))(
            *(
                ll.llama_logit_bias(token, -math.inf if bias <= -MAX_LOGIT_BIAS else bias)
                for token, bias in p.logit_bias
            )
        )
        add(
            chain,
            ll.llama_sampler_init_logit_bias(n_vocab, len(biases), biases),
        )
    if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
        add(
            chain,
            ll.llama_sampler_init_penalties(
                n_vocab,
                PENALTY_LAST_N,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            ),
        )
    if p.temperature <= 0.0:
        add(chain, ll.llama_sampler_init_greedy())
        return chain
    if p.top_k > 0:
        add(chain, ll.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        add(chain, ll.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        add(chain, ll.llama_sampler_init_min_p(p.min_p, 1))
    add(chain, ll.llama_sampler_init_temp(p.temperature))
    seed = p.seed if p.seed is not None else random.getrandbits(32)
    add(chain, ll.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain
