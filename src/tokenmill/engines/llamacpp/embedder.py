"""Embeddings on a llama.cpp replica: a second context on the same loaded model.

:class:`Embedder` belongs to one :class:`~tokenmill.engines.llamacpp.LlamaCppEngine`.
It shares the engine's ``llama_model`` (the weights are loaded once) and owns a
second ``llama_context`` made for embeddings (``embeddings = true``), created on the
first request and freed with the engine.

Work runs on the engine's decode thread, between two decode steps of the streams:
the decode loop (``llamacpp/loop.py``) calls :meth:`Embedder.step` while jobs are
queued, and a step decodes at most ``EMBED_CHUNK`` tokens of inputs, then the streams
get their next token. So embeddings neither hold streams up for longer than a prompt's prefill
chunk nor wait for them to finish.

Pooling: a model whose GGUF declares one (``<arch>.pooling_type``: an embedding
model's CLS, mean or last token) gets llama.cpp's, which needs a whole input in one
pass: such an input is decoded whole, in a step of its own. A causal LM that
declares none (SmolLM2) gets the mean of its token vectors, computed here: an input
is decoded in chunks of ``EMBED_CHUNK`` tokens over as many steps (the KV cache
carries the earlier chunks, as for a prompt), and the vectors of its tokens summed.

Every input is decoded on its own, at the same chunk boundaries whatever else is
queued, so the same text always gets the very same vector (batching inputs together
changes the float results). Vectors are L2-normalized. A failed embedding decode
fails its request, never the loop.

This module imports ``llama_cpp``; it is loaded lazily, never by ``import tokenmill``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as ll
import numpy as np

from tokenmill.engines.base import Prepared
from tokenmill.engines.embeddings import EmbeddingInfo, EmbeddingRequest, Embeddings
from tokenmill.engines.llamacpp.vocab import Vocab
from tokenmill.errors import ContextLengthError, EngineError, InvalidRequestError

log = logging.getLogger("tokenmill.engines.embeddings")

# Tokens of inputs decoded per step (a whole input of a model with its own pooling
# may be more): the same bound as a step's prompt prefill, so streams wait no longer
# for embeddings than for a new prompt.
EMBED_CHUNK = 512

_POOLING = {
    ll.LLAMA_POOLING_TYPE_MEAN: "mean",
    ll.LLAMA_POOLING_TYPE_CLS: "cls",
    ll.LLAMA_POOLING_TYPE_LAST: "last",
    ll.LLAMA_POOLING_TYPE_RANK: "rank",
}


@dataclass(eq=False)
class _Job:
    """One request's inputs on their way through the decode thread, one at a time."""

    inputs: list[list[int]]
    future: asyncio.Future[Embeddings]
    loop: asyncio.AbstractEventLoop
    vectors: list[tuple[float, ...]] = field(default_factory=list)
    pos: int = 0  # tokens of the current input (``inputs[len(vectors)]``) decoded
    total: Any = None  # their vectors' sum (mean pooling done here)

    def resolve(self, outcome: Embeddings | BaseException) -> None:
        """Hand the outcome to the waiting caller, on its event loop (from any thread)."""

        def deliver() -> None:
            if self.future.done():  # the caller left
                return
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)

        with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
            self.loop.call_soon_threadsafe(deliver)


