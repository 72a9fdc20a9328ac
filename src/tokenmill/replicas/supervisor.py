"""A replica outside the gateway's process, supervised: launched, probed, restarted.

:class:`SupervisedHost` is a :class:`~tokenmill.replicas.host.ReplicaHost` whose engine
runs elsewhere: a child process (:mod:`tokenmill.replicas.process`) or a Ray actor
(:mod:`tokenmill.replicas.rayactor`). Both run the same replica loop
(:mod:`tokenmill.replicas.runner`) and speak the frames of
:mod:`tokenmill.replicas.wire`; only what carries the frames differs, and that is a
:class:`Launcher` and its :class:`~tokenmill.replicas.client.Channel`. This module
keeps one replica running; talking to it (requests as frames, multiplexed by id) is
the :class:`~tokenmill.replicas.client.ReplicaClient` of each launch.

A replica that dies (a segfault in llama.cpp, an OOM kill, its Ray node gone) fails
its open requests at once with :class:`EngineError` (their streams end with it), the
host turns ``restarting``, and a new replica is launched with exponential backoff.
A replica can also be alive yet wedged (a native call that never returns, a stopped
process): the host pings it every ``probe_interval_s``; one whose last frame is older
than ``probe_timeout_s``, or whose engine reports one decode step running longer
than that, is killed, and handled like any other death.

A replica of a pool (:mod:`tokenmill.replicas.pool`) is shared with other gateways and
says so in its ``ready`` frame (``"shared": true``); its client then reserves slots
there (``reserve`` may fail with :class:`~tokenmill.errors.ReplicaFullError`). The
host only ever *detaches* from such a replica when it loses or closes it: the replica
keeps serving the other gateways; killing it is for a replica that failed or hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenmill.engines import (
    ChunkStream,
    EmbeddingInfo,
    EmbeddingRequest,
    Embeddings,
    EngineHealth,
    GenerationRequest,
    KvState,
    PromptInfo,
    TokenizeRequest,
    TokenizerInfo,
)
from tokenmill.errors import EngineError
from tokenmill.kvblocks import CacheEvent
from tokenmill.replicas.client import Channel, ReplicaClient
from tokenmill.replicas.host import KvLink, ReplicaLocation, ReplicaState

log = logging.getLogger("tokenmill.replicas.supervisor")

# A replica that has not loaded its model after this long is considered wedged.
START_TIMEOUT_S = 300.0
# Restart backoff: 0.5 s, 1 s, 2 s, ... capped; reset once a replica stayed up a while.
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
CLOSE_WAIT_S = 10.0
# Health probe defaults (per deployment: health_check_interval_s / _timeout_s).
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 30.0


class Launcher(Protocol):
    """Starts replicas of one kind: ``launch`` returns the new replica's channel at
    once; its first frame says whether its engine loaded (``ready`` or ``fatal``)."""

    kind: str

    async def launch(self) -> Channel: ...

    async def close(self) -> None:
        """The host closed: release what launching needed (a cluster connection)."""


class SupervisedHost:
    """A replica run by a :class:`Launcher`, restarted when it dies. See the module
    docstring."""

    def __init__(
        self,
        launcher: Launcher,
        *,
        slots: int,
        context_length: int = 0,
        probe_interval_s: float = PROBE_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.launcher = launcher
        self.kind = launcher.kind
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._restarts = 0
        self._current: ReplicaClient | None = None
        self._state: ReplicaState = "unloaded"
        self._status: dict[str, Any] = {"slots": slots, "context_length": context_length}
        self._supervisor: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._callbacks: list[Callable[[], None]] = []
        self._status_callbacks: list[Callable[[], None]] = []
        self._cache_callbacks: list[Callable[[CacheEvent], None]] = []
        self._lost = asyncio.Event()
        self._closing = False
        self._lock = asyncio.Lock()

    # -- state --------------------------------------------------------------------

    @property
    def state(self) -> ReplicaState:
        return self._state

    @property
    def restarts(self) -> int:
        return self._restarts

    def location(self) -> ReplicaLocation:
        current = self._current
        if current is None or current.lost:
            return ReplicaLocation()
        return current.channel.location()

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def on_status(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) whenever the replica reports its status:
        a shared replica's slots may have come free."""
        self._status_callbacks.append(callback)

    def _status_changed(self, status: dict[str, Any]) -> None:
        self._status = status
        for callback in self._status_callbacks:
            callback()

    def on_cache(self, callback: Callable[[CacheEvent], None]) -> None:
        self._cache_callbacks.append(callback)

    def _cache_changed(self, event: CacheEvent) -> None:
        for callback in self._cache_callbacks:
            callback(event)

    def _set(self, state: ReplicaState) -> None:
        if state != self._state:
            self._state = state
            for callback in self._callbacks:
                callback()

    def health(self) -> EngineHealth:
        s = self._status
        return EngineHealth(
            ready=self._state == "ready",
            slots=int(s.get("slots") or 1),
            running=int(s.get("running", 0)),
            waiting=int(s.get("waiting", 0)),
            tokens_generated=int(s.get("tokens_generated", 0)),
            kv_cache_usage=float(s.get("kv_cache_usage", 0.0)),
            threads=s.get("threads"),
            detail={"restarts": self._restarts},
            kv={str(k): int(v) for k, v in (s.get("kv") or {}).items()},
            moves_kv=bool(s.get("moves_kv")),
            weights={str(k): str(v) for k, v in (s.get("weights") or {}).items()},
        )

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        async with self._lock:
            if self._supervisor is not None and not self._supervisor.done():
                return
            self._closing = False
            self._set("loading")
            try:
                await self._launch()
            except BaseException:
                self._set("unhealthy")
                raise
            self._supervisor = asyncio.create_task(self._supervise())

    async def close(self) -> None:
        async with self._lock:
            self._closing = True
            if self._supervisor is not None:
                self._supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._supervisor
                self._supervisor = None
            current = self._current
            if current is not None:
                with contextlib.suppress(Exception):
                    current.stop()
                try:
                    await asyncio.wait_for(current.channel.wait(), CLOSE_WAIT_S)
                except TimeoutError:
                    log.warning("%s did not stop; killing it", current.channel.name)
                    current.channel.kill()
                    await current.channel.wait()
                current.fail(EngineError("the replica is shutting down"))
                self._current = None
            tasks, self._tasks = self._tasks, []
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.launcher.close()
            self._set("unloaded")

    async def _launch(self) -> None:
        """Launch a replica and wait until its engine is loaded; raise if it is not."""
        channel = await self.launcher.launch()
        try:
            first = await asyncio.wait_for(channel.receive(), START_TIMEOUT_S)
        except TimeoutError:
            first = {"op": "fatal", "message": f"not loaded after {START_TIMEOUT_S:g}s"}
        except BaseException:  # cancelled (closed while loading): leave no orphan
            channel.kill()
            await asyncio.shield(channel.wait())
            raise
        if first is None or first.get("op") != "ready":
            reason = "it ended" if first is None else str(first.get("message"))
            channel.kill()
            how = await channel.wait()
            raise EngineError(f"the {self.kind} replica failed to start ({reason}; {how})")
        self._status = dict(first.get("status") or self._status)
        current = ReplicaClient(
            channel,
            shared=bool(first.get("shared")),
            on_status=self._status_changed,
            on_cache=self._cache_changed,
        )
        self._current = current
        self._lost.clear()
        self._tasks = [
            asyncio.create_task(self._serve(current)),
            asyncio.create_task(self._probe(current)),
        ]
        self._set("ready")
        log.info("%s ready", channel.name)

    async def _supervise(self) -> None:
        backoff = BACKOFF_INITIAL_S
        while not self._closing:
            await self._lost.wait()
            if self._closing:
                return
            current = self._current
            if current is not None:
                if time.monotonic() - current.started > STABLE_AFTER_S:
                    backoff = BACKOFF_INITIAL_S
                how = await current.channel.wait()
                log.error("%s died (%s); restarting in %.1fs", current.channel.name, how, backoff)
            while not self._closing:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                self._restarts += 1
                try:
                    await self._launch()
                    break
                except Exception as e:
                    log.error("restarting the %s replica failed: %s", self.kind, e)

    async def _probe(self, current: ReplicaClient) -> None:
        """Kill the replica when it stops answering pings or a decode step hangs."""
        while not current.lost:
            await asyncio.sleep(self.probe_interval_s)
            if current.lost:
                return
            silent = time.monotonic() - current.answered
            stalled = float(self._status.get("stalled_s", 0.0))
            if silent > self.probe_timeout_s or stalled > self.probe_timeout_s:
                what = f"silent for {silent:.1f}s" if silent > stalled else "decode stalled"
                log.error(
                    "%s is wedged (%s; limit %gs); killing it",
                    current.channel.name,
                    what,
                    self.probe_timeout_s,
                )
                current.channel.kill()
                return
            current.ping()

    async def _serve(self, current: ReplicaClient) -> None:
        """Read the replica's frames until it is gone, then have it restarted."""
        try:
            await current.read()
        finally:
            # It is gone (or closing): nothing it had will ever answer.
            if current is self._current and not self._closing:
                self._set("restarting")
            current.fail(EngineError("the replica died during the request; retry it"))
            self._lost.set()

    # -- requests: the live replica's client ------------------------------------------

    def _live(self) -> ReplicaClient:
        current = self._current
        if current is None or current.lost or self._state != "ready":
            raise EngineError("the replica is restarting; retry the request")
        return current

    async def reserve(self, request_id: str, weight: int) -> None:
        await self._live().reserve(request_id, weight)

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        return await self._live().prepare(request)

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        return await self._live().tokenize(request)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return await self._live().detokenize(tokens)

    async def tokenizer_info(self) -> TokenizerInfo:
        return await self._live().tokenizer_info()

    def context_length(self) -> int:
        # The replica reports its engine's in every status frame.
        return int(self._status.get("context_length") or 0)

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        return await self._live().prepare_embeddings(request)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        return await self._live().embed(request)

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
        return await self._live().export_kv(tokens, min_tokens)

    async def import_kv(self, state: KvState) -> bool:
        return await self._live().import_kv(state)

    async def held_kv(self, min_tokens: int) -> list[tuple[int, ...]]:
        return await self._live().held_kv(min_tokens)

    def kv_link(self) -> KvLink | None:
        current = self._current
        return None if current is None else current.channel.kv_link()

    def generate(self, request: GenerationRequest) -> ChunkStream:
        return self._live().generate(request)

    def cancel(self, request_id: str) -> None:
        current = self._current
        if current is not None:
            current.cancel(request_id)


__all__ = ["Launcher", "SupervisedHost"]
