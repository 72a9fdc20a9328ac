"""Traces and GenAI server metrics through the real OTLP/HTTP exporters into an in-test
receiver that decodes the protobuf it is sent (tests/otlp.py): one trace per request,
its root the child of the incoming W3C ``traceparent``, named and attributed in the
GenAI conventions, the gateway's stages under it and the replica process's own spans
(exported by that process) beside them; the same request id as the response, its
receipt and its log line; the ``gen_ai.server.*`` histograms; a span for a request
refused before the gateway and for a KV move. Off, nothing is exported or imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.conftest import ServerProcess
from tests.gateway.test_tier_routing import busy_home_moves
from tests.otlp import Received, Receiver, traced_env
from tests.waiting import HANG_S, wait_until
from tokenmill.gateway import RequestRecord
from tokenmill.identity import ANONYMOUS
from tokenmill.otel import metrics_enabled
from tokenmill.tracing import METRICS, Tracing, enabled

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


# Named first by the tests: it outlives their servers, which export what is left as
# they stop.
@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def root_of(spans: list[Received]) -> Received:
    [root] = [r for r in spans if r.span.kind == Span.SPAN_KIND_SERVER]
    return root


def named(spans: list[Received], name: str) -> Received:
    [found] = [s for s in spans if s.span.name == name]
    return found


def server_span(receiver: Receiver, request_id: str) -> Received | None:
    with receiver.lock:
        for r in receiver.spans:
            if (
                r.span.kind == Span.SPAN_KIND_SERVER
                and r.attributes.get("tokenmill.request_id") == request_id
            ):
                return r
    return None


def with_spans(receiver: Receiver, trace_id: str, *names: str) -> list[Received] | None:
    """The trace's spans, once it has every span ``names`` names."""
    got = receiver.trace(trace_id)
    return got if set(names) <= {s.span.name for s in got} else None


