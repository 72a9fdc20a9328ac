"""llama.cpp engine: one continuous-batching decode loop over llama-cpp-python's C API.

A dedicated thread owns the llama context. Each step it builds one batch holding
the next token of every decoding sequence plus a bounded chunk of pending prompt
tokens (so a long prompt never stalls running streams), calls ``llama_decode`` once,
samples every sequence with its own sampler chain, and hands the step's text deltas
to the event loop in a single ``call_soon_threadsafe``. ctypes releases the GIL
inside llama.cpp, so the event loop keeps serving while a step runs.

Each slot is a llama.cpp sequence with its own KV stream (``kv_unified=false``). A
finished or aborted request leaves its slot at once; the tokens it left in the
slot's KV cells stay there as a prefix cache, so a later prompt sharing a prefix
(a system prompt, a continued chat) only computes the rest.

This module imports ``llama_cpp``; it is loaded lazily by name, never by ``import
tokenmill``.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from tokenmill import stages
from tokenmill.config import LlamaCppDeployment
from tokenmill.engines.base import (
    Chunk,
    EngineHealth,
    FinishReason,
    GenerationRequest,
    Prepared,
    PromptInfo,
    SamplingParams,
    StepSink,
    TokenizeRequest,
    TokenizerInfo,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tokenmill.engines.chat_template import next_user_turn
from tokenmill.engines.chunks import ChunkStream
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.embeddings import EmbeddingInfo, EmbeddingRequest, Embeddings
from tokenmill.engines.grammar import GrammarCache, SequenceGrammar
from tokenmill.engines.llama_embed import Embedder
from tokenmill.engines.logits import LogitRow
from tokenmill.engines.logprobs import TokenAligner, finite
from tokenmill.engines.sampling import build_sampler
from tokenmill.engines.slots import Slot, apply_placement, plan_placement
from tokenmill.engines.textstream import TextStream
from tokenmill.engines.threads import ThreadTuner, available_cpus
from tokenmill.engines.vocab import Vocab, init_backend, model_params
from tokenmill.errors import ContextLengthError, EngineError, InvalidRequestError

__all__ = ["LlamaCppEngine", "embedded_model_path"]

log = logging.getLogger("tokenmill.engines.llamacpp")

# Tokens of prompt prefilled per step across all sequences. Large enough that a
# 2k-token prompt is in after 4 steps, small enough that a step with 16 decoding
# streams stays a few tens of ms.
PREFILL_CHUNK = 512
# A chat's answer finished and nothing else to do for this long: the engine computes
# what the template writes before the next user message (see ``_warm_next_turn``). A
# person takes seconds to answer; a program that sends its next request at once
# arrives well before this and is never kept waiting by it.
WARM_AFTER_S = 0.2
# Chat templates whose next-turn tokens are kept (the model's, and requests' own).
NEXT_TURNS_KEPT = 64


@dataclass(slots=True)
class _Sequence:
    """One choice of a request: a sequence decoding in a slot of its own."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    stream: TextStream
    group: _Group | None = None  # set at once by _enqueue
    key: str = ""  # unique among running sequences (the request id for choice 0)
    index: int = 0  # the choice (OpenAI's ``index``)
    # Choices of one prompt share its prefill: the first (the leader) decodes the
    # prompt; the others (followers) wait with a slot of their own, then sample from
    # the leader's last prompt row and take a copy of its KV stream (see _step).
    leader: _Sequence | None = None  # a follower's, until it starts
    followers: list[_Sequence] = field(default_factory=list)
    slot: int = -1
    n_past: int = 0  # tokens of this request already in the slot's KV
    cached: int = 0  # prompt tokens reused from the prefix cache
    generated: int = 0
    last_token: int = -1
    sampler: Any = None
    done: bool = False
    # Tokens waiting for their text, when log probabilities were asked for.
    aligner: TokenAligner | None = None
    # The prompt's text goes out before the first sampled token (``echo``).
    echo_pending: bool = False
    # With echo and logprobs: (log probability, alternatives) of prompt tokens 1..n-1,
    # read from logits of every prompt row (see ``_step``); None: not collected.
    prompt_logprobs: list[tuple[float, tuple[TopLogprob, ...]]] | None = None
    # The constraint's state (structured outputs): masks the logits before sampling.
    grammar: SequenceGrammar | None = None
    # A chat's answer: what its template writes before the next user message, as
    # tokens (see ``LlamaCppEngine._warm_next_turn``); empty for anything else.
    next_turn: tuple[int, ...] = ()


