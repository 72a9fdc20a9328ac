"""A replica outside the gateway's process, supervised: the gateway side of it.

:class:`SupervisedHost` is a :class:`~tokenmill.gateway.hosts.ReplicaHost` whose engine
runs elsewhere: a child process (:mod:`tokenmill.gateway.process`) or a Ray actor
(:mod:`tokenmill.gateway.rayhost`). Both speak the frames of :mod:`tokenmill.gateway.wire`
and run the same replica loop (:mod:`tokenmill.gateway.runner`); only what carries the
frames differs, and that is a :class:`Launcher` and its :class:`Channel`. Everything
else lives here once: multiplexing requests by id, cancellation, the health probe, and
restarting a replica that died.

A replica that dies (a segfault in llama.cpp, an OOM kill, its Ray node gone) fails
its open requests at once with :class:`EngineError` (their streams end with it), the
host turns ``restarting``, and a new replica is launched with exponential backoff.
A replica can also be alive yet wedged (a native call that never returns, a stopped
process): the host pings it every ``probe_interval_s``; one whose last frame is older
than ``probe_timeout_s``, or whose engine reports one decode step running longer
than that, is killed, and handled like any other death.

A replica of a pool (:mod:`tokenmill.gateway.pool`) is shared with other gateways and
says so in its ``ready`` frame (``"shared": true``). It then keeps its own slot count:
``reserve`` holds the request's slots there, or fails with
:class:`~tokenmill.errors.ReplicaFullError` at once (the deployment places the request
elsewhere); a request reserved but never generated is dropped there by ``cancel``. The
host only ever *detaches* from such a replica when it loses or closes it: the replica
keeps serving the other gateways; killing it is for a replica that failed or hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill import stages
from tokenmill.engines.base import (
    EngineHealth,
    GenerationRequest,
    PromptInfo,
    TokenizeRequest,
    TokenizerInfo,
)
from tokenmill.engines.chunks import ChunkStream
from tokenmill.engines.embeddings import EmbeddingInfo, EmbeddingRequest, Embeddings
from tokenmill.errors import EngineError, ReplicaFullError, TokenmillError
from tokenmill.gateway.hosts import ReplicaLocation, ReplicaState
from tokenmill.gateway.wire import (
    decode_cache_event,
    decode_chunk_row,
    decode_error,
    decode_tokenizer_info,
    encode_embedding,
    encode_request,
    encode_tokenize,
)
from tokenmill.kvblocks import CacheEvent

log = logging.getLogger("tokenmill.gateway.supervised")

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


class Channel(Protocol):
    """One incarnation of a replica: frames both ways, and its end."""

    # Whether the replica's time.monotonic() is ours (the same host, one boot): only then
    # do its first-token marks join the gateway's TTFT stages (tokenmill.stages).
    same_clock: bool

    def send(self, message: dict[str, Any]) -> None:
        """Queue a frame for the replica; raise ``EngineError`` if it is gone."""

    async def receive(self) -> dict[str, Any] | None:
        """The replica's next frame; None once it is gone (and for good)."""
        ...

    def kill(self) -> None:
        """End the replica now, without asking it."""

    def detach(self) -> None:
        """Let go of the replica: end it (``kill``) if it is this gateway's alone; for
        a pool's, close this connection and leave it serving the others."""

    async def wait(self) -> str:
        """Wait until the replica has ended; how it ended (for the log)."""
        ...

    def location(self) -> ReplicaLocation: ...

    @property
    def name(self) -> str:
        """What the logs call it: ``replica process 1234``, ``ray replica ...``."""
        ...


class Launcher(Protocol):
    """Starts replicas of one kind: ``launch`` returns the new replica's channel at
    once; its first frame says whether its engine loaded (``ready`` or ``fatal``)."""

    kind: str

    async def launch(self) -> Channel: ...

    async def close(self) -> None:
        """The host closed: release what launching needed (a cluster connection)."""


