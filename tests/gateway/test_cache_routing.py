"""Cache-aware routing end to end: 2 real process replicas, multi-turn chats.

Ten-minute support chats share a long system prompt; each later turn re-sends the
whole conversation. Routed by load alone, a later turn often lands on the replica
that does not hold its conversation and finds only the system prompt cached. Routed
by ``cache_aware``, every later turn finds its whole earlier prompt cached: asserted
on the cached token counts the API reports, never on times.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.waiting import HANG_S, wait_until

SYSTEM = (
    "You are the support assistant of Velo Works, a bicycle shop. Answer in one short "
    "sentence. Name the part involved. Never promise a repair date. Our workshop is "
    "open Monday to Saturday, nine to six; tune-ups take a day, wheel builds three. "
    "We stock chains, cassettes, brake pads, tyres, tubes, saddles, pedals and lights "
    "for road, gravel, city and mountain bikes, and we service e-bike motors of the "
    "two main brands. Warranty repairs need the receipt. Loan bikes are free during "
    "repairs longer than a day. Prices: tune-up 60, brake bleed 35, wheel true 20, "
    "chain fitting 10 plus the chain. We never sell used parts."
)
# Each conversation's own messages: long enough that its history, not its load,
# decides where it is cheapest to continue.
TOPICS = [
    "My chain keeps slipping on the largest cog whenever I climb out of the saddle, "
    "even though the chain and the cassette were both replaced last spring",
    "The front brake lever goes almost all the way to the bar before the hydraulic "
    "brake bites, and it got worse after a long descent in the rain last weekend",
    "There is a clicking sound from the bottom bracket on every pedal stroke, only "
    "when I push hard, and it stops completely when I am coasting downhill",
]
FOLLOW_UPS = [
    "Thanks. Can you tell me which part you would check first, and why that one?",
    "And if that part is fine, what would be the next thing to look at, please?",
]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One thread per replica on a small shared machine; slots enough that a few
    # conversations at once never make the load badly imbalanced.
    srv = launch(
        tmp_path_factory.mktemp("cache-routing"),
        config="""
[[deployments]]
id = "support"
replicas = 2
placement = "process"
n_threads = 1
max_num_seqs = 8
n_ctx = 2048
""",
    )
    yield srv
    srv.stop()


def turn(client: httpx.Client, messages: list[dict[str, str]]) -> tuple[dict[str, Any], str]:
    """The response, and the request id its log line has."""
    r = client.post(
        "/v1/chat/completions",
        json={"model": "support", "messages": messages, "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return dict(r.json()), r.headers["x-request-id"]


def conversation(gw: ServerProcess, topic: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Three turns; each turn's response and its log line."""
    out = []
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": topic}]
    with httpx.Client(base_url=gw.url, timeout=HANG_S) as client:
        for follow_up in [*FOLLOW_UPS, None]:
            body, rid = turn(client, messages)
            line = wait_until(partial(gw.request_line, rid), "the request's log line")
            out.append((body, line))
            if follow_up is None:
                break
            answer = body["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": follow_up},
            ]
    return out


def check_later_turns_found_their_history(
    turns: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    for (before, _), (body, line) in itertools.pairwise(turns):
        usage = body["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # The whole earlier prompt (and more: its answer) was cached where it went.
        assert cached >= before["usage"]["prompt_tokens"], (cached, usage, line["route"])
        route = line["route"]
        assert route["reason"] == "cache"
        # The index saw the turn continue what one slot holds whole (its parked answer
        # and the next turn's warm-up), not only share its start.
        assert route["continues"] is True, route
        assert route["cached_tokens"] >= before["usage"]["prompt_tokens"] // 16 * 16
        assert route["cached_tokens"] == 16 * route["cached_blocks"] <= cached


def test_one_conversation_at_a_time_stays_with_its_cache(gw: ServerProcess) -> None:
    for topic in TOPICS:
        turns = conversation(gw, topic)
        check_later_turns_found_their_history(turns)
        replicas = {line["route"]["replica"] for _, line in turns}
        assert len(replicas) == 1, [line["route"] for _, line in turns]
    # A new conversation found the system prompt only as the start of another one's.
    _, first = turns[0]
    assert first["route"]["continues"] is False, first["route"]


def test_a_few_conversations_at_once_each_find_their_history(gw: ServerProcess) -> None:
    topics = [f"{t} (again, on my second bike)" for t in TOPICS]
    with ThreadPoolExecutor(len(topics)) as pool:
        runs = list(pool.map(lambda t: conversation(gw, t), topics))
    for turns in runs:
        check_later_turns_found_their_history(turns)


def test_routing_is_counted_in_metrics(gw: ServerProcess) -> None:
    text = httpx.get(f"{gw.url}/metrics", timeout=HANG_S).text
    decisions = [
        line
        for line in text.splitlines()
        if line.startswith("tokenmill_routing_decisions_total{") and 'reason="cache"' in line
    ]
    assert decisions and all(float(line.rsplit(" ", 1)[1]) > 0 for line in decisions)
    hits = [
        line for line in text.splitlines() if line.startswith("tokenmill_cache_hit_tokens_total{")
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in hits) > 0
