"""The llama.cpp engine's face: the ``Engine`` interface over one decode loop.

:class:`LlamaCppEngine` loads the model (:class:`~.context.LlamaContext`), starts
the decode thread (:class:`~.loop.DecodeLoop`) and turns requests into groups of
choices (:mod:`.choices`, :mod:`.intake`) for it; it hands each step's chunks to the
streams of ``generate()`` on the event loop, or to a replica's step sink. Health,
tokenization and embeddings' intake are answered here; everything that happens
between two steps happens on the decode thread. What the slots hold is published as
block names (``publish_cache``, :class:`~tokenmill.kvblocks.CachePublisher`) for the
gateway's cache-aware routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Literal

from tokenmill import stages
from tokenmill.config import LlamaCppDeployment, WeightsSetting, default_data_dir
from tokenmill.engines.base import (
    Chunk,
    EngineHealth,
    GenerationRequest,
    KvState,
    Prepared,
    PromptInfo,
    StepSink,
    TokenizeRequest,
    TokenizerInfo,
)
from tokenmill.engines.chunks import ChunkStream
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.embeddings import EmbeddingInfo, EmbeddingRequest, Embeddings
from tokenmill.engines.llamacpp.choices import Choice, build_group
from tokenmill.engines.llamacpp.context import (
    LlamaContext,
    RopeScaling,
    kv_fingerprint,
    mem_available,
)
from tokenmill.engines.llamacpp.counters import Counters
from tokenmill.engines.llamacpp.disktier import DiskTier, DiskWriter, default_capacity
from tokenmill.engines.llamacpp.embedder import Embedder
from tokenmill.engines.llamacpp.grammar import GrammarCache
from tokenmill.engines.llamacpp.hosttier import HostTier
from tokenmill.engines.llamacpp.intake import NextTurns, prompt_tokens
from tokenmill.engines.llamacpp.kvslots import KvSlots
from tokenmill.engines.llamacpp.loop import PREFILL_CHUNK, DecodeLoop
from tokenmill.engines.llamacpp.slotcache import SlotCache
from tokenmill.engines.llamacpp.threads import ThreadTuner, available_cpus
from tokenmill.engines.llamacpp.vocab import Vocab
from tokenmill.engines.llamacpp.weights import ServedWeights, served_weights
from tokenmill.errors import EngineError
from tokenmill.kvblocks import CacheEvent, CachePublisher

__all__ = ["LlamaCppEngine"]

log = logging.getLogger("tokenmill.engines.llamacpp")


# The host tier's default size: a quarter of the memory available when the model is
# loaded, at most llama-server's --cache-ram default (8 GiB).
HOST_TIER_MAX_DEFAULT = 8 << 30
HOST_TIER_SHARE = 4


def holds_one(key: str, value: int, context: LlamaContext, advice: str = "") -> None:
    """A tier's bound ``key = value`` must hold one whole sequence (``n_ctx`` tokens of
    the model's cells): an EngineError naming the key otherwise."""
    one = context.n_ctx_seq * context.bytes_per_token
    if value < one:
        raise EngineError(
            f"{key} = {value} cannot hold one sequence: {context.n_ctx_seq} tokens (n_ctx) "
            f"of this model take {one} bytes. Set at least {one}{advice}"
        )


