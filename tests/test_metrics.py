"""GET /metrics: Prometheus text format, exact token counts, errors, load gauges."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.sse import events, text, to_done
from tests.sse import usage as sse_usage
from tests.waiting import HANG_S, wait_until
from tokenmill.config import Settings
from tokenmill.gateway import Gateway
from tokenmill.metrics import GatewayMetrics

DEP = "smollm2"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HISTOGRAMS = (
    "tokenmill_time_to_first_token_seconds",
    "tokenmill_inter_token_latency_seconds",
    "tokenmill_e2e_request_latency_seconds",
    "tokenmill_request_queue_time_seconds",
)
COUNTERS = ("tokenmill_prompt_tokens_total", "tokenmill_generation_tokens_total")
GAUGES = (
    "tokenmill_num_requests_running",
    "tokenmill_num_requests_waiting",
    "tokenmill_kv_cache_usage_perc",
    "tokenmill_replicas_desired",
    "tokenmill_replicas",
    "tokenmill_queue_depth",
    "tokenmill_slot_usage_perc",
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    # The shared fixture's 60 s is too short on a busy 2-core machine.
    with httpx.Client(base_url=server.url, timeout=300.0) as client:
        yield client


def scrape(http: httpx.Client) -> Samples:
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset({"deployment": DEP, **labels}.items())), 0.0)


def engine_tokens(http: httpx.Client) -> int:
    d = http.get(f"/v1/deployments/{DEP}").json()
    return sum(r["tokens_generated"] for r in d["replicas"])


def wait_engine_tokens(http: httpx.Client, expected: int) -> None:
    """Until the engine's counter reaches ``expected`` (replica processes publish it a
    moment after each step); it must not pass it."""
    now = wait_until(
        lambda: (n := engine_tokens(http)) >= expected and n, f"{expected} engine tokens"
    )
    assert now == expected


def agreed_engine_tokens(http: httpx.Client) -> int:
    """The engine's counter once it agrees with the gateway's: every token produced so
    far, on both sides (the gateway settles aborted streams with the engine's count)."""

    def agreed() -> int | None:
        metric = val(scrape(http), "tokenmill_generation_tokens_total")
        engine = engine_tokens(http)
        return engine if engine == metric else None

    return wait_until(agreed, "the engine's token counter to agree with the gateway's")


def stream_chat(http: httpx.Client, body: dict[str, object]) -> tuple[int, dict[str, int]]:
    """Stream a chat completion; return (text frames seen, final usage)."""
    frames = 0
    usage: dict[str, int] = {}
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        for event in to_done(r):
            assert "error" not in event, event
            usage = sse_usage(event) or usage
            if text(event):
                frames += 1
    return frames, usage


def test_every_metric_is_exposed_with_a_deployment_label(http: httpx.Client) -> None:
    http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}).raise_for_status()
    text = http.get("/metrics").text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for h in HISTOGRAMS:
        assert f"{h}_bucket" in names and f"{h}_count" in names, h
    for c in (*COUNTERS, "tokenmill_request_success_total"):
        assert c in names, c
    for g in GAUGES:
        assert g in names, g
    # Every series names its deployment.
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("tokenmill_"):
                assert s.labels.get("deployment") == DEP, s
    assert "# TYPE tokenmill_spend_total counter" in text or "tokenmill_spend" in text