@pytest.mark.parametrize("latest", [True, False], ids=["latest", "previous"])
def test_a_request_is_one_trace_across_the_gateway_and_its_replica_in_genai_terms(
    receiver: Receiver, start_server: Callable[..., ServerProcess], latest: bool
) -> None:
    # The embedded model in a replica process: it exports its own spans of the request
    # (its queue, prefill, sampling and decode), children of the gateway's span.
    srv = start_server(env=traced_env(receiver, latest))
    rid = "traced-1"
    with openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=5,
            temperature=0.5,
            top_p=0.9,
            extra_headers={"x-request-id": rid, "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        )
        completion = raw.parse()
        # Another request, without a traceparent: a trace of its own.
        other_usage = client.completions.create(
            model="smollm2",
            prompt="One, two,",
            max_tokens=3,
            extra_headers={"x-request-id": "traced-2"},
        ).usage
    assert raw.headers["x-request-id"] == rid
    usage = completion.usage
    assert usage is not None and other_usage is not None

    spans = wait_until(
        lambda: with_spans(receiver, TRACE_ID, "tokenmill.decode", "tokenmill.replica.decode"),
        "the request's spans, the gateway's and the replica's",
    )
    root = root_of(spans)
    assert root.span.name == "chat smollm2"
    assert root.parent == PARENT_ID
    assert root.resource["service.name"] == "tokenmill-under-test"
    provider = "gen_ai.provider.name" if latest else "gen_ai.system"
    attributes = root.attributes
    assert {k: v for k, v in attributes.items() if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "chat",
        provider: "tokenmill",
        "gen_ai.request.model": "smollm2",
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.response.model": "smollm2",
        "gen_ai.response.id": rid,
        "gen_ai.response.finish_reasons": [completion.choices[0].finish_reason],
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
    }
    assert attributes["tokenmill.request_id"] == rid
    assert attributes["tokenmill.account"] == "anonymous"
    assert attributes["tokenmill.replica"] == 0

    # The replica process's own span, a child of the gateway's, in the same trace, with
    # its stages under it: exported by that process, not the gateway.
    replica = named(spans, "tokenmill.replica")
    assert replica.parent == root.id
    described = httpx.get(f"{srv.base_url}/deployments/smollm2", timeout=HANG_S).json()
    replica_pid = described["replicas"][0]["pid"]
    assert replica_pid != srv.proc.pid
    assert replica.attributes["tokenmill.replica.pid"] == replica_pid
    assert replica.attributes["tokenmill.request_id"] == rid
    assert replica.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert replica.resource["service.name"] == "tokenmill-under-test"
    inside = {s.span.name for s in spans if s.parent == replica.id}
    assert inside == {
        "tokenmill.engine_queue", "tokenmill.prefill", "tokenmill.sample", "tokenmill.frame",
        "tokenmill.replica.decode",
    }, inside  # fmt: skip

    # The gateway's stages under the request's span, in its time; the replica's stages
    # are the replica's alone.
    gateway = [s for s in spans if s.parent == root.id and s is not replica]
    names = {s.span.name for s in gateway}
    assert {
        "tokenmill.auth", "tokenmill.admission", "tokenmill.hold", "tokenmill.dispatch",
        "tokenmill.decode",
    } <= names, names  # fmt: skip
    assert not names & inside, names & inside
    assert {s.id for s in spans} == {root.id, replica.id, *(s.id for s in gateway)} | {
        s.id for s in spans if s.parent == replica.id
    }
    for child in gateway:
        assert root.span.start_time_unix_nano <= child.span.start_time_unix_nano
        assert child.span.end_time_unix_nano <= root.span.end_time_unix_nano

    # The same id in the receipt and the log line.
    assert httpx.get(f"{srv.base_url}/usage/{rid}").json()["request_id"] == rid
    line = wait_until(lambda: srv.request_line(rid), "the request's log line")
    assert line["request_id"] == rid

    other = wait_until(lambda: server_span(receiver, "traced-2"), "the second request's span")
    assert other.span.name == "text_completion smollm2"
    assert other.span.trace_id.hex() != TRACE_ID and other.parent == ""

    # The GenAI server metrics: one request of each operation in the duration and the
    # time to first token, in seconds, with the conventions' attributes and buckets.
    def counted(name: str, n: int) -> bool:
        return sum(h.point.count for h in receiver.latest(name)) == n

    wait_until(lambda: counted("gen_ai.server.request.duration", 2), "both requests measured")
    longer = sum(u.completion_tokens > 1 for u in (usage, other_usage))
    wait_until(lambda: counted("gen_ai.server.time_per_output_token", longer), "per token")
    buckets = {name: list(b) for name, _, b in METRICS}
    for name in buckets:
        points = receiver.latest(name)
        assert {h.unit for h in points} == {"s"}
        assert all(list(h.point.explicit_bounds) == buckets[name] for h in points)
        assert all(h.point.sum > 0 for h in points)
        if name == "gen_ai.server.time_per_output_token":
            continue
        by_operation = sorted(points, key=lambda h: str(h.attributes["gen_ai.operation.name"]))
        assert [(h.attributes, h.point.count) for h in by_operation] == [
            (
                {
                    "gen_ai.operation.name": operation,
                    provider: "tokenmill",
                    "gen_ai.request.model": "smollm2",
                    "gen_ai.response.model": "smollm2",
                },
                1,
            )
            for operation in ("chat", "text_completion")
        ], points


def test_a_kv_move_and_a_request_refused_before_the_gateway_have_spans(
    receiver: Receiver, start_server: Callable[..., ServerProcess]
) -> None:
    # 2 process replicas of one slot each: a busy home's history moves to the other
    # replica with the next turn (tests/gateway/test_tier_routing.py).
    config = (
        '[[deployments]]\nid = "notes"\nreplicas = 2\nplacement = "process"\n'
        "n_threads = 1\nmax_num_seqs = 1\nn_ctx = 1024\nkv_host_bytes = 67108864\n"
    )
    srv = start_server(config=config, env=traced_env(receiver))

    # A bad body: 400, before any gateway work; its span says so, under its traceparent.
    bad = httpx.post(
        f"{srv.base_url}/chat/completions",
        json={"model": "notes", "messages": "hello"},
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "bad-1"},
        timeout=HANG_S,
    )
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    refused = wait_until(lambda: receiver.trace(TRACE_ID), "the refused request's span")
    root = root_of(refused)
    assert root.span.name == "chat" and root.parent == PARENT_ID
    assert root.span.status.code == Status.STATUS_CODE_ERROR
    assert root.span.status.message == error["message"]
    assert root.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "tokenmill",
        "error.type": error["code"] or error["type"],
        "http.response.status_code": 400,
        "tokenmill.request_id": "bad-1",
    }
    # The stages the gateway's server marked before it refused the body.
    assert {"tokenmill.auth"} <= {s.span.name for s in refused if s is not root} <= {
        "tokenmill.http", "tokenmill.auth",
    }  # fmt: skip

    busy_home_moves(srv, "notes", via="gateway")

    # The moved request's trace: the move under its span, and each half of it in the
    # replica that did it (the donor's export, the target's import).
    def moved() -> Received | None:
        with receiver.lock:
            found = [s for s in receiver.spans if s.attributes.get("tokenmill.kv_move") == "moved"]
        return found[0] if found else None

    root = wait_until(moved, "the moved request's span")
    trace_id = root.span.trace_id.hex()
    spans = wait_until(
        lambda: with_spans(
            receiver, trace_id, "tokenmill.kv_move", "tokenmill.kv_export", "tokenmill.kv_import",
            "tokenmill.replica",
        ),
        "the move's spans",
    )  # fmt: skip
    move = named(spans, "tokenmill.kv_move")
    exported, imported = named(spans, "tokenmill.kv_export"), named(spans, "tokenmill.kv_import")
    assert move.parent == exported.parent == imported.parent == root.id
    target = root.attributes["tokenmill.replica"]
    assert move.attributes == {
        "tokenmill.kv_move.from": 1 - target,
        "tokenmill.kv_move.to": target,
        "tokenmill.kv_move.outcome": "moved",
    }
    assert root.span.start_time_unix_nano <= move.span.start_time_unix_nano
    assert move.span.end_time_unix_nano <= root.span.end_time_unix_nano
    assert exported.attributes["tokenmill.kv.found"] is True
    assert exported.attributes["tokenmill.kv.bytes"] > 0
    assert imported.attributes["tokenmill.kv.imported"] is True
    assert imported.attributes["tokenmill.kv.tokens"] == exported.attributes["tokenmill.kv.tokens"]
    # The target served it, with the moved tokens cached.
    replica = named(spans, "tokenmill.replica")
    pids = {
        r["index"]: r["pid"]
        for r in httpx.get(f"{srv.base_url}/deployments/notes").json()["replicas"]
    }
    assert (
        replica.attributes["tokenmill.replica.pid"]
        == imported.attributes["tokenmill.replica.pid"]
        == pids[target]
    )
    assert exported.attributes["tokenmill.replica.pid"] == pids[1 - target]
    assert (
        replica.attributes["tokenmill.cached_tokens"] >= exported.attributes["tokenmill.kv.tokens"]
    )

    # The refusal is measured, with its error (and without a model: none was read).
    def refusal() -> list[dict[str, object]]:
        points = receiver.latest("gen_ai.server.request.duration")
        return [h.attributes for h in points if "gen_ai.request.model" not in h.attributes]

    assert wait_until(refusal, "the refusal's duration") == [
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "tokenmill",
            "error.type": error["code"] or error["type"],
        }
    ]


