"""``cache_aware``: where the prompt is cached, and new conversations where load is light.

Every serving replica with room for the request (every serving one if none has room)
gets an expected time to first token, from its measured speeds (:mod:`.speed`)::

    ttft_s = (uncached + in_flight) * prefill_s  +  (decode_s / 2 if in_flight else 0)

the prompt tokens it would still have to compute; a batching engine computes them in
one step with one token of every stream running there, once the step under way (half
a step on average) has ended. Cached tokens parked in a replica's host memory rather
than held by a slot (``cached_tier == "host"``) are restored into a slot first, at
:data:`RESTORE_S` a token: hundreds of times cheaper than computing them, so a
conversation goes back to the replica that parked its history.

What happens next depends on what the request is to the replicas' caches (the index
knows it exactly, see :meth:`tokenmill.gateway.prefix.PrefixIndex.continued`):

* **It continues a sequence a replica holds whole** (``continues``: a conversation's
  next turn, an agent's next call with its growing context): the lowest ``ttft_s``
  wins. Its history is where it was last computed; moving it means computing the
  whole history again, so it stays unless load is badly imbalanced (below).
* **It starts a new sequence** (nothing cached, or only a part of what slots hold:
  the system prompt every conversation shares, a document other requests also
  asked about): where it goes is where its conversation will live, so the score also
  counts the work already running there, which the new stream shares every decode
  step with until it ends::

      score_s = ttft_s + in_flight * decode_s * horizon / 2

  each stream running there has about half its answer to go (``horizon`` tokens, the
  request's ``max_tokens`` or, if less or not given, what streams of this deployment
  generate on average). So new conversations spread over the replicas, the second
  replica pays once to compute a shared system prompt rather than leaving the first
  to carry every conversation, and a long shared prefix (an agent's 10k-token
  context) still outweighs a stream or two of load.

A replica not yet measured is assumed as fast as the measured ones' average
(:data:`PREFILL_S`, :data:`DECODE_S`, :data:`HORIZON` before any is). Ties go to the
fewest in flight, then the least recently used.

A full replica (no ``weight`` free slots) is a candidate only for a request that
continues a sequence it holds whole: its history's home. Sent there, the request
waits for a slot, which the score counts as ``wait_s``: the slots that must free
(``in_flight + weight - slots``), each after the answer's time split among the
replica's streams, ``horizon * decode_s / (slots + 1)`` (of ``slots`` answers under
way, the first ends after about 1 / (slots + 1) of one). So a conversation waits a
fraction of an answer for its home rather than recomputing its whole history on a
replica with room, unless the wait is the longer (a long answer to come, a deep
queue), or load is badly imbalanced (below).

**State moves when that beats computing it.** A replica that holds more of the
prompt than the one scored (``movable`` both, at least :data:`MOVE_MIN_TOKENS` more)
can send it: the score of that option counts the moved tokens at the measured
``move_s`` a token (:data:`MOVE_S` before any move is measured: export, transfer
through the gateway, import) plus :data:`RESTORE_S`, instead of computing them, and the
rest of the prompt at the slower of the two replicas' measured prefill speeds: a move
is chosen for room and load, never because the target measured faster (the estimates
swing with whatever else runs on a host, and moving 150 tokens to save a few ms of
noise is no gain). Each
candidate is scored with its better option; choosing a move sets the decision's
``move_from`` (the deployment fetches the state before it dispatches, and computes
the prompt if the move fails). So when its home is busy, a conversation goes where
there is room and takes its history with it.

Two exceptions, in this order:

* **Load wins when badly imbalanced** (SGLang's rule, in slots): when the chosen
  replica has more than :data:`IMBALANCE` of its slots busier than the least loaded
  candidate, the least loaded one is taken (``reason = "imbalance"``): a hot
  conversation or prefix must not pile every request on one replica.
* **Session affinity when no cache is known**: when no candidate holds any block of
  the prompt (a short prompt, replicas that publish no cache) and the request names a
  session (``user`` or ``x-session-id``), the replica that served the session last is
  taken if it is a candidate and not badly imbalanced (``reason = "affinity"``). The
  caller remembers which that was (``RouteQuery.session_home``, :mod:`.history`).

Otherwise the reason is ``cache`` when the chosen replica holds some of the prompt,
``load`` when none does. The decision's ``score_s`` is the chosen replica's score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
# Seconds to restore a parked token's KV state into a slot (llama_state_seq_set_data):
# 180 tokens of SmolLM2-135M in 0.7 ms, measured here.
RESTORE_S = 4e-6
# Seconds to read a token's KV state from a disk tier file, check it and restore it:
# 23 KB a token of SmolLM2-135M (page cache, SHA-256), about 20 us.
READ_S = 2e-5
# Seconds a token's KV state takes to move between replicas (export, the gateway's
# two hops, import) before one move is measured: SmolLM2-135M's 23 KB a token at
# about 0.5 GB/s.
MOVE_S = 5e-5
# The least a move must bring beyond what the target holds: below it, the round trips
# are not worth it.
MOVE_MIN_TOKENS = 128
# Tokens a stream is assumed to generate when neither the request (max_tokens) nor
# the deployment's measured streams say.
HORIZON = 64
# Badly imbalanced: the chosen replica has this fraction of its slots more in
# flight than the least loaded candidate (4 of 16 slots at 0.25 would be too eager:
# a multi-turn chat's replica often runs several of its conversations at once).
IMBALANCE = 0.5


# What a cached token costs before the rest of the prompt is computed, by its tier.
_LOAD_S = {"slot": 0.0, "host": RESTORE_S, "disk": READ_S}


class CacheAware:
    name: RoutingName = "cache_aware"

    def choose(self, replicas: Sequence[ReplicaView], query: RouteQuery) -> Decision:
        pool = candidates(replicas, query.weight)
        # A continuation may wait for its history's home, full or not (see above).
        pool += [r for r in replicas if r.serving and r.continues and r not in pool]
        prefill = _average([r.prefill_s for r in replicas], PREFILL_S)
        decode = _average([r.decode_s for r in replicas], DECODE_S)
        horizon = _average([r.generated for r in replicas], HORIZON)
        if query.max_tokens > 0:
            horizon = min(horizon, query.max_tokens)
        new_sequence = not any(r.continues for r in pool)

        donors = sorted(
            (r for r in replicas if r.serving and r.movable and r.cached_tokens),
            key=lambda r: -r.cached_tokens,
        )

        def option(r: ReplicaView) -> _Option:
            p, d = r.prefill_s or prefill, r.decode_s or decode
            queued = r.in_flight + query.weight - r.slots  # slots that must free first
            wait = queued * horizon * d / (r.slots + 1) if queued > 0 else 0.0
            rest = wait + (r.in_flight * d * horizon / 2 if new_sequence else 0.0)
            busy = r.in_flight * p + (d / 2 if r.in_flight else 0.0)

            def ttft(cached: int, load_s: float, per_token: float = p) -> float:
                return max(query.prompt_tokens - cached, 0) * per_token + load_s + busy

            load = r.cached_tokens * _LOAD_S.get(r.cached_tier or "slot", 0.0)
            own = _Option(r, ttft(r.cached_tokens, load) + rest)
            if not r.movable:
                return own
            donor = next((x for x in donors if x.index != r.index), None)
            if donor is None or donor.cached_tokens < r.cached_tokens + MOVE_MIN_TOKENS:
                return own
            n = donor.cached_tokens
            # The rest of the prompt at the slower of the two prefill speeds: a move is
            # made for room and load, never for a measured speed difference (an
            # estimate that swings with what else runs on the host).
            slower = max(p, donor.prefill_s or prefill)
            moved = ttft(n, n * ((donor.move_s or MOVE_S) + RESTORE_S), slower) + rest
            return own if own.score_s <= moved else _Option(r, moved, donor)

        options = {r.index: option(r) for r in pool}
        best = min(pool, key=lambda r: (options[r.index].score_s, r.in_flight, r.last_used))
        least = min(pool, key=lambda r: (r.in_flight, r.last_used))
        reason: Reason = "cache" if options[best.index].cached_tokens else "load"
        if _imbalanced(best, least):
            best, reason = least, "imbalance"
        elif not any(r.cached_tokens for r in pool) and query.session_home is not None:
            held = next((r for r in pool if r.index == query.session_home), None)
            if held is not None and not _imbalanced(held, least):
                best, reason = held, "affinity"
        chosen = options[best.index]
        return Decision(
            best.index,
            reason,
            chosen.cached_tokens,
            chosen.score_s,
            chosen.via.continues,
            chosen.via.cached_tier,
            None if chosen.donor is None else chosen.donor.index,
        )


@dataclass(frozen=True, slots=True)
class _Option:
    """Serving a request on ``target``: its score, and the donor whose state moves
    there first (None: with what ``target`` holds)."""

    target: ReplicaView
    score_s: float
    donor: ReplicaView | None = None

    @property
    def via(self) -> ReplicaView:
        """The replica whose cache the request uses."""
        return self.donor or self.target

    @property
    def cached_tokens(self) -> int:
        return self.via.cached_tokens


def _imbalanced(chosen: ReplicaView, least: ReplicaView) -> bool:
    return chosen.in_flight - least.in_flight > IMBALANCE * max(chosen.slots, 1)


def _average(values: Sequence[float | None], default: float) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else default