def test_token_counts_are_exact(server: ServerProcess, http: httpx.Client) -> None:
    engine_before = agreed_engine_tokens(http)
    before = scrape(http)
    completion_sum = 0
    prompt_sum = 0
    # Non-streamed, both routes.
    for path, body in (
        (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 7}),
        (CHAT, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 9}),
    ):
        usage = http.post(path, json=body).json()["usage"]
        completion_sum += usage["completion_tokens"]
        prompt_sum += usage["prompt_tokens"]
    # Streamed with usage; count the text frames for the inter-token histogram.
    frames, usage = stream_chat(
        http,
        {
            "messages": [{"role": "user", "content": "Count from one to twenty."}],
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    completion_sum += usage["completion_tokens"]
    prompt_sum += usage["prompt_tokens"]
    after = scrape(http)
    gen = "tokenmill_generation_tokens_total"
    assert val(after, gen) - val(before, gen) == completion_sum
    # The engine's own counter agrees (it is published a moment after the response).
    wait_engine_tokens(http, engine_before + completion_sum)
    assert (
        val(after, "tokenmill_prompt_tokens_total") - val(before, "tokenmill_prompt_tokens_total")
        == prompt_sum
    )
    ok = sum(
        val(after, "tokenmill_request_success_total", finished_reason=r)
        - val(before, "tokenmill_request_success_total", finished_reason=r)
        for r in ("stop", "length")
    )
    assert ok == 3
    for h in ("tokenmill_time_to_first_token_seconds", "tokenmill_e2e_request_latency_seconds"):
        assert val(after, f"{h}_count") - val(before, f"{h}_count") == 3, h
    # One inter-token gap per text chunk after the first, for every request.
    itl = "tokenmill_inter_token_latency_seconds_count"
    assert frames >= 2
    assert val(after, itl) - val(before, itl) >= frames - 1

    # A stream whose client leaves: the tokens produced count, however many that is.
    engine_before = agreed_engine_tokens(http)
    before = scrape(http)
    body = {
        "prompt": "Write a very long story.",
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=HANG_S) as c,
        c.stream("POST", COMPLETIONS, json=body) as r,
    ):
        stream = events(r)
        seen = [next(stream) for _ in range(4)]
        assert all(isinstance(e, dict) and "error" not in e for e in seen), seen

    def settled() -> bool:
        produced = engine_tokens(http) - engine_before
        now = scrape(http)
        moved = val(now, gen) - val(before, gen)
        # Replica processes push their counters a moment later: wait for them.
        return produced == moved > 0 and val(now, "tokenmill_num_requests_running") == 0

    wait_until(settled, "the left stream's tokens to be counted on both sides")
    after = scrape(http)
    produced = engine_tokens(http) - engine_before
    assert produced >= 3
    assert val(after, gen) - val(before, gen) == produced
    aborts = "tokenmill_request_success_total"
    assert (
        val(after, aborts, finished_reason="abort") - val(before, aborts, finished_reason="abort")
        == 1
    )
    assert val(after, "tokenmill_num_requests_running") == 0


def test_refused_requests_are_counted_by_code(http: httpx.Client) -> None:
    before = scrape(http)
    r = http.post(COMPLETIONS, json={"prompt": "word " * 9000, "max_tokens": 5})
    assert r.status_code == 400
    after = scrape(http)
    name = "tokenmill_request_errors_total"
    code = "context_length_exceeded"
    assert val(after, name, code=code) - val(before, name, code=code) == 1


def test_load_gauges_and_overload(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    """One slot, a queue of one: running, waiting, KV cache, queue time and 429s show.

    A scripted deployment: the long stream holds its slot until the test leaves it,
    however many calls the test makes meanwhile.
    """
    # The scripted engine's KV usage: the running requests' words and tokens over n_ctx.
    n_ctx, prompt, emitted = 64, "Write a very long story.", 3
    config = scripted_deployment(
        driver, id=DEP, max_num_seqs=1, max_queue=1, queue_timeout_s=HANG_S, n_ctx=n_ctx
    )
    srv = start_server(config=config)
    long_body = {"model": DEP, "prompt": prompt, "max_tokens": 50, "stream": True}
    queued_body = {"model": DEP, "prompt": "Hello", "max_tokens": 4}
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as http, ThreadPoolExecutor(1) as pool:
        with http.stream(
            "POST", COMPLETIONS, json=long_body, headers={"x-request-id": "long"}
        ) as r:
            # Hold the iterator: dropping it would close the connection at once.
            stream = events(r)
            driver.emit("long", emitted)
            got = [text(next(stream)) for _ in range(emitted)]
            assert got == [" w1", " w2", " w3"], got
            queued = pool.submit(
                http.post, COMPLETIONS, json=queued_body, headers={"x-request-id": "queued"}
            )
            wait_until(
                lambda: http.get(f"/v1/deployments/{DEP}").json()["queued"] == 1,
                "the second request to queue",
            )
            # The engine gauges come from the replica's status, pushed when it changes:
            # once it shows the 3 tokens, it stays put until the test acts again.
            wait_engine_tokens(http, emitted)
            during = scrape(http)
            # The slot is taken and the queue is full: a third request is refused.
            refused = http.post(COMPLETIONS, json={"model": DEP, "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 429, refused.text
        # The stream's client left: the server aborts it, and the queued one gets the slot.
        assert driver.wait("aborted", "long")["tokens"] == emitted
        driver.emit("queued", 4)
        answer = queued.result(timeout=HANG_S)
        assert answer.status_code == 200, answer.text
        produced = emitted + 4

        def counted() -> Samples | None:
            after = scrape(http)
            both = val(after, "tokenmill_generation_tokens_total") == engine_tokens(http)
            return after if both and val(after, "tokenmill_num_requests_running") == 0 else None

        after = wait_until(counted, "both streams' tokens to be counted on both sides")
        assert engine_tokens(http) == produced
    assert driver.index("ended", "queued") > driver.index("aborted", "long")
    assert val(during, "tokenmill_num_requests_running") == 1
    assert val(during, "tokenmill_num_requests_waiting") == 1
    assert val(during, "tokenmill_kv_cache_usage_perc") == (len(prompt.split()) + emitted) / n_ctx
    # What an autoscaler outside tokenmill scales on (docs/autoscaling.md).
    assert val(during, "tokenmill_queue_depth", **{"class": "default"}) == 1
    assert val(during, "tokenmill_queue_depth", **{"class": "interactive"}) == 0
    assert val(during, "tokenmill_slot_usage_perc") == 1.0
    assert val(during, "tokenmill_replicas_desired") == 1
    assert val(during, "tokenmill_replicas", phase="active", serving="true") == 1
    assert val(after, "tokenmill_queue_depth", **{"class": "default"}) == 0
    assert val(after, "tokenmill_request_errors_total", code="overloaded") == 1
    assert val(after, "tokenmill_request_queue_time_seconds_count") == 2
    # The queued request's wait was measured (how long it was is up to the machine).
    assert val(after, "tokenmill_request_queue_time_seconds_sum") > 0
    assert val(after, "tokenmill_num_requests_waiting") == 0
    assert val(after, "tokenmill_request_success_total", finished_reason="abort") == 1
    assert val(after, "tokenmill_request_success_total", finished_reason="length") == 1
    assert val(after, "tokenmill_generation_tokens_total") == produced


def test_each_app_has_its_own_registry() -> None:
    """Two gateways in one process: no duplicate-series clash, independent counts."""
    settings = Settings().with_default_deployment()
    a = GatewayMetrics(Gateway(settings))
    b = GatewayMetrics(Gateway(settings))
    assert a.registry is not b.registry
    a.generation.labels(DEP).inc(5)
    assert b'tokenmill_generation_tokens_total{deployment="smollm2"} 5.0' in a.render()
    assert b'tokenmill_generation_tokens_total{deployment="smollm2"} 0.0' in b.render()


def test_metrics_off_serves_completions_and_404s_metrics(
    start_server: Callable[..., ServerProcess],
) -> None:
    """TOKENMILL_METRICS=0: no observer and no /metrics route; serving is unchanged."""
    srv = start_server(env={"TOKENMILL_METRICS": "0"})
    with httpx.Client(base_url=srv.url, timeout=300.0) as c:
        r = c.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        body = {"prompt": "Hello", "max_tokens": 8, "stream": True}
        with c.stream("POST", COMPLETIONS, json=body) as s:
            assert s.status_code == 200
            chunks = to_done(s)
        assert any(choice["text"] for chunk in chunks for choice in chunk["choices"])
        r = c.get("/metrics")
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": "no route GET /metrics",
            "type": "invalid_request_error",
            "param": None,
            "code": "unknown_url",
        }