def test_the_genai_metrics_alone_with_their_own_endpoint(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OTEL_EXPORTER_OTLP_METRICS_ENDPOINT alone: the metrics, and no span. The exporter
    # reads the process's environment; close() exports what was measured.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"{receiver.endpoint}/v1/metrics")
    tracing = Tracing.from_environment()
    assert tracing is not None and tracing.tracer is None
    done = RequestRecord("m-1", "smollm2", ANONYMOUS, prompt_tokens=3, completion_tokens=5)
    done.finish_reason, done.ttft_s, done.duration_s = "stop", 0.25, 1.25
    failed = RequestRecord("m-2", "smollm2", ANONYMOUS, status="error", error_code="engine_error")
    failed.duration_s = 0.5
    tracing.on_finish(done)
    tracing.on_finish(failed)
    tracing.close()
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "tokenmill",
        "gen_ai.request.model": "smollm2",
        "gen_ai.response.model": "smollm2",
    }
    durations = receiver.latest("gen_ai.server.request.duration")
    assert sorted((len(h.attributes), h.point.sum) for h in durations) == [(4, 1.25), (5, 0.5)]
    assert [h.attributes for h in durations if h.point.sum == 0.5] == [
        {**common, "error.type": "engine_error"}
    ]
    [ttft] = receiver.latest("gen_ai.server.time_to_first_token")
    [per_token] = receiver.latest("gen_ai.server.time_per_output_token")
    assert ttft.attributes == per_token.attributes == common
    assert (ttft.point.count, ttft.point.sum) == (1, 0.25)
    assert (per_token.point.count, per_token.point.sum) == (1, (1.25 - 0.25) / 4)
    assert receiver.spans == []


def test_tracing_is_off_without_an_endpoint() -> None:
    assert not enabled({})
    assert Tracing.from_environment({}) is None
    assert not enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
    assert not enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"})
    assert enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x/v1/traces"})
    assert not enabled({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://x/v1/metrics"})
    assert metrics_enabled({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://x/v1/metrics"})
    assert metrics_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert not metrics_enabled(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_METRICS_EXPORTER": "none"}
    )
    assert not metrics_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x/v1/traces"})
    # Off, building the app loads nothing of OpenTelemetry's SDK or exporter, and a
    # replica's frames go unwrapped.
    probe = (
        "import json, sys\n"
        "from tokenmill.config import Settings\n"
        "from tokenmill.server.app import create_app\n"
        "from tokenmill.replicas.spans import traced\n"
        "create_app(Settings().with_default_deployment())\n"
        "receive, frames = object(), object()\n"
        "with traced(receive, frames) as both:\n"
        "    assert both == (receive, frames)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
    ).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert not [m for m in loaded if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
