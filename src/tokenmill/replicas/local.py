"""A replica in the gateway's own process (``placement = "local"``).

No crash isolation and no restart: a failed engine leaves the replica ``unhealthy``.
For embedding tokenmill in a program, and as the benchmark's ceiling (no frames to
carry).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from tokenmill import stages
from tokenmill.engines import (
    CachePublishing,
    ChunkStream,
    EmbeddingEngine,
    EmbeddingInfo,
    EmbeddingRequest,
    Embeddings,
    Engine,
    EngineHealth,
    GenerationRequest,
    KvMoving,
    KvState,
    PromptInfo,
    TokenizeRequest,
    TokenizerInfo,
    TokenizingEngine,
    cannot_embed,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.kvblocks import CacheEvent
from tokenmill.replicas.host import KvLink, ReplicaLocation, ReplicaState


class LocalHost:
    """The engine in the gateway's own process (``placement = "local"``)."""

    kind = "local"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._state: ReplicaState = "unloaded"
        self._callbacks: list[Callable[[], None]] = []
        self._cache_callbacks: list[Callable[[CacheEvent], None]] = []
        self._publishing = False
        self._lock = asyncio.Lock()

    @property
    def state(self) -> ReplicaState:
        if self._state == "ready" and not self.engine.health().ready:
            return "unhealthy"  # its engine failed (a dead decode loop): no restart here
        return self._state

    @property
    def restarts(self) -> int:
        return 0

    def location(self) -> ReplicaLocation:
        return ReplicaLocation()

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def on_cache(self, callback: Callable[[CacheEvent], None]) -> None:
        self._cache_callbacks.append(callback)

    def on_status(self, callback: Callable[[], None]) -> None:
        # Never called: this replica is this gateway's alone, so the deployment counts
        # its slots itself and never waits for it to report a free one.
        pass

    def _publish(self) -> None:
        """Have the engine report its cache to the callbacks, from any of its threads."""
        if self._publishing or not isinstance(self.engine, CachePublishing):
            return
        self._publishing = True
        loop = asyncio.get_running_loop()

        def deliver(event: CacheEvent) -> None:
            for callback in self._cache_callbacks:
                callback(event)

        def publish(event: CacheEvent) -> None:
            loop.call_soon_threadsafe(deliver, event)

        self.engine.publish_cache(publish)

    def _set(self, state: ReplicaState) -> None:
        if state != self._state:
            self._state = state
            for callback in self._callbacks:
                callback()

    async def start(self) -> None:
        async with self._lock:
            if self._state == "ready":
                return
            self._set("loading")
            self._publish()
            try:
                await self.engine.start()
            except BaseException:
                self._set("unhealthy")
                raise
            self._set("ready")

    async def close(self) -> None:
        async with self._lock:
            await self.engine.close()
            self._set("unloaded")

    async def reserve(self, request_id: str, weight: int) -> None:
        pass  # this gateway's alone: the deployment counts its slots

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        stages.mark("prepare_start")
        info = await self.engine.prepare(request)
        stages.mark("prepare_end")
        return info

    def generate(self, request: GenerationRequest) -> ChunkStream:
        return self.engine.generate(request)

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def _tokenizer(self) -> TokenizingEngine:
        if not isinstance(self.engine, TokenizingEngine):
            raise InvalidRequestError(
                f"the {self.engine.name} engine has no tokenizer", param="model"
            )
        return self.engine

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        return await self._tokenizer().tokenize(request)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return await self._tokenizer().detokenize(tokens)

    def context_length(self) -> int:
        return self._tokenizer().context_length()

    async def tokenizer_info(self) -> TokenizerInfo:
        return await self._tokenizer().tokenizer_info()

    def _embedder(self) -> EmbeddingEngine:
        if not isinstance(self.engine, EmbeddingEngine):
            raise InvalidRequestError(cannot_embed(self.engine.name), param="model")
        return self.engine

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        return await self._embedder().prepare_embeddings(request)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        return await self._embedder().embed(request)

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
        if not isinstance(self.engine, KvMoving):
            return None
        return await self.engine.export_kv(tokens, min_tokens)

    async def import_kv(self, state: KvState) -> bool:
        if not isinstance(self.engine, KvMoving):
            return False
        return await self.engine.import_kv(state)

    async def held_kv(self, min_tokens: int) -> list[tuple[int, ...]]:
        if not isinstance(self.engine, KvMoving):
            return []
        return await self.engine.held_kv(min_tokens)

    def kv_link(self) -> KvLink | None:
        return None  # in the gateway's own process already

    def health(self) -> EngineHealth:
        return self.engine.health()


__all__ = ["LocalHost"]
