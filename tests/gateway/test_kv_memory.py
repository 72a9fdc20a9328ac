"""A replica's KV memory as an operator sees it: parking through a real server.

More open conversations than slots (three on ``max_num_seqs = 2``): a slot given to
another conversation parks what it held in the host tier, and that conversation's
next turn gets it back. Through real HTTP with the real model, every second turn
reports its whole first-turn prompt cached, and ``GET /v1/deployments/{id}``'s
``replicas[].kv`` and ``/metrics``' ``tokenmill_kv_*`` series show the parks, hits
and restores, within the configured bytes (docs/operations.md#kv-memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, launch
from tests.waiting import HANG_S, wait_until

DEP = "chat"
HOST_BYTES = 256 << 20  # room for every conversation here (SmolLM2: 23,040 B a token)
TOPICS = [
    "Tell me about the lighthouses of the Breton coast, their keepers and their lamps, "
    "and why so many of them were built on rocks far out at sea.",
    "Explain how glaciers carve valleys, what moraines are, and how a glacier that "
    "melts away leaves lakes and boulders behind it across the landscape.",
    "Describe a beekeeper's year: spring inspections, swarming, the honey harvest in "
    "summer, and how a colony survives the winter inside its hive.",
]
FOLLOW_UP = "Thanks. What is the single most surprising fact about that?"
# The Prometheus series of a replica's kv stats (docs/operations.md#kv-memory), by key.
SERIES = {
    **{
        key: f"tokenmill_kv_{key}"
        for key in ("pool_tokens", "pool_used_tokens", "host_bytes", "host_capacity_bytes")
    },
    "host_entries": "tokenmill_kv_host_entries",
    **{
        key: f"tokenmill_kv_{key}_total"
        for key in (
            "host_parks",
            "host_hits",
            "host_restores",
            "host_evictions",
            "preemptions",
            "span_trims",
            "exports",
            "imports",
            "spec_drafted",
            "spec_accepted",
        )
    },
}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # Two slots for three conversations: parking is forced. One thread on a small
    # shared machine. The host tier alone: its series are what this test compares
    # with /metrics (the disk tier's, on by default, are test_disk_tier.py's).
    srv = launch(
        tmp_path_factory.mktemp("kv-memory"),
        config=f"""
[[deployments]]
id = "{DEP}"
placement = "process"
n_threads = 1
max_num_seqs = 2
n_ctx = 1024
kv_host_bytes = {HOST_BYTES}
kv_disk_dir = ""
""",
    )
    yield srv
    srv.stop()


def turn(client: httpx.Client, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = client.post(
        "/v1/chat/completions",
        json={"model": DEP, "messages": messages, "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def replica_kv(client: httpx.Client) -> dict[str, int]:
    r = client.get(f"/v1/deployments/{DEP}")
    assert r.status_code == 200, r.text
    (replica,) = r.json()["replicas"]
    return dict(replica.get("kv") or {})


def kv_metrics(client: httpx.Client) -> dict[str, float]:
    """This deployment's replica 0 ``tokenmill_kv_*`` samples, by sample name."""
    r = client.get("/metrics")
    assert r.status_code == 200
    labels = {"deployment": DEP, "replica": "0"}
    return {
        s.name: s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name.startswith("tokenmill_kv_") and s.labels == labels
    }


def test_parked_conversations_come_back_cached_and_the_tier_is_reported(
    gw: ServerProcess,
) -> None:
    with httpx.Client(base_url=gw.url, timeout=HANG_S) as client:
        capacity = wait_until(
            lambda: replica_kv(client).get("host_capacity_bytes"), "the replica's kv stats"
        )
        assert capacity == HOST_BYTES
        chats = [[{"role": "user", "content": topic}] for topic in TOPICS]
        firsts = []
        for messages in chats:
            body = turn(client, messages)
            firsts.append(body["usage"]["prompt_tokens"])
            answer = body["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": FOLLOW_UP},
            ]
        for messages, first in zip(chats, firsts, strict=True):
            usage = turn(client, messages)["usage"]
            # Its whole first turn, from a slot or restored from host memory.
            assert usage["prompt_tokens_details"]["cached_tokens"] >= first, (usage, first)

        # The replica pushes its status a moment after each step: wait for it to show
        # what the turns did, and for /metrics to agree with it.
        def restored() -> dict[str, int] | None:
            kv = replica_kv(client)
            return kv if kv["host_restores"] > 0 else None

        kv = wait_until(restored, "the replica's kv stats to show a restore")
        assert kv["host_parks"] > 0 and kv["host_hits"] > 0
        assert kv["host_restored_tokens"] > 0
        assert 0 < kv["host_bytes"] <= kv["host_capacity_bytes"] == HOST_BYTES
        assert kv["host_entries"] > 0 and kv["host_swapped"] == 0
        assert kv["n_ctx"] == 1024 and kv["pool_tokens"] >= 2 * 1024

        def agreed() -> dict[str, float] | None:
            kv, metrics = replica_kv(client), kv_metrics(client)
            wanted = {series: float(kv[key]) for key, series in SERIES.items()}
            return metrics if metrics == wanted else None

        metrics = wait_until(agreed, "/metrics to show the replica's kv stats")
        for key in ("host_parks", "host_hits", "host_restores", "host_bytes"):
            assert metrics[SERIES[key]] > 0, key
        bound = metrics[SERIES["host_capacity_bytes"]]
        assert metrics[SERIES["host_bytes"]] <= bound == HOST_BYTES
