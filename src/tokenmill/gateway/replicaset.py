"""A deployment's replicas and every change in their lives, in one place.

A :class:`Replica` is a host (:class:`~tokenmill.replicas.host.ReplicaHost`, whose
own state says whether it is loaded and well) and the gateway's side of it: its
phase (``active``: counted and routed to; ``draining``: finishing its streams before
it stops; ``off``: a spare, or one that went), whether it is still joining, the
slots it has in flight, when it was last used and how fast it measured.

A :class:`ReplicaSet` owns them. Its methods are the only writers of a replica's
phase, joining and slots in flight, and each transition refreshes the deployment's
admitted capacity itself (the slots of the replicas that can serve, plus what
draining ones still run):

* :meth:`~ReplicaSet.start`: at start-up, the active replicas load;
* :meth:`~ReplicaSet.ready`: the replicas serving now, or, where every active one
  is unloaded, loaded on demand for the request that asks (up from zero);
* a host's own change (ready, restarting, failed) refreshes capacity and drops
  what the prefix index knew of a replica that no longer serves;
* :meth:`~ReplicaSet.add`: a spare starts, and its slots join admission once it
  serves; a draining replica wanted again serves on, warm;
* :meth:`~ReplicaSet.remove`: a replica leaves: it stops taking requests at once,
  finishes its streams (up to ``drain_s``), hands its cached sequences to those that
  stay (:mod:`~tokenmill.gateway.moves`) and stops. The last active one is unloaded
  in place instead (:meth:`~ReplicaSet.unload`): the one way to zero, which the next
  request loads again. An autoscaler (:mod:`~tokenmill.gateway.scaling`) decides
  when, ``min_replicas = 0`` and ``idle_unload_s`` alike;
* :meth:`~ReplicaSet.retire`: one that failed for good stops, and a spare may take
  its place.

A transition that takes time (a start, a drain, an unload) runs as a task of the set,
one at a time per replica (:meth:`~ReplicaSet.busy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from typing import Any

from tokenmill.errors import UnavailableError
from tokenmill.gateway.admission import Admission
from tokenmill.gateway.autoscale import FirstTokens, Phase
from tokenmill.gateway.prefix import PrefixIndex, Tier
from tokenmill.gateway.routing import ReplicaView
from tokenmill.gateway.routing.speed import Speed
from tokenmill.kvblocks import BLOCK_TOKENS, BlockSnapshot, CacheEvent, chain
from tokenmill.replicas import ADMITTING, ReplicaHost, ReplicaState

log = logging.getLogger("tokenmill.gateway")

# A drained replica hands its cached sequences to the others for at most this long.
HAND_OFF_S = 30.0


class Replica:
    """One replica of a deployment: its host, and the gateway's side of its life."""

    def __init__(
        self,
        deployment_id: str,
        index: int,
        host: ReplicaHost,
        slots: int,
        pool: str | None = None,
        first_tokens: FirstTokens | None = None,
    ) -> None:
        self.deployment_id = deployment_id
        self.pool = pool
        self.index = index
        self.host = host
        self.slots = slots
        self.last_used = time.monotonic()
        self.touched = self.last_used  # last used outside routing (tokenizing, preparing)
        self.speed = Speed()  # measured from its streams (RequestStream)
        # The deployment's recent first tokens, which the autoscaler watches.
        self.first_tokens = first_tokens if first_tokens is not None else FirstTokens()
        # Written by its ReplicaSet only (see the module docstring).
        self._phase: Phase = "active"
        self._joining = False  # started and not ready yet: its slots wait to join
        self._in_flight = 0

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def joining(self) -> bool:
        return self._joining

    @property
    def in_flight(self) -> int:
        """Slots that requests routed here hold."""
        return self._in_flight

    @property
    def state(self) -> ReplicaState:
        return self.host.state

    def serving(self) -> bool:
        return self._phase == "active" and self.host.state == "ready"

    def available(self) -> bool:
        """Counts toward the deployment's capacity: serving, or loads on demand."""
        return not self._joining and self._phase == "active" and self.host.state in ADMITTING

    def looks_full(self, weight: int) -> bool:
        """A shared replica's last report leaves no room for ``weight`` slots."""
        return self.slots - self.host.health().running < weight

    def movable(self) -> bool:
        """Its engine exports and imports KV state (reported with its health)."""
        try:
            return self.host.health().moves_kv
        except Exception:  # not loaded yet: nothing to move
            return False

    def describe(self) -> dict[str, Any]:
        h = self.host.health()
        where = self.host.location()
        out: dict[str, Any] = {
            "index": self.index,
            "host": self.host.kind,
            "pid": where.pid,
            "state": self.host.state,
            "phase": self._phase,
            "in_flight": self._in_flight,
            "queued": h.waiting,
            "slots": self.slots,
            "restarts": self.host.restarts,
            "tokens_generated": h.tokens_generated,
            "threads": h.threads,
            "prefill_ms_per_token": _ms(self.speed.prefill_s),
            "decode_ms_per_token": _ms(self.speed.decode_s),
        }
        if h.kv:  # llama.cpp: its KV pool and host-memory tier (docs/operations.md)
            out["kv"] = h.kv
        if h.weights:  # llama.cpp: the weights it serves and why (docs/operations.md)
            out["weights"] = h.weights
        if self.host.kind == "ray":
            out["node_id"] = where.node_id
            out["node_address"] = where.node_address
            if where.actor_id is not None:
                out["actor_id"] = where.actor_id
        if self.pool is not None:  # shared: its own count of slots taken, by any gateway
            out["pool"] = self.pool
            out["running"] = h.running
        return out


