"""Routing that sees the replicas' host-memory tiers: 2 real process replicas of one
slot each, more conversations than slots.

Each replica parks what its only slot held when the slot goes to another
conversation, and publishes the parked sequence as one more chain of its cache
(:mod:`tokenmill.kvblocks`). A conversation's next turn then goes back to the replica
that parked its history, and finds it cached (restored from host memory), where
routing by slots alone would see nothing cached anywhere and send it to the least
recently used replica. Asserted on the route log field and the cached tokens the API
reports, never on times.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.sse import events
from tests.waiting import HANG_S, wait_until

# Unrelated prompts, sent as plain completions (a chat template would give every
# conversation the same default system prompt): only a conversation's own history
# can be cached for it.
OPENINGS = {
    "a": "Notes for a museum guide. The lighthouses of the northern coast and their keepers",
    "b": "Notes for a museum guide. The glaciers of the Alps and how fast they are retreating",
    "c": "Notes for a museum guide. Beekeeping on city rooftops and what the bees eat there",
    "d": "Notes for a museum guide. The violin makers of Cremona and the wood they choose",
}
OPENINGS = {k: f"{v}, in three paragraphs. " * 3 for k, v in OPENINGS.items()}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(
        tmp_path_factory.mktemp("tier-routing"),
        config="""
[[deployments]]
id = "notes"
replicas = 2
placement = "process"
n_threads = 1
max_num_seqs = 1
n_ctx = 1024
kv_host_bytes = 67108864
""",
    )
    yield srv
    srv.stop()


def complete(
    gw: ServerProcess, prompt: str, max_tokens: int = 8, model: str = "notes"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One completion: the response and its log line."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    line = wait_until(partial(gw.request_line, r.headers["x-request-id"]), "the log line")
    return r.json(), line


def host_hits_at_least(gw: ServerProcess, n: int) -> list[dict[str, Any]] | None:
    """The deployment's replicas once their host-tier hits add up to ``n``."""
    replicas: list[dict[str, Any]] = httpx.get(
        f"{gw.url}/v1/deployments/notes", timeout=HANG_S
    ).json()["replicas"]
    return replicas if sum(r["kv"].get("host_hits", 0) for r in replicas) >= n else None


def test_each_next_turn_goes_back_to_the_replica_that_holds_its_history(
    gw: ServerProcess,
) -> None:
    first = {k: complete(gw, OPENINGS[k]) for k in "abcd"}
    home = {k: line["route"]["replica"] for k, (_, line) in first.items()}
    # What each replica's only slot holds: the last conversation it served. Four
    # conversations on two slots: at least two were parked in host memory.
    in_slot = {home[k]: k for k in "abcd"}
    tiers = []
    for k in "abcd":
        before = first[k][0]
        prompt = OPENINGS[k] + before["choices"][0]["text"] + " The next paragraph says"
        body, line = complete(gw, prompt)
        route = line["route"]
        tier = "slot" if in_slot[home[k]] == k else "host"
        # Home, wherever its history is, and the index said where.
        assert route["replica"] == home[k], (k, route, home)
        assert (route["reason"], route["continues"], route["tier"]) == ("cache", True, tier)
        prompt_before = before["usage"]["prompt_tokens"]
        assert route["cached_tokens"] >= prompt_before // 16 * 16, route
        # Found, not recomputed: the replica reports the whole first turn cached.
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prompt_before, (k, cached, body["usage"], route)
        in_slot[home[k]] = k
        tiers.append(tier)
    assert tiers.count("host") >= 2, tiers

    # The replicas' counters reach the gateway in their status pushes (every 0.25 s,
    # runner.STATUS_INTERVAL_S): the last restore may not be in the describe yet.
    wait_until(partial(host_hits_at_least, gw, 2), "two host-tier hits in the describe")
    # Counted by tier: every host-tier decision of the log is in the metrics.
    metrics = httpx.get(f"{gw.url}/metrics", timeout=HANG_S).text
    from_host = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tokenmill_routing_decisions_total{") and 'tier="host"' in line
    ]
    assert sum(from_host) == tiers.count("host"), metrics


def test_a_busy_homes_history_moves_with_the_next_turn(gw: ServerProcess) -> None:
    """The conversation's home is busy (its only slot runs a story that shares the
    conversation's document, which parked the conversation there); the next turn goes
    to the other replica, and its history moves with it instead of being computed
    again: the route says from where, and the answer reports it cached."""
    busy_home_moves(gw, "notes", via="gateway")  # process replicas: through the gateway


def busy_home_moves(gw: ServerProcess, model: str, via: str) -> None:
    """The scenario above, on deployment ``model`` of 2 replicas of one slot each
    (process replicas here; Ray actors in tests/replicas/test_ray.py), the state
    moved ``via`` the gateway or a link of the replicas' own."""
    doc = (
        "Notes for a museum guide. The salt roads of the Sahara and the caravans "
        "that crossed them, in three paragraphs. "
    ) * 6
    opening = doc + "Question: who led the caravans? Answer:"
    first, line = complete(gw, opening, max_tokens=48, model=model)
    home = line["route"]["replica"]
    story = {"model": model, "prompt": doc + "Now a long story about it:", "stream": True}
    story |= {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_S) as c,
        c.stream("POST", "/v1/completions", json=story) as running,
    ):
        stream = events(running)  # one iterator: dropping it closes the stream
        assert isinstance(next(stream), dict)  # the story runs
        following = opening + first["choices"][0]["text"] + " And then"
        body, line = complete(gw, following, model=model)
        story_id = running.headers["x-request-id"]
    # (The story's line is logged once it ended: the client left.)
    story_line = wait_until(partial(gw.request_line, story_id), "the story's log line")
    assert story_line["route"]["replica"] == home  # its document was cached there
    route = line["route"]
    assert route["replica"] != home, route
    assert (route["moved_from"], route["moved"], route["continues"]) == (home, "moved", True)
    prompt_before = first["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_before, body
    dep = httpx.get(f"{gw.url}/v1/deployments/{model}", timeout=HANG_S).json()
    assert dep["kv_moves"]["moved"] >= 1 and dep["kv_moves"]["bytes"] > 0, dep["kv_moves"]
    assert dep["kv_moves"]["via"] == {via: dep["kv_moves"]["moved"]}, dep["kv_moves"]
    metrics = httpx.get(f"{gw.url}/metrics", timeout=HANG_S).text
    moved = [
        float(m.rsplit(" ", 1)[1])
        for m in metrics.splitlines()
        if m.startswith(f'tokenmill_kv_moved_bytes_total{{deployment="{model}"}}')
    ]
    assert moved == [dep["kv_moves"]["bytes"]], metrics
