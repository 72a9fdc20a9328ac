"""``round_robin``: each serving replica in turn (those with room for the request,
when any has), whatever their caches, loads and speeds. The turn is the caller's to
remember (``RouteQuery.last_index``, :mod:`.history`)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.gateway.routing import (
    Decision,
    ReplicaView,
    RouteQuery,
    RoutingName,
    candidates,
)


class RoundRobin:
    name: RoutingName = "round_robin"

    def choose(self, replicas: Sequence[ReplicaView], query: RouteQuery) -> Decision:
        pool = candidates(replicas, query.weight)
        # The first candidate after the last chosen index, wrapping round.
        after = [r for r in pool if r.index > query.last_index]
        best = min(after or pool, key=lambda r: r.index)
        return Decision(best.index, "round_robin", best.cached_tokens, tier=best.cached_tier)
