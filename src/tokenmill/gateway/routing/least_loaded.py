"""``least_loaded``: the serving replica with the fewest requests in flight.

Among replicas with room for the request first, then the fewest in flight, then the
least recently used (so that idle replicas take turns). Blind to caches and speeds:
tokenmill's routing before ``cache_aware``, kept as the reference it is measured
against.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.gateway.routing import Decision, ReplicaView, RouteQuery, RoutingName


class LeastLoaded:
    name: RoutingName = "least_loaded"

    def choose(self, replicas: Sequence[ReplicaView], query: RouteQuery) -> Decision:
        serving = [r for r in replicas if r.serving]
        if not serving:
            raise ValueError("no serving replica to route to")
        best = min(serving, key=lambda r: (r.free < query.weight, r.in_flight, r.last_used))
        return Decision(best.index, "least_loaded", best.cached_tokens, tier=best.cached_tier)
