"""KV state moved between a deployment's replicas, as routing decided.

When ``cache_aware`` sends a request to a replica other than the one holding the
most of its prompt, and moving that state costs less than computing it, the
decision names the donor (:attr:`~tokenmill.gateway.routing.Decision.move_from`).
:class:`KvMoves` carries it out before the request is dispatched: the donor exports
the sequence (from a slot, its host-memory tier or its disk tier), the target
imports it as a parked sequence, and the target's placement then restores it for
the request, computing only the rest. Between two replicas with a
:class:`~tokenmill.replicas.host.KvLink` of one kind (Ray actors: the object store)
the state goes that way, and the gateway only passes a reference on; otherwise both
hops go through the gateway's replica connections (a process replica's socket), the
state as a raw blob. ``via`` counts the moves made each way.

A move never fails a request: a donor that no longer holds the prefix, a target that
refuses the state (no room, another model), an error or a move slower than its
budget (the time computing the moved tokens would take) leaves the target to compute
the prompt, as without a move. The measured seconds a moved token costs feed the
next decisions (:attr:`~tokenmill.gateway.routing.ReplicaView.move_s`).

:meth:`KvMoves.fetch` carries out routing's decision for a request;
:meth:`KvMoves.hand_off` moves what a replica that is about to stop holds to those
that stay (autoscaling down: :meth:`~tokenmill.gateway.replicaset.ReplicaSet.remove`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tokenmill import stages
from tokenmill.gateway.prefix import PrefixIndex
from tokenmill.gateway.replicaset import Replica
from tokenmill.gateway.routing import Decision
from tokenmill.gateway.routing.cache_aware import MOVE_MIN_TOKENS, PREFILL_S
from tokenmill.kvblocks import chain
from tokenmill.replicas import ReplicaHost

__all__ = ["HAND_OFF_MAX", "MOVE_BUDGET_MIN_S", "KvMoves", "MoveOutcome"]

log = logging.getLogger("tokenmill.gateway")

# The least a move may take before it is given up, whatever computing would cost.
MOVE_BUDGET_MIN_S = 0.5
# Weight of the newest move in the measured seconds a token (a moving average).
ALPHA = 0.2
# A replica that stops hands at most this many of its cached sequences to the others.
HAND_OFF_MAX = 64

# moved: the target holds the state; missing: the donor no longer held the prefix;
# refused: the target did not take it; failed: an error or past the budget.
MoveOutcome = Literal["moved", "missing", "refused", "failed"]


@dataclass
class KvMoves:
    """A deployment's moves: what they did, and their measured cost a token."""

    outcomes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("moved", "missing", "refused", "failed"), 0)
    )
    bytes_moved: int = 0
    tokens_moved: int = 0
    # Moves made, by the way the state went: "gateway", or a KvLink's kind.
    via: dict[str, int] = field(default_factory=dict)
    move_s: float | None = None  # measured seconds a moved token (None: none yet)
    # Sequences a replica about to stop handed to those that stay (autoscaling).
    handed_off: int = 0

    async def move(
        self,
        donor: ReplicaHost,
        target: ReplicaHost,
        prompt: Sequence[int],
        *,
        min_tokens: int,
        budget_s: float,
    ) -> MoveOutcome:
        """Move the donor's state of ``prompt``'s longest held prefix (at least
        ``min_tokens``) to ``target``, within ``budget_s`` (at least
        :data:`MOVE_BUDGET_MIN_S`)."""
        started = time.monotonic()
        stages.mark("move_start", started)  # a request's (tokenmill.tracing: its span)
        outcome: MoveOutcome
        size = n = 0
        sender, taker = donor.kv_link(), target.kv_link()
        if sender is None or taker is None or sender.kind != taker.kind:
            sender = taker = None
        way = "gateway" if sender is None else sender.kind
        try:
            async with asyncio.timeout(max(budget_s, MOVE_BUDGET_MIN_S)):
                if sender is not None and taker is not None:
                    parcel = await sender.export_kv(prompt, min_tokens)
                    if parcel is None:
                        outcome = "missing"
                    else:
                        size, n = parcel.nbytes, len(parcel.tokens)
                        outcome = "moved" if await taker.import_kv(parcel) else "refused"
                else:
                    state = await donor.export_kv(prompt, min_tokens)
                    if state is None:
                        outcome = "missing"
                    else:
                        size, n = len(state.state), len(state.tokens)
                        outcome = "moved" if await target.import_kv(state) else "refused"
        except Exception as e:  # (TimeoutError included) the target computes it
            log.warning(
                "moving a KV state between replicas (%s) failed (%s): computed instead", way, e
            )
            outcome = "failed"
        self.outcomes[outcome] += 1
        if outcome == "moved":
            self.via[way] = self.via.get(way, 0) + 1
            self.bytes_moved += size
            self.tokens_moved += n
            per_token = (time.monotonic() - started) / max(n, 1)
            last = self.move_s
            self.move_s = per_token if last is None else last + ALPHA * (per_token - last)
        stages.mark("move_end")
        return outcome

    async def fetch(
        self,
        decision: Decision,
        donor: Replica,
        target: Replica,
        prompt: Sequence[int],
        prefixes: PrefixIndex,
    ) -> Decision:
        """Carry out ``decision``'s move of ``prompt``'s cached state from ``donor`` to
        ``target``, the request's replica, before it is dispatched; the decision as it
        turned out (``moved``). Worth waiting for no longer than computing what it
        brings would take."""
        gain = decision.cached_tokens - prefixes.cached_tokens(chain(prompt)).get(target.index, 0)
        budget = gain * (target.speed.prefill_s or PREFILL_S)
        outcome = await self.move(
            donor.host, target.host, prompt, min_tokens=MOVE_MIN_TOKENS, budget_s=budget
        )
        return dataclasses.replace(decision, moved=outcome)

    async def hand_off(
        self,
        donor: Replica,
        staying: Sequence[Replica],
        prefixes: PrefixIndex,
        budget_s: float,
    ) -> int:
        """Move the sequences ``donor`` holds to the replicas that stay, before it
        stops: most recently used first, each to the one of ``staying`` that holds the
        least, for up to ``budget_s``. The number moved; none where the engines cannot
        move state."""
        staying = [r for r in staying if r.movable()]
        if not (staying and donor.movable()):
            return 0
        deadline = time.monotonic() + budget_s
        name = f"{donor.deployment_id}/{donor.index}"
        try:
            held = await donor.host.held_kv(MOVE_MIN_TOKENS)
        except Exception as e:  # it stops anyway: what it held is computed again
            log.warning("replica %s listed no KV state to hand off: %s", name, e)
            return 0
        moved = 0
        for tokens in held[:HAND_OFF_MAX]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            target = min(staying, key=lambda r: (prefixes.blocks(r.index), r.index))
            outcome = await self.move(
                donor.host, target.host, tokens, min_tokens=len(tokens), budget_s=left
            )
            if outcome == "moved":
                moved += 1
                self.handed_off += 1
        if held:
            log.info(
                "replica %s handed %d of its %d cached sequence(s) to the replicas that stay",
                name,
                moved,
                len(held),
            )
        return moved

    def describe(self) -> dict[str, object]:
        return {
            **self.outcomes,
            "bytes": self.bytes_moved,
            "handed_off": self.handed_off,
            "tokens": self.tokens_moved,
            "via": dict(self.via),
            "us_per_token": None if self.move_s is None else round(self.move_s * 1e6, 2),
        }
