"""One loaded GGUF model and its decode context: the llama.cpp calls of the decode loop.

:class:`LlamaContext` owns the ``llama_model``, the ``llama_context`` with one KV
stream per slot (``kv_unified=false``) and the batch every step is written into. It
decodes, reads logits, samples, and copies or drops a slot's KV cells; what those
cells hold is recorded elsewhere (:mod:`.slotcache`), and what to do with them is
decided elsewhere (:mod:`tokenmill.engines.slots`, :mod:`.kvslots`).

All of it runs on the engine's decode thread (or, before the loop starts, the thread
that loads the model).
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from tokenmill.engines.vocab import Vocab, init_backend, model_params
from tokenmill.errors import EngineError

__all__ = ["LlamaContext", "RopeScaling"]

log = logging.getLogger("tokenmill.engines.llamacpp")

_ROPE_TYPES = {
    "none": ll.LLAMA_ROPE_SCALING_TYPE_NONE,
    "linear": ll.LLAMA_ROPE_SCALING_TYPE_LINEAR,
    "yarn": ll.LLAMA_ROPE_SCALING_TYPE_YARN,
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE context extension, as llama-server's ``--rope-scaling KIND --rope-scale
    SCALE --yarn-orig-ctx N``: positions are stretched ``scale`` times (llama.cpp's
    ``rope_freq_scale`` is its inverse); ``orig_ctx`` is the context the model was
    trained with (None: the model file's)."""

    kind: str  # "none", "linear" or "yarn"
    scale: float | None = None
    orig_ctx: int | None = None

    def apply(self, cparams: Any) -> None:
        cparams.rope_scaling_type = _ROPE_TYPES[self.kind]
        if self.scale is not None:
            cparams.rope_freq_scale = 1.0 / self.scale
        if self.orig_ctx is not None:
            cparams.yarn_orig_ctx = self.orig_ctx


class LlamaContext:
    """A model loaded for ``n_slots`` sequences of ``n_ctx_seq`` tokens each.

    ``batch_size`` bounds the tokens of one decode (the step's prefill chunk plus a
    token for every slot).
    """

    def __init__(
        self,
        path: Path,
        *,
        n_slots: int,
        n_ctx_seq: int,
        n_threads: int,
        batch_size: int,
        rope: RopeScaling | None = None,
    ) -> None:
        if not path.is_file():
            raise EngineError(f"model file not found: {path}")
        init_backend()
        model = ll.llama_model_load_from_file(str(path).encode(), model_params())
        if not model:
            raise EngineError(f"llama.cpp could not load {path}")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx_seq * n_slots
        cparams.n_seq_max = n_slots
        cparams.n_batch = batch_size
        cparams.n_ubatch = batch_size
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.kv_unified = False
        cparams.no_perf = True
        if rope is not None:
            rope.apply(cparams)
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            ll.llama_model_free(model)
            raise EngineError("llama.cpp could not create a context (out of memory?)")
        self.model: Any = model
        self._ctx: Any = ctx
        self.vocab = Vocab(model)
        self._mem: Any = ll.llama_get_memory(ctx)
        self.n_ctx_seq: int = ll.llama_n_ctx_seq(ctx)
        self.batch: Any = ll.llama_batch_init(batch_size, 0, 1)
        self.batch_cap = batch_size
        self.threads = n_threads  # what the last decode used
        self.decoded_at = 0.0  # when the last llama_decode returned
        self.decoding_since: float | None = None  # set while llama_decode runs
        self.copies_queued = False  # a seq_cp waits for the next decode (see copy_seq)

    def close(self) -> None:
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self.model is not None:
            ll.llama_model_free(self.model)
            self.model = None

    # -- decoding ----------------------------------------------------------------------

    def add(self, i: int, token: int, pos: int, slot: int, logits: bool) -> None:
        """Write row ``i`` of the batch: ``token`` at ``pos`` of ``slot``'s sequence."""
        batch = self.batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = slot
        batch.logits[i] = logits

    def set_threads(self, threads: int) -> None:
        if threads != self.threads:
            ll.llama_set_n_threads(self._ctx, threads, threads)
            self.threads = threads

    def decode(self, n_tokens: int) -> int:
        """``llama_decode`` of the batch's first ``n_tokens`` rows, seen by the health
        probe while it runs (``decoding_since``); it carries out the copies
        :meth:`copy_seq` queued before it writes."""
        self.batch.n_tokens = n_tokens
        self.decoding_since = time.monotonic()
        try:
            rc: int = ll.llama_decode(self._ctx, self.batch)
        finally:
            self.decoding_since = None
            self.copies_queued = False
        self.decoded_at = time.monotonic()
        return rc

    def logits(self, idx: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The logits at batch output ``idx``: a view of llama.cpp's own buffer."""
        n_vocab = self.vocab.n_tokens
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, idx), shape=(n_vocab,))

    def sample(self, sampler: Any, idx: int) -> int:
        """Draw a token from batch output ``idx`` with a sampler chain."""
        token: int = ll.llama_sampler_sample(sampler, self._ctx, idx)
        return token

    # -- KV cells --------------------------------------------------------------------

    def copy_seq(self, src: int, dst: int) -> None:
        """Make slot ``dst``'s KV cells a copy of slot ``src``'s, now.

        Through llama.cpp's sequence state (``llama_state_seq_get_data`` and
        ``..._set_data``): only the cells ``src`` uses cross, twice, which costs in
        proportion to them (measured here: 0.7 ms for 180 tokens of SmolLM2-135M, 4 MB).
        ``llama_memory_seq_cp`` between two KV streams instead queues a copy of the
        whole stream (``n_ctx`` cells, 47 MB at 2048) that the next ``llama_decode``
        carries out: ~11 ms on the first token's path of the request that caused it.

        Should llama.cpp refuse the state, the copy falls back to ``seq_cp``; later
        copies then queue behind it until the next decode, so that every copy still
        happens in the order it was asked for (a queued copy read by an immediate one
        would be read before it is made).
        """
        if not self.copies_queued:
            ctx = self._ctx
            size = ll.llama_state_seq_get_size(ctx, src)
            # A new buffer each time (0.25 ms more than reusing one for 4 MB here):
            # nothing as big as a slot's cells stays held between copies.
            buf = (ctypes.c_uint8 * size).from_buffer(bytearray(size))
            written = ll.llama_state_seq_get_data(ctx, buf, size, src)
            if written and ll.llama_state_seq_set_data(ctx, buf, written, dst) == written:
                return
            log.warning("llama.cpp refused slot %d's state for slot %d: copying", src, dst)
        ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self.copies_queued = True

    def drop(self, slot: int, start: int) -> bool:
        """Drop ``slot``'s KV cells from position ``start`` on (-1: all of them);
        False if llama.cpp cannot cut the sequence there."""
        return bool(ll.llama_memory_seq_rm(self._mem, slot, start, -1))