class Embedder:
    """Embeddings for one llama.cpp engine. See the module docstring.

    ``cv`` is the engine's condition variable: jobs are queued under it and it is
    notified, so the decode loop wakes for them as for a new request.
    """

    def __init__(
        self, model: Any, vocab: Vocab, *, window: int, n_threads: int, cv: threading.Condition
    ) -> None:
        self._model = model
        self._vocab = vocab
        # Tokens one input may hold: the engine's window, within what the model learnt.
        self.window = min(window, int(ll.llama_model_n_ctx_train(model)) or window)
        self._n_threads = n_threads
        self._cv = cv
        self.jobs: collections.deque[_Job] = collections.deque()
        self.dimensions = int(ll.llama_model_n_embd_out(model))
        self.pooling = _declared_pooling(model)
        self._prepared: Prepared[list[list[int]]] = Prepared()
        self._ctx: Any = None
        self._batch: Any = None
        self._failed: str | None = None  # the context could not be created: why
        # Set while an embedding decode runs: the engine's stall report includes it.
        self.decoding_since: float | None = None

    # -- the event loop's side -----------------------------------------------------

    def tokens_of(self, request: EmbeddingRequest) -> list[list[int]]:
        """Every input's tokens; ``InvalidRequestError`` for what cannot be embedded."""
        if self.pooling == ll.LLAMA_POOLING_TYPE_RANK:
            raise InvalidRequestError(
                "this model is a reranker (its pooling is 'rank'): it scores pairs and "
                "gives no embedding vectors",
                param="model",
            )
        if request.dimensions is not None and request.dimensions != self.dimensions:
            raise InvalidRequestError(
                f"this model's embeddings have {self.dimensions} dimensions and it cannot "
                f"shorten them to {request.dimensions}: omit 'dimensions' or send "
                f"{self.dimensions}",
                param="dimensions",
            )
        out: list[list[int]] = []
        for i, item in enumerate(request.inputs):
            where = "input" if len(request.inputs) == 1 else f"input.{i}"
            if isinstance(item, str):
                tokens = self._vocab.tokenize(item)
            else:
                self._vocab.check_ids(item, where)
                tokens = list(item)
            if not tokens:
                raise InvalidRequestError(f"'{where}' is empty: nothing to embed", param="input")
            if len(tokens) > self.window:
                raise ContextLengthError(
                    f"This model's maximum context length is {self.window} tokens, but "
                    f"'{where}' has {len(tokens)} tokens. Shorten it, or split it into "
                    "several inputs.",
                    param="input",
                )
            out.append(tokens)
        return out

    def prepare(self, request: EmbeddingRequest) -> EmbeddingInfo:
        tokens = self.tokens_of(request)
        self._prepared.put(request.request_id, tokens)
        return EmbeddingInfo(sum(len(t) for t in tokens), self.dimensions)

    async def embed(
        self, request: EmbeddingRequest, *, failed: Callable[[], BaseException | None]
    ) -> Embeddings:
        """Queue the request's inputs for the decode thread and wait for their vectors.

        ``failed`` tells (under the lock) whether the decode loop died: nothing would
        ever take the job."""
        inputs = self._prepared.take(request.request_id)
        if inputs is None:
            inputs = self.tokens_of(request)
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop.create_future(), loop)
        with self._cv:
            error = failed()
            if error is not None:
                raise EngineError(f"the engine failed: {error}")
            self.jobs.append(job)
            self._cv.notify()
        return await job.future

    # -- the decode thread's side ------------------------------------------------------

    def step(self) -> None:
        """Decode up to ``EMBED_CHUNK`` tokens of queued inputs (at least one chunk)."""
        used = 0
        while True:
            with self._cv:
                # A request whose caller left is dropped.
                while self.jobs and self.jobs[0].future.done():
                    self.jobs.popleft()
                if not self.jobs:
                    return
                job = self.jobs[0]
            tokens = job.inputs[len(job.vectors)]
            size = len(tokens) if self.pooling is not None else EMBED_CHUNK
            chunk = tokens[job.pos : job.pos + size]
            if used and used + len(chunk) > EMBED_CHUNK:
                return
            used += len(chunk)
            try:
                self._ensure_context()
                self._decode(job, chunk)
            except Exception as e:
                log.exception("an embedding decode failed")
                with self._cv:
                    with contextlib.suppress(ValueError):
                        self.jobs.remove(job)
                job.resolve(e if isinstance(e, EngineError) else EngineError(f"embedding: {e}"))
                return
            if len(job.vectors) == len(job.inputs):
                with self._cv:
                    with contextlib.suppress(ValueError):
                        self.jobs.remove(job)
                tokens_in = sum(len(t) for t in job.inputs)
                job.resolve(Embeddings(tuple(job.vectors), tokens_in))

    def _ensure_context(self) -> None:
        if self._ctx is not None:
            return
        if self._failed is not None:
            raise EngineError(self._failed)
        own = self.pooling is not None
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.window
        # The model's own pooling sees an input in one pass: it fits one ubatch.
        cparams.n_batch = self.window if own else EMBED_CHUNK
        cparams.n_ubatch = cparams.n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = self._n_threads
        cparams.n_threads_batch = self._n_threads
        cparams.embeddings = True
        # Without pooling of its own: every token's vector, pooled here.
        cparams.pooling_type = self.pooling if own else ll.LLAMA_POOLING_TYPE_NONE
        cparams.no_perf = True
        ctx = ll.llama_init_from_model(self._model, cparams)
        if not ctx:
            self._failed = "llama.cpp could not create the embedding context (out of memory?)"
            raise EngineError(self._failed)
        self._ctx = ctx
        self._batch = ll.llama_batch_init(cparams.n_batch, 0, 1)
        log.info(
            "embedding context: %d tokens, %s pooling, %d dimensions",
            self.window,
            _POOLING.get(ll.LLAMA_POOLING_TYPE_MEAN if self.pooling is None else self.pooling),
            self.dimensions,
        )

    def _decode(self, job: _Job, chunk: list[int]) -> None:
        """Decode the next ``chunk`` of the job's current input; when that was its
        last, the input's unit-length vector joins ``job.vectors``."""
        ctx, batch = self._ctx, self._batch
        if job.pos == 0:
            mem = ll.llama_get_memory(ctx)
            if mem:  # an encoder-only model keeps no memory between passes
                ll.llama_memory_clear(mem, True)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = job.pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True  # every token's vector is read
        batch.n_tokens = len(chunk)
        self.decoding_since = time.monotonic()
        try:
            rc = ll.llama_decode(ctx, batch)
        finally:
            self.decoding_since = None
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc} for an embedding")
        job.pos += len(chunk)
        if self.pooling is None:
            rows = np.ctypeslib.as_array(
                ll.llama_get_embeddings(ctx), shape=(len(chunk), self.dimensions)
            )
            part = rows.astype(np.float64).sum(axis=0)
            job.total = part if job.total is None else job.total + part
        if job.pos < len(job.inputs[len(job.vectors)]):
            return
        if self.pooling is None:
            vector = job.total  # the mean's direction: the sum's
        else:
            ptr = ll.llama_get_embeddings_seq(ctx, 0)
            if not ptr:
                raise EngineError("llama.cpp returned no pooled embedding")
            vector = np.ctypeslib.as_array(ptr, shape=(self.dimensions,))
        job.vectors.append(unit(vector))
        job.pos, job.total = 0, None

    def fail_all(self, err: BaseException) -> None:
        """The decode loop ended: every queued request fails with ``err``."""
        with self._cv:
            jobs = list(self.jobs)
            self.jobs.clear()
        for job in jobs:
            job.resolve(err)

    def close(self) -> None:
        """Free the context (the decode thread has stopped)."""
        self.fail_all(EngineError("the engine is shutting down"))
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None


def unit(vector: Any) -> tuple[float, ...]:
    """``vector`` scaled to length 1, as float32 values (what base64 encodes exactly)."""
    v = np.asarray(vector, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    if norm > 0.0 and np.isfinite(norm):
        v = v / norm
    return tuple(v.astype(np.float32).tolist())


def _declared_pooling(model: Any) -> int | None:
    """The pooling the GGUF declares (``<arch>.pooling_type``), or None."""
    arch = _meta(model, "general.architecture")
    if arch is None:
        return None
    value = _meta(model, f"{arch}.pooling_type")
    if value is None or not value.lstrip("-").isdigit():
        return None
    pooling = int(value)
    return pooling if pooling in _POOLING else None


def _meta(model: Any, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    return buf.value.decode("utf-8", errors="replace")


__all__ = ["EMBED_CHUNK", "Embedder", "unit"]
