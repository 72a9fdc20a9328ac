"""Generation guarantees through the real HTTP API and the real model."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServerProcess
from tests.ledger.helpers import receipt
from tests.sse import events, to_done
from tests.sse import text as event_text
from tests.waiting import HANG_S, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def stream_completion(http: httpx.Client, body: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Return the text chunks and the usage of a streamed completion."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    texts: list[str] = []
    usage: dict[str, Any] = {}
    with http.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        for event in to_done(r):
            assert "error" not in event, event
            if event["choices"]:
                texts.append(event["choices"][0]["text"])
            else:
                usage = event["usage"]
    return texts, usage


def complete(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


PROMPTS = ["Once upon a time", "The recipe needs", "def fib(n):", "Dear Sir,", "1, 2, 3,", "Hello"]


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=st.sampled_from(PROMPTS),
    max_tokens=st.integers(min_value=1, max_value=24),
    seed=st.integers(min_value=0, max_value=2**31),
    temperature=st.sampled_from([0.0, 0.7, 1.5]),
    stream=st.booleans(),
)
def test_max_tokens_is_a_hard_limit(
    http: httpx.Client, prompt: str, max_tokens: int, seed: int, temperature: float, stream: bool
) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "temperature": temperature}
    if stream:
        _, usage = stream_completion(http, body)
    else:
        out = complete(http, body)
        usage = out["usage"]
        reason = out["choices"][0]["finish_reason"]
        assert reason == ("length" if usage["completion_tokens"] == max_tokens else "stop")
    assert 0 <= usage["completion_tokens"] <= max_tokens


def test_length_and_stop_finish_reasons(http: httpx.Client) -> None:
    # ignore_eos: the model cannot end the answer before max_tokens.
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    out = complete(http, body)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    r = http.post(
        CHAT,
        json={
            "messages": [{"role": "user", "content": "Say yes."}],
            "max_tokens": 200,
            "temperature": 0,
        },
    )
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 200


def test_stop_string_spanning_tokens_is_never_returned(http: httpx.Client) -> None:
    base = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    full = complete(http, base)["choices"][0]["text"]
    assert len(full) > 40
    # A stop string that starts mid-token and spans several tokens.
    stop = full[13:27]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks, _usage = stream_completion(http, {**base, "stop": [stop]})
            text = "".join(chunks)
            assert len([c for c in chunks if c]) > 1
            assert all(stop not in c for c in chunks)
        else:
            out = complete(http, {**base, "stop": stop})
            text = out["choices"][0]["text"]
            assert out["choices"][0]["finish_reason"] == "stop"
        assert text == expected
    # Several stop strings: the earliest wins; text before it is never lost.
    later = full[30:36]
    out = complete(http, {**base, "stop": [later, stop]})
    assert out["choices"][0]["text"] == expected


def test_seed_reproduces_and_greedy_is_deterministic(http: httpx.Client) -> None:
    body = {"prompt": "My favourite animal is", "max_tokens": 20, "temperature": 1.0, "seed": 42}
    a = complete(http, body)["choices"][0]["text"]
    b = complete(http, body)["choices"][0]["text"]
    c, _ = stream_completion(http, body)
    assert a == b == "".join(c)
    others = {complete(http, {**body, "seed": s})["choices"][0]["text"] for s in range(1, 5)}
    assert len(others | {a}) > 1, "different seeds should not all give the same text"
    greedy = {"prompt": "My favourite animal is", "max_tokens": 20, "temperature": 0}
    assert (
        complete(http, greedy)["choices"][0]["text"] == complete(http, greedy)["choices"][0]["text"]
    )


def test_utf8_never_broken_across_chunks(http: httpx.Client) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "Translate to Japanese: Good morning, how are you?"}
        ],
        "max_tokens": 40,
        "temperature": 0,
    }
    full = http.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    assert any(ord(ch) > 0x3000 for ch in full), full  # the model wrote CJK text
    parts: list[str] = []
    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        raw = b""
        for chunk in r.iter_bytes():
            raw += chunk
        for line in raw.decode("utf-8").splitlines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                parts.append(delta.get("content") or "")
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == full
    # Cut in the middle of multi-byte characters: still valid text, nothing replaced.
    for n in range(1, 12):
        text = http.post(CHAT, json={**body, "max_tokens": n}).json()["choices"][0]["message"][
            "content"
        ]
        assert "\ufffd" not in text
        assert full.startswith(text)


def test_eight_concurrent_streams_all_complete(server: ServerProcess) -> None:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=120) as c:
                chunks, usage = stream_completion(
                    c, {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "seed": i}
                )
                assert usage["completion_tokens"] > 0
                results[i] = "".join(chunks)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 8 and all(results.values())


def test_disconnect_stops_generation(server: ServerProcess, http: httpx.Client) -> None:
    max_tokens = 1500
    body = {
        "prompt": "Write a very long story.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 1.0,
        "seed": 3,
    }
    received = 0
    with (
        httpx.Client(base_url=server.url, timeout=HANG_S) as c,
        c.stream("POST", COMPLETIONS, json=body) as r,
    ):
        request_id = r.headers["x-request-id"]
        for event in events(r):
            if event_text(event):
                received += 1
                if received >= 5:
                    break
    # The connection is closed now: the gateway aborts the generation and settles the
    # tokens the engine really produced, counted when it stopped. How many more than
    # the client read depends on how fast the machine runs each side; that nothing
    # runs once the abort arrives is ordered by events in test_request_lifecycle.py.
    got = receipt(http, request_id)
    assert got["finish_reason"] == "abort"
    assert received <= got["completion_tokens"] < max_tokens, got
    wait_until(
        lambda: http.get("/v1/deployments/smollm2").json()["in_flight"] == 0,
        "the aborted request's slot to come back",
    )
