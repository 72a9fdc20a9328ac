"""The end-of-sequence token is a completion token: counted, billed and reported.

A model that ends its answer generates an end-of-sequence token. As vLLM and
llama-server do, tokenmill counts it in ``completion_tokens`` (so in the receipt, the
metrics and the engine's ``tokens_generated``) and gives it a ``logprobs`` entry (its
special text, ``<|im_end|>`` for SmolLM2), but never writes it into the text.

The oracle for "the answer ended on its end-of-sequence token" is the model's own
greedy answer (``finish_reason: stop`` with no stop string); for the token's text,
``/tokenizer_info``'s ``eos_token``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.ledger.helpers import (
    ENV,
    PRICE,
    admin,
    expected_charge,
    new_account,
    new_key,
    receipt,
    user,
)
from tests.sse import to_done
from tests.waiting import wait_until

ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
# Room for the whole answer: it ends on its own, well before this.
ROOM = 200
CONFIG = f"""
[[deployments]]
id = "smollm2"
n_ctx = 1024
n_threads = 1
# Answers with less room are compared with the whole one token for token.
kv_layout = "per_slot"

[deployments.price]
prompt_per_mtok = {PRICE.prompt_per_mtok}
completion_per_mtok = {PRICE.completion_per_mtok}
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("eos"), config=CONFIG, env=ENV)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def adm(gw: ServerProcess) -> Iterator[httpx.Client]:
    with admin(gw.url) as client:
        yield client


@pytest.fixture(scope="module")
def http(gw: ServerProcess, adm: httpx.Client) -> Iterator[httpx.Client]:
    """A client with an account's key (every request gets a receipt)."""
    _, key = new_key(adm, new_account(adm, "eos", 10**9))
    with user(gw.url, key) as client:
        yield client


