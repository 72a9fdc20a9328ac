"""Traces and server metrics in OpenTelemetry's GenAI semantic conventions, over OTLP/HTTP.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (or ``..._TRACES_ENDPOINT`` for the
traces alone, ``..._METRICS_ENDPOINT`` for the metrics alone: :mod:`tokenmill.otel`),
and then configured by the standard ``OTEL_*`` variables (service name, resource
attributes, headers, timeouts, batch delays, export interval, propagators), which the
OpenTelemetry SDK reads itself. Off, nothing of OpenTelemetry is imported and no
observer or middleware is installed: it costs nothing.

On, :class:`Tracing` is a gateway observer, as :mod:`tokenmill.metrics` is, and the
server's :class:`~tokenmill.server.traces.TraceContext` tells it of each GenAI request
as it comes in (:meth:`Tracing.arrived`) and once it is answered
(:meth:`Tracing.answered`).

**Traces.** A request's span (kind SERVER) is started when it comes in, from its first
byte, the child of the W3C ``traceparent`` it came with; its trace context goes with it
to its replica (:func:`tokenmill.otel.carry`), whose own spans join the trace
(:mod:`tokenmill.replicas.spans`). When the request ends the span is named
``{gen_ai.operation.name} {gen_ai.request.model}``, given its attributes, and under it
one span is written per stage of its first token marked in the gateway
(``tokenmill.stages``: auth, parse, admission, prepare, hold, dispatch, ...), the KV
move its routing made (``tokenmill.kv_move``), then ``decode`` from the first token to
the end; the replica's own stages (its queue, prefill, sampling) are written by the
replica, or from the marks it sent back where it writes no spans (a pool's replica).
A request refused before it reached the gateway (a bad body: 400) still has its span,
with ``error.type``, ``http.response.status_code`` and the error's message as its
status. Attribute names are the GenAI conventions' latest experimental ones where
``OTEL_SEMCONV_STABILITY_OPT_IN`` has ``gen_ai_latest_experimental``
(``gen_ai.provider.name``), and their previous ones otherwise (``gen_ai.system``);
tokenmill's own are under ``tokenmill.`` (the request id of its log line and receipt,
account, class, replica, cached tokens, the charge).

**Metrics.** The conventions' server histograms, in seconds, with their attributes
(operation, provider, request and response model, ``error.type`` for a failure):
``gen_ai.server.request.duration`` (every request, the figure of the Prometheus
``e2e`` histogram), ``gen_ai.server.time_to_first_token`` and
``gen_ai.server.time_per_output_token`` (successful ones).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill import otel, stages
from tokenmill.gateway import RequestRecord

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("tokenmill.tracing")

LATEST = "gen_ai_latest_experimental"
PROVIDER = "tokenmill"
# The request fields a GenAI span names, as each API spells them.
REQUEST_FIELDS = {
    "gen_ai.request.max_tokens": ("max_tokens", "max_completion_tokens", "max_output_tokens"),
    "gen_ai.request.temperature": ("temperature",),
    "gen_ai.request.top_p": ("top_p",),
}
# The routes that are GenAI operations, and which (anything else is not traced).
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
}
# The stages a replica marks: one that writes its own spans writes them.
REPLICA_STAGES = frozenset(("engine_queue", "prefill", "sample", "frame"))
# The GenAI server metrics: name, description, the conventions' bucket boundaries.
METRICS = (
    (
        "gen_ai.server.request.duration",
        "Generative AI server request duration such as time-to-last byte or last output token",
        (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92),
    ),
    (
        "gen_ai.server.time_to_first_token",
        "Time to generate first token for successful responses",
        (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5, 7.5, 10),
    ),
    (
        "gen_ai.server.time_per_output_token",
        "Time per output token generated after the first token for successful responses",
        (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
    ),
)


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether traces are to be exported (:func:`tokenmill.otel.traces_enabled`)."""
    return otel.traces_enabled(environ)


