"""Requests to one launched replica, as frames: the gateway's end of the wire.

A :class:`ReplicaClient` speaks :mod:`tokenmill.replicas.wire` over one
:class:`Channel` (a child process's socket, a Ray actor's): it sends each request
as a frame, multiplexes the answers by id back to their streams
(:class:`~tokenmill.engines.chunks.ChunkStream`) and waiting calls, and hands the
replica's own reports (status, KV cache events) to whoever made it. It lives as
long as that one replica: when the channel ends, :meth:`ReplicaClient.fail` ends
every open stream and call with an error. Launching, probing and restarting are not
its job (:mod:`tokenmill.replicas.supervisor` does them, a new client per launch).

A pool's replica (``shared``) keeps its own slot count: :meth:`ReplicaClient.reserve`
holds the request's slots there or fails with
:class:`~tokenmill.errors.ReplicaFullError` at once; a reservation no ``generate``
followed is dropped there by :meth:`ReplicaClient.cancel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenmill import otel, stages
from tokenmill.engines import (
    ChunkStream,
    EmbeddingInfo,
    EmbeddingRequest,
    Embeddings,
    GenerationRequest,
    KvState,
    PromptInfo,
    TokenizeRequest,
    TokenizerInfo,
)
from tokenmill.errors import EngineError, ReplicaFullError, ServiceError
from tokenmill.kvblocks import CacheEvent
from tokenmill.replicas.host import KvLink, ReplicaLocation
from tokenmill.replicas.wire import (
    decode_cache_event,
    decode_chunk_row,
    decode_error,
    decode_tokenizer_info,
    encode_embedding,
    encode_request,
    encode_tokenize,
)

log = logging.getLogger("tokenmill.replicas.client")


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

    def kv_link(self) -> KvLink | None:
        """Its path for KV state that skips the gateway (:class:`KvLink`), if any."""
        ...

    @property
    def name(self) -> str:
        """What the logs call it: ``replica process 1234``, ``ray replica ...``."""
        ...


class ReplicaClient:
    """Requests to the replica at the other end of ``channel``. See the module
    docstring.

    ``on_status`` receives each status the replica reports (its ``health``);
    ``on_cache`` each change of what its KV cache holds.
    """

    def __init__(
        self,
        channel: Channel,
        *,
        shared: bool,
        on_status: Callable[[dict[str, Any]], None],
        on_cache: Callable[[CacheEvent], None],
    ) -> None:
        self.channel = channel
        # A pool's replica, shared with other gateways: it keeps the slot count.
        self.shared = shared
        self.started = time.monotonic()
        self.answered = self.started  # when its last frame arrived
        self.lost = False
        self._on_status = on_status
        self._on_cache = on_cache
        self._streams: dict[str, ChunkStream] = {}
        # prepare / tokenize / detokenize / embed calls waiting for their answer, by id.
        self._calls: dict[str, asyncio.Future[dict[str, Any]]] = {}
        # Requests whose slots a shared replica holds, reserved and not yet generated.
        self._reserved: set[str] = set()
        self._ids = itertools.count(1)  # the ids of calls that are not a request's

    def send(self, message: dict[str, Any]) -> None:
        if self.lost:
            raise EngineError("the replica is gone; retry the request")
        self.channel.send(message)

    def ping(self) -> None:
        """Ask for a ``pong`` (with the replica's status), if it is still there."""
        with contextlib.suppress(EngineError):
            self.send({"op": "ping"})

    def stop(self) -> None:
        """Ask the replica to close; it answers by ending."""
        self.send({"op": "close"})

    # -- frames in ----------------------------------------------------------------------

    async def read(self) -> None:
        """Hand the replica's frames to their streams, calls and listeners until the
        channel ends. Whoever runs this then calls :meth:`fail`."""
        streams = self._streams
        # A replica's monotonic marks line up with ours only on the same host's clock.
        clock = self.channel.same_clock
        try:
            while True:
                msg = await self.channel.receive()
                if msg is None:
                    return
                self.answered = time.monotonic()
                op = msg["op"]
                if op == "chunks":
                    marks = msg.get("t")
                    if marks is not None and clock:
                        # The replica's marks of first tokens, before the chunks end
                        # (and remove) their streams.
                        for rid, values in marks.items():
                            stream = streams.get(rid)
                            if stream is not None:
                                stream.marks = stages.received(values, self.answered)
                    for row in msg["c"]:
                        rid, chunk = decode_chunk_row(row)
                        stream = streams.get(rid)
                        if stream is not None:
                            stream.put(chunk)
                            if stream.ended:
                                del streams[rid]
                elif op in ("kv", "kv_all"):
                    self._on_cache(decode_cache_event(msg))
                elif op in ("status", "pong"):
                    self._on_status(msg["status"])
                elif op == "full":  # a shared replica's slots are all taken
                    self._end(
                        msg["id"],
                        ReplicaFullError(
                            f"{self.channel.name} has no free slot (other gateways hold "
                            "them); place the request on another replica"
                        ),
                    )
                    self._on_status(msg["status"])
                elif op in ("prepared", "answer", "reserved"):
                    call = self._calls.pop(msg["id"], None)
                    if call is not None and not call.done():
                        call.set_result(msg)
                elif op == "error":
                    self._end(msg["id"], decode_error(msg["error"]))
        except Exception:
            log.exception("reading from %s failed", self.channel.name)

    def _end(self, rid: str, err: ServiceError) -> None:
        """End the call or stream of id ``rid`` with ``err``."""
        call = self._calls.pop(rid, None)
        if call is not None and not call.done():
            call.set_exception(err)
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.put(err)

    def fail(self, err: ServiceError) -> None:
        """The replica is gone (or being let go): nothing it had will ever answer, so
        every open stream and call ends with ``err``."""
        self.lost = True
        self.channel.detach()
        self._reserved.clear()
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()
        for call in self._calls.values():
            if not call.done():
                call.set_exception(err)
        self._calls.clear()

    # -- requests -----------------------------------------------------------------------

    async def _call(self, call_id: str, message: dict[str, Any]) -> dict[str, Any]:
        """Send a frame and wait for the answer with its id (``prepared``/``answer``)."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self.send({**message, "id": call_id})
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _next_id(self) -> str:
        return f"call-{next(self._ids)}"

    async def reserve(self, request_id: str, weight: int) -> None:
        """Hold ``weight`` slots for the request on a shared replica (a pool's), or
        raise :class:`ReplicaFullError` at once; nothing to do on a replica of this
        gateway's own, whose slots the deployment counts."""
        if not self.shared:
            return
        await self._call(request_id, {"op": "reserve", "w": weight})
        self._reserved.add(request_id)

    async def prepare(self, request: GenerationRequest) -> PromptInfo:
        answer = await self._call(
            request.request_id, {"op": "prepare", "req": encode_request(request)}
        )
        work = answer.get("t")  # when the replica began and ended the work
        if work and self.channel.same_clock:
            stages.mark("prepare_start", work[0])
            stages.mark("prepare_end", work[1])
        tokens = answer.get("k")
        return PromptInfo(
            answer["prompt_tokens"],
            answer["context_length"],
            longest_prompt=answer.get("longest_prompt"),
            tokens=None if tokens is None else tuple(tuple(p) for p in tokens),
        )

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        answer = await self._call(
            self._next_id(), {"op": "tokenize", "req": encode_tokenize(request)}
        )
        return [int(t) for t in answer["tokens"]]

    async def detokenize(self, tokens: Sequence[int]) -> str:
        answer = await self._call(self._next_id(), {"op": "detokenize", "tokens": list(tokens)})
        return str(answer["text"])

    async def tokenizer_info(self) -> TokenizerInfo:
        answer = await self._call(self._next_id(), {"op": "tokenizer_info"})
        return decode_tokenizer_info(answer["info"])

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
        """The replica's KV state of the longest prefix of ``tokens`` it holds (at
        least ``min_tokens``), carried raw after the answer's JSON."""
        message = {"op": "kv_export", "tokens": list(tokens), "min": min_tokens}
        answer = await self._call(self._next_id(), traced(message))
        if not answer.get("found"):
            return None
        held = tuple(int(t) for t in answer["tokens"])
        return KvState(held, bytes(answer["blob"]), str(answer["fp"]))

    async def import_kv(self, state: KvState) -> bool:
        message = {"op": "kv_import", "tokens": list(state.tokens), "fp": state.fingerprint}
        answer = await self._call(self._next_id(), traced({**message, "blob": state.state}))
        return bool(answer.get("ok"))

    async def held_kv(self, min_tokens: int) -> list[tuple[int, ...]]:
        answer = await self._call(self._next_id(), {"op": "kv_held", "min": min_tokens})
        return [tuple(int(t) for t in seq) for seq in answer["seqs"]]

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        answer = await self._call(
            self._next_id(), {"op": "embed_prepare", "req": encode_embedding(request)}
        )
        return EmbeddingInfo(int(answer["prompt_tokens"]), int(answer["dimensions"]))

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        answer = await self._call(
            self._next_id(), {"op": "embed", "req": encode_embedding(request)}
        )
        vectors = tuple(tuple(float(x) for x in v) for v in answer["vectors"])
        return Embeddings(vectors, int(answer["prompt_tokens"]))

    def generate(self, request: GenerationRequest) -> ChunkStream:
        rid = request.request_id
        stream = ChunkStream(rid, self.cancel)
        self._streams[rid] = stream
        self._reserved.discard(rid)
        frame = {"op": "generate", "req": encode_request(request)}
        # With tracing on, the replica's spans join the request's trace (replicas.spans);
        # a pool's replica writes none, and the gateway writes its stages from its marks.
        if not self.shared and (parent := otel.traceparent(handed=True)) is not None:
            frame["traceparent"] = parent
        try:
            self.send(frame)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    def cancel(self, request_id: str) -> None:
        """Stop a request; on a shared replica, also drop one reserved and never
        generated (its slots are held there)."""
        if request_id in self._reserved:
            self._reserved.discard(request_id)
        elif request_id not in self._streams:
            return
        # If the replica is gone, fail() ends the stream instead.
        with contextlib.suppress(EngineError):
            self.send({"op": "abort", "id": request_id})


def traced(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with the current request's ``traceparent`` when tracing carries one:
    the replica's span of it joins the request's trace (:mod:`tokenmill.replicas.spans`)."""
    parent = otel.traceparent()
    return message if parent is None else {**message, "traceparent": parent}


__all__ = ["Channel", "ReplicaClient"]
