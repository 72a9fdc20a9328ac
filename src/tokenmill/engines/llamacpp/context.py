"""One loaded GGUF model and its decode context: the llama.cpp calls of the decode loop.

:class:`LlamaContext` owns the ``llama_model``, the ``llama_context`` (one KV pool the
slots share, ``kv_unified=true``, or a KV stream per slot) and the batch every step is
written into. It
decodes, reads logits, samples, and copies or drops a slot's KV cells; what those
cells hold is recorded elsewhere (:mod:`.slotcache`), and what to do with them is
decided elsewhere (:mod:`tokenmill.engines.llamacpp.slots`, :mod:`.kvslots`).

All of it runs on the engine's decode thread (or, before the loop starts, the thread
that loads the model).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from tokenmill.engines.llamacpp.vocab import Vocab, init_backend, model_params
from tokenmill.errors import EngineError

__all__ = [
    "DEFAULT_MAX_N_CTX",
    "POOL_TOKENS_PER_SLOT",
    "LlamaContext",
    "RopeScaling",
    "kv_bytes_per_token",
    "kv_fingerprint",
]

log = logging.getLogger("tokenmill.engines.llamacpp")

# The pool's default size: this many cells per slot (what every slot owned before the
# pool: the same memory, 16 x 2048 cells, 720 MiB of f16 cells for SmolLM2-135M), or
# one whole context if that is more.
POOL_TOKENS_PER_SLOT = 2048
# n_ctx's default is the model's trained context, at most this: a model trained on
# 128k tokens would otherwise take a pool of that many cells by default.
DEFAULT_MAX_N_CTX = 32768
# Memory a loaded model needs beside its weights and KV cells (compute buffers, the
# batch, the process): kept free when checking that a pool fits.
HEADROOM_BYTES = 512 << 20


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of f16 keys and values one token takes in every layer of ``model``."""
    n_head = max(1, ll.llama_model_n_head(model))
    head_dim = ll.llama_model_n_embd(model) // n_head
    n_head_kv = ll.llama_model_n_head_kv(model) or n_head
    return int(ll.llama_model_n_layer(model)) * 2 * int(n_head_kv) * int(head_dim) * 2


# How much of a model file its fingerprint reads: the GGUF header, metadata and tensor
# table, and the first weights (hashing a many-GiB file at every start would not do).
FINGERPRINT_BYTES = 16 << 20


