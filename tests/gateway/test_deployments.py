"""Deployments, process replicas, the upstream engine, admission and predict endpoints.

One gateway serves two llama.cpp deployments (process replicas) and one upstream
deployment that points at a second tokenmill: the session's default ``server``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.sse import Event, events
from tests.waiting import HANG_S, wait_until

COUNTING = "1, 2, 3, 4, 5, 6,"


def config(upstream: str) -> str:
    # Small windows, few slots, one thread per replica: the machine is small and shared,
    # and llama.cpp's spinning thread pools crawl when cores are oversubscribed.
    return f"""
[[deployments]]
id = "chatty"
endpoint_type = "chat"
max_num_seqs = 2
n_ctx = 512
n_threads = 1
max_queue = 1
queue_timeout_s = 30

[[deployments]]
id = "texty"
endpoint_type = "completion"
replicas = 2
max_num_seqs = 1
n_ctx = 512
n_threads = 1

[[deployments]]
id = "remote"
engine = "upstream"
url = "{upstream}"
upstream_model = "smollm2"
endpoint_type = "completion"
max_num_seqs = 2
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, server: ServerProcess) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("gw"), config=config(server.base_url))
    yield srv
    srv.stop()


@pytest.fixture
def client(gw: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw.url, timeout=HANG_S) as c:
        yield c


def signal_mid_stream(
    c: httpx.Client, body: dict[str, Any], pid: int, sig: signal.Signals
) -> list[Event]:
    """Stream ``body``; at its first text send ``sig`` to ``pid``. Returns the events
    after the signal."""
    sent = False
    tail: list[Event] = []
    try:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for e in events(r):
                if sent:
                    tail.append(e)
                elif isinstance(e, dict) and e["choices"] and e["choices"][0]["text"]:
                    os.kill(pid, sig)
                    sent = True
    finally:
        if sig == signal.SIGSTOP:  # never leave a stopped process behind a failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert sent, "the stream ended before its first text"
    return tail


