"""A replica that several gateways share: one engine, a connection per gateway.

A pool's replica (:mod:`tokenmill.replicas.pool`) loads its engine once and serves every
gateway attached to it, each over a connection of its own carrying the frames of
:mod:`tokenmill.replicas.wire`, as a replica of one gateway does
(:func:`tokenmill.replicas.runner.serve`). What differs:

* **Its slots are its own.** Each gateway admits against its own view, so the
  replica decides: a gateway's ``reserve`` (``{"op": "reserve", "id", "w"}``, sent
  once it has chosen this replica) holds the request's ``w`` slots (one per choice) in
  a :class:`~tokenmill.replicas.slotbook.SlotBook` and is answered ``reserved``, or at
  once ``{"op": "full", "id", "status"}``, and that gateway tries another replica or
  waits for a slot. The ``generate`` that follows runs on the reservation; the
  request's final chunk frees it; a gateway's ``abort`` before its ``generate`` drops
  it. (``prepare`` holds nothing: a gateway may prepare on one replica and run on
  another.) So all gateways together never run more streams here than ``max_num_seqs``.
  The status every gateway receives counts as ``running`` the slots taken, by whoever.
* **Frames go to whom they concern.** Answers to a gateway's calls and its requests'
  chunks go to that gateway alone (the engine's step sink splits each step's events by
  owner); replica events (``status`` now; any event about the replica as a whole, such
  as its cache) go to every attached gateway, by :meth:`SharedReplica.broadcast`.
* **A gateway leaving is not the end.** Its connection closing (``close``, or its
  death) cancels its requests and drops its reservations; the engine keeps serving
  the others, and the next gateway to attach gets ``ready`` at once. The replica ends
  only when its actor does (``tokenmill pool stop``, or its death).

Request ids are the gateways' own: an id already held here (another gateway's) is
refused with an ``error`` naming ``x-request-id``, never mixed up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill import stages
from tokenmill.engines import (
    CachePublishing,
    Chunk,
    Engine,
    GenerationRequest,
    SteppedEngine,
    StepSink,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.replicas.runner import (
    STATUS_INTERVAL_S,
    FrameWriter,
    Outbox,
    Runner,
    engine_status,
    load_engine,
    step_sink,
)
from tokenmill.replicas.slotbook import SlotBook
from tokenmill.replicas.wire import (
    decode_request,
    encode_cache_event,
    encode_error,
    encode_frame,
    read_frame,
)

log = logging.getLogger("tokenmill.replicas.shared")


@dataclass(eq=False)
class _Attached:
    """One gateway's connection."""

    number: int
    frames: FrameWriter  # any thread
    runner: Runner  # its calls and (engines without a step sink) its streams
    sink: StepSink | None  # its requests' events of a step, from the decode thread
    # Stops sending it the engine's cache events (kv_all, kv), if the engine has them.
    unpublish: Callable[[], None] | None = None

    def send(self, message: dict[str, Any]) -> None:
        self.runner.out.send(message)


def _final(item: Chunk | BaseException) -> bool:
    return not isinstance(item, Chunk) or item.finish_reason is not None


