"""Several choices per request (``n``) and several prompts per completion, over HTTP.

One metered gateway holds the llama.cpp model in a replica process and in the
gateway's own process, and an upstream proxy. The oracle for a choice is the same
request with ``n: 1``: choice ``i`` of a request with ``seed`` s is what a single
request with seed ``s + i`` gives, token for token, which also shows that the
prompt a choice copies from its leader's KV cache is the prompt. The oracle for
usage is the single request's own usage.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess, launch
from tests.ledger.helpers import (
    ENV,
    PRICE,
    account,
    admin,
    charge_for,
    expected_charge,
    new_account,
    new_key,
    receipt,
    user,
)
from tests.server.test_bad_input import assert_error
from tests.sse import events, to_done
from tests.waiting import wait_until

SLOTS = 4
CONFIG = f"""
[[deployments]]
id = "smollm2"
max_num_seqs = {SLOTS}
n_ctx = 512
n_threads = 1

[deployments.price]
prompt_per_mtok = {PRICE.prompt_per_mtok}
completion_per_mtok = {PRICE.completion_per_mtok}

[[deployments]]
id = "inproc"
isolated = false
max_num_seqs = {SLOTS}
n_ctx = 512
n_threads = 1

[[deployments]]
id = "upstream"
engine = "upstream"
url = "http://127.0.0.1:9/v1"
"""
MODELS = ["smollm2", "inproc"]
ASK = [{"role": "user", "content": "Name a colour and a fruit."}]
PROMPTS = ["The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("choices"), config=CONFIG, env=ENV)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def key(gw: ServerProcess) -> str:
    with admin(gw.url) as adm:
        _, secret = new_key(adm, new_account(adm, "choices", 10**9))
    return secret


@pytest.fixture
def http(gw: ServerProcess, key: str) -> Iterator[httpx.Client]:
    with user(gw.url, key) as client:
        yield client


@pytest.fixture
def client(gw: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def tokens_of(choice: Any) -> int:
    """A chat choice's completion tokens: one logprobs entry each (no stop strings)."""
    return len(choice.logprobs.content)


@pytest.mark.parametrize("model", MODELS)
def test_n_choices_are_the_single_requests_with_seed_plus_i(
    client: openai.OpenAI, model: str
) -> None:
    args: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 11,
        "logprobs": True,
    }
    many = client.chat.completions.create(n=3, **args)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(**{**args, "seed": 11 + i}) for i in range(3)]
    for choice, single in zip(many.choices, singles, strict=True):
        assert choice.message.content == single.choices[0].message.content
        assert choice.finish_reason == single.choices[0].finish_reason
    # Sampled with temperature 1, three choices are not all the same text.
    assert len({c.message.content for c in many.choices}) > 1
    # One usage: the prompt once, the completions of every choice.
    assert many.usage is not None and singles[0].usage is not None
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(tokens_of(c) for c in many.choices)


@pytest.mark.parametrize("model", MODELS)
def test_streamed_choices_reassemble_to_the_whole_body(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = {
        "model": model,
        "messages": ASK,
        "max_tokens": 10,
        "temperature": 0.8,
        "seed": 5,
        "n": 3,
    }
    whole = client.chat.completions.create(**args)
    texts = ["", "", ""]
    reasons: dict[int, list[str]] = {0: [], 1: [], 2: []}
    usages = []
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args
    ):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                reasons[c.index].append(c.finish_reason)
    assert texts == [c.message.content for c in whole.choices]
    # Each choice ends exactly once, with its own reason.
    assert reasons == {c.index: [c.finish_reason] for c in whole.choices}
    assert len(usages) == 1 and usages[0] == whole.usage


@pytest.mark.parametrize("model", MODELS)
def test_several_prompts_give_a_choice_each_in_order(http: httpx.Client, model: str) -> None:
    base = {"model": model, "max_tokens": 6, "temperature": 0}
    singles = [ok(http.post("/v1/completions", json={**base, "prompt": p})) for p in PROMPTS]
    both = ok(http.post("/v1/completions", json={**base, "prompt": PROMPTS, "n": 2}))
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in both["choices"]]
    # Greedy: both choices of a prompt are that prompt's single completion.
    expect = [s["choices"][0]["text"] for s in singles]
    assert texts == [expect[0], expect[0], expect[1], expect[1]]
    prompt_tokens = [s["usage"]["prompt_tokens"] for s in singles]
    assert both["usage"]["prompt_tokens"] == sum(prompt_tokens)
    assert both["usage"]["completion_tokens"] == 2 * sum(
        s["usage"]["completion_tokens"] for s in singles
    )
    # The same prompts as token-id lists give the same choices.
    ids = [
        ok(http.post("/tokenize", json={"model": model, "prompt": p}))["tokens"] for p in PROMPTS
    ]
    by_ids = ok(http.post("/v1/completions", json={**base, "prompt": ids, "n": 2}))
    assert [c["text"] for c in by_ids["choices"]] == texts
    # (What the prefix cache served differs: the prompts were just computed.)
    for count in ("prompt_tokens", "completion_tokens"):
        assert by_ids["usage"][count] == both["usage"][count]