@dataclass(eq=False)
class _Incarnation:
    """One launched replica and what is waiting on it."""

    channel: Channel
    started: float = field(default_factory=time.monotonic)
    streams: dict[str, ChunkStream] = field(default_factory=dict)
    # prepare / tokenize / detokenize / embed calls waiting for their answer, by id.
    calls: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    lost: bool = False
    answered: float = field(default_factory=time.monotonic)  # last frame received
    # A pool's replica, shared with other gateways: it keeps the slot count, and holds
    # the slots of these requests, reserved and not yet generated.
    shared: bool = False
    reserved: set[str] = field(default_factory=set)

    def send(self, message: dict[str, Any]) -> None:
        if self.lost:
            raise EngineError("the replica is gone; retry the request")
        self.channel.send(message)


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
        self._current: _Incarnation | None = None
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
        self._calls = 0  # calls sent, for their ids

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
                    current.send({"op": "close"})
                try:
                    await asyncio.wait_for(current.channel.wait(), CLOSE_WAIT_S)
                except TimeoutError:
                    log.warning("%s did not stop; killing it", current.channel.name)
                    current.channel.kill()
                    await current.channel.wait()
                self._fail(current, EngineError("the replica is shutting down"))
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
        current = _Incarnation(channel, shared=bool(first.get("shared")))
        self._current = current
        self._lost.clear()
        self._tasks = [
            asyncio.create_task(self._read_loop(current)),
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

    async def _probe(self, current: _Incarnation) -> None:
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
            with contextlib.suppress(EngineError):
                current.send({"op": "ping"})

    async def _read_loop(self, current: _Incarnation) -> None:
        streams = current.streams
        # A replica's monotonic marks line up with ours only on the same host's clock.
        clock = current.channel.same_clock
        try:
            while True:
                msg = await current.channel.receive()
                if msg is None:
                    break
                current.answered = time.monotonic()
                op = msg["op"]
                if op == "chunks":
                    marks = msg.get("t")
                    if marks is not None and clock:
                        # The replica's marks of first tokens, before the chunks end
                        # (and remove) their streams.
                        for rid, values in marks.items():
                            stream = streams.get(rid)
                            if stream is not None:
                                stream.marks = stages.received(values, current.answered)
                    for row in msg["c"]:
                        rid, chunk = decode_chunk_row(row)
                        stream = streams.get(rid)
                        if stream is not None:
                            stream.put(chunk)
                            if stream.ended:
                                del streams[rid]
                elif op in ("kv", "kv_all"):
                    event = decode_cache_event(msg)
                    for callback in self._cache_callbacks:
                        callback(event)
                elif op in ("status", "pong"):
                    self._status_changed(msg["status"])
                elif op == "full":  # a shared replica's slots are all taken
                    rid = msg["id"]
                    full = ReplicaFullError(
                        f"{current.channel.name} has no free slot (other gateways hold "
                        "them); place the request on another replica"
                    )
                    call = current.calls.pop(rid, None)
                    if call is not None and not call.done():
                        call.set_exception(full)
                    stream = streams.pop(rid, None)
                    if stream is not None:
                        stream.put(full)
                    self._status_changed(msg["status"])
                elif op in ("prepared", "answer", "reserved"):
                    call = current.calls.pop(msg["id"], None)
                    if call is not None and not call.done():
                        call.set_result(msg)
                elif op == "error":
                    rid = msg["id"]
                    err = decode_error(msg["error"])
                    call = current.calls.pop(rid, None)
                    if call is not None and not call.done():
                        call.set_exception(err)
                    stream = streams.pop(rid, None)
                    if stream is not None:
                        stream.put(err)
        except Exception:
            log.exception("reading from %s failed", current.channel.name)
        finally:
            # It is gone (or closing): nothing it had will ever answer.
            if current is self._current and not self._closing:
                self._set("restarting")
            self._fail(current, EngineError("the replica died during the request; retry it"))
            self._lost.set()

    def _fail(self, current: _Incarnation, err: TokenmillError) -> None:
        current.lost = True
        current.channel.detach()
        current.reserved.clear()
        for stream in current.streams.values():
            stream.put(err)
        current.streams.clear()
        for call in current.calls.values():
            if not call.done():
                call.set_exception(err)
        current.calls.clear()

    # -- requests ---------------------------------------------------------------------

    def _live(self) -> _Incarnation:
        current = self._current
        if current is None or current.lost or self._state != "ready":
            raise EngineError("the replica is restarting; retry the request")
        return current

    async def _call(self, call_id: str, message: dict[str, Any]) -> dict[str, Any]:
        """Send a frame and wait for the answer with its id (``prepared``/``answer``)."""
        current = self._live()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        current.calls[call_id] = fut
        try:
            current.send({**message, "id": call_id})
            return await fut
        finally:
            current.calls.pop(call_id, None)

    async def reserve(self, request_id: str, weight: int) -> None:
        """Hold ``weight`` slots for the request on a shared replica (a pool's), or
        raise :class:`ReplicaFullError` at once; nothing to do on a replica of this
        gateway's own, whose slots the deployment counts."""
        current = self._live()
        if not current.shared:
            return
        await self._call(request_id, {"op": "reserve", "w": weight})
        current.reserved.add(request_id)

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        current = self._current
        answer = await self._call(
            request.request_id, {"op": "prepare", "req": encode_request(request)}
        )
        work = answer.get("t")  # when the replica began and ended the work
        if work and current is not None and current.channel.same_clock:
            stages.mark("prepare_start", work[0])
            stages.mark("prepare_end", work[1])
        tokens = answer.get("k")
        return PromptInfo(
            answer["prompt_tokens"],
            answer["context_length"],
            longest_prompt=answer.get("longest_prompt"),
            tokens=None if tokens is None else tuple(tuple(p) for p in tokens),
        )

    def _next_call_id(self) -> str:
        self._calls += 1
        return f"call-{self._calls}"

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        answer = await self._call(
            self._next_call_id(), {"op": "tokenize", "req": encode_tokenize(request)}
        )
        return [int(t) for t in answer["tokens"]]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        answer = await self._call(
            self._next_call_id(), {"op": "detokenize", "tokens": list(tokens)}
        )
        return str(answer["text"])

    async def tokenizer_info(self) -> TokenizerInfo:
        answer = await self._call(self._next_call_id(), {"op": "tokenizer_info"})
        return decode_tokenizer_info(answer["info"])

    def context_length(self) -> int:
        # The replica reports its engine's in every status frame.
        return int(self._status.get("context_length") or 0)

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        answer = await self._call(
            self._next_call_id(), {"op": "embed_prepare", "req": encode_embedding(request)}
        )
        return EmbeddingInfo(int(answer["prompt_tokens"]), int(answer["dimensions"]))

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        answer = await self._call(
            self._next_call_id(), {"op": "embed", "req": encode_embedding(request)}
        )
        vectors = tuple(tuple(float(x) for x in v) for v in answer["vectors"])
        return Embeddings(vectors, int(answer["prompt_tokens"]))

    def generate(self, request: GenerationRequest) -> ChunkStream:
        current = self._live()
        rid = request.request_id
        stream = ChunkStream(rid, self.cancel)
        current.streams[rid] = stream
        current.reserved.discard(rid)
        try:
            current.send({"op": "generate", "req": encode_request(request)})
        except BaseException:
            current.streams.pop(rid, None)
            raise
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a request; on a shared replica, also drop one reserved and never
        generated (its slots are held there)."""
        current = self._current
        if current is None:
            return
        if request_id in current.reserved:
            current.reserved.discard(request_id)
        elif request_id not in current.streams:
            return
        # If the replica is gone, _fail ends the stream instead.
        with contextlib.suppress(EngineError):
            current.send({"op": "abort", "id": request_id})


__all__ = ["Channel", "Launcher", "SupervisedHost"]
