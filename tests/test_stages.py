"""The first token's stages (tokenmill.stages): every mark recorded, in causal order.

Over HTTP against the real gateway with a process replica: the stages of a streamed
chat are in its log line and in ``tokenmill_first_token_stage_seconds``. Durations are
never compared with a bound; that each is at least 0 says the marks, taken in two
processes on one monotonic clock, follow the order the request met them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess
from tests.sse import text, to_done
from tests.waiting import wait_until
from tokenmill.stages import STAGE_NAMES, STAGES, durations

BODY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300.0) as client:
        yield client


def stage_counts(http: httpx.Client) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "tokenmill_first_token_stage_seconds":
            for s in family.samples:
                if s.name.endswith("_count"):
                    out[s.labels["stage"]] = s.value
    return out


def test_a_streamed_chat_logs_every_stage_in_order(
    server: ServerProcess, http: httpx.Client
) -> None:
    before = stage_counts(http)
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        assert "".join(text(e) for e in to_done(r))

    line = wait_until(lambda: server.request_line(request_id), "the request's log line")
    stages = line["stages_ms"]
    # A process replica shares the host's clock: every stage, replica ones included.
    assert list(stages) == list(STAGE_NAMES)
    negative = {name: ms for name, ms in stages.items() if ms < 0}
    assert not negative, f"marks out of order: {negative}"

    after = stage_counts(http)
    counted = {name: after.get(name, 0) - before.get(name, 0) for name in STAGE_NAMES}
    # Every stage of every request that ended meanwhile: this one, and on the shared
    # server maybe another test's that was still ending (seen under load: 2 each).
    assert min(counted.values()) >= 1 and len(set(counted.values())) == 1, counted


def test_a_refused_request_has_no_stages(server: ServerProcess, http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={**BODY, "max_tokens": 10**6})
    assert r.status_code == 400
    request_id = r.headers["x-request-id"]
    line = wait_until(lambda: server.request_line(request_id), "the request's log line")
    assert line["status"] == "rejected" and line["stages_ms"] is None


def test_stages_chain_mark_to_mark() -> None:
    # Each stage starts where the one before it ended: together they cover the way.
    for (_, _, end), (_, start, _) in itertools.pairwise(STAGES):
        assert end == start
    marks = {mark: float(i) for i, mark in enumerate([STAGES[0][1], *(s[2] for s in STAGES)])}
    assert durations(marks) == {name: 1.0 for name in STAGE_NAMES}
    del marks["queued"]  # a replica on another host's clock sends none of its marks
    assert "to_replica" not in durations(marks) and "engine_queue" not in durations(marks)