def test_several_prompts_stream_and_echo_each_its_own(http: httpx.Client) -> None:
    body = {
        "model": "smollm2",
        "prompt": PROMPTS,
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    whole = ok(http.post("/v1/completions", json=body))
    for prompt, choice in zip(PROMPTS, whole["choices"], strict=True):
        assert choice["text"].startswith(prompt)
        # The echoed prompt's first token has no log probability, the rest do.
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert all(x is not None for x in choice["logprobs"]["token_logprobs"][1:])
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        got = to_done(r)
    texts = ["", ""]
    for event in got:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in whole["choices"]]


def test_a_request_is_held_and_billed_for_all_its_choices(gw: ServerProcess) -> None:
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 5, "temperature": 1, "seed": 3}
    with admin(gw.url) as adm:
        rich = new_account(adm, "rich", 10**9)
        _, secret = new_key(adm, rich)
        with user(gw.url, secret) as u:
            resp = u.post("/v1/chat/completions", json={**body, "n": 3})
            r = ok(resp)
            got = receipt(u, resp.headers["x-request-id"])
        assert got["prompt_tokens"] == r["usage"]["prompt_tokens"]
        assert got["completion_tokens"] == r["usage"]["completion_tokens"]
        assert got["charged"] == expected_charge(got)
        # Credit for one choice's max_tokens, not for three: n=3 is refused before any
        # token (402), n=1 goes through.
        prompt = r["usage"]["prompt_tokens"]
        poor = new_account(adm, "poor", charge_for(prompt, 5))
        _, secret = new_key(adm, poor)
        with user(gw.url, secret) as u:
            assert_error(u.post("/v1/chat/completions", json={**body, "n": 3}), 402)
            assert account(adm, poor)["balance"] == charge_for(prompt, 5)
            ok(u.post("/v1/chat/completions", json=body))


@pytest.mark.parametrize("model", MODELS)
def test_leaving_stops_every_choice_and_frees_every_slot(
    http: httpx.Client, gw: ServerProcess, model: str
) -> None:
    body = {
        "model": model,
        "messages": ASK,
        "max_tokens": 400,
        "ignore_eos": True,
        "n": SLOTS,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        rid = resp.headers["x-request-id"]
        stream = events(resp)
        seen = [next(stream) for _ in range(SLOTS + 3)]  # the role frames, then text
        assert all(isinstance(e, dict) and "error" not in e for e in seen), seen
    r = receipt(http, rid)
    assert r["finish_reason"] == "abort"
    assert 1 <= r["completion_tokens"] < SLOTS * 400

    def idle() -> bool:
        d = ok(http.get(f"/v1/deployments/{model}"))
        return bool(d["in_flight"] == 0 and d["queued"] == 0)

    wait_until(idle, f"{model}'s slots to be free again")
    # And the slots serve again: a request taking all of them completes.
    again = ok(http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}))
    assert len(again["choices"]) == SLOTS


def test_a_request_for_every_slot_waits_its_turn(http: httpx.Client, gw: ServerProcess) -> None:
    long = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    wide = {"model": "smollm2", "messages": ASK, "max_tokens": 3, "n": SLOTS}
    result: dict[str, httpx.Response] = {}
    with http.stream("POST", "/v1/chat/completions", json=long) as resp:
        stream = events(resp)
        next(stream)
        # One slot is busy: the request for all four queues instead of failing.
        worker = threading.Thread(
            target=lambda: result.setdefault("r", http.post("/v1/chat/completions", json=wide))
        )
        worker.start()
        wait_until(
            lambda: ok(http.get("/v1/deployments/smollm2"))["queued"] == 1,
            "the wide request to queue",
        )
        assert "r" not in result
    # The long stream left: its slot frees and the wide request runs.
    worker.join()
    assert len(ok(result["r"])["choices"]) == SLOTS


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": "smollm2", "messages": ASK, "n": 0}, "n"),
        ("/v1/chat/completions", {"model": "smollm2", "messages": ASK, "n": 129}, "n"),
        # More choices than a replica has slots can never run: 400, not a wait.
        ("/v1/chat/completions", {"model": "smollm2", "messages": ASK, "n": SLOTS + 1}, "n"),
        ("/v1/completions", {"model": "smollm2", "prompt": PROMPTS * 3}, "n"),
        ("/v1/completions", {"model": "smollm2", "prompt": PROMPTS, "n": 3}, "n"),
        ("/v1/completions", {"model": "smollm2", "prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"model": "smollm2", "prompt": [[1, 2], []]}, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": ["hi", "x " * 600]}, "max_tokens"),
        ("/v1/completions", {"model": "smollm2", "prompt": ["a"] * 129}, "prompt"),
        ("/v1/chat/completions", {"model": "upstream", "messages": ASK, "n": 2}, "n"),
        ("/v1/completions", {"model": "upstream", "prompt": PROMPTS}, "prompt"),
    ],
)
def test_bad_choices_are_refused_by_name(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    err = assert_error(http.post(path, json={"max_tokens": 2, **body}), 400, param)
    assert err["type"] == "invalid_request_error"


def test_best_of_equal_to_n_is_n(http: httpx.Client) -> None:
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "n": 2, "best_of": 2}
    assert len(ok(http.post("/v1/completions", json=body))["choices"]) == 2