# What a replica that leaves does with its cache: hands it to those that stay.
HandOff = Callable[[Replica, Sequence[Replica], float], Awaitable[int]]


class ReplicaSet:
    """A deployment's replicas, their transitions and the capacity they admit against
    (see the module docstring). ``spares_from``: the replicas from this index on are
    spares, off until added."""

    def __init__(
        self,
        deployment_id: str,
        hosts: Sequence[ReplicaHost],
        slots: int,
        admission: Admission,
        *,
        pool: str | None = None,
        spares_from: int | None = None,
    ) -> None:
        self.id = deployment_id
        self.pool = pool
        self.admission = admission
        self.first_tokens = FirstTokens()
        self.replicas = [
            Replica(deployment_id, i, h, slots, pool, self.first_tokens)
            for i, h in enumerate(hosts)
        ]
        for r in self.replicas[spares_from if spares_from is not None else len(hosts) :]:
            r._phase = "off"
        # What each replica's KV cache holds, from the events its host passes on.
        self.prefixes = PrefixIndex()
        # Requests admitted and being prepared before they are placed on a replica
        # (Gateway.open): none holds a slot yet, but no replica unloads under them.
        self.preparing = 0
        # Requests admitted here and waiting for a pool's replica to report room.
        self.placing = 0
        # When any replica was last used (routed to, released, tokenizing): what idle
        # unloading counts from. Never, until the first request.
        self.last_use = -math.inf
        # Told first when a request finds no replica loaded (the autoscaler: this
        # request is the load that asks for one), and what a replica that leaves does
        # with its cache.
        self.on_demand: Callable[[], object] | None = None
        self.hand_off: HandOff | None = None
        # Set (and replaced) whenever a slot may have come free: a request waiting for
        # a pool's replica then tries again.
        self._room = asyncio.Event()
        self._load_lock = asyncio.Lock()
        self._changing: dict[int, asyncio.Task[None]] = {}  # a transition under way
        for r in self.replicas:
            r.host.on_change(self._changed(r))
            r.host.on_cache(self._cached(r.index))
            r.host.on_status(self._wake)
        admission.resize(self._capacity())

    # -- reading ----------------------------------------------------------------------
    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.serving()]

    def busy(self, replica: Replica) -> bool:
        """Whether a transition of ``replica`` (a start, a drain, an unload) is under way."""
        return replica.index in self._changing

    async def settled(self, replica: Replica) -> None:
        """Until ``replica``'s transition under way, if any, is done."""
        job = self._changing.get(replica.index)
        if job is not None:
            await asyncio.wait([job])

    def ongoing(self) -> float:
        """Requests holding or waiting for the slots, Batch API lines among them: what
        an autoscaler sizes the replicas for. (Those waiting for a pool's replica are
        admitted already: among ``active``.)"""
        return self.admission.active + self.admission.waiting

    def views(
        self, ready: Collection[Replica], prompt: Sequence[int], moves: bool, move_s: float | None
    ) -> list[ReplicaView]:
        """The replicas as routing sees them now (:mod:`~tokenmill.gateway.routing`):
        those in ``ready`` serving, with what each holds of ``prompt`` (its token ids)
        and, where ``moves`` are on, whether its state can move (at ``move_s`` a token)."""
        cached: dict[int, int] = {}
        continued: set[int] = set()
        tiers: dict[int, Tier] = {}
        if prompt:
            names = chain(prompt)
            blocks = self.prefixes.cached_blocks(names)
            cached = {i: n * BLOCK_TOKENS for i, n in blocks.items()}
            continued = self.prefixes.continued(names, blocks)
            tiers = self.prefixes.tiers(names, blocks)
        return [
            ReplicaView(
                index=r.index,
                serving=r in ready,
                slots=r.slots,
                in_flight=r.in_flight,
                cached_tokens=cached.get(r.index, 0),
                continues=r.index in continued,
                cached_tier=tiers.get(r.index),
                prefill_s=r.speed.prefill_s,
                decode_s=r.speed.decode_s,
                generated=r.speed.generated,
                last_used=r.last_used,
                movable=moves and r.movable(),
                move_s=move_s,
            )
            for r in self.replicas
        ]

    def room(self) -> asyncio.Event:
        """Set at the next report or release that may have freed a slot."""
        return self._room

    # -- requests ---------------------------------------------------------------------
    async def ready(self) -> list[Replica]:
        """The replicas serving now, or, where every active one is unloaded, those it
        loads for this request; ``UnavailableError`` when none serves."""
        ready = self.serving()
        if not ready:
            active = [r for r in self.replicas if r.phase == "active"]
            if active and all(r.state == "unloaded" for r in active):
                await self._load(active)
                ready = self.serving()
            if not ready:
                states = ", ".join(r.state for r in self.replicas if r.phase != "off")
                raise UnavailableError(
                    f"deployment {self.id!r} has no ready replica ({states}); retry shortly"
                )
        return ready

    def take(self, replica: Replica, weight: int) -> None:
        """``weight`` slots of ``replica`` routed to."""
        replica._in_flight += weight
        replica.last_used = self.last_use = time.monotonic()

    def release(self, replica: Replica, weight: int = 1) -> None:
        replica._in_flight -= weight
        replica.last_used = self.last_use = time.monotonic()
        if replica.phase == "draining":
            self._refresh()  # its slots leave admission as its streams end
        elif self.pool is not None:
            self._wake()

    def touch(self, replica: Replica) -> None:
        """Used outside routing (tokenizing, preparing): not idle."""
        replica.touched = self.last_use = time.monotonic()

    # -- transitions ------------------------------------------------------------------
    async def start(self) -> None:
        """Load the active replicas (start-up)."""
        await asyncio.gather(*(r.host.start() for r in self.replicas if r.phase == "active"))
        self._refresh()

    async def _load(self, active: list[Replica]) -> None:
        """Up from zero: load ``active`` for the request that asks."""
        self.last_use = time.monotonic()  # a request is here: not idle
        if self.on_demand is not None:
            self.on_demand()
        async with self._load_lock:
            try:
                await asyncio.gather(*(r.host.start() for r in active if r.state == "unloaded"))
            finally:
                self._refresh()
        for r in self.serving():
            self.touch(r)  # loaded for a request: not idle yet

    def add(self, replica: Replica) -> None:
        """Serve with ``replica`` again: a draining one serves on, warm; any other
        starts, and its slots join admission once it serves (requests wait in the
        queue meanwhile)."""
        job = self._changing.get(replica.index)
        if replica.phase == "draining" and job is not None:
            job.cancel()  # wanted again before it went
            self._set(replica, phase="active")
            return
        replica.touched = time.monotonic()
        self._set(replica, phase="active", joining=True)
        self._run(replica, self._join(replica))

    async def _join(self, replica: Replica) -> None:
        try:
            await replica.host.start()
        except Exception as e:  # unhealthy now: an autoscaler retires it
            log.warning("deployment %s: replica %d did not start: %s", self.id, replica.index, e)
        finally:
            self._set(replica, joining=False)

    def remove(self, replica: Replica, drain_s: float) -> None:
        """Take ``replica`` out of service (see the module docstring): the last active
        one is unloaded in place once nothing runs on it or waits for it (asked again
        until then); any other drains for up to ``drain_s`` and stops."""
        if self.busy(replica):
            return
        if not any(r.phase == "active" for r in self.replicas if r is not replica):
            if replica.in_flight == 0 and not self.preparing:
                self._run(replica, self.unload(replica))
            return
        self._set(replica, phase="draining")
        self._run(replica, self._drain(replica, drain_s))

    async def _drain(self, replica: Replica, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        while replica.in_flight > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            released = self._room  # set as each of its streams ends (release)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(released.wait(), left)
        if replica.in_flight > 0:
            log.warning(
                "deployment %s: replica %d still ran %d stream(s) after the %gs drain; "
                "they end now, billed for what they produced",
                self.id,
                replica.index,
                replica.in_flight,
                drain_s,
            )
        # Off before the host closes: nothing routes to it while it stops.
        self._set(replica, phase="off")
        # What it caches goes to the replicas that stay: not past the drain limit (its
        # streams end now), nor a pool's (its other gateways may still use it).
        if self.hand_off is not None and self.pool is None and replica.in_flight == 0:
            staying = [r for r in self.serving() if r is not replica]
            await self.hand_off(replica, staying, HAND_OFF_S)
        await replica.host.close()  # its host's change drops it from the prefix index

    async def unload(self, replica: Replica) -> None:
        """Stop ``replica`` where it stands, idle: it stays ``unloaded`` and active, and
        the next request loads it again (:meth:`ready`). The one way to zero."""
        async with self._load_lock:
            if replica.in_flight or self.preparing:  # a request came meanwhile
                return
            log.info("unloading idle replica %s/%d", self.id, replica.index)
            await replica.host.close()
            self._refresh()

    def retire(self, replica: Replica) -> None:
        """``replica`` failed for good: off, and stopped."""
        log.warning(
            "deployment %s: replica %d failed; another takes its place", self.id, replica.index
        )
        self._set(replica, phase="off")
        self._run(replica, replica.host.close())

    async def close(self) -> None:
        jobs = list(self._changing.values())
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await asyncio.gather(*(r.host.close() for r in self.replicas), return_exceptions=True)

    # -- the one place capacity follows from ------------------------------------------
    def _set(
        self, replica: Replica, *, phase: Phase | None = None, joining: bool | None = None
    ) -> None:
        if phase is not None:
            replica._phase = phase
        if joining is not None:
            replica._joining = joining
        self._refresh()

    def _capacity(self) -> int:
        """The slots of the replicas that can serve right now; a draining replica's
        streams hold admission slots that are not the staying replicas': counted beside
        them until each ends."""
        capacity = sum(r.slots for r in self.replicas if r.available())
        return capacity + sum(r.in_flight for r in self.replicas if r.phase == "draining")

    def _refresh(self) -> None:
        """Admit against the slots of the replicas that can serve right now."""
        capacity = self._capacity()
        if capacity != self.admission.capacity:
            log.info("deployment %s: capacity %d slots", self.id, capacity)
            self.admission.resize(capacity)
        self._wake()

    def _wake(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    def _run(self, replica: Replica, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._changing[replica.index] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._changing.get(replica.index) is t:
                del self._changing[replica.index]
            if not t.cancelled() and t.exception() is not None:
                log.error("deployment %s: replica %d: %s", self.id, replica.index, t.exception())

        task.add_done_callback(done)

    def _changed(self, replica: Replica) -> Callable[[], None]:
        def changed() -> None:
            if not replica.serving():
                self.prefixes.drop(replica.index)  # its next snapshot says what it holds
            self._refresh()

        return changed

    def _cached(self, index: int) -> Callable[[CacheEvent], None]:
        def cached(event: CacheEvent) -> None:
            if isinstance(event, BlockSnapshot):
                self.prefixes.reset(index, event.slots, event.n_slots, event.disk)
            else:
                self.prefixes.update(index, event)

        return cached


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


__all__ = ["HAND_OFF_S", "Replica", "ReplicaSet"]
