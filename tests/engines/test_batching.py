"""Continuous batching through the whole gateway: many streams share one model."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import ServerProcess
from tests.ledger.helpers import receipt
from tests.sse import events
from tests.waiting import HANG_S, wait_until

CHAT = "/v1/chat/completions"


def ask(url: str, content: str, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    r = httpx.post(url + CHAT, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def text_of(r: dict[str, Any]) -> str:
    return str(r["choices"][0]["message"]["content"])


TOPICS = [
    "the sea",
    "a red fox",
    "winter",
    "bread",
    "trains",
    "the moon",
    "chess",
    "rain",
    "a lighthouse",
    "honey",
    "volcanoes",
    "a violin",
    "deserts",
    "owls",
    "paper",
    "tea",
]


# 32 requests on 16 slots: half of them queue. A generous queue timeout keeps a slow
# shared machine from turning the test into one about admission.
QUEUED = "queue_timeout_s = 600\n"


def batched_and_solo(url: str, **extra: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    prompts = [f"Write one sentence about {TOPICS[i % 16]} (#{i})." for i in range(32)]
    solo = [ask(url, prompts[i], **extra) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        batched = list(pool.map(lambda i: ask(url, prompts[i], **extra), range(32)))
    return solo, batched


def test_batched_equals_solo_and_32_streams_stay_separate(
    start_server: Callable[..., ServerProcess],
) -> None:
    # A KV stream per slot (16 x 2,048 cells): llama.cpp computes each sequence's
    # attention alone, bit for bit the same whatever runs beside it.
    server = start_server(
        config=f'[[deployments]]\nid = "smollm2"\nkv_layout = "per_slot"\n{QUEUED}'
    )
    solo, batched = batched_and_solo(server.url)
    # Greedy decoding is deterministic, so any token crossing between sequences, or
    # any sampling state shared between them, would change some answer.
    for i, (alone, among) in enumerate(zip(solo, batched, strict=True)):
        assert text_of(among) == text_of(alone), f"request {i} differs when batched"
    assert len({text_of(r) for r in batched}) >= 16


# How far apart two tokens' log probabilities may be and still swap places between
# batch shapes on the shared pool. A sequence's cells sit among other sequences' there,
# attention runs over them in another layout, and its sums round differently. Where a
# sequence's cells start in the pool moves how llama.cpp's CPU attention groups them
# into tiles (prefill) and chunks (one token a step), so even the prompt's first token
# may drift: 0.18 nats on the top tokens of one prompt computed 170 cells further in
# (raw llama.cpp, one thread); logprobs drifted up to 0.22 in 32 answers of 24 tokens
# seen here. Tokens crossing between sequences, or a prefix copied wrong, part answers
# where the model is sure (a state copy into the pool once moved a first token's
# logprob by 2 nats).
NEAR_TIE = 0.5


def first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x["token"] != y["token"]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_on_the_shared_pool_batched_differs_from_solo_only_at_near_ties(
    start_server: Callable[..., ServerProcess],
) -> None:
    # The default: 16 slots share one pool (n_ctx the model's 8,192), so a
    # sequence's cells sit among others' and attention sums over them in another
    # order: a greedy answer may take the other of two tokens that nearly tie, as
    # on llama-server's unified KV, and nowhere else.
    server = start_server(config=f'[[deployments]]\nid = "smollm2"\n{QUEUED}')
    solo, batched = batched_and_solo(server.url, logprobs=True, top_logprobs=2)
    for i, (alone, among) in enumerate(zip(solo, batched, strict=True)):
        a = alone["choices"][0]["logprobs"]["content"]
        b = among["choices"][0]["logprobs"]["content"]
        at = first_difference(a, b)
        if at is None:
            continue
        for run in (a, b):
            if at == len(run):  # this run ended here (its end of text, not listed)
                continue
            top = run[at]["top_logprobs"]
            assert len(top) == 2, run[at]
            gap = top[0]["logprob"] - top[1]["logprob"]
            assert gap <= NEAR_TIE, (i, at, run[at])
    assert len({text_of(r) for r in batched}) >= 16


def test_prefix_cache_hit_is_reported(server: ServerProcess) -> None:
    system = "You are a careful assistant who answers in one short sentence. " * 4
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0}
    first = httpx.post(server.url + CHAT, json=body, timeout=60).json()
    msgs2 = [msgs[0], {"role": "user", "content": "Name a tree."}]
    second = httpx.post(server.url + CHAT, json={**body, "messages": msgs2}, timeout=60).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 40, second["usage"]
    assert cached < second["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] > 40


# A long shared prefix that the answer must read: the list can only be repeated from
# the cached keys and values of the prefix. (Exact token equality with an uncached run
# is not a property of llama.cpp: a prefix computed in another batch differs in the
# last bits, which can flip a near-tie between two tokens.)
WORDS = "apple, river, candle, mountain, violin, copper, forest, lantern, pepper, harbour"
PREFIX = f"Here is a list of words: {WORDS}.\n" * 6


def test_prefix_reused_from_another_slot(start_server: Callable[..., ServerProcess]) -> None:
    """Cached prefixes move between slots: parked when their slot is retaken, and
    copied from a slot that is still running."""
    config = '[[deployments]]\nid = "smollm2"\nmax_num_seqs = 4\n'
    repeat = {"prompt": PREFIX + "Repeat the list: apple,", "max_tokens": 12, "temperature": 0}
    # No max_tokens and no end-of-sequence: the story fills the rest of its slot's
    # window (some 1,900 tokens), far beyond the 12 tokens of the request that runs
    # beside it. That it was still running when that request completed is asserted
    # below, not assumed: it is closed only then, and its receipt says "abort".
    story = {"prompt": PREFIX + "Now write a long story.", "stream": True, "ignore_eos": True}

    def complete(url: str) -> tuple[str, int]:
        r = httpx.post(url + "/v1/completions", json=repeat, timeout=HANG_S)
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def while_a_story_runs(url: str, story_id: str) -> tuple[str, int]:
        with httpx.Client(base_url=url, timeout=HANG_S) as c:
            headers = {"x-request-id": story_id}
            with c.stream("POST", "/v1/completions", json=story, headers=headers) as running:
                stream = events(running)  # one iterator: dropping it closes the stream
                assert isinstance(next(stream), dict)  # the story has its slot
                out = complete(url)
                after = next(stream)
                assert isinstance(after, dict) and "error" not in after, after
            # The client left only after the other request had completed; had the
            # story ended before, nothing would have been left to abort.
            got = receipt(c, story_id)
        assert got["finish_reason"] == "abort", got
        return out

    x = start_server(config=config)
    reference, cached = complete(x.url)  # the first request: nothing cached
    assert cached == 0
    assert reference.startswith(" river, candle, mountain"), reference
    one = httpx.post(x.url + "/v1/completions", json={**repeat, "max_tokens": 1}, timeout=HANG_S)
    n_prompt = one.json()["usage"]["prompt_tokens"]
    # The story takes the slot the list was cached in (it shares the prefix); the
    # cached request is parked in another slot and found there in full.
    parked, cached = while_a_story_runs(x.url, "story-parks-the-list")
    assert cached == n_prompt - 1
    assert parked.startswith(" river, candle, mountain"), parked

    # On a fresh server only the running story's slot holds the prefix: it is copied.
    y = start_server(config=config)
    copied, cached = while_a_story_runs(y.url, "story-lends-its-prefix")
    assert n_prompt - 12 < cached < n_prompt - 1
    assert copied.startswith(" river, candle, mountain"), copied


def test_abort_mid_batch_frees_the_slot(start_server: Callable[..., ServerProcess]) -> None:
    # No queue: the third request is refused unless the aborted stream's slot came back.
    srv = start_server(config='[[deployments]]\nid = "smollm2"\nmax_num_seqs = 2\nmax_queue = 0\n')
    long_body = {
        "prompt": "Tell a long story.",
        "max_tokens": 1000,
        "stream": True,
        "seed": 1,
        "ignore_eos": True,
    }

    def in_flight(c: httpx.Client) -> int:
        return int(c.get("/v1/deployments/smollm2").json()["in_flight"])

    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=long_body) as r1:
            stream1 = events(r1)  # one iterator: dropping it would close the stream
            assert isinstance(next(stream1), dict)
            with c.stream("POST", "/v1/completions", json=long_body) as r2:
                stream2 = events(r2)
                assert isinstance(next(stream2), dict)  # both stream, in one batch
                assert in_flight(c) == 2
            # r2 closed mid-stream: the gateway sees the disconnect, aborts it in the
            # engine and returns its slot; then a new request gets that slot.
            wait_until(lambda: in_flight(c) == 1, "the aborted stream's slot to come back")
            r3 = ask(srv.url, "Say hi.", max_tokens=4)
            assert r3["usage"]["completion_tokens"] >= 1
            assert in_flight(c) == 1
            assert isinstance(next(stream1), dict)  # r1 still runs
        wait_until(lambda: in_flight(c) == 0, "the last stream's slot to come back")