@pytest.fixture(scope="module")
def eos(http: httpx.Client) -> str:
    info = http.get("/tokenizer_info", params={"model": "smollm2"})
    assert info.status_code == 200, info.text
    text: str = info.json()["eos_token"]
    return text


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(response body, request id) of one request, streamed or not, as one body: a
    stream's frames are merged (text and logprobs in order, its finish and usage)."""
    body = {"model": "smollm2", "temperature": 0, **body}
    if not body.get("stream"):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json(), r.headers["x-request-id"]
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        frames, rid = to_done(r), r.headers["x-request-id"]
    choice: dict[str, Any] = {"text": "", "finish_reason": None}
    entries: list[Any] = []
    merged: dict[str, list[Any]] = {}
    for frame in frames[:-1]:
        (c,) = frame["choices"]
        choice["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
        choice["finish_reason"] = c["finish_reason"] or choice["finish_reason"]
        if c["logprobs"] is not None:
            if "content" in c["logprobs"]:
                entries += c["logprobs"]["content"]
            else:
                for key, values in c["logprobs"].items():
                    merged.setdefault(key, []).extend(values)
    choice["logprobs"] = {"content": entries} if "messages" in body else merged
    choice["message"] = {"content": choice["text"]}
    return {"choices": [choice], "usage": frames[-1]["usage"]}, rid


def chat(http: httpx.Client, stream: bool, **extra: Any) -> tuple[dict[str, Any], str]:
    body = {"messages": ASK, "max_tokens": ROOM, "logprobs": True, "top_logprobs": 3}
    return post(http, "/v1/chat/completions", {**body, "stream": stream, **extra})


def engine_tokens(adm: httpx.Client) -> int:
    d = adm.get("/v1/deployments/smollm2").json()
    return sum(r["tokens_generated"] for r in d["replicas"])


def metric_tokens(adm: httpx.Client) -> float:
    for line in adm.get("/metrics").text.splitlines():
        if line.startswith('tokenmill_generation_tokens_total{deployment="smollm2"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_ends_counts_and_reports_its_end_of_sequence_token(
    http: httpx.Client, eos: str, stream: bool
) -> None:
    body, rid = chat(http, stream)
    (choice,) = body["choices"]
    entries, text = choice["logprobs"]["content"], choice["message"]["content"]
    assert choice["finish_reason"] == "stop"  # no stop string: the model ended it
    usage = body["usage"]
    # One entry a counted token, the last of them the end of the answer...
    assert usage["completion_tokens"] == len(entries) < ROOM
    last = entries[-1]
    assert last["token"] == eos and last["bytes"] == list(eos.encode())
    assert math.isfinite(last["logprob"]) and last["logprob"] <= 0
    # ... greedy: the likeliest token, with its alternatives.
    assert len(last["top_logprobs"]) == 3 and last["top_logprobs"][0]["token"] == eos
    assert last["top_logprobs"][0]["logprob"] == last["logprob"]
    # Never text: the answer is the other tokens' text, all of it.
    assert eos not in text and "".join(e["token"] for e in entries[:-1]) == text
    # Billed as counted.
    r = receipt(http, rid)
    assert (r["prompt_tokens"], r["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert r["charged"] == expected_charge(r)


def test_an_end_of_sequence_token_at_max_tokens_is_the_last_token(
    http: httpx.Client, eos: str
) -> None:
    whole, _ = chat(http, False)
    n = whole["usage"]["completion_tokens"]
    # Room for exactly the answer: it still ends on its own, every token counted.
    exact, _ = chat(http, False, max_tokens=n)
    assert exact["choices"][0]["finish_reason"] == "stop"
    assert exact["usage"]["completion_tokens"] == n
    assert exact["choices"][0]["message"] == whole["choices"][0]["message"]
    # One less: cut before its end, and nothing past max_tokens.
    cut, _ = chat(http, False, max_tokens=n - 1)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == n - 1
    entries = cut["choices"][0]["logprobs"]["content"]
    assert len(entries) == n - 1 and eos not in [e["token"] for e in entries]
    # ignore_eos: the end-of-sequence token is just a token, and generation goes on.
    on, _ = chat(http, False, max_tokens=n + 2, ignore_eos=True)
    assert on["choices"][0]["finish_reason"] == "length"
    assert on["usage"]["completion_tokens"] == n + 2


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_one_with_echo_reads_the_end_of_sequence_token(
    http: httpx.Client, eos: str, stream: bool
) -> None:
    # lm-evaluation-harness's log-likelihood request: it drops the last entry as the
    # generated token, so there must be one whatever that token is.
    answer, _ = chat(http, False)
    template = http.post("/tokenize", json={"model": "smollm2", "messages": ASK}).json()
    rendered = http.post("/detokenize", json={"model": "smollm2", **template}).json()
    prompt = rendered["prompt"] + answer["choices"][0]["message"]["content"]
    ids = http.post("/tokenize", json={"model": "smollm2", "prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "stream": stream}
    got, rid = post(http, "/v1/completions", body)
    (choice,) = got["choices"]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and choice["text"] == prompt
    assert len(lp["tokens"]) == len(ids) + 1 and lp["tokens"][-1] == eos
    assert lp["token_logprobs"][0] is None and math.isfinite(lp["token_logprobs"][-1])
    assert lp["top_logprobs"][-1] == {eos: lp["token_logprobs"][-1]}
    assert lp["text_offset"][-1] == len(prompt)
    assert got["usage"]["completion_tokens"] == 1
    assert receipt(http, rid)["completion_tokens"] == 1


def agreed_counts(adm: httpx.Client) -> tuple[int, float]:
    """(engine's count, gateway's metric) once they agree: the replica process
    publishes its count a moment after each step."""

    def agreed() -> tuple[int, float] | None:
        engine, metric = engine_tokens(adm), metric_tokens(adm)
        return (engine, metric) if engine == metric else None

    return wait_until(agreed, "the engine's token count to agree with the metric")


def test_the_engine_and_the_metrics_count_it(
    http: httpx.Client, adm: httpx.Client, eos: str
) -> None:
    before, before_metric = agreed_counts(adm)
    body, rid = chat(http, False, n=2, temperature=0.8, seed=7)
    usage, choices = body["usage"], body["choices"]
    ended = [c for c in choices if c["finish_reason"] == "stop"]
    assert ended and all(c["logprobs"]["content"][-1]["token"] == eos for c in ended)
    assert usage["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices)
    assert receipt(http, rid)["completion_tokens"] == usage["completion_tokens"]
    assert agreed_counts(adm) == (
        before + usage["completion_tokens"],
        before_metric + usage["completion_tokens"],
    )
