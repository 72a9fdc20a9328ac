"""Log probabilities over HTTP with the openai SDK: chat and completions, streamed or not."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.server.test_bad_input import assert_error
from tests.sse import to_done


@pytest.fixture(scope="module")
def server(stable_server: ServerProcess) -> ServerProcess:
    """Streamed log probabilities are compared with the whole body's token for token:
    the KV-stream-a-slot server (conftest.stable_server)."""
    return stable_server


ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The three primary colours are"


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def chat(client: openai.OpenAI, stream: bool, **extra: Any) -> tuple[str, list[Any], Any]:
    """(content, logprobs content entries, usage) of one greedy chat completion."""
    args: dict[str, Any] = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        **extra,
    }
    if not stream:
        r = client.chat.completions.create(**args)
        assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
        return r.choices[0].message.content or "", r.choices[0].logprobs.content, r.usage
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text, entries = "", list[Any]()
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            if c.choices[0].logprobs is not None:
                entries += c.choices[0].logprobs.content or []
    return text, entries, chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_greedy_tokens(client: openai.OpenAI, stream: bool) -> None:
    text, entries, usage = chat(client, stream)
    assert usage.completion_tokens == len(entries) == 10  # no stop: every token reported
    assert "".join(e.token for e in entries) == text
    for e in entries:
        assert math.isfinite(e.logprob) and e.logprob <= 0
        assert e.bytes is not None and bytes(e.bytes).decode(errors="replace") == e.token
        assert len(e.top_logprobs) == 5
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert all(math.isfinite(t) and t <= 0 for t in tops)
        # Temperature 0: the sampled token is the most likely one, and first among them.
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)


def test_streamed_logprobs_equal_the_whole_body(client: openai.OpenAI) -> None:
    # Both compared answers find the prompt cached (test_tools.warm says why).
    chat(client, False, max_tokens=1)
    whole_text, whole, _ = chat(client, False)
    streamed_text, streamed, _ = chat(client, True)
    assert streamed_text == whole_text
    assert [e.token for e in streamed] == [e.token for e in whole]
    for a, b in zip(streamed, whole, strict=True):
        # Another batch may compute the logits in another order: the last bits differ.
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_top_logprobs_zero_gives_the_tokens_alone(client: openai.OpenAI) -> None:
    _, entries, _ = chat(client, False, top_logprobs=0, max_tokens=3)
    assert len(entries) == 3 and all(e.top_logprobs == [] for e in entries)


def test_without_logprobs_there_are_none(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    assert r.choices[0].logprobs is None


def completion(http: httpx.Client, stream: bool, **extra: Any) -> tuple[str, dict[str, list[Any]]]:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3, **extra}
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        got = to_done(r)
    text = ""
    merged: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for e in got:
        choice = e["choices"][0]
        text += choice["text"]
        for key in merged:
            merged[key] += (choice["logprobs"] or {}).get(key, [])
    return text, merged


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(http: httpx.Client, stream: bool) -> None:
    text, lp = completion(http, stream)
    tokens = lp["tokens"]
    assert len(tokens) == 12 and "".join(tokens) == text
    for token, logprob, top, offset in zip(
        tokens, lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True
    ):
        assert math.isfinite(logprob) and logprob <= 0
        assert text[offset : offset + len(token)] == token
        # The sampled token is always there, beside up to 3 others; greedy: the best.
        assert top[token] == pytest.approx(logprob) and len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)


def test_tokens_a_stop_string_swallows_go_with_it(http: httpx.Client) -> None:
    _, lp = completion(http, False)
    tokens = lp["tokens"]
    # Stop at the start of the 5th token: the first 4 are the whole answer.
    at_boundary = "".join(tokens[4:7])
    stopped, lp_stopped = completion(http, False, stop=[at_boundary])
    assert stopped == "".join(tokens[:4]) and lp_stopped["tokens"] == tokens[:4]
    # Stop inside the 6th token: its head is returned; the token is not, its text being
    # cut. The stream agrees with the body.
    inside = tokens[5][1:] + tokens[6]
    assert inside and inside not in "".join(tokens[:5]) + tokens[5][:1]
    stopped, lp_stopped = completion(http, False, stop=[inside])
    assert stopped == "".join(tokens[:5]) + tokens[5][:1]
    assert lp_stopped["tokens"] == tokens[:5]
    assert completion(http, True, stop=[inside]) == (stopped, lp_stopped)


def test_predict_takes_either_shape(http: httpx.Client) -> None:
    # ignore_eos: two tokens whatever is sampled (an end of text as the second token
    # made the answer one token long: seen once in make test).
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 2, "ignore_eos": True}
    r = http.post("/v1/deployments/smollm2/predict", json={**body, "endpoint_type": "completion"})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 2
    body |= {"logprobs": True, "top_logprobs": 2, "endpoint_type": "chat"}
    r = http.post("/v1/deployments/smollm2/predict", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_logprobs_requests(
    http: httpx.Client, path: str, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": ASK, "prompt": PROMPT, "max_tokens": 1, **extra}
    assert_error(http.post(path, json=body), 400, param)
