"""A replica that autoscaling removes hands what it caches to the one that stays: the
real model, two process replicas of one slot at most, scaled by the load.

Ordered by what the test holds: a long story streams on replica 0 (its only slot) for
as long as the test reads it, so a second request waits, which is two requests for
one replica's target: replica 1 starts and serves it. That request done, one is
running: one replica is enough, and the idle one goes, after handing the
conversation it served to replica 0. Its next turn then finds its history there.
Asserted on the request log, the describe and the cached tokens the API reports,
never on times.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, launch
from tests.gateway.test_tier_routing import complete
from tests.sse import events
from tests.waiting import HANG_S, wait_until

DOC = (
    "Notes for a museum guide. The salt roads of the Sahara and the caravans that "
    "crossed them, in three paragraphs. "
) * 6
STORY = "Notes for a museum guide. The lighthouses of the northern coast. A long story:"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(
        tmp_path_factory.mktemp("autoscale-handoff"),
        config="""
[[deployments]]
id = "notes"
placement = "process"
n_threads = 1
max_num_seqs = 1
n_ctx = 1024
kv_host_bytes = 67108864

[deployments.autoscale]
min_replicas = 1
max_replicas = 2
target_ongoing_requests = 1
upscale_delay_s = 0
downscale_delay_s = 0
look_back_s = 0.01
""",
    )
    yield srv
    srv.stop()


def describe(gw: ServerProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{gw.url}/v1/deployments/notes", timeout=HANG_S).json())


def test_a_replica_that_goes_hands_its_conversation_to_the_one_that_stays(
    gw: ServerProcess,
) -> None:
    opening = DOC + "Question: who led the caravans? Answer:"
    story = {"model": "notes", "prompt": STORY, "stream": True, "max_tokens": 900}
    story |= {"temperature": 0, "ignore_eos": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_S) as c,
        c.stream("POST", "/v1/completions", json=story) as running,
    ):
        stream = events(running)  # one iterator: dropping it closes the stream
        assert isinstance(next(stream), dict)  # the story holds replica 0's slot
        first, line = complete(gw, opening, max_tokens=8)
        assert line["route"]["replica"] == 1, line["route"]
        # One request running now: replica 1, idle, goes, handing its cache over.

        def gone() -> dict[str, Any] | None:
            d = describe(gw)
            phases = [(r["phase"], r["state"]) for r in d["replicas"]]
            return d if phases == [("active", "ready"), ("off", "unloaded")] else None

        after = wait_until(gone, "replica 1 to be drained and stopped")
    assert after["kv_moves"]["handed_off"] >= 1, after["kv_moves"]
    assert [(e["replicas_from"], e["replicas_to"]) for e in after["autoscale"]["events"]] == [
        (1, 2),
        (2, 1),
    ]
    assert "handed 1 of its 1 cached sequence(s)" in gw.log()

    following = opening + first["choices"][0]["text"] + " And then"
    body, line = complete(gw, following)
    route = line["route"]
    assert (route["replica"], route["continues"]) == (0, True), route
    # Found, not recomputed: the whole first turn came from what replica 1 handed over.
    assert (
        body["usage"]["prompt_tokens_details"]["cached_tokens"] >= (first["usage"]["prompt_tokens"])
    ), body["usage"]