def host_tier_bytes(configured: int | None, context: LlamaContext) -> int:
    """The host tier's capacity: ``configured`` (``kv_host_bytes``; None: the default,
    0: off), checked to hold one whole sequence, whose bytes it must be able to park;
    an EngineError naming the key otherwise. A default too small for one is 0 (off)."""
    if configured is None:
        available = mem_available() or 0
        default = min(HOST_TIER_MAX_DEFAULT, available // HOST_TIER_SHARE)
        return default if default >= context.n_ctx_seq * context.bytes_per_token else 0
    if configured:
        holds_one("kv_host_bytes", configured, context, ", or 0 to turn the host-memory tier off")
    return configured


def _publish_parked(
    published: CachePublisher, tier: str
) -> Callable[[Hashable, tuple[int, ...] | None], None]:
    """A tier's listener: what it parks, and what leaves it, published."""

    def parked(key: Hashable, tokens: tuple[int, ...] | None) -> None:
        if tokens is None:
            published.unpark((tier, key))
        else:
            published.park((tier, key), tokens, disk=tier == "disk")

    return parked


def disk_tier(
    engine: LlamaCppEngine, context: LlamaContext, host: int, fingerprint: str
) -> DiskWriter | None:
    """The disk tier (``kv_disk_dir``, ``kv_disk_bytes``), opened: its files checked,
    stale or foreign ones deleted, the rest published; None without a directory, or
    without room for its default bound."""
    directory = engine.kv_disk_dir
    if directory is None:
        return None
    capacity = engine.kv_disk_bytes
    if capacity is None:
        capacity = default_capacity(directory, context.n_ctx_seq * context.bytes_per_token)
        if capacity is None:
            return None
    if host == 0:
        raise EngineError(
            "kv_disk_dir needs the host-memory tier (what it parks is written to disk): "
            "kv_host_bytes must not be 0"
        )
    holds_one("kv_disk_bytes", capacity, context)
    tier = DiskTier(
        directory, capacity, fingerprint, _publish_parked(engine.published_cache, "disk")
    )
    try:
        tier.open()
    except OSError as e:
        raise EngineError(f"kv_disk_dir = {directory}: {e}") from e
    return DiskWriter(tier)


class _Loaded:
    """What one ``start()`` makes and ``close()`` frees: the model and its loop."""

    def __init__(self, engine: LlamaCppEngine, path: Path) -> None:
        n_slots = engine.max_num_seqs
        self.context = LlamaContext(
            path,
            n_slots=n_slots,
            n_ctx_seq=engine.n_ctx_seq,
            n_threads=engine.n_threads,
            batch_size=max(PREFILL_CHUNK + n_slots, 512),
            pool_tokens=engine.kv_pool_tokens,
            rope=engine.rope,
            unified=engine.kv_layout == "shared",
        )
        context = self.context
        try:
            capacity = host_tier_bytes(engine.kv_host_bytes, context)
        except EngineError:
            context.close()
            raise
        published = engine.published_cache
        published.reset()  # every slot starts empty, and the tiers
        self.tier: HostTier[bytearray] = HostTier(
            capacity, listener=_publish_parked(published, "host")
        )
        # What a saved sequence state is valid for (moves between replicas, files).
        self.fingerprint = kv_fingerprint(path, context.bytes_per_token, engine.rope)
        try:
            self.disk = disk_tier(engine, context, capacity, self.fingerprint)
        except EngineError:
            context.close()
            raise
        self.cache: SlotCache[Choice] = SlotCache(n_slots, context.n_ctx_seq)
        self.cache.subscribe(lambda c: published.change(c.slot, c.kept, c.added))
        cv = threading.Condition()
        self.embedder = Embedder(
            context.model,
            context.vocab,
            window=context.n_ctx_seq,
            n_threads=engine.n_threads,
            cv=cv,
        )
        self.loop = DecodeLoop(
            context,
            KvSlots(context, self.cache, engine.counters, self.tier, self.disk),
            cv=cv,
            post=engine._post,
            counters=engine.counters,
            first_marks=engine.first_marks,
            tuner=engine._tuner,
            embedder=self.embedder,
            speculate=engine.speculative,
            always_draft=engine.speculative_rule == "always",
        )
        self.next_turns = NextTurns(context.vocab)
        # Compiled grammars of constrained requests (see grammar.py), made on first use.
        self.grammars: GrammarCache | None = None

    def close(self) -> None:
        # The loop has stopped: what the slots hold goes to the disk tier, whose
        # writes end before the model is freed.
        if self.disk is not None:
            self.loop.kv.save_to_disk()
            self.disk.close()
        self.embedder.close()
        self.context.close()


class LlamaCppEngine:
    """Continuous batching over one loaded GGUF model. See the package docstring."""

    name = "llamacpp"

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        max_num_seqs: int = 16,
        n_ctx: int = 0,
        n_threads: int | None = None,
        adapt_threads: bool = True,
        kv_host_bytes: int | None = None,
        kv_layout: Literal["shared", "per_slot"] = "shared",
        kv_pool_tokens: int | None = None,
        kv_disk_dir: str | Path | None = None,
        kv_disk_bytes: int | None = None,
        rope: RopeScaling | None = None,
        speculative: bool = False,
        speculative_rule: Literal["measured", "always"] = "measured",
        weights: WeightsSetting | None = None,
        weights_dir: str | Path | None = None,
    ) -> None:
        self.model_path = Path(model_path) if model_path else None
        # The file served for it: as given, or converted (see weights.py).
        self.weights = weights
        self.weights_dir = Path(weights_dir) if weights_dir else default_data_dir() / "weights"
        self.served: ServedWeights | None = None
        self.speculative = speculative  # n-gram drafts verified in the step
        self.speculative_rule = speculative_rule  # which drafts: by measured costs, or all
        self.rope = rope  # RoPE context extension (the deployment's rope_* keys)
        self.max_num_seqs = max_num_seqs
        # 0: the model's trained context (known once it is loaded).
        self.n_ctx_seq = n_ctx
        # None: a default from the host's memory (see host_tier_bytes); 0: no tier.
        self.kv_host_bytes = kv_host_bytes
        # One KV pool the slots share, or a KV stream a slot (LlamaContext).
        self.kv_layout = kv_layout
        self.kv_pool_tokens = kv_pool_tokens
        # The disk tier: None, none; kv_disk_bytes None: a default from the free space.
        self.kv_disk_dir = Path(kv_disk_dir) if kv_disk_dir else None
        self.kv_disk_bytes = kv_disk_bytes
        self.n_threads = n_threads or available_cpus()
        # Fewer threads when the cores are shared with other busy work (see threads.py).
        self._tuner = ThreadTuner(self.n_threads) if adapt_threads else None
        self._loaded: _Loaded | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_lock = asyncio.Lock()
        # Streams of generate() requests, filled on the event loop by the default sink.
        self._streams: dict[str, ChunkStream] = {}
        self._prepared: Prepared[list[list[int]]] = Prepared()
        # What the slots hold, as block names, for whoever routes to this engine.
        self.published_cache = CachePublisher(max_num_seqs)
        self.counters = Counters()
        # Request id -> the marks of its first token (queued, picked, decoded, sampled:
        # tokenmill.stages), until the sink sends them with the token.
        self.first_marks: dict[str, tuple[float, ...]] = {}
        # Receives every step's chunks on the decode thread: by default it hands them to
        # the streams of generate() on the event loop; a replica process sets its own.
        self._sink: StepSink = self._to_streams
        self._own_sink = False

    @classmethod
    def from_config(cls, config: LlamaCppDeployment) -> LlamaCppEngine:
        n_threads = config.n_threads
        most = config.most_replicas()
        if n_threads is None and most > 1 and config.placement != "ray":
            # Replicas of one deployment share this host's cores; oversubscribed
            # llama.cpp thread pools spin against each other and every replica slows.
            # Autoscaled: sized for the most it may run.
            n_threads = max(1, available_cpus() // most)
        return cls(
            config.model,
            max_num_seqs=config.max_num_seqs,
            n_ctx=config.n_ctx,
            n_threads=n_threads,
            adapt_threads=config.adapt_threads,
            kv_host_bytes=config.kv_host_bytes,
            kv_layout=config.kv_layout,
            kv_pool_tokens=config.kv_pool_tokens,
            kv_disk_dir=config.kv_disk_dir,
            kv_disk_bytes=config.kv_disk_bytes,
            rope=None
            if config.rope_scaling is None
            else RopeScaling(config.rope_scaling, config.rope_scale, config.yarn_orig_ctx),
            speculative=config.speculative == "ngram",
            speculative_rule=config.speculative_rule,
            weights=config.weights,
            weights_dir=config.weights_dir,
        )

    # -- what it has done and holds (health, tests, the bench) -----------------------

    @property
    def tokens_generated(self) -> int:
        return self.counters.tokens_generated

    @property
    def steps(self) -> int:
        return self.counters.steps

    @property
    def kv_copies(self) -> int:
        return self.counters.kv_copies

    @property
    def warmups(self) -> int:
        return self.counters.warmups

    @property
    def slot_cache(self) -> SlotCache[Choice]:
        """What every KV slot holds (read it, or subscribe to its changes)."""
        return self._require().cache

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._thread is not None:
                return
            self._loop = asyncio.get_running_loop()
            loaded = await asyncio.to_thread(self._load)
            self._thread = threading.Thread(
                target=loaded.loop.run, name=f"llamacpp-decode-{id(self):x}", daemon=True
            )
            self._thread.start()

    async def close(self) -> None:
        thread, loaded = self._thread, self._loaded
        if thread is None or loaded is None:
            return
        loaded.loop.stop()
        await asyncio.to_thread(thread.join)
        self._thread = None
        self._loaded = None
        loaded.close()

    def _load(self) -> _Loaded:
        source = self.model_path or embedded_model_path()
        self.served = served_weights(
            source, self.weights, self.weights_dir, embedded=self.model_path is None
        )
        path = self.served.served
        loaded = self._loaded = _Loaded(self, path)
        self.n_ctx_seq = loaded.context.n_ctx_seq
        context = loaded.context
        log.info(
            "loaded %s: %d slots of up to %d tokens in a %s pool of %d, host tier %d MiB, "
            "%d threads",
            path.name,
            self.max_num_seqs,
            self.n_ctx_seq,
            "unified" if context.unified else "per-slot",
            context.pool_tokens,
            loaded.tier.capacity >> 20,
            self.n_threads,
        )
        return loaded

    def _require(self) -> _Loaded:
        if self._loaded is None:
            raise EngineError("the model is not loaded")
        return self._loaded

    def _check_started(self) -> _Loaded:
        if self._thread is None or self._loaded is None:
            raise EngineError("the engine is not started")
        return self._loaded

    # -- prompts -------------------------------------------------------------------

    @property
    def vocab(self) -> Vocab:
        return self._require().context.vocab

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        if self._loaded is None:
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
            tokens=tuple(tuple(p) for p in prompts),
        )

    def _prompts(self, request: GenerationRequest) -> list[list[int]]:
        context = self._require().context
        return prompt_tokens(
            request,
            self.vocab,
            n_ctx=self.n_ctx_seq,
            max_choices=self.max_num_seqs,
            pool=context.pool_tokens if context.unified else None,
        )

    def _grammar_cache(self) -> GrammarCache:
        loaded = self._require()
        if loaded.grammars is None:
            vocab = loaded.context.vocab
            eog = [t for t in range(vocab.n_tokens) if vocab.is_eog(t)]
            loaded.grammars = GrammarCache(vocab.handle, vocab.n_tokens, eog)
        return loaded.grammars

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        if self._loaded is None:
            await self.start()
        vocab = self.vocab
        return vocab.tokenize(vocab.render(request), bos=request.add_special_tokens)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        if self._loaded is None:
            await self.start()
        return self.vocab.detokenize(tokens)

    def context_length(self) -> int:
        return self.n_ctx_seq

    async def tokenizer_info(self) -> TokenizerInfo:
        if self._loaded is None:
            await self.start()
        return self.vocab.info(self.n_ctx_seq)

    # -- embeddings (the work runs on the decode thread: see embedder.py) -----------

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        if self._loaded is None:
            await self.start()
        return self._require().embedder.prepare(request)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        loaded = self._check_started()
        return await loaded.embedder.embed(request, failed=lambda: loaded.loop.failed)

    # -- requests ----------------------------------------------------------------

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

    def _enqueue(self, request: GenerationRequest) -> None:
        loaded = self._require()
        prompts = self._prepared.take(request.request_id)
        if prompts is None and request.tokenized is not None:
            # Prepared (tokenized and checked) by another replica of this deployment.
            prompts = [list(p) for p in request.tokenized]
        if prompts is None:
            prompts = self._prompts(request)
        grammars = None if request.sampling.constraint is None else self._grammar_cache()
        group = build_group(
            request,
            prompts,
            next_turn=loaded.next_turns.of(request),
            start_grammar=None if grammars is None else grammars.start,
        )
        loaded.loop.enqueue(group)

    def publish_cache(self, listener: Callable[[CacheEvent], None]) -> Callable[[], None]:
        """Tell ``listener`` what the slots hold: a snapshot now and at every start,
        then every change of a slot's full blocks, from the decode thread; until the
        returned function is called."""
        return self.published_cache.subscribe(listener)

    def cancel(self, request_id: str) -> None:
        """Stop a request within one step; unknown or finished ids are ignored."""
        if self._loaded is not None:
            self._loaded.loop.cancel(request_id)

    # -- the step sink: chunks straight from the decode thread -----------------------

    def set_step_sink(self, sink: StepSink) -> None:
        """Receive every request's chunks on the decode thread.

        ``sink`` is called once per decode step with every ``(request_id, chunk or
        error)`` the step produced, before the next step starts. A replica process
        writes them to the gateway from there, so a token crosses no event loop on
        its way out (see :mod:`tokenmill.replicas.runner`). It must not block for
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

    def _post(self, events: list[tuple[str, Chunk | BaseException]]) -> None:
        """The decode loop's output: every step's chunks, to the current sink."""
        self._sink(events)

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

    # -- KV state between replicas (KvMoving) ---------------------------------------

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
        loaded = self._check_started()
        prompt = tuple(tokens)
        future = loaded.loop.call(lambda: loaded.loop.kv.export(prompt, min_tokens))
        found = await asyncio.wrap_future(future)
        if found is None:
            return None
        held, state = found
        self.counters.kv_exports += 1
        return KvState(held, bytes(state), loaded.fingerprint)

    async def held_kv(self, min_tokens: int) -> list[tuple[int, ...]]:
        loaded = self._check_started()
        future = loaded.loop.call(lambda: loaded.loop.kv.held(min_tokens))
        held: list[tuple[int, ...]] = await asyncio.wrap_future(future)
        return held

    async def import_kv(self, state: KvState) -> bool:
        loaded = self._check_started()
        if state.fingerprint != loaded.fingerprint:
            log.warning("refused a moved KV state: it was saved for another model or llama.cpp")
            return False
        tokens, data = state.tokens, bytearray(state.state)
        taken = await asyncio.wrap_future(
            loaded.loop.call(lambda: loaded.loop.kv.take(tokens, data))
        )
        self.counters.kv_imports += taken
        return taken

    def kv_stats(self) -> dict[str, int]:
        """The KV pool and the host tier, for ``GET /v1/deployments/{id}`` and metrics
        (see docs/operations.md); empty before the model is loaded."""
        loaded = self._loaded
        if loaded is None:
            return {}
        context, tier, counters = loaded.context, loaded.tier, self.counters
        stats = tier.stats
        return {
            "n_ctx": self.n_ctx_seq,
            "pool_tokens": context.pool_tokens,
            "pool_used_tokens": loaded.cache.used_tokens(),
            "pool_unified": int(context.unified),
            "pool_evictions": counters.pool_evictions,
            "span_trims": counters.span_trims,
            "preemptions": counters.preemptions,
            "resumes": counters.resumes,
            "host_bytes": tier.used,
            "host_capacity_bytes": tier.capacity,
            "host_entries": tier.cached_entries(),
            "host_swapped": len(tier.entries) - tier.cached_entries(),
            "host_parks": stats.parks,
            "host_hits": stats.hits,
            "host_restores": stats.restores,
            "host_restored_tokens": stats.restored_tokens,
            "host_evictions": stats.evictions,
            "exports": counters.kv_exports,
            "imports": counters.kv_imports,
            "spec_drafted": counters.spec_drafted,
            "spec_accepted": counters.spec_accepted,
            **self._disk_stats(loaded),
        }

    @staticmethod
    def _disk_stats(loaded: _Loaded) -> dict[str, int]:
        if loaded.disk is None:
            return {}
        disk = loaded.disk.tier
        stats = disk.stats
        return {
            "disk_bytes": disk.used,
            "disk_capacity_bytes": disk.capacity,
            "disk_entries": len(disk.entries),
            "disk_writes": stats.writes,
            "disk_written_bytes": stats.written_bytes,
            "disk_hits": stats.hits,
            "disk_restored_tokens": stats.restored_tokens,
            "disk_evictions": stats.evictions,
            "disk_dropped": stats.dropped,
        }

    def health(self) -> EngineHealth:
        loaded = self._loaded
        total = max(1, self.n_ctx_seq * self.max_num_seqs)
        if loaded is not None and loaded.context.unified:
            total = loaded.context.pool_tokens
        return EngineHealth(
            ready=self._thread is not None and loaded is not None and loaded.loop.failed is None,
            slots=self.max_num_seqs,
            # (swapped out of a full pool or not: to a client it runs)
            running=0 if loaded is None else len(loaded.loop.running) + len(loaded.loop.swapped),
            waiting=0 if loaded is None else loaded.loop.waiting,
            tokens_generated=self.tokens_generated,
            kv_cache_usage=0.0 if loaded is None else loaded.cache.used_tokens() / total,
            threads=self.n_threads if loaded is None else loaded.context.threads,
            detail={"stalled_s": self.stalled_s()},
            kv=self.kv_stats(),
            moves_kv=True,
            weights={} if self.served is None else self.served.describe(),
        )

    def stalled_s(self) -> float:
        """How long the decode step in progress has been running (0 between steps)."""
        loaded = self._loaded
        if loaded is None:
            return 0.0
        since = loaded.context.decoding_since
        if since is None:
            since = loaded.embedder.decoding_since
        return 0.0 if since is None else time.monotonic() - since
