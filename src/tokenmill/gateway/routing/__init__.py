"""Which replica of a deployment serves a request: routing policies, pure and small.

A policy is handed an immutable picture of a deployment's replicas at the moment a
request is routed (:class:`ReplicaView`: serving or not, slots, requests in flight,
how much of this prompt each has cached, measured speeds) and the request
(:class:`RouteQuery`), and returns a :class:`Decision`. It never does I/O, never
awaits, never reads a clock, never touches a replica and keeps nothing between calls:
the deployment (:mod:`tokenmill.gateway.deployment`) builds the picture, counts the
decision and carries it out, and remembers what a later request needs of it (a
session's replica, round robin's turn: :mod:`.history`), which the query carries. That
is what lets each policy be tested on synthetic states, one call at a time.

Policies, one module each, chosen per deployment by ``routing`` (see :func:`policy`):

* ``cache_aware`` (the default, :mod:`.cache_aware`): the lowest expected time to
  first token, from the uncached part of the prompt, the work in flight and each
  replica's measured speeds; load wins when it is badly imbalanced;
* ``least_loaded`` (:mod:`.least_loaded`): the fewest requests in flight;
* ``round_robin`` (:mod:`.round_robin`): each replica in turn.

Every policy prefers a serving replica with ``weight`` free slots when one has them
(a request's choices run on one replica; ``cache_aware`` also weighs waiting for a
full replica that holds the request's history), and only chooses among serving ones;
the caller guarantees at least one is serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from tokenmill.gateway.prefix import Tier

RoutingName = Literal["cache_aware", "least_loaded", "round_robin"]
# Why a replica was chosen: the ``reason`` of the ``route`` log field and metric label.
Reason = Literal["cache", "load", "imbalance", "affinity", "least_loaded", "round_robin"]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as a policy sees it, at one instant."""

    index: int
    serving: bool
    slots: int
    in_flight: int
    # Leading tokens of this request's prompt the replica holds in its KV cache (whole
    # blocks only, see tokenmill.kvblocks); 0 for a replica that publishes no cache.
    cached_tokens: int = 0
    # Whether those blocks are the whole of what one of its slots holds: the prompt
    # continues that slot's sequence (a conversation's next turn), rather than sharing
    # only its first part with it (a system prompt other conversations share too).
    continues: bool = False
    # Where those tokens are: in a slot, or parked in the replica's host memory (a
    # restore first); None when nothing is cached.
    cached_tier: Tier | None = None
    # Measured seconds per prompt token computed, per generated token of one stream,
    # and tokens a stream generates (moving averages, see .speed); None until measured.
    prefill_s: float | None = None
    decode_s: float | None = None
    generated: float | None = None
    last_used: float = 0.0  # monotonic time it last took or ended a request
    # Whether its KV state can be moved to and from the deployment's other replicas
    # (an engine that exports and imports sequences, tokenmill.engines.KvMoving), and
    # the measured seconds a moved token costs (export, transfer, import; None until
    # measured).
    movable: bool = False
    move_s: float | None = None

    @property
    def free(self) -> int:
        return self.slots - self.in_flight


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What a policy knows of the request."""

    prompt_tokens: int = 0  # the prompt as tokenized (0: unknown)
    weight: int = 1  # slots it takes: its choices
    max_tokens: int = 0  # the most tokens a choice may generate (0: not given)
    # The ``user`` field or ``x-session-id`` header: an affinity hint.
    session: str | None = None
    # What the caller remembers (.history.RouteHistory.recall): the replica this
    # session was routed to last (None: none, or no session), and the replica any
    # request was routed to last (-1: none yet).
    session_home: int | None = None
    last_index: int = -1


@dataclass(frozen=True, slots=True)
class Decision:
    index: int  # the chosen replica's
    reason: Reason
    cached_tokens: int = 0  # of the prompt, on the chosen replica
    # The chosen replica's score, in seconds (cache_aware only).
    score_s: float | None = None
    # Whether the prompt continues a sequence the chosen replica holds whole (see
    # ReplicaView.continues); None for a policy that does not look.
    continues: bool | None = None
    # Where the chosen replica holds the cached tokens (ReplicaView.cached_tier); with
    # ``move_from``, where that replica holds them.
    tier: Tier | None = None
    # The replica whose cached state of the prompt the chosen one fetches before it
    # computes the rest (cache_aware only; None: nothing moves).
    move_from: int | None = None
    # How that move went, once the deployment carried it out (tokenmill.gateway.moves:
    # "moved", "missing", "refused" or "failed"; None: none was tried).
    moved: str | None = None


class RoutingPolicy(Protocol):
    """Chooses a replica: a pure function of the replicas and the query."""

    name: RoutingName

    def choose(self, replicas: Sequence[ReplicaView], query: RouteQuery) -> Decision:
        """The replica to send ``query`` to; ``replicas`` has at least one serving."""
        ...


def candidates(replicas: Sequence[ReplicaView], weight: int) -> list[ReplicaView]:
    """The serving replicas with ``weight`` free slots, or every serving one if none has."""
    serving = [r for r in replicas if r.serving]
    if not serving:
        raise ValueError("no serving replica to route to")
    roomy = [r for r in serving if r.free >= weight]
    return roomy or serving


def policy(name: RoutingName) -> RoutingPolicy:
    """A fresh policy by its configured name."""
    if name == "cache_aware":
        from tokenmill.gateway.routing.cache_aware import CacheAware

        return CacheAware()
    if name == "round_robin":
        from tokenmill.gateway.routing.round_robin import RoundRobin

        return RoundRobin()
    from tokenmill.gateway.routing.least_loaded import LeastLoaded

    return LeastLoaded()


__all__ = [
    "Decision",
    "Reason",
    "ReplicaView",
    "RouteQuery",
    "RoutingName",
    "RoutingPolicy",
    "Tier",
    "candidates",
    "policy",
]