def operation_of(path: str) -> str | None:
    """The GenAI operation a route performs; None for a route that performs none."""
    found = OPERATIONS.get(path)
    if found is None and path.startswith("/v1/deployments/") and "/predict" in path:
        return "chat"
    return found


@dataclass
class Incoming:
    """A GenAI request as the server saw it come in: its operation, its scope's state
    (the parsed body lands there), its marks, and with traces on its span (started)
    and the trace context its replica is given."""

    operation: str
    state: dict[str, Any]
    marks: stages.Marks
    arrived: float  # monotonic: its first byte
    offset: int = field(default_factory=otel.offset_ns)  # wall minus monotonic ns
    span: Span | None = None
    carried: otel.Carried | None = None
    # The gateway admitted it (on_start): it is written when the gateway ends it.
    started: bool = False
    status: int = 0  # the response's HTTP status
    error: bytes = b""  # the body of an error response

    def ns(self, monotonic: float) -> int:
        return otel.at_ns(self.offset, monotonic)


class Tracing:
    """Writes a trace, and the GenAI server metrics, for each GenAI request (see the
    module docstring). ``provider`` or ``meters`` may be None: traces or metrics off."""

    def __init__(
        self,
        provider: TracerProvider | None,
        *,
        latest: bool,
        meters: MeterProvider | None = None,
    ) -> None:
        self.provider = provider
        self.tracer: Tracer | None = None if provider is None else provider.get_tracer(PROVIDER)
        self.meters = meters
        self.histograms: dict[str, Histogram] = {}
        if meters is not None:
            meter = meters.get_meter(PROVIDER)
            for name, description, buckets in METRICS:
                self.histograms[name] = meter.create_histogram(
                    name, unit="s", description=description,
                    explicit_bucket_boundaries_advisory=buckets,
                )  # fmt: skip
        self.latest = latest
        # request id -> what its HTTP request brought; the server fills it, the
        # request's end (on_finish, or answered for one the gateway never took) empties it.
        self.incoming: dict[str, Incoming] = {}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Tracing | None:
        traces, metrics = otel.traces_enabled(environ), otel.metrics_enabled(environ)
        if not (traces or metrics):
            return None
        opt_in = environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
        latest = LATEST in {part.strip() for part in opt_in.split(",")}
        log.info(
            "OpenTelemetry over OTLP/HTTP: traces %s, GenAI metrics %s (GenAI names: %s)",
            "on" if traces else "off", "on" if metrics else "off",
            "latest" if latest else "previous",
        )  # fmt: skip
        return cls(
            otel.tracer_provider() if traces else None,
            latest=latest,
            meters=otel.meter_provider() if metrics else None,
        )

    def close(self) -> None:
        """Export what is left, then stop."""
        if self.provider is not None:
            self.provider.shutdown()
        if self.meters is not None:
            self.meters.shutdown()

    # -- the HTTP request (tokenmill.server.traces) -------------------------------------
    def arrived(
        self, request_id: str, operation: str, headers: Mapping[str, str], state: dict[str, Any]
    ) -> Incoming:
        """A GenAI request came in: its span starts (traces on), a child of the trace
        context its headers carry."""
        marks = stages.current() or {}
        begin = marks.get("arrive", marks.get("app", time.monotonic()))
        incoming = Incoming(operation, state, marks, begin)
        if self.tracer is not None:
            from opentelemetry.propagate import extract
            from opentelemetry.trace import SpanKind

            span = self.tracer.start_span(
                operation, context=extract(headers), kind=SpanKind.SERVER,
                start_time=incoming.ns(begin),
            )  # fmt: skip
            incoming.span = span
            ctx = span.get_span_context()
            if ctx.trace_flags.sampled:
                parent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
                incoming.carried = otel.Carried(parent)
        self.incoming[request_id] = incoming
        return incoming

    def answered(self, request_id: str, failure: str | None = None) -> None:
        """Its response is done (or ``failure`` raised through): a request the gateway
        never took is written now; one it took is written when it ends (on_finish)."""
        incoming = self.incoming.get(request_id)
        if incoming is None or incoming.started:
            return
        del self.incoming[request_id]
        try:
            self._refused(request_id, incoming, time.monotonic(), failure)
        except Exception:  # a trace is never worth a request
            log.exception("tracing: could not write the trace of %s", request_id)

    # -- gateway observer ---------------------------------------------------------------
    def on_start(self, record: RequestRecord) -> None:
        incoming = self.incoming.get(record.request_id)
        if incoming is not None:
            incoming.started = True

    def on_tokens(self, record: RequestRecord, now: float) -> None:
        return None

    def on_finish(self, record: RequestRecord) -> None:
        incoming = self.incoming.pop(record.request_id, None)
        try:
            now = time.monotonic()
            if self.tracer is not None:
                self._write(record, incoming, now)
            if self.histograms:
                self._measure(record, incoming, now)
        except Exception:  # a trace is never worth a request
            log.exception("tracing: could not write the trace of %s", record.request_id)

    # -- the trace ----------------------------------------------------------------------
    def _write(self, record: RequestRecord, incoming: Incoming | None, now: float) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        tracer = self.tracer
        assert tracer is not None
        if incoming is None:  # not from an HTTP request of its own (a batch's line)
            incoming = Incoming("chat", {}, record.marks, record.started)
        operation = incoming.operation
        attributes = self._attributes(record, operation, incoming.state.get("parsed_body"))
        ns = incoming.ns
        marks = record.marks
        span = incoming.span
        if span is None:
            begin = min([incoming.arrived, *marks.values()])
            span = tracer.start_span(operation, kind=SpanKind.SERVER, start_time=ns(begin))
        span.update_name(f"{operation} {record.deployment}")
        span.set_attributes(attributes)
        if record.status != "ok":
            span.set_attribute("error.type", record.error_code or record.status)
            span.set_status(Status(StatusCode.ERROR, record.error_code))
        parent = set_span_in_context(span)

        def child(name: str, a: float, b: float, attributes: dict[str, Any]) -> None:
            s = tracer.start_span(name, context=parent, start_time=ns(a), attributes=attributes)
            s.end(end_time=ns(b))

        handed = incoming.carried is not None and incoming.carried.handed
        for name, start, stop in stages.STAGES:
            if handed and name in REPLICA_STAGES:
                continue  # the replica wrote it (tokenmill.replicas.spans)
            a, b = marks.get(start), marks.get(stop)
            if a is not None and b is not None and b >= a:
                child(f"tokenmill.{name}", a, b, {"tokenmill.stage": name})
        route = record.route
        a, b = marks.get("move_start"), marks.get("move_end")
        if a is not None and b is not None and route is not None:
            child("tokenmill.kv_move", a, b, {
                "tokenmill.kv_move.from": route.move_from if route.move_from is not None else -1,
                "tokenmill.kv_move.to": route.index,
                "tokenmill.kv_move.outcome": str(route.moved),
            })  # fmt: skip
        if record.ttft_s is not None:
            output = {"gen_ai.usage.output_tokens": record.completion_tokens}
            child("tokenmill.decode", record.started + record.ttft_s, now, output)
        span.end(end_time=ns(now))

    def _refused(
        self, request_id: str, incoming: Incoming, now: float, failure: str | None
    ) -> None:
        """The span of a request refused before the gateway took it (a bad body),
        with the error its response carried (and its measure)."""
        status = incoming.status or 500
        kind, message = failure, failure
        if incoming.error:
            kind, message = error_of(incoming.error)
        error_type = (kind or str(status)) if status >= 400 or failure else None
        body = incoming.state.get("parsed_body")
        model = getattr(body, "model", None)
        model = model if isinstance(model, str) else None
        common = self._common(incoming.operation, model)
        if error_type is not None:
            common["error.type"] = error_type
        span = incoming.span
        if span is not None:
            from opentelemetry.trace import Status, StatusCode, set_span_in_context

            assert self.tracer is not None
            span.update_name(f"{incoming.operation} {model}" if model else incoming.operation)
            span.set_attributes(common)
            span.set_attributes(
                {"tokenmill.request_id": request_id, "http.response.status_code": status}
            )
            if error_type is not None:
                span.set_status(Status(StatusCode.ERROR, message or error_type))
            parent = set_span_in_context(span)
            for name, start, stop in stages.STAGES:  # the gateway's first stages (auth)
                a, b = incoming.marks.get(start), incoming.marks.get(stop)
                if a is not None and b is not None and b >= a:
                    s = self.tracer.start_span(
                        f"tokenmill.{name}", context=parent, start_time=incoming.ns(a),
                        attributes={"tokenmill.stage": name},
                    )  # fmt: skip
                    s.end(end_time=incoming.ns(b))
            span.end(end_time=incoming.ns(now))
        if self.histograms:
            self.histograms["gen_ai.server.request.duration"].record(now - incoming.arrived, common)

    def _common(self, operation: str, model: str | None) -> dict[str, Any]:
        """The attributes every GenAI span and metric has."""
        common: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            ("gen_ai.provider.name" if self.latest else "gen_ai.system"): PROVIDER,
        }
        if model is not None:
            common["gen_ai.request.model"] = model
        return common

    def _attributes(self, record: RequestRecord, operation: str, body: object) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            **self._common(operation, record.deployment),
            "gen_ai.response.model": record.deployment,
            "gen_ai.response.id": record.request_id,
            "gen_ai.response.finish_reasons": (record.finish_reason,),
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "tokenmill.request_id": record.request_id,
            "tokenmill.account": record.caller.account_id,
            "tokenmill.priority": record.caller.priority,
            "tokenmill.cached_tokens": record.cached_tokens,
            "tokenmill.charged": record.charged,
            "tokenmill.queue_s": record.queue_s,
        }
        for name, fields in REQUEST_FIELDS.items():
            for f in fields:
                value = getattr(body, f, None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    attributes[name] = value
                    break
        if record.ttft_s is not None:
            attributes["tokenmill.time_to_first_token_s"] = record.ttft_s
        if record.route is not None:
            attributes["tokenmill.replica"] = record.route.index
            attributes["tokenmill.route.reason"] = str(record.route.reason)
            if record.route.tier is not None:
                attributes["tokenmill.route.tier"] = str(record.route.tier)
            if record.route.moved is not None:
                attributes["tokenmill.kv_move"] = record.route.moved
        return attributes

    # -- the metrics --------------------------------------------------------------------
    def _measure(self, record: RequestRecord, incoming: Incoming | None, now: float) -> None:
        """The request's GenAI server metrics: the same figures as the Prometheus
        ``e2e`` and ``ttft`` histograms (from the gateway taking it)."""
        operation = incoming.operation if incoming is not None else "chat"
        common = self._common(operation, record.deployment)
        common["gen_ai.response.model"] = record.deployment
        duration = record.duration_s or now - record.started
        if record.status != "ok":
            common["error.type"] = record.error_code or record.status
            self.histograms["gen_ai.server.request.duration"].record(duration, common)
            return
        self.histograms["gen_ai.server.request.duration"].record(duration, common)
        ttft = record.ttft_s
        if ttft is not None:
            self.histograms["gen_ai.server.time_to_first_token"].record(ttft, common)
            if record.completion_tokens > 1:
                per_token = max(duration - ttft, 0.0) / (record.completion_tokens - 1)
                self.histograms["gen_ai.server.time_per_output_token"].record(per_token, common)


def error_of(body: bytes) -> tuple[str | None, str | None]:
    """An error response's kind (its ``code``, else its ``type``) and message, from the
    OpenAI or Anthropic error body."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    kind = error.get("code") or error.get("type")
    message = error.get("message")
    return (None if kind is None else str(kind)), (None if message is None else str(message))