@dataclass(slots=True)
class _Group:
    """One request's choices: ``n`` sequences for each of its prompts."""

    request_id: str
    members: list[_Sequence]
    prompt_tokens: int  # every prompt, each counted once
    generated: int = 0  # completion tokens of all its choices
    open: int = 0  # choices not finished yet
    # Monotonic times it was queued and taken by the decode loop (tokenmill.stages).
    marks: list[float] = field(default_factory=list)

    def usage(self) -> Usage:
        cached = sum(m.cached for m in self.members)
        return Usage(self.prompt_tokens, self.generated, cached)


# A KV slot and the request decoding in it (see slots.py, which places requests).
_Slot = Slot[_Sequence]


class LlamaCppEngine:
    """Continuous batching over one loaded GGUF model. See the module docstring."""

    name = "llamacpp"

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        max_num_seqs: int = 16,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        adapt_threads: bool = True,
    ) -> None:
        self.model_path = Path(model_path) if model_path else None
        self.max_num_seqs = max_num_seqs
        self.n_ctx_seq = n_ctx
        self.n_threads = n_threads or available_cpus()
        # Fewer threads when the cores are shared with other busy work (see threads.py).
        self._tuner = ThreadTuner(self.n_threads) if adapt_threads else None
        self._threads_now = self.n_threads
        self._model: Any = None
        self._ctx: Any = None
        self._vocab: Vocab | None = None
        self._mem: Any = None
        self._batch: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cv = threading.Condition()
        self._inbox: collections.deque[_Group] = collections.deque()
        self._aborts: set[str] = set()
        self._running: dict[str, _Sequence] = {}  # by key
        self._groups: dict[str, _Group] = {}  # admitted requests, by request id
        self._slots: list[_Slot] = []
        self._stop = False
        self._start_lock = asyncio.Lock()
        # Streams of generate() requests, filled on the event loop by the default sink.
        self._streams: dict[str, ChunkStream] = {}
        self._prepared: Prepared[list[list[int]]] = Prepared()
        self.tokens_generated = 0
        self.steps = 0
        self.kv_copies = 0  # prefixes copied from another slot (see _assign)
        self._copies_queued = False  # a seq_cp waits for the next decode (_copy_seq)
        # (slot, its token count then, tokens): the next turn of the chat that just
        # ended there, to compute once the engine has been idle WARM_AFTER_S.
        self._warm: tuple[int, int, list[int]] | None = None
        self.warmups = 0  # next turns computed ahead (see _warm_next_turn)
        # Chat template source -> its next-turn tokens (see _next_turn): the same few
        # tokens for every chat with that template, tokenized once.
        self._next_turns: dict[str, tuple[int, ...]] = {}
        # Request id -> the marks of its first token (queued, picked, decoded, sampled:
        # tokenmill.stages), until the sink sends them with the token.
        self.first_marks: dict[str, tuple[float, ...]] = {}
        self._decoded_at = 0.0  # when the last llama_decode returned
        self._decoding_since: float | None = None  # set while llama_decode runs
        # Receives every step's chunks on the decode thread: by default it hands them to
        # the streams of generate() on the event loop; a replica process sets its own.
        self._sink: StepSink = self._to_streams
        self._own_sink = False
        self._failed: BaseException | None = None
        # Embedding requests (a second context, see llama_embed.py), made at load.
        self._embedder: Embedder | None = None
        # Compiled grammars of constrained requests (see grammar.py), made on first use.
        self._grammars: GrammarCache | None = None

    @classmethod
    def from_config(cls, config: LlamaCppDeployment) -> LlamaCppEngine:
        n_threads = config.n_threads
        if n_threads is None and config.replicas > 1 and config.placement != "ray":
            # Replicas of one deployment share this host's cores; oversubscribed
            # llama.cpp thread pools spin against each other and every replica slows.
            n_threads = max(1, available_cpus() // config.replicas)
        return cls(
            config.model,
            max_num_seqs=config.max_num_seqs,
            n_ctx=config.n_ctx,
            n_threads=n_threads,
            adapt_threads=config.adapt_threads,
        )

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._thread is not None:
                return
            self._loop = asyncio.get_running_loop()
            await asyncio.to_thread(self._load)
            self._stop = False
            self._thread = threading.Thread(
                target=self._run, name=f"llamacpp-decode-{id(self):x}", daemon=True
            )
            self._thread.start()

    async def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None
        self._unload()

    def _load(self) -> None:
        path = self.model_path or embedded_model_path()
        if not path.is_file():
            raise EngineError(f"model file not found: {path}")
        init_backend()
        mparams = model_params()
        model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise EngineError(f"llama.cpp could not load {path}")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.n_ctx_seq * self.max_num_seqs
        cparams.n_seq_max = self.max_num_seqs
        cparams.n_batch = max(PREFILL_CHUNK + self.max_num_seqs, 512)
        cparams.n_ubatch = cparams.n_batch
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.kv_unified = False
        cparams.no_perf = True
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            ll.llama_model_free(model)
            raise EngineError("llama.cpp could not create a context (out of memory?)")
        self._model, self._ctx = model, ctx
        self._vocab = Vocab(model)
        self._mem = ll.llama_get_memory(ctx)
        self.n_ctx_seq = ll.llama_n_ctx_seq(ctx)
        self._batch = ll.llama_batch_init(cparams.n_batch, 0, 1)
        self._batch_cap = cparams.n_batch
        self._slots = [_Slot(i) for i in range(self.max_num_seqs)]
        self._embedder = Embedder(
            model, self._vocab, window=self.n_ctx_seq, n_threads=self.n_threads, cv=self._cv
        )
        log.info(
            "loaded %s: %d slots x %d tokens, %d threads",
            path.name,
            self.max_num_seqs,
            self.n_ctx_seq,
            self.n_threads,
        )

    def _unload(self) -> None:
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None

    # -- prompt ------------------------------------------------------------------

    @property
    def vocab(self) -> Vocab:
        if self._vocab is None:
            raise EngineError("the model is not loaded")
        return self._vocab

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        if self._vocab is None:
            await self.start()
        prompts = self._prompts(request)
        constraint = request.sampling.constraint
        if constraint is not None:
            # Compiling a large grammar takes a while: not on the event loop, and
            # checked here so that a bad one is a 400 before anything is held.
            await asyncio.to_thread(self._grammar_cache().compile, constraint)
        self._prepared.put(request.request_id, prompts)
        return PromptInfo(
            prompt_tokens=sum(map(len, prompts)),
            context_length=self.n_ctx_seq,
            longest_prompt=max(map(len, prompts)),
        )

    def _prompts(self, request: GenerationRequest) -> list[list[int]]:
        """The request's prompts as token ids, each checked against the context."""
        n_vocab = self.vocab.n_tokens
        for token, _ in request.sampling.logit_bias:
            if not 0 <= token < n_vocab:
                raise InvalidRequestError(
                    f"logit_bias names token {token}; this model's token ids are 0 to "
                    f"{n_vocab - 1}",
                    param="logit_bias",
                )
        if request.choices > self.max_num_seqs:
            raise InvalidRequestError(
                f"the request asks for {request.choices} choices (n times the prompts); a "
                f"replica of this deployment generates at most {self.max_num_seqs} at once",
                param="n",
            )
        if request.prompts is not None:
            prompts = [self._prompt_item(item) for item in request.prompts]
        elif request.prompt_tokens is not None:
            prompts = [self._prompt_item(request.prompt_tokens)]
        else:
            prompts = [self.vocab.tokenize(self.vocab.render(request))]
        several = len(prompts) > 1
        for p, tokens in enumerate(prompts):
            which = f"prompt {p}" if several else "the prompt"
            if not tokens:
                raise InvalidRequestError(f"{which} is empty", param="prompt")
            # max_tokens 0 means "as many as fit": the prompt must leave room for one.
            n_prompt, n_max = len(tokens), request.sampling.max_tokens
            if n_prompt + max(n_max, 1) > self.n_ctx_seq:
                raise ContextLengthError(
                    f"This model's maximum context length is {self.n_ctx_seq} tokens. "
                    f"However, you requested {n_prompt + n_max} tokens ({n_prompt} in "
                    f"{which}, {n_max} for the completion). Shorten the prompt or lower "
                    "max_tokens.",
                    param="max_tokens",
                )
        return prompts

    def _grammar_cache(self) -> GrammarCache:
        if self._grammars is None:
            vocab = self.vocab
            eog = [t for t in range(vocab.n_tokens) if vocab.is_eog(t)]
            self._grammars = GrammarCache(vocab.handle, vocab.n_tokens, eog)
        return self._grammars

    def _prompt_item(self, item: str | Sequence[int]) -> list[int]:
        if isinstance(item, str):
            return self.vocab.tokenize(item)
        self.vocab.check_ids(item, "prompt")
        return list(item)

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        if self._vocab is None:
            await self.start()
        return self.vocab.tokenize(self.vocab.render(request))

    async def detokenize(self, tokens: Sequence[int]) -> str:
        if self._vocab is None:
            await self.start()
        return self.vocab.detokenize(tokens)

    def context_length(self) -> int:
        return self.n_ctx_seq

    async def tokenizer_info(self) -> TokenizerInfo:
        if self._vocab is None:
            await self.start()
        return self.vocab.info(self.n_ctx_seq)

    # -- embeddings (the work runs on the decode thread: see llama_embed.py) -------------

    def _embeddings(self) -> Embedder:
        if self._embedder is None:
            raise EngineError("the model is not loaded")
        return self._embedder

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        if self._vocab is None:
            await self.start()
        return self._embeddings().prepare(request)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        self._check_started()
        return await self._embeddings().embed(request, failed=lambda: self._failed)

    # -- requests ------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> ChunkStream:
        if self._own_sink:
            raise EngineError("this engine has a step sink: start requests with submit()")
        self._check_started()
        rid = request.request_id
        stream = ChunkStream(rid, self.cancel)
        self._streams[rid] = stream
        try:
            self._enqueue(request)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    def _check_started(self) -> None:
        if self._thread is None:
            raise EngineError("the engine is not started")

    def _enqueue(self, request: GenerationRequest) -> None:
        prompts = self._prepared.take(request.request_id)
        if prompts is None:
            prompts = self._prompts(request)
        rid, base = request.request_id, request.sampling
        echo, logprobs = base.echo, base.logprobs is not None
        grammars = None if base.constraint is None else self._grammar_cache()
        members: list[_Sequence] = []
        group = _Group(rid, members, sum(map(len, prompts)))
        next_turn = self._next_turn(request)
        for tokens in prompts:
            leader: _Sequence | None = None
            for i in range(request.n):
                sampling = base
                if i and base.seed is not None:  # each choice samples on its own
                    sampling = replace(base, seed=base.seed + i)
                index = len(members)
                seq = _Sequence(
                    request_id=rid,
                    prompt=tokens,
                    sampling=sampling,
                    stream=TextStream(base.stop),
                    group=group,
                    key=rid if index == 0 else f"{rid}#{index}",
                    index=index,
                    leader=leader,
                    aligner=TokenAligner() if logprobs else None,
                    echo_pending=echo,
                    # A follower takes its leader's (see _start_follower).
                    prompt_logprobs=[] if echo and logprobs and leader is None else None,
                    grammar=None
                    if grammars is None or base.constraint is None
                    else grammars.start(base.constraint),
                    next_turn=next_turn,
                )
                if leader is None:
                    leader = seq
                else:
                    leader.followers.append(seq)
                members.append(seq)
        group.open = len(members)
        group.marks.append(time.monotonic())
        with self._cv:
            if self._failed is not None:
                raise EngineError(f"the engine failed: {self._failed}")
            self._inbox.append(group)
            self._cv.notify()

    def _next_turn(self, request: GenerationRequest) -> tuple[int, ...]:
        """The tokens a chat's template writes after this request's answer, before
        the next user message (empty: not a one-choice chat without tools, or a
        template that does not write an answer as it was generated)."""
        if request.messages is None or request.choices != 1 or request.tools is not None:
            return ()
        vocab = self.vocab
        source = request.chat_template or vocab.template
        if not source:
            return ()
        tokens = self._next_turns.get(source)
        if tokens is None:
            text = next_user_turn(source, vocab.bos, vocab.eos)
            tokens = tuple(vocab.tokenize(text, bos=False)) if text else ()
            if len(self._next_turns) < NEXT_TURNS_KEPT:  # requests' own templates vary
                self._next_turns[source] = tokens
        return tokens

    def cancel(self, request_id: str) -> None:
        """Stop a request within one step; unknown or finished ids are ignored."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    # -- the step sink: chunks straight from the decode thread -------------------------

    def set_step_sink(self, sink: StepSink) -> None:
        """Receive every request's chunks on the decode thread.

        ``sink`` is called once per decode step with every ``(request_id, chunk or
        error)`` the step produced, before the next step starts. A replica process
        writes them to the gateway from there, so a token crosses no event loop on
        its way out (see :mod:`tokenmill.gateway.runner`). It must not block for
        long, and must not call back into the engine. Requests are then started with
        :meth:`submit`.
        """
        self._sink = sink
        self._own_sink = True

    def submit(self, request: GenerationRequest) -> None:
        """Start ``request``; its chunks, up to one with a finish reason or an
        error, go to the step sink. :meth:`cancel` ends it early (the final chunk,
        finish reason ``abort``, carries the usage)."""
        if not self._own_sink:
            raise EngineError("submit() needs a step sink")
        self._check_started()
        self._enqueue(request)

    def _to_streams(self, events: list[tuple[str, Chunk | BaseException]]) -> None:
        """The default step sink: each chunk to its request's stream, on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        streams = self._streams
        first = stages.take_first(self.first_marks, (rid for rid, _ in events))

        def deliver() -> None:
            for rid, item in events:
                stream = streams.get(rid)
                if stream is not None:
                    if first is not None and rid in first:
                        stream.marks = stages.received(first[rid], time.monotonic())
                    stream.put(item)
                    if stream.ended:
                        del streams[rid]

        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            loop.call_soon_threadsafe(deliver)

    def health(self) -> EngineHealth:
        running = len(self._running)
        used = sum(len(s.tokens) for s in self._slots)
        total = max(1, self.n_ctx_seq * self.max_num_seqs)
        return EngineHealth(
            ready=self._thread is not None and self._failed is None,
            slots=self.max_num_seqs,
            running=running,
            waiting=len(self._inbox),
            tokens_generated=self.tokens_generated,
            kv_cache_usage=used / total,
            threads=self._threads_now,
            detail={"stalled_s": self.stalled_s()},
        )

    def stalled_s(self) -> float:
        """How long the decode step in progress has been running (0 between steps)."""
        since = self._decoding_since
        if since is None and self._embedder is not None:
            since = self._embedder.decoding_since
        return 0.0 if since is None else time.monotonic() - since

    # -- decode thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                warm = None
                with self._cv:
                    while (
                        not self._stop
                        and not self._inbox
                        and not self._running
                        and not (self._embedder and self._embedder.jobs)
                    ):
                        self._aborts.clear()
                        if self._warm is None:
                            self._cv.wait()
                        elif not self._cv.wait(WARM_AFTER_S):
                            warm, self._warm = self._warm, None
                            break
                    if self._stop:
                        break
                if warm is not None:
                    self._warm_next_turn(*warm)
                    continue
                with self._cv:
                    admitted = self._admit_locked()
                    aborts: set[str] = _NO_ABORTS
                    if self._aborts:
                        aborts, self._aborts = self._aborts, set()
                events: list[tuple[_Sequence, Chunk | BaseException]] = []
                # When this round takes every free slot, no step will see a gap. (Not
                # counted on the steps that admit nothing: most of them.)
                fills = bool(admitted) and len(admitted) == sum(
                    1 for slot in self._slots if slot.seq is None
                )
                for i, seq in enumerate(admitted):
                    # Requests about to need a slot: this round's rest and the queue.
                    waiting = len(admitted) - i - 1 + len(self._inbox)
                    self._assign(seq, pending=waiting, fills=fills)
                for rid in aborts:
                    group = self._groups.get(rid)
                    if group is not None:
                        for seq in group.members:
                            self._finish(seq, "abort", events)
                    else:
                        self._drop_queued(rid, events)
                if self._running:
                    self._step(events)
                if self._embedder and self._embedder.jobs:
                    self._embedder.step()  # one bounded batch of embedding inputs
                if events:
                    self._post(events)
        except BaseException as e:  # a native failure: fail every request, loudly
            log.exception("decode loop failed")
            with self._cv:
                self._failed = e
                pending = self._pending_requests()
                self._inbox.clear()
            self._post([(s, EngineError(f"the engine failed: {e}")) for s in pending])
        finally:
            failed: list[tuple[_Sequence, Chunk | BaseException]] = [
                (seq, EngineError("the engine is shutting down"))
                for seq in self._pending_requests()
            ]
            self._running.clear()
            self._groups.clear()
            self._inbox.clear()
            if failed:
                self._post(failed)
            if self._embedder is not None:
                self._embedder.fail_all(EngineError("the engine is shutting down"))

    def _pending_requests(self) -> list[_Sequence]:
        """A sequence of every request running or queued (one each: an error ends all
        of a request's choices)."""
        groups = list(self._groups.values()) + list(self._inbox)
        return [g.members[0] for g in groups if g.open > 0]

    def _drop_queued(self, request_id: str, events: list[tuple[_Sequence, Any]]) -> None:
        with self._cv:
            for group in self._inbox:
                if group.request_id == request_id:
                    self._inbox.remove(group)
                    for seq in group.members:
                        seq.done = True
                    group.open = 0
                    last = group.members[-1]
                    events.append((last, Chunk("", "abort", group.usage(), index=last.index)))
                    return

    def _admit_locked(self) -> list[_Sequence]:
        """Requests, first come first served, while all of a request's choices fit."""
        admitted: list[_Sequence] = []
        if not self._inbox:
            return admitted
        self._warm = None  # not idle: whatever comes next is not worth waiting for
        free = sum(1 for s in self._slots if s.seq is None)
        while self._inbox and free >= len(self._inbox[0].members):
            group = self._inbox.popleft()
            group.marks.append(time.monotonic())
            self._groups[group.request_id] = group
            admitted.extend(group.members)
            free -= len(group.members)
        return admitted

    def _assign(self, seq: _Sequence, pending: int = 0, fills: bool = False) -> None:
        """Give a request a free slot, reusing the longest cached prefix of its prompt.

        Which slot, what is parked and copied into it, and how much of its cache is
        kept is ``plan_placement``'s decision (see slots.py); here it meets llama.cpp.
        """
        plan = plan_placement(
            self._slots,
            seq.prompt,
            pending=pending,
            fills=fills,
            # Its prompt's log probabilities need logits of every prompt row: a cached
            # prefix would skip computing them. A follower's prompt comes from its
            # leader, whole.
            reuse_prefix=seq.prompt_logprobs is None and seq.leader is None,
        )
        # What ``dest`` holds is parked before anything is copied into it.
        if plan.park_to is not None:
            self._copy_seq(plan.dest, plan.park_to)
        if plan.copy_from is not None:
            self._copy_seq(plan.copy_from, plan.dest)
        keep = plan.keep
        if not ll.llama_memory_seq_rm(self._mem, plan.dest, keep, -1):
            ll.llama_memory_seq_rm(self._mem, plan.dest, -1, -1)
            keep = 0
        apply_placement(self._slots, plan, seq, now=time.monotonic(), keep=keep)
        self.kv_copies += plan.copies
        seq.slot = plan.dest
        seq.n_past = keep
        seq.cached = keep
        seq.sampler = build_sampler(seq.sampling, self.vocab.n_tokens)
        self._running[seq.key] = seq

    def _start_follower(self, seq: _Sequence, leader: _Sequence) -> None:
        """``leader`` has decoded the prompt: ``seq`` takes a copy of its KV cells.

        The leader's first token is sampled but not decoded yet, so the copy is the
        prompt.
        """
        self._copy_seq(leader.slot, seq.slot)
        self.kv_copies += 1
        self._slots[seq.slot].tokens = list(self._slots[leader.slot].tokens)
        seq.n_past = len(seq.prompt)
        seq.leader = None
        seq.prompt_logprobs = leader.prompt_logprobs

    def _copy_seq(self, src: int, dst: int) -> None:
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
        if not self._copies_queued:
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
        self._copies_queued = True

    def _decode(self, batch: Any) -> int:
        """``llama_decode``, seen by the health probe while it runs (``stalled_s``);
        it carries out the copies ``_copy_seq`` queued before it writes."""
        self._decoding_since = time.monotonic()
        try:
            rc: int = ll.llama_decode(self._ctx, batch)
        finally:
            self._decoding_since = None
            self._copies_queued = False
        self._decoded_at = time.monotonic()
        return rc

    def _step(self, events: list[tuple[_Sequence, Chunk | BaseException]]) -> None:
        batch = self._batch
        # Every decoding sequence gets its next token; the prompt budget left goes to
        # prefilling sequences first come, first served (dict order is arrival order).
        # (A follower waits for its leader's prompt: it neither decodes nor prefills.)
        decoding = sum(1 for s in self._running.values() if s.n_past >= len(s.prompt))
        budget = min(PREFILL_CHUNK, self._batch_cap - decoding)
        grant: dict[str, int] = {}
        for seq in self._running.values():
            if budget <= 0:
                break
            if seq.n_past < len(seq.prompt) and seq.leader is None:
                grant[seq.key] = take = min(len(seq.prompt) - seq.n_past, budget)
                budget -= take
        # The batch itself is laid out in slot order. With one KV stream per slot,
        # llama.cpp splits a batch into one ubatch (one pass over the weights) per
        # run of consecutive sequence ids, taking the same number of tokens from each:
        # in any other order the same tokens cost up to one pass per sequence.
        n = 0
        outputs: list[tuple[_Sequence, int]] = []
        # (sequence, batch row) of prompt rows whose logits give the prompt's logprobs.
        prompt_rows: list[tuple[_Sequence, int]] = []
        for seq in sorted(self._running.values(), key=_by_slot):
            if seq.n_past >= len(seq.prompt):
                _batch_add(batch, n, seq.last_token, seq.n_past, seq.slot, True)
                outputs.append((seq, n))
                n += 1
                continue
            take = grant.get(seq.key, 0)
            if take == 0:
                continue
            start, end = seq.n_past, seq.n_past + take
            collect = seq.prompt_logprobs is not None
            for i in range(start, end):
                last = i == len(seq.prompt) - 1
                _batch_add(batch, n, seq.prompt[i], i, seq.slot, last or collect)
                if last:
                    outputs.append((seq, n))
                elif collect:
                    prompt_rows.append((seq, n))
                n += 1
            seq.n_past = end
            self._slots[seq.slot].tokens.extend(seq.prompt[start:end])
        if n == 0:
            return
        batch.n_tokens = n
        tuner = self._tuner
        threads = self.n_threads if tuner is None else tuner.threads_for(n)
        if threads != self._threads_now:
            ll.llama_set_n_threads(self._ctx, threads, threads)
            self._threads_now = threads
        started = time.monotonic()
        rc = self._decode(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if tuner is not None:
            tuner.observe(threads, n, self._decoded_at - started)
        self.steps += 1
        for seq, idx in prompt_rows:
            assert seq.prompt_logprobs is not None
            row = self._logit_row(idx)
            token = seq.prompt[len(seq.prompt_logprobs) + 1]  # the token this row predicts
            top = self._top(row, seq.sampling.logprobs or 0)
            seq.prompt_logprobs.append((finite(row.logprob(token)), top))
        for seq, idx in outputs:
            # Read before sampling: the model's own distribution, untouched by it.
            logprobs = None if seq.aligner is None else self._logit_row(idx)
            if seq.followers:  # the prompt is in: the other choices start from here
                for follower in seq.followers:
                    if not follower.done:
                        self._start_follower(follower, seq)
                        self._sample(follower, idx, logprobs, events)
                seq.followers = []
            self._sample(seq, idx, logprobs, events)

    def _sample(
        self,
        seq: _Sequence,
        idx: int,
        logprobs: LogitRow | None,
        events: list[tuple[_Sequence, Chunk | BaseException]],
    ) -> None:
        """Sample ``seq``'s next token from batch output ``idx`` and pass its text on."""
        vocab = self.vocab
        group = seq.group
        assert group is not None
        if seq.echo_pending:
            seq.echo_pending = False
            events.append((seq, self._echo(seq)))
        grammar = seq.grammar
        if grammar is not None and not grammar.mask(self._logits(idx)):
            log.warning("request %s: grammar failed: %s", seq.request_id, grammar.error)
            self._finish(seq, "stop", events)
            return
        token = ll.llama_sampler_sample(seq.sampler, self._ctx, idx)
        if seq.n_past > len(seq.prompt) or seq.generated > 0:
            # the previous sampled token is now in the KV cache
            self._slots[seq.slot].tokens.append(seq.last_token)
        if not seq.sampling.ignore_eos and vocab.is_eog(token):
            self._finish(seq, "stop", events)
            self._plan_warm(seq, [])
            return
        if grammar is not None and not grammar.consume(token):
            log.warning("request %s: grammar refused a token: %s", seq.request_id, grammar.error)
            self._finish(seq, "stop", events)
            return
        seq.generated += 1
        group.generated += 1
        self.tokens_generated += 1
        seq.last_token = token
        seq.n_past = len(seq.prompt) + seq.generated - 1
        piece = vocab.piece(token)
        text = seq.stream.feed(piece)
        if group.generated == 1:  # the request's first token
            self.first_marks[group.request_id] = (
                *group.marks,
                self._decoded_at,
                time.monotonic(),
            )
        if seq.aligner is not None and logprobs is not None:
            top = self._top(logprobs, seq.sampling.logprobs or 0)
            stream = seq.stream
            seq.aligner.add(piece, logprobs.logprob(token), top, stream.decoded, stream.partial)
        if seq.stream.stopped or (grammar is not None and grammar.done):
            # (A complete grammar that allows nothing more is the end of the answer,
            # even at max_tokens: the output is whole.)
            self._finish(seq, "stop", events, text)
        elif seq.generated >= seq.sampling.max_tokens or (
            len(seq.prompt) + seq.generated >= self.n_ctx_seq
        ):
            self._finish(seq, "length", events, text + seq.stream.finish())
            self._plan_warm(seq, [token])  # the last token, sampled, never decoded
        else:
            released = () if seq.aligner is None else seq.aligner.release(len(text))
            if text or released:
                chunk = Chunk(text, tokens=group.generated, logprobs=released, index=seq.index)
                events.append((seq, chunk))

    def _plan_warm(self, seq: _Sequence, head: list[int]) -> None:
        """``seq``, a chat's answer, ended whole (EOS or max_tokens): its slot may
        compute ``head`` and what the template writes before the next user message,
        once the engine has nothing else to do (see ``_warm_next_turn``)."""
        if not seq.next_turn:
            return
        slot = self._slots[seq.slot]
        tokens = [*head, *seq.next_turn]
        if len(slot.tokens) + len(tokens) < self.n_ctx_seq:
            self._warm = (slot.index, len(slot.tokens), tokens)

    def _warm_next_turn(self, index: int, length: int, tokens: list[int]) -> None:
        """Decode ``tokens`` into free slot ``index`` after its ``length`` cached ones.

        A chat's next request is its history plus a new message: the prompt cache
        holds the history up to the answer's last decoded token, and the rest is
        computed on that request's first-token path: the answer's last token when it
        ended at max_tokens, the template's end of the answer and start of the next
        user turn (ChatML: ``<|im_end|>\\n<|im_start|>user\\n``, 5 tokens), then the new
        message. The first two are known when the answer ends, so they are computed
        while the person reads it: only after ``WARM_AFTER_S`` with nothing to do,
        never while anything runs or waits. If the next request is something else (a
        tool's answer, another conversation) the cells are simply not reused.
        """
        slot = self._slots[index]
        if slot.seq is not None or len(slot.tokens) != length:
            return  # the slot moved on since the answer ended
        batch = self._batch
        for i, token in enumerate(tokens):
            _batch_add(batch, i, token, length + i, index, i == len(tokens) - 1)
        batch.n_tokens = len(tokens)
        rc = self._decode(batch)
        if rc != 0:
            log.warning("llama_decode returned %d warming slot %d's next turn", rc, index)
            ll.llama_memory_seq_rm(self._mem, index, length, -1)
            return
        slot.tokens.extend(tokens)
        self.warmups += 1

    def _echo(self, seq: _Sequence) -> Chunk:
        """The prompt as a chunk: its text, and its tokens' log probabilities if asked."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts: list[str] = []
        tokens: list[TokenLogprob] = []
        chars = 0
        collected = seq.prompt_logprobs
        for i, token in enumerate(seq.prompt):
            piece = self.vocab.piece(token, special=True)
            if collected is not None:
                logprob, top = (None, ()) if i == 0 else collected[i - 1]
                tokens.append(TokenLogprob(piece, logprob, chars, top))
            text = decoder.decode(piece)
            parts.append(text)
            chars += len(text)
        parts.append(decoder.decode(b"", final=True))
        return Chunk("".join(parts), logprobs=tuple(tokens), index=seq.index)

    def _logit_row(self, idx: int) -> LogitRow:
        """The raw logits at batch output ``idx`` (copied), for log probabilities."""
        return LogitRow(self._logits(idx))

    def _logits(self, idx: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The logits at batch output ``idx``: a view of llama.cpp's own buffer."""
        n_vocab = self.vocab.n_tokens
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, idx), shape=(n_vocab,))

    def _top(self, row: LogitRow, k: int) -> tuple[TopLogprob, ...]:
        if k <= 0:
            return ()
        # Control tokens as written (<|im_end|>): as text they would all be "", and
        # several would collide as keys of a completion's top_logprobs.
        piece = self.vocab.piece
        return tuple(TopLogprob(piece(t, special=True), finite(lp)) for t, lp in row.top(k))

    def _finish(
        self,
        seq: _Sequence,
        reason: FinishReason,
        events: list[tuple[_Sequence, Chunk | BaseException]],
        text: str = "",
    ) -> None:
        if seq.done:
            return
        seq.done = True
        if reason == "stop" and not seq.stream.stopped:
            text += seq.stream.finish()
        self._running.pop(seq.key, None)
        slot = self._slots[seq.slot]
        slot.seq = None
        slot.last_used = time.monotonic()
        # Keep only what is really in the KV cells: the prompt part decoded so far
        # plus generated tokens already fed back (the last sampled one never was).
        kept = len(slot.tokens)
        ll.llama_memory_seq_rm(self._mem, slot.index, kept, -1)
        if seq.sampler is not None:
            ll.llama_sampler_free(seq.sampler)
            seq.sampler = None
        # Tokens still waiting now are those a stop string swallowed (or an abort cut).
        released = () if seq.aligner is None else seq.aligner.release(len(text))
        group = seq.group
        assert group is not None
        group.open -= 1
        if group.open > 0:  # other choices go on: this one's end is not the request's
            chunk = Chunk(
                text,
                tokens=group.generated,
                logprobs=released,
                index=seq.index,
                choice_finish=reason,
            )
        else:
            self._groups.pop(group.request_id, None)
            chunk = Chunk(text, reason, group.usage(), group.generated, released, seq.index)
        events.append((seq, chunk))

    def _post(self, events: list[tuple[_Sequence, Chunk | BaseException]]) -> None:
        self._sink([(seq.request_id, item) for seq, item in events])


# The aborts of a step that has none (never added to: cancel() adds to engine._aborts).
_NO_ABORTS: set[str] = set()


def _by_slot(seq: _Sequence) -> int:
    return seq.slot


def _batch_add(batch: Any, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq_id
    batch.logits[i] = logits