class SharedReplica:
    """One engine served to every attached gateway. See the module docstring."""

    def __init__(self, section: dict[str, Any]) -> None:
        self.section = section
        slots = section.get("max_num_seqs")
        self.book = SlotBook(slots if isinstance(slots, int) else 1)
        self._engine: Engine | None = None
        self._stepped: SteppedEngine | None = None
        self._first_marks: dict[str, tuple[float, ...]] | None = None
        self._loading: asyncio.Task[Engine] | None = None
        self._attached: dict[int, _Attached] = {}
        self._numbers = itertools.count(1)
        # The book is read and written on the event loop and by the decode thread (a
        # request's final chunk frees its slots there).
        self._lock = threading.Lock()
        self._refused = False  # someone was told "full" since slots last freed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._status_task: asyncio.Task[None] | None = None

    @property
    def engine(self) -> Engine | None:
        """The engine, once loaded."""
        return self._engine

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Begin loading the engine (once); gateways attached meanwhile wait for it."""
        if self._loading is None:
            self._loop = asyncio.get_running_loop()
            self._loading = asyncio.create_task(self._load())

    async def _load(self) -> Engine:
        engine = await load_engine(self.section)
        self._engine = engine
        if isinstance(engine, SteppedEngine):
            self._stepped = engine
            self._first_marks = getattr(engine, "first_marks", None)
            engine.set_step_sink(self._sink)
        self._status_task = asyncio.create_task(self._push_status())
        return engine

    async def close(self) -> None:
        """Stop serving: every connection ends, then the engine closes."""
        for conn in list(self._attached.values()):
            conn.frames.closed = True
        if self._status_task is not None:
            self._status_task.cancel()
        if self._loading is not None:
            self._loading.cancel()
            with contextlib.suppress(BaseException):
                await self._loading
        if self._engine is not None:
            await self._engine.close()

    def status(self) -> dict[str, Any]:
        assert self._engine is not None
        status = engine_status(self._engine)
        status["running"] = self.book.taken  # every gateway's, reserved or running
        return status

    def broadcast(self, message: dict[str, Any]) -> None:
        """A replica event, to every attached gateway, from any thread (the decode
        thread too: an engine's cache events): encoded once, written whole to each."""
        data = encode_frame(message)
        for conn in list(self._attached.values()):
            conn.frames.write(data)

    async def _push_status(self) -> None:
        last: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            status = self.status()
            if status != last:
                self.broadcast({"op": "status", "status": status})
                last = status

    # -- one gateway's connection ---------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one gateway's connection until it says ``close`` or is gone."""
        self.start()
        assert self._loading is not None
        frames = FrameWriter(writer.get_extra_info("socket"))
        number = next(self._numbers)
        try:
            try:
                engine = await asyncio.shield(self._loading)
            except Exception as e:
                frames.send({"op": "fatal", "message": str(e)})
                return
            sink = None
            if self._stepped is not None:
                sink = step_sink(frames, self._first_marks)
            conn = _Attached(number, frames, Runner(engine, Outbox(frames)), sink)
            self._attached[number] = conn
            conn.send({"op": "ready", "status": self.status(), "shared": True})
            if isinstance(engine, CachePublishing):
                # Its own snapshot, then every change (as a replica of one gateway does).
                conn.unpublish = engine.publish_cache(
                    lambda event: frames.send(encode_cache_event(event))
                )
            log.info("gateway connection %d attached (%d now)", number, len(self._attached))
            await self._answer(conn, reader)
        finally:
            self._detach(number)
            with contextlib.suppress(Exception):
                writer.close()

    async def _answer(self, conn: _Attached, reader: asyncio.StreamReader) -> None:
        while True:
            msg = await read_frame(reader)
            if msg is None or msg["op"] == "close":
                return
            op = msg["op"]
            if op == "reserve":
                self._reserve(conn, str(msg["id"]), int(msg["w"]))
            elif op == "prepare":
                await conn.runner.prepare(decode_request(msg["req"]))
            elif op == "generate":
                self._generate(conn, decode_request(msg["req"]))
            elif op == "abort":
                self._abort(conn, str(msg["id"]))
            elif await conn.runner.call(msg):
                continue
            elif op == "ping":
                conn.send({"op": "pong", "status": self.status()})

    def _detach(self, number: int) -> None:
        """A gateway left: its reservations go, its running requests are cancelled
        (their slots free with their final chunks, as ever)."""
        conn = self._attached.pop(number, None)
        if conn is None:
            return
        conn.frames.closed = True  # whatever is still on its way to it is dropped
        if conn.unpublish is not None:
            conn.unpublish()
        with self._lock:
            reserved, running = self.book.held_by(number)
            for rid in reserved:
                self.book.end(rid)
        assert self._engine is not None
        for rid in running:
            self._engine.cancel(rid)
        for task in conn.runner.calls:
            task.cancel()
        log.info(
            "gateway connection %d detached (%d left; %d of its requests cancelled)",
            number,
            len(self._attached),
            len(running),
        )
        if reserved:
            self._freed()

    # -- slots ------------------------------------------------------------------------

    def _reserve(self, conn: _Attached, rid: str, weight: int) -> None:
        with self._lock:
            booked = self.book.reserve(conn.number, rid, weight, time.monotonic())
        if booked == "full":
            self._refused = True
            conn.send({"op": "full", "id": rid, "status": self.status()})
        elif booked == "duplicate":
            conn.send({"op": "error", "id": rid, "error": encode_error(_duplicate(rid))})
        else:
            conn.send({"op": "reserved", "id": rid})

    def _generate(self, conn: _Attached, req: GenerationRequest) -> None:
        rid = req.request_id
        with self._lock:
            booked = self.book.start(conn.number, rid, req.choices, time.monotonic())
        if booked != "ok":
            if booked == "full":
                self._refused = True
                conn.send({"op": "full", "id": rid, "status": self.status()})
            else:
                conn.send({"op": "error", "id": rid, "error": encode_error(_duplicate(rid))})
            return
        if self._stepped is not None:
            try:
                self._stepped.submit(req)
            except Exception as e:
                self._end(rid)
                conn.send({"op": "error", "id": rid, "error": encode_error(e)})
            return
        conn.runner.generate(req)
        pump = conn.runner.pumps.get(rid)
        if pump is None:  # refused at once (its error is sent)
            self._end(rid)
        else:
            pump.add_done_callback(lambda _: self._end(rid))

    def _abort(self, conn: _Attached, rid: str) -> None:
        with self._lock:
            if self.book.owner(rid) != conn.number:
                return  # finished meanwhile, or not this gateway's
            if not self.book.running(rid):  # reserved, never generated
                self.book.end(rid)
                rid = ""
        if rid:
            assert self._engine is not None
            self._engine.cancel(rid)  # its final chunk frees the slots
        else:
            self._freed()

    def _end(self, rid: str) -> None:
        with self._lock:
            owner = self.book.end(rid)
        if owner is not None:
            self._freed()

    def _freed(self) -> None:
        """Slots came free (on the event loop): gateways told "full" hear it now, not
        at the next status push."""
        if self._refused:
            self._refused = False
            self.broadcast({"op": "status", "status": self.status()})

    def _sink(self, events: list[tuple[str, Chunk | BaseException]]) -> None:
        """The engine's step sink (decode thread): each owner's events to it alone."""
        by_owner: dict[int | None, list[tuple[str, Chunk | BaseException]]] = {}
        freed = False
        with self._lock:
            for rid, item in events:
                by_owner.setdefault(self.book.owner(rid), []).append((rid, item))
                if _final(item) and self.book.end(rid) is not None:
                    freed = True
        for owner, mine in by_owner.items():
            conn = None if owner is None else self._attached.get(owner)
            if conn is not None and conn.sink is not None:
                conn.sink(mine)
            elif self._first_marks:  # nobody to send them to: drop their marks too
                stages.take_first(self._first_marks, (rid for rid, _ in mine))
        loop = self._loop
        if freed and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._freed)


def _duplicate(rid: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"a request with the id {rid!r} is already running on this replica (from another "
        "gateway of its pool): send each request with an id of its own",
        param="x-request-id",
    )


__all__ = ["SharedReplica"]