def kv_fingerprint(path: Path, bytes_per_token: int, rope: RopeScaling | None) -> str:
    """What a saved sequence state is valid for: this model file (its size and a
    SHA-256 of its first ``FINGERPRINT_BYTES``), this llama.cpp (llama-cpp-python's
    version pins it, and so its state format), a KV cell's size and the RoPE
    settings (keys are stored rotated). A state saved under another is never
    restored (:mod:`.disktier`)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
    return json.dumps(
        {
            "model": digest.hexdigest(),
            "model_bytes": path.stat().st_size,
            "llama_cpp_python": ll.__version__,
            "kv_bytes_per_token": bytes_per_token,
            "rope": None if rope is None else [rope.kind, rope.scale, rope.orig_ctx],
        },
        sort_keys=True,
    )


def mem_available() -> int | None:
    """Bytes of memory the kernel says are available (None where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    """A model loaded for ``n_slots`` sequences of up to ``n_ctx_seq`` tokens each.

    ``unified``: the slots share one pool of ``pool_tokens`` KV cells (None:
    ``POOL_TOKENS_PER_SLOT`` a slot, at least one context), and ``n_ctx_seq`` 0 is
    the model's trained context, at most ``DEFAULT_MAX_N_CTX``. Otherwise every slot
    has a KV stream of ``n_ctx_seq`` cells (0: ``POOL_TOKENS_PER_SLOT``, at most the
    trained context), and ``pool_tokens`` must be None.

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
        pool_tokens: int | None = None,
        rope: RopeScaling | None = None,
        unified: bool = True,
    ) -> None:
        if not path.is_file():
            raise EngineError(f"model file not found: {path}")
        init_backend()
        model = ll.llama_model_load_from_file(str(path).encode(), model_params())
        if not model:
            raise EngineError(f"llama.cpp could not load {path}")
        try:
            n_ctx, pool = self._sizes(model, n_slots, n_ctx_seq, pool_tokens, unified)
        except EngineError:
            ll.llama_model_free(model)
            raise
        self.unified = unified
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = pool
        cparams.n_seq_max = n_slots
        cparams.n_batch = batch_size
        cparams.n_ubatch = batch_size
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.kv_unified = self.unified
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
        # The most tokens one sequence holds, and the pool's cells (llama.cpp may round
        # its context up).
        self.n_ctx_seq: int = n_ctx if self.unified else ll.llama_n_ctx_seq(ctx)
        self.pool_tokens: int = ll.llama_n_ctx(ctx)
        self.bytes_per_token = kv_bytes_per_token(model)
        self.batch: Any = ll.llama_batch_init(batch_size, 0, 1)
        self.batch_cap = batch_size
        self.threads = n_threads  # what the last decode used
        self.decoded_at = 0.0  # when the last llama_decode returned
        self.decoding_since: float | None = None  # set while llama_decode runs
        self.copies_queued = False  # a seq_cp waits for the next decode (see copy_seq)

    @staticmethod
    def _sizes(
        model: Any, n_slots: int, n_ctx_seq: int, pool_tokens: int | None, unified: bool
    ) -> tuple[int, int]:
        """(tokens a sequence may hold, cells of the context, all slots together); an
        EngineError naming the key when they would not fit in the memory available."""
        trained = int(ll.llama_model_n_ctx_train(model))
        if unified:
            n_ctx = n_ctx_seq or min(trained, DEFAULT_MAX_N_CTX)
            pool = pool_tokens or max(n_ctx, n_slots * POOL_TOKENS_PER_SLOT)
            if pool < n_ctx:
                raise EngineError(
                    f"kv_pool_tokens = {pool} is less than n_ctx = {n_ctx}: one sequence "
                    "could never use its whole context. Raise kv_pool_tokens or lower n_ctx"
                )
        else:
            if pool_tokens is not None:
                raise EngineError(
                    "kv_pool_tokens sizes the shared pool; with kv_layout = 'per_slot' "
                    "every slot has n_ctx cells of its own: set n_ctx instead"
                )
            n_ctx = n_ctx_seq or min(trained, POOL_TOKENS_PER_SLOT)
            pool = n_ctx * n_slots
        cells = pool
        need = cells * kv_bytes_per_token(model) + int(ll.llama_model_size(model))
        available = mem_available()
        if available is not None and need + HEADROOM_BYTES > available:
            key = "kv_pool_tokens" if pool_tokens else "n_ctx"
            value = pool if pool_tokens else n_ctx
            raise EngineError(
                f"{key} = {value} needs {cells} KV cells ({need / 2**30:.1f} GiB with "
                f"the model), more than the {available / 2**30:.1f} GiB of memory "
                f"available: lower {key}"
                + (
                    ""
                    if pool_tokens
                    else " (or max_num_seqs" + (", or set kv_pool_tokens)" if unified else ")")
                )
            )
        return n_ctx, pool

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

        In a unified pool ``seq_cp`` copies nothing: ``dst`` shares ``src``'s cells, at
        once. But it *adds* them to whatever ``dst`` held (only a copy between KV
        streams replaces the destination's stream), so ``dst``'s own cells go first:
        a slot holding two cells at one position attends to both, and its answers
        change (issue #46: the shared pool's corruption under load, found by
        tests/engines/test_kv_oracle.py). llama-server removes the destination
        before every ``seq_cp`` for the same reason.
        """
        if self.unified:
            ll.llama_memory_seq_rm(self._mem, dst, -1, -1)
            ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
            return
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
        self.copies_queued = True  # between KV streams the copy waits for the next decode

    def save_seq(self, slot: int) -> bytearray | None:
        """Slot ``slot``'s KV cells as llama.cpp's sequence state (to park them in host
        memory); None if llama.cpp gives none."""
        ctx = self._ctx
        size = ll.llama_state_seq_get_size(ctx, slot)
        if not size:
            return None
        data = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        written = ll.llama_state_seq_get_data(ctx, buf, size, slot)
        del buf  # the bytearray can be resized only once no view of it is left
        if not written:
            return None
        del data[written:]
        return data

    def restore_seq(self, slot: int, state: bytearray) -> bool:
        """Replace slot ``slot``'s KV cells by a saved sequence state; False (the slot
        then holds nothing) if llama.cpp cannot place it."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        done = bool(ll.llama_state_seq_set_data(self._ctx, buf, len(state), slot) == len(state))
        del buf
        if not done:
            ll.llama_memory_seq_rm(self._mem, slot, -1, -1)
        return done

    def held(self, slot: int) -> int:
        """How many positions slot ``slot``'s cells hold (0 when empty)."""
        return int(ll.llama_memory_seq_pos_max(self._mem, slot)) + 1

    def drop(self, slot: int, start: int) -> bool:
        """Drop ``slot``'s KV cells from position ``start`` on (-1: all of them);
        False if llama.cpp cannot cut the sequence there."""
        return bool(ll.llama_memory_seq_rm(self._mem, slot, start, -1))
