"""A model file's perplexity on a fixed text: what a conversion costs in quality.

``tokenmill convert`` prints it for the file it reads and the file it writes, so that a
user sees the cost of a type before serving it. The text (``perplexity.txt``, shipped
with the package) is a few hundred tokens of plain English written for this purpose:
the same text, tokenizer and window make two files of one model comparable, not two
models. One context reads it in one batch with logits at every position; each token's
negative log-likelihood comes from the log-softmax of the row before it.

This module imports ``llama_cpp``; it is loaded lazily, never by ``import tokenmill``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from tokenmill.engines.llamacpp.threads import available_cpus
from tokenmill.engines.llamacpp.vocab import Vocab, init_backend, model_params
from tokenmill.errors import EngineError

__all__ = ["Perplexity", "fixed_text", "perplexity"]


def fixed_text() -> str:
    """The shipped text every file is measured on."""
    return resources.files("tokenmill.engines.llamacpp").joinpath("perplexity.txt").read_text()


@dataclass(frozen=True, slots=True)
class Perplexity:
    value: float
    tokens: int  # tokens scored (the text's, less the first)


def perplexity(path: Path, text: str | None = None, *, threads: int | None = None) -> Perplexity:
    """``path``'s perplexity on ``text`` (None: :func:`fixed_text`)."""
    init_backend()
    model = ll.llama_model_load_from_file(str(path).encode(), model_params())
    if not model:
        raise EngineError(f"llama.cpp could not load {path}")
    try:
        tokens = Vocab(model).tokenize(fixed_text() if text is None else text, special=False)
        if len(tokens) < 2:
            raise EngineError("the text has fewer than two tokens: nothing to score")
        if len(tokens) > ll.llama_model_n_ctx_train(model):
            raise EngineError(f"the text's {len(tokens)} tokens exceed the model's context")
        logits = _all_logits(model, tokens, threads or available_cpus())
    finally:
        ll.llama_model_free(model)
    rows = logits[:-1].astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    log_norm = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
    targets = np.asarray(tokens[1:])
    nll = log_norm - rows[np.arange(len(targets)), targets]
    return Perplexity(math.exp(float(nll.mean())), len(targets))


def _all_logits(model: Any, tokens: list[int], threads: int) -> np.ndarray[Any, Any]:
    """The logits after every token of ``tokens``, decoded as one batch of one sequence."""
    n = len(tokens)
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = n
    cparams.n_batch = n
    cparams.n_ubatch = n
    cparams.n_seq_max = 1
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.no_perf = True
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        raise EngineError("llama.cpp could not create a context (out of memory?)")
    batch = ll.llama_batch_init(n, 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True
        batch.n_tokens = n
        rc = ll.llama_decode(ctx, batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed ({rc}) reading the text")
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        out = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(n, n_vocab)).copy()
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
    return out
