"""``cache_aware``: the replica with the lowest expected time to first token.

For each serving replica with room for the request (every serving one if none has
room), the expected time to first token is one formula (as NVIDIA Dynamo's KV router
writes its cost)::

    expected_s = (prompt_tokens - cached_tokens) * prefill_s + in_flight * decode_s

the prompt tokens it would still have to compute at its measured prefill speed, plus
the work already on it: each stream running there shares every decode batch with the
new prompt, and costs it about one step of that stream (its measured seconds per
generated token). A replica not yet measured is assumed as fast as the measured
ones' average (:data:`PREFILL_S`, :data:`DECODE_S` before any is). Ties go to the
fewest in flight, then the least recently used.

Two exceptions, in this order:

* **Load wins when badly imbalanced** (SGLang's rule, in slots): when the replica
  chosen by the formula has more than :data:`IMBALANCE` of its slots busier than the
  least loaded candidate, the least loaded one is taken (``reason = "imbalance"``):
  the formula's queueing term is crude, and a hot prefix must not pile every request
  on one replica.
* **Session affinity when no cache is known**: when no candidate holds any block of
  the prompt (a short prompt, replicas that publish no cache) and the request names a
  session (``user`` or ``x-session-id``), the replica that served the session last is
  taken if it is a candidate and not badly imbalanced (``reason = "affinity"``).

Otherwise the reason is ``cache`` when the chosen replica holds some of the prompt,
``load`` when none does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenmill.gateway.routing import (
    Decision,
    Reason,
    ReplicaView,
    RouteQuery,
    RoutingName,
    candidates,
)

# Speeds assumed before any replica of the deployment is measured: SmolLM2-135M on
# one CPU thread, measured here (about 1 ms a prompt token, 20 ms a generated token).
# Only their ratio matters while every replica uses them.
PREFILL_S = 1e-3
DECODE_S = 2e-2
# Badly imbalanced: the formula's choice has this fraction of its slots more in
# flight than the least loaded candidate (4 of 16 slots at 0.25 would be too eager:
# a multi-turn chat's replica often runs several of its conversations at once).
IMBALANCE = 0.5
# Sessions remembered for affinity, the least recently routed forgotten first (an
# entry is ~150 bytes: 10k sessions cost ~1.5 MB a deployment).
SESSIONS_KEPT = 10_000


class CacheAware:
    name: RoutingName = "cache_aware"

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def choose(self, replicas: Sequence[ReplicaView], query: RouteQuery) -> Decision:
        pool = candidates(replicas, query.weight)
        prefill = _average([r.prefill_s for r in replicas], PREFILL_S)
        decode = _average([r.decode_s for r in replicas], DECODE_S)

        def expected_s(r: ReplicaView) -> float:
            uncached = max(query.prompt_tokens - r.cached_tokens, 0)
            return uncached * (r.prefill_s or prefill) + r.in_flight * (r.decode_s or decode)

        scores = {r.index: expected_s(r) for r in pool}
        best = min(pool, key=lambda r: (scores[r.index], r.in_flight, r.last_used))
        least = min(pool, key=lambda r: (r.in_flight, r.last_used))
        reason: Reason = "cache" if best.cached_tokens else "load"
        if _imbalanced(best, least):
            best, reason = least, "imbalance"
        elif not any(r.cached_tokens for r in pool) and query.session is not None:
            known = self._sessions.get(query.session)
            held = next((r for r in pool if r.index == known), None)
            if held is not None and not _imbalanced(held, least):
                best, reason = held, "affinity"
        if query.session is not None:
            self._sessions[query.session] = best.index
            self._sessions.move_to_end(query.session)
            if len(self._sessions) > SESSIONS_KEPT:
                self._sessions.popitem(last=False)
        return Decision(best.index, reason, best.cached_tokens, scores[best.index])


def _imbalanced(chosen: ReplicaView, least: ReplicaView) -> bool:
    return chosen.in_flight - least.in_flight > IMBALANCE * max(chosen.slots, 1)


def _average(values: list[float | None], default: float) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else default
