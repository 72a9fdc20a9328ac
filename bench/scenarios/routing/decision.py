"""What the gateway's routing decision costs, timed in-process: the gateway exposes no
timing of it, so it is measured here, before any server starts, on synthetic state."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from .workload import REPLICAS, percentile


def decision_cost(iterations: int, slots: int) -> dict[str, Any]:
    """What routing a 300-token prompt costs in the gateway, in microseconds: the chain,
    the index lookups over 2 replicas' slots (blocks held, sequences continued), the
    views, the routing history's recall and record, and ``CacheAware.choose``."""
    from tokenmill.gateway.prefix import PrefixIndex
    from tokenmill.gateway.routing import ReplicaView, RouteQuery
    from tokenmill.gateway.routing.cache_aware import CacheAware
    from tokenmill.gateway.routing.history import RouteHistory
    from tokenmill.kvblocks import BLOCK_TOKENS, chain

    rng = random.Random(26)
    system = [rng.randrange(49_000) for _ in range(250)]
    index = PrefixIndex()
    for replica in range(REPLICAS):
        held = [chain(system + [rng.randrange(49_000) for _ in range(250)]) for _ in range(slots)]
        index.reset(replica, held)
    prompt = system + [rng.randrange(49_000) for _ in range(50)]
    policy = CacheAware()
    history = RouteHistory()  # the session memory the deployment keeps beside it
    samples: list[float] = []
    for k in range(iterations):
        began = time.perf_counter()
        names = chain(prompt)
        blocks = index.cached_blocks(names)
        continued = index.continued(names, blocks)
        views = [
            ReplicaView(
                index=r,
                serving=True,
                slots=slots,
                in_flight=(k + r) % 4,
                cached_tokens=blocks.get(r, 0) * BLOCK_TOKENS,
                continues=r in continued,
                prefill_s=1e-3,
                decode_s=2e-2,
                generated=32.0,
                last_used=float(k),
            )
            for r in range(REPLICAS)
        ]
        query = history.recall(
            RouteQuery(prompt_tokens=len(prompt), max_tokens=32, session=f"s{k % 64}")
        )
        history.record(query, policy.choose(views, query))
        samples.append(time.perf_counter() - began)
    micro = [s * 1e6 for s in samples]
    return {
        "iterations": iterations,
        "prompt_tokens": len(prompt),
        "p50_us": round(statistics.median(micro), 1),
        "p99_us": round(percentile(micro, 0.99) or 0.0, 1),
    }