def describe(c: httpx.Client, dep: str) -> dict[str, Any]:
    r = c.get(f"/v1/deployments/{dep}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_in_flight_zero(c: httpx.Client, dep: str) -> None:
    """Until the deployment reports nothing in flight: its capacity came back."""

    def idle() -> bool:
        d = describe(c, dep)
        return d["in_flight"] == 0 and all(r["in_flight"] == 0 for r in d["replicas"])

    wait_until(idle, f"{dep} to have nothing in flight")


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def chat_text(body: dict[str, Any]) -> str:
    assert body["object"] == "chat.completion", body
    return str(body["choices"][0]["message"]["content"])


def completion_text(body: dict[str, Any]) -> str:
    assert body["object"] == "text_completion", body
    return str(body["choices"][0]["text"])


# -- listing -------------------------------------------------------------------


def test_deployments_describe_replicas(gw: ServerProcess, client: httpx.Client) -> None:
    data = client.get("/v1/deployments").json()["data"]
    by_id = {d["id"]: d for d in data}
    assert set(by_id) == {"chatty", "texty", "remote"}
    assert [r["slots"] for r in by_id["texty"]["replicas"]] == [1, 1]
    pids = [r["pid"] for d in ("chatty", "texty") for r in by_id[d]["replicas"]]
    # Each local replica is its own child process, not the gateway.
    assert all(isinstance(p, int) for p in pids)
    assert len(set(pids)) == 3 and gw.proc.pid not in pids
    for d in data:
        for r in d["replicas"]:
            assert r["state"] == "ready"
            assert r["in_flight"] == 0 and r["queued"] == 0 and r["restarts"] == 0
    assert by_id["remote"]["engine"] == "upstream"
    assert by_id["remote"]["replicas"][0]["pid"] is None
    r = client.get("/v1/deployments/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "deployment_not_found"


def test_least_outstanding_routing_spreads_over_replicas(client: httpx.Client) -> None:
    body = {"prompt": COUNTING, "max_tokens": 40, "temperature": 0}
    url = "/v1/deployments/texty/predictWithResponseStream"
    with client.stream("POST", url, json=body) as r1, client.stream("POST", url, json=body) as r2:
        first, second = events(r1), events(r2)  # keep both open while we look
        assert isinstance(next(first), dict) and isinstance(next(second), dict)
        # Both run at once: one on each single-slot replica.
        assert [r["in_flight"] for r in describe(client, "texty")["replicas"]] == [1, 1]
        tails = [list(first), list(second)]
    for tail in tails:
        assert tail[-1] == "[DONE]"
        assert all("error" not in e for e in tail if isinstance(e, dict)), tail


def test_prompts_without_max_tokens_each_get_the_rest_of_the_window(
    client: httpx.Client,
) -> None:
    """Several prompts and no max_tokens: each choice may fill the context window after
    its own prompt (not after all prompts together), through a replica process too."""
    prompt = "The tide came in over the sand and the gulls rose. " * 12
    r = client.post(
        "/v1/completions",
        json={"model": "chatty", "prompt": [prompt, prompt], "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    each = body["usage"]["prompt_tokens"] // 2
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 2 * (512 - each)


# -- predict endpoints -----------------------------------------------------------


def test_predict_default_routes(client: httpx.Client) -> None:
    r = client.post("/v1/deployments/chatty/predict", json={"prompt": "Say hi", "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert chat_text(r.json())  # a prompt on the chat route became a user message
    # Greedy: sampled, the model may end its count before max_tokens.
    body = {"prompt": COUNTING, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/deployments/texty/predict", json=body)
    assert r.status_code == 200, r.text
    assert completion_text(r.json())
    assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    ("dep", "override", "expect"),
    [
        ("chatty", {"field": "completion"}, "text_completion"),
        ("texty", {"field": "chat"}, "chat.completion"),
        ("chatty", {"header": "/v1/completions"}, "text_completion"),
        ("texty", {"header": "/v1/chat/completions"}, "chat.completion"),
    ],
)
def test_predict_overrides(
    client: httpx.Client, dep: str, override: dict[str, str], expect: str
) -> None:
    body: dict[str, Any] = {"prompt": COUNTING, "max_tokens": 6, "temperature": 0}
    headers = {}
    if "field" in override:
        body["endpoint_type"] = override["field"]
    else:
        headers["route"] = override["header"]
    r = client.post(f"/v1/deployments/{dep}/predict", json=body, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == expect
    text = chat_text(out) if expect == "chat.completion" else completion_text(out)
    assert text


def test_predict_messages_on_completion_route_use_the_template(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.post("/v1/deployments/texty/predict", json={"messages": messages, "max_tokens": 6})
    assert r.status_code == 200, r.text
    assert completion_text(r.json())
    # The rendered template (role markers) counts far more than the 3 words sent.
    assert r.json()["usage"]["prompt_tokens"] > 10


def test_predict_with_response_stream(client: httpx.Client) -> None:
    for dep, obj in (("chatty", "chat.completion.chunk"), ("texty", "text_completion")):
        # Greedy: sampled, the model may end its count early (stop, not length).
        body = {"prompt": COUNTING, "max_tokens": 6, "temperature": 0}
        with client.stream(
            "POST", f"/v1/deployments/{dep}/predictWithResponseStream", json=body
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            got = list(events(r))
        assert got[-1] == "[DONE]"
        frames = [e for e in got[:-1] if isinstance(e, dict)]
        assert frames and all(f["object"] == obj for f in frames)
        assert frames[-1]["choices"][0]["finish_reason"] == "length"


def test_predict_unknown_deployment_is_404(client: httpx.Client) -> None:
    r = client.post("/v1/deployments/nope/predict", json={"prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "deployment_not_found"
    r = client.post("/v1/deployments/chatty/predict", json={"prompt": "x"}, headers={"route": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "route"


# -- upstream ------------------------------------------------------------------------


def test_upstream_streams_with_the_upstreams_usage(
    client: httpx.Client, http: httpx.Client
) -> None:
    messages = [{"role": "user", "content": "Write one short sentence about rivers."}]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    texts: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json={**body, "model": "remote"}) as r:
        assert r.status_code == 200
        for e in events(r):
            if isinstance(e, dict):
                assert "error" not in e, e
                if e["choices"]:
                    texts.append(e["choices"][0]["delta"].get("content", ""))
                else:
                    usage = e["usage"]
    direct = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    # Forwarded chunk by chunk, and billed with the upstream's own counts: the
    # gateway's estimate (~4 characters a token) would be about half of the real
    # count, which includes the chat template's role markers.
    assert len([t for t in texts if t]) > 1
    assert usage["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert 0 < usage["completion_tokens"] <= 12


def test_upstream_predict_and_errors(client: httpx.Client) -> None:
    # ignore_eos (forwarded to the upstream): all 5 come, wherever the model would end.
    body = {"prompt": COUNTING, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/deployments/remote/predict", json=body)
    assert r.status_code == 200, r.text
    assert completion_text(r.json())
    assert r.json()["usage"]["completion_tokens"] == 5
    # The upstream's own refusal (prompt + max_tokens beyond its window) comes back as
    # the client's error, not a 5xx.
    r = client.post("/v1/completions", json={"model": "remote", "prompt": "x", "max_tokens": 9999})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_upstream_gets_the_fields_it_supports_and_names_what_it_refuses(
    client: httpx.Client,
) -> None:
    # 29106 is " zebra" in SmolLM2's vocabulary (tests/server/test_logit_bias.py).
    body = {"model": "remote", "prompt": "An animal:", "max_tokens": 2}
    r = client.post("/v1/completions", json={**body, "logit_bias": {"29106": 100}})
    assert r.status_code == 200, r.text
    assert completion_text(r.json()) == " zebra zebra"
    # The upstream refuses a token past its vocabulary: its 400, naming the field.
    r = client.post("/v1/completions", json={**body, "logit_bias": {"999999": 1}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias"
    assert "the upstream refused" in r.json()["error"]["message"]


def test_upstream_is_sent_the_constraint_and_names_what_it_cannot_send(
    client: httpx.Client,
) -> None:
    # The upstream is a tokenmill: it applies the response_format it is forwarded.
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    body = {
        "model": "remote",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 20,
        "temperature": 0,
    }
    r = client.post("/v1/chat/completions", json={**body, "response_format": rf})
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert answer["colour"] in {"red", "green", "blue"}
    r = client.post("/v1/chat/completions", json={**body, "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in {"yes", "no"}
    # A regex has no field every OpenAI-compatible server reads: refused, not dropped.
    r = client.post("/v1/chat/completions", json={**body, "guided_regex": "[0-9]+"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex"


def test_upstream_logprobs_come_back_as_the_upstream_sent_them(
    client: httpx.Client, http: httpx.Client
) -> None:
    body = {"prompt": COUNTING, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    direct = http.post("/v1/completions", json=body).json()["choices"][0]
    r = client.post("/v1/completions", json={**body, "model": "remote"})
    assert r.status_code == 200, r.text
    remote = r.json()["choices"][0]
    assert remote["text"] == direct["text"]
    assert remote["logprobs"]["tokens"] == direct["logprobs"]["tokens"]
    assert remote["logprobs"]["text_offset"] == direct["logprobs"]["text_offset"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    chat |= {"logprobs": True, "top_logprobs": 2, "model": "remote"}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == r.json()["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_upstream_disconnect_closes_the_upstream_request(
    client: httpx.Client, http: httpx.Client
) -> None:
    body = {
        "model": "remote",
        "prompt": COUNTING,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,  # still running when the client leaves, however fast
        "stream": True,
    }
    with client.stream("POST", "/v1/completions", json=body) as r:
        # Keep the iterator referenced: a dropped generator closes the connection.
        stream = events(r)
        for e in stream:
            if isinstance(e, dict) and e["choices"] and e["choices"][0]["text"]:
                break
        assert describe(http, "smollm2")["in_flight"] == 1
    wait_in_flight_zero(client, "remote")
    wait_in_flight_zero(http, "smollm2")


# -- failures and capacity -----------------------------------------------------------


def test_sigkill_mid_stream_fails_fast_and_the_replica_restarts(client: httpx.Client) -> None:
    before = describe(client, "chatty")["replicas"][0]
    body = {
        "model": "chatty",
        "prompt": COUNTING,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    tail = signal_mid_stream(client, body, before["pid"], signal.SIGKILL)
    assert tail[-1] == "[DONE]"
    errors = [e for e in tail if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error"
    wait_in_flight_zero(client, "chatty")  # the error freed its capacity

    def back() -> dict[str, Any] | None:
        rep = describe(client, "chatty")["replicas"][0]
        assert rep["state"] in ("restarting", "ready"), rep
        return rep if rep["state"] == "ready" else None

    after = wait_until(back, "the replica to restart")
    assert after["restarts"] == before["restarts"] + 1
    assert after["pid"] not in (None, before["pid"])
    r = client.post("/v1/deployments/chatty/predict", json={"prompt": "Say hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert chat_text(r.json())


def test_sigkill_during_a_non_streamed_request_is_a_502(client: httpx.Client) -> None:
    pid = describe(client, "texty")["replicas"][0]["pid"]
    pids = {r["pid"] for r in describe(client, "texty")["replicas"]}
    # No end-of-sequence: still running when the kill comes, however fast the model.
    body = {"prompt": COUNTING, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.post, "/v1/deployments/texty/predict", json=body)

        def busy_pid() -> int | None:
            reps = describe(client, "texty")["replicas"]
            return next((x["pid"] for x in reps if x["in_flight"]), None)

        busy = wait_until(busy_pid, "the request to reach a replica")
        assert busy in pids, pid
        os.kill(busy, signal.SIGKILL)
        r = fut.result()
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "server_error"
    # The other replica keeps serving while this one restarts.
    r = client.post("/v1/deployments/texty/predict", json={"prompt": COUNTING, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_capacity_returns_after_end_error_and_disconnect(client: httpx.Client) -> None:
    body = {"model": "chatty", "prompt": COUNTING, "max_tokens": 8, "stream": True}
    # end
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert list(events(r))[-1] == "[DONE]"
    wait_in_flight_zero(client, "chatty")
    # error before streaming (the prompt cannot fit the 512-token window)
    r = client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 600})
    assert r.status_code == 400
    wait_in_flight_zero(client, "chatty")
    # disconnect mid-stream (no end-of-sequence: it still runs when the client leaves)
    long = {**body, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=long) as r:
        # Keep the iterator referenced: a dropped generator closes the connection.
        stream = events(r)
        for e in stream:
            if isinstance(e, dict) and e["choices"] and e["choices"][0]["text"]:
                break
        assert describe(client, "chatty")["in_flight"] == 1
    wait_in_flight_zero(client, "chatty")


def test_overload_answers_only_200_or_429(client: httpx.Client) -> None:
    # Three requests a slot (2 slots, a queue of 1) on the real model: every answer is
    # a 200 with text or a 429 to retry, never an error. How many of each depends on
    # how fast the machine serves them; that a burst's excess is refused, exactly, is
    # shown with held slots in test_request_lifecycle.py.
    d = describe(client, "chatty")
    capacity = sum(r["slots"] for r in d["replicas"])
    n = 3 * capacity
    body = {"prompt": "Write a sentence about cats.", "max_tokens": 16, "temperature": 0}

    def call(_: int) -> httpx.Response:
        with httpx.Client(base_url=client.base_url, timeout=HANG_S) as c:
            return c.post("/v1/deployments/chatty/predict", json=body)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(call, range(n)))
    codes = sorted(r.status_code for r in results)
    assert set(codes) <= {200, 429}, codes
    # The first arrivals find free slots, whatever happens to the rest.
    assert codes.count(200) >= capacity, codes
    for r in results:
        if r.status_code == 200:
            assert chat_text(r.json()).strip()
        else:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    wait_in_flight_zero(client, "chatty")
    assert describe(client, "chatty")["queued"] == 0


# -- configuration errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        ('colour = "blue"', ["deployments.0.colour", "unknown key"]),
        ("replicas = 0", ["deployments.0.replicas", "greater than or equal to 1"]),
        ('max_num_seqs = "many"', ["deployments.0.max_num_seqs"]),
        ('model = "missing.gguf"', ["deployments.0.model", "model file not found", "missing.gguf"]),
        ('[[deployments]]\nid = "a"', ["duplicate deployment id 'a'"]),
        ('tokenizer = "embedded"', ["deployments.0", "'tokenizer' is for upstream deployments"]),
        (
            'engine = "upstream"\nurl = "http://127.0.0.1:9/v1"\ntokenizer = "nope.gguf"',
            ["deployments.0.tokenizer", "tokenizer file not found", "nope.gguf"],
        ),
        ("replica_nice = 20", ["deployments.0.replica_nice", "less than or equal to 19"]),
        ('engine = "scripted"', ["deployments.0", "a scripted (test) deployment needs 'control'"]),
        ('control = "/tmp/x.sock"', ["deployments.0", "'control' is only for scripted"]),
    ],
    ids=[
        "unknown-key",
        "bad-value",
        "bad-type",
        "missing-model",
        "duplicate-id",
        "tokenizer-on-llamacpp",
        "missing-tokenizer",
        "nice-out-of-range",
        "scripted-without-control",
        "control-on-llamacpp",
    ],
)
def test_configuration_errors_stop_startup(tmp_path: Path, extra: str, expect: list[str]) -> None:
    srv = launch(tmp_path, config=f'[[deployments]]\nid = "a"\n{extra}\n', wait=False)
    try:
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    out = srv.log()
    assert code != 0, out
    assert str(tmp_path / "tokenmill.toml") in out
    for text in expect:
        assert text in out, out
    assert "Traceback" not in out


def test_idle_replica_unloads_and_loads_again(
    start_server: Callable[..., ServerProcess],
) -> None:
    srv = start_server(
        config='[[deployments]]\nid = "lazy"\nmax_num_seqs = 1\nn_ctx = 256\nn_threads = 1\n'
        "idle_unload_s = 1\n"
    )
    with httpx.Client(base_url=srv.url, timeout=120.0) as c:
        rep = describe(c, "lazy")["replicas"][0]
        assert rep["state"] == "unloaded" and rep["pid"] is None  # loads on first request
        # Looked at once its stream has begun (200 tokens to go): an idle replica may
        # unload a second after a request ends, which a loaded machine can take to
        # answer the next GET after a short request.
        long = {"prompt": COUNTING, "max_tokens": 200, "ignore_eos": True}
        with c.stream("POST", "/v1/deployments/lazy/predictWithResponseStream", json=long) as r:
            assert r.status_code == 200
            assert any(line.startswith("data: ") for line in r.iter_lines())
            rep = describe(c, "lazy")["replicas"][0]
            assert rep["state"] == "ready" and isinstance(rep["pid"], int)
        pid = rep["pid"]
        rep = wait_until(
            lambda: (d := describe(c, "lazy")["replicas"][0])["state"] == "unloaded" and d,
            "the idle replica to unload",
        )
        assert rep["pid"] is None
        wait_until(lambda: process_gone(pid), f"replica process {pid} to exit")  # not leaked
        r = c.post("/v1/deployments/lazy/predict", json={"prompt": COUNTING, "max_tokens": 4})
        assert r.status_code == 200, r.text
