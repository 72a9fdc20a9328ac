"""A replica's own spans of the requests it serves, in the gateway's trace.

When tracing is on (:func:`tokenmill.otel.traces_enabled`: a replica process inherits
the gateway's ``OTEL_*`` environment, a Ray actor is given it), the gateway adds the
W3C ``traceparent`` of a request's span to the frames it sends for it (``generate``,
``kv_export``, ``kv_import``), and the replica exports, over the same OTLP settings,
spans that are children of that span:

* ``tokenmill.replica``: from the ``generate`` frame read to the request's final
  chunk (or error) written, with its pid and usage; under it, from the
  engine's first-token marks where it keeps them (llama.cpp): ``tokenmill.engine_queue``
  (waiting for a slot), ``tokenmill.prefill`` (the prompt decoded: a cached prefix,
  from a slot, the host-memory or disk tier or a moved state, is restored there, and
  its tokens are the span's ``tokenmill.cached_tokens``), ``tokenmill.sample``,
  ``tokenmill.frame``; then ``tokenmill.replica.decode``, from the first token's frame
  to the last.
* ``tokenmill.kv_export`` and ``tokenmill.kv_import``: a KV move's two halves, in the
  donor and the target.

:func:`traced` wraps the replica loop's frames both ways: frames in are looked at for a
``traceparent``, frames out for the chunks, answers and errors of the requests that
had one. That is a dictionary lookup a frame (a row of a step's frame) on the decode
thread; the spans are built and exported from a thread of their own. Off, the frames
are not wrapped and nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill import otel

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

Receive = Callable[[], Awaitable[dict[str, Any] | None]]
# The replica stages under ``tokenmill.replica``: (span, from mark, to mark), the marks
# an engine sends with a first token (tokenmill.stages.REPLICA_MARKS).
STAGES = (
    ("tokenmill.engine_queue", "queued", "picked"),
    ("tokenmill.prefill", "picked", "decoded"),
    ("tokenmill.sample", "decoded", "sampled"),
    ("tokenmill.frame", "sampled", "sent"),
)
MARKS = ("queued", "picked", "decoded", "sampled", "sent")
CALLS = {"kv_export": "tokenmill.kv_export", "kv_import": "tokenmill.kv_import"}


class Frames(Protocol):
    def send(self, message: dict[str, Any]) -> None: ...


@dataclass
class Traced:
    """One traced request or call, from its frame in to its last frame out."""

    name: str
    traceparent: str
    start: float
    attributes: dict[str, Any] = field(default_factory=dict)
    first: float | None = None  # its first chunk written
    marks: list[float] | None = None  # the engine's first-token marks (MARKS)
    end: float = 0.0
    error: str | None = None


class ReplicaSpans:
    """Frames watched both ways (see the module docstring); :meth:`close` exports what
    is left."""

    def __init__(self, provider: TracerProvider, receive: Receive, frames: Frames) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tokenmill.replica")
        self._receive = receive
        self._frames = frames
        self.open: dict[str, Traced] = {}  # by request id or call id
        self._ended: queue.SimpleQueue[Traced | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_all, name="replica-spans", daemon=True)
        self._writer.start()

    # -- frames in ----------------------------------------------------------------------
    async def receive(self) -> dict[str, Any] | None:
        msg = await self._receive()
        if msg is not None and (tp := msg.get("traceparent")) is not None:
            now = time.monotonic()
            op = msg["op"]
            if op == "generate":
                rid = msg["req"]["id"]
                self.open[rid] = Traced("tokenmill.replica", tp, now, {"tokenmill.request_id": rid})
            elif op in CALLS:
                tokens = len(msg.get("tokens") or ())
                self.open[msg["id"]] = Traced(CALLS[op], tp, now, {"tokenmill.kv.tokens": tokens})
        return msg

    # -- frames out (from the event loop and the decode thread) -------------------------
    def send(self, message: dict[str, Any]) -> None:
        if self.open:
            self._saw(message)
        self._frames.send(message)

    def _saw(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "chunks":
            marks = message.get("t")
            for row in message["c"]:
                traced = self.open.get(row[0])
                if traced is None:
                    continue
                if traced.first is None:
                    traced.first = time.monotonic()
                    if marks is not None:
                        traced.marks = marks.get(row[0])
                if row[2] is not None:  # its final chunk: [rid, text, finish, usage, ...]
                    traced.attributes["gen_ai.response.finish_reasons"] = (row[2],)
                    if row[3] is not None:
                        usage = dict(zip(("input", "output", "cached"), row[3], strict=False))
                        traced.attributes |= {
                            "gen_ai.usage.input_tokens": usage["input"],
                            "gen_ai.usage.output_tokens": usage["output"],
                            "tokenmill.cached_tokens": usage["cached"],
                        }
                    self._end(row[0])
        elif op == "error" and message.get("id") in self.open:
            error = message.get("error") or {}
            self._end(message["id"], str(error.get("code") or error.get("type") or "error"))
        elif op == "answer" and message.get("id") in self.open:
            traced = self.open[message["id"]]
            if "found" in message:
                traced.attributes["tokenmill.kv.found"] = bool(message["found"])
            if "ok" in message:
                traced.attributes["tokenmill.kv.imported"] = bool(message["ok"])
            if message.get("found"):
                traced.attributes["tokenmill.kv.tokens"] = len(message.get("tokens") or ())
            blob = message.get("blob")
            if isinstance(blob, bytes | bytearray):
                traced.attributes["tokenmill.kv.bytes"] = len(blob)
            self._end(message["id"])

    def _end(self, key: str, error: str | None = None) -> None:
        traced = self.open.pop(key, None)
        if traced is not None:
            traced.end = time.monotonic()
            traced.error = error
            self._ended.put(traced)

    # -- the spans, on their own thread -------------------------------------------------
    def _write_all(self) -> None:
        while (traced := self._ended.get()) is not None:
            try:
                self._write(traced)
            except Exception:  # a span is never worth a replica
                import logging

                logging.getLogger("tokenmill.replicas.spans").exception("a span failed")

    def _write(self, t: Traced) -> None:
        from opentelemetry.trace import Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract({"traceparent": t.traceparent})
        offset = otel.offset_ns()
        attributes = {"tokenmill.replica.pid": os.getpid(), **t.attributes}
        span = self.tracer.start_span(
            t.name, context=parent, start_time=otel.at_ns(offset, t.start), attributes=attributes
        )
        if t.error is not None:
            span.set_attribute("error.type", t.error)
            span.set_status(Status(StatusCode.ERROR, t.error))
        inside = set_span_in_context(span)

        def child(name: str, a: float, b: float) -> None:
            if b >= a:
                s = self.tracer.start_span(name, context=inside, start_time=otel.at_ns(offset, a))
                s.end(end_time=otel.at_ns(offset, b))

        marks = dict(zip(MARKS, t.marks or (), strict=False))
        for name, a, b in STAGES:
            if a in marks and b in marks:
                child(name, marks[a], marks[b])
        first = marks.get("sent", t.first)
        if first is not None and t.name == "tokenmill.replica":
            child("tokenmill.replica.decode", first, t.end)
        span.end(end_time=otel.at_ns(offset, t.end))

    def close(self) -> None:
        """Write what has ended, export it, stop."""
        self._ended.put(None)
        self._writer.join()
        self.provider.shutdown()


@contextlib.contextmanager
def traced(receive: Receive, frames: Frames) -> Iterator[tuple[Receive, Frames]]:
    """The replica loop's frames, watched for spans when tracing is on (``receive`` and
    ``frames`` as they are when it is off); what is left is exported on the way out."""
    if not otel.traces_enabled():
        yield receive, frames
        return
    spans = ReplicaSpans(otel.tracer_provider(), receive, frames)
    try:
        yield spans.receive, spans
    finally:
        spans.close()


__all__ = ["ReplicaSpans", "traced"]
