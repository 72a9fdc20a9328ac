"""A shared host: busy loops on every core beside the server.

A replica picks its thread count by measuring its own steps (the thread tuner,
docs/deployments.md#shared-hosts): with busy loops on every core, a stream keeps going
and the replica moves to fewer threads. How fast it then serves, beside llama.cpp's own
``llama-server`` on the same loops, is a benchmark's question, not a test's: the
``versus`` scenario's shared-host rows (``make bench``; docs/benchmarks.md#shared-hosts).
"""

from __future__ import annotations

import httpx

from tests.conftest import ServerProcess
from tests.sse import events
from tests.waiting import wait_until
from tokenmill.bench import busy_loops
from tokenmill.engines.llamacpp.threads import available_cpus


def test_a_replica_moves_to_fewer_threads_when_busy_loops_share_its_cores(
    server: ServerProcess,
) -> None:
    def threads() -> int:
        replica = httpx.get(f"{server.url}/v1/deployments/smollm2", timeout=30).json()
        return int(replica["replicas"][0]["threads"])

    body = {"prompt": "Tell a very long story.", "max_tokens": 1500, "ignore_eos": True}
    with (
        busy_loops(available_cpus()),
        httpx.Client(base_url=server.url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        stream = events(r)  # one iterator: dropping it would close the stream
        next(stream)
        # The tuner measures its steps while the stream runs, and takes fewer threads.
        wait_until(lambda: threads() < available_cpus(), "the replica to use fewer threads")
        assert next(stream)  # still streaming
