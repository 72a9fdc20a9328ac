"""An in-test OTLP/HTTP receiver: ``POST /v1/traces`` and ``POST /v1/metrics`` of
protobuf, as the real exporters send them, kept decoded (the spans with their
resource; every metrics export, in order).
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import HistogramDataPoint
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    assert kind is not None
    return getattr(v, kind)


def attributes_of(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for a in pairs:
        assert isinstance(a, KeyValue)
        found[a.key] = value(a.value)
    return found


@dataclass
class Received:
    span: Span
    resource: dict[str, Any]

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes_of(self.span.attributes)

    @property
    def parent(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def id(self) -> str:
        return self.span.span_id.hex()


@dataclass
class Histogram:
    """One histogram data point of a metrics export: its attributes and counts."""

    name: str
    unit: str
    attributes: dict[str, Any]
    point: HistogramDataPoint


class Receiver:
    """The OTLP/HTTP endpoint; ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` names."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.metrics: list[list[Histogram]] = []  # every export's histograms
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.headers["content-type"] == "application/x-protobuf"
                if self.path == "/v1/traces":
                    receiver.took_spans(ExportTraceServiceRequest.FromString(body))
                    answer = ExportTraceServiceResponse().SerializeToString()
                else:
                    assert self.path == "/v1/metrics", self.path
                    receiver.took_metrics(ExportMetricsServiceRequest.FromString(body))
                    answer = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def took_spans(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                resource = attributes_of(rs.resource.attributes)
                for ss in rs.scope_spans:
                    self.spans += [Received(s, resource) for s in ss.spans]

    def took_metrics(self, request: ExportMetricsServiceRequest) -> None:
        export = [
            Histogram(m.name, m.unit, attributes_of(p.attributes), p)
            for rm in request.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.WhichOneof("data") == "histogram"
            for p in m.histogram.data_points
        ]
        with self.lock:
            self.metrics.append(export)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace(self, trace_id: str) -> list[Received]:
        with self.lock:
            return [r for r in self.spans if r.span.trace_id.hex() == trace_id]

    def latest(self, name: str) -> list[Histogram]:
        """The data points of histogram ``name`` in the latest export that had it
        (cumulative: each export has every count so far)."""
        with self.lock:
            for export in reversed(self.metrics):
                found = [h for h in export if h.name == name]
                if found:
                    return found
        return []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def traced_env(receiver: Receiver, latest: bool = True) -> dict[str, str]:
    """A gateway's environment to export to ``receiver``, at once (the test waits for
    what it expects, not for a timer)."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "tokenmill-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "10",
        "OTEL_METRIC_EXPORT_INTERVAL": "100",
    }
    if latest:
        env["OTEL_SEMCONV_STABILITY_OPT_IN"] = "http,gen_ai_latest_experimental"
    return env
