"""OpenTelemetry's switches, its providers, and the trace context a request carries to
its replica: what the gateway's observer (:mod:`tokenmill.tracing`) and a replica's
own spans (:mod:`tokenmill.replicas.spans`) share, in the bottom layer so that both
may use it.

Everything here reads the standard ``OTEL_*`` variables; nothing imports OpenTelemetry
until a provider is built, which happens only when an OTLP endpoint is set. A replica
process inherits the gateway's environment; a Ray actor is given its ``OTEL_*``
variables (:func:`passed_on`) in its runtime environment.

The request being served carries its trace context in a context variable
(:func:`carry`), set by the HTTP layer when tracing is on: the replica client adds its
``traceparent`` to the frames it sends for that request (:func:`traceparent`), and
marks it handed, so that the gateway leaves to the replica the spans the replica
writes itself. Off, the variable is never set and reading it costs a lookup.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
SERVICE = "tokenmill"


def _sdk_on(environ: Mapping[str, str]) -> bool:
    return environ.get("OTEL_SDK_DISABLED", "").lower() != "true"


def traces_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether traces are exported: an OTLP endpoint for them is set, and neither
    ``OTEL_SDK_DISABLED`` nor ``OTEL_TRACES_EXPORTER=none`` turns them off."""
    if not _sdk_on(environ) or environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(environ.get(ENDPOINT) or environ.get(TRACES_ENDPOINT))


def metrics_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the GenAI server metrics are exported: an OTLP endpoint for them is set,
    and neither ``OTEL_SDK_DISABLED`` nor ``OTEL_METRICS_EXPORTER=none`` turns them off."""
    if not _sdk_on(environ) or environ.get("OTEL_METRICS_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(environ.get(ENDPOINT) or environ.get(METRICS_ENDPOINT))


def passed_on(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """This process's ``OTEL_*`` variables: what a replica elsewhere (a Ray actor)
    needs to export as the gateway does."""
    return {k: v for k, v in environ.items() if k.startswith("OTEL_")}


def resource() -> Resource:
    """The resource of every span and metric: ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` as the SDK reads them, ``tokenmill`` unless named."""
    from opentelemetry.sdk.resources import Resource

    found = Resource.create()
    if str(found.attributes.get("service.name", "")).startswith("unknown_service"):
        found = found.merge(Resource({"service.name": SERVICE}))
    return found


def tracer_provider() -> TracerProvider:
    """Spans exported over OTLP/HTTP by a batch processor (its ``OTEL_BSP_*`` and the
    exporter's ``OTEL_EXPORTER_OTLP_*`` variables apply)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def meter_provider() -> MeterProvider:
    """Metrics exported over OTLP/HTTP every ``OTEL_METRIC_EXPORT_INTERVAL`` ms."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    return MeterProvider(metric_readers=[reader], resource=resource())


def offset_ns() -> int:
    """Wall-clock nanoseconds minus monotonic ones, now: a monotonic mark ``m`` was at
    ``offset + m * 1e9`` on the wall clock (spans are stamped in wall-clock time)."""
    return time.time_ns() - time.monotonic_ns()


def at_ns(offset: int, monotonic: float) -> int:
    return offset + int(monotonic * 1e9)


@dataclass
class Carried:
    """The trace context of the request being served, as its replica is to receive it."""

    traceparent: str
    # A replica that writes its own spans was given it (the gateway then leaves out
    # the stages that replica marked, which it writes itself).
    handed: bool = False


_carried: ContextVar[Carried | None] = ContextVar("tokenmill_trace", default=None)


def carry(carried: Carried) -> Token[Carried | None]:
    """Make ``carried`` the current request's (returns the token for :func:`uncarry`)."""
    return _carried.set(carried)


def uncarry(token: Token[Carried | None]) -> None:
    _carried.reset(token)


def traceparent(*, handed: bool = False) -> str | None:
    """The current request's W3C ``traceparent``, if tracing carries one; ``handed``:
    it goes to a replica that writes its own spans of the request."""
    carried = _carried.get()
    if carried is None:
        return None
    if handed:
        carried.handed = True
    return carried.traceparent
