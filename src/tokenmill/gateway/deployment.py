"""Deployments and their replicas.

A :class:`Deployment` is a named model (the ``model`` clients send) with one or more
:class:`Replica` objects, each on a :class:`~tokenmill.replicas.host.ReplicaHost`
(the engine in this process, in a supervised child process, or in a Ray actor),
built by :func:`~tokenmill.replicas.placement.build_host`.
Requests are admitted against the deployment's total slots and routed by the
deployment's routing policy (:mod:`tokenmill.gateway.routing`), which sees each
serving replica's load, measured speeds and, from the replicas' published KV caches
(:mod:`tokenmill.gateway.prefix`), how much of the prompt each one holds.

A deployment of a pool (``pool = "..."``, :mod:`tokenmill.replicas.pool`) shares its
replicas with other gateways, so its admission's slots are an upper bound, not a
promise: a replica whose slots other gateways hold refuses the request's
``reserve``, and
:meth:`Deployment.place` tries the others, then waits for one to report a free slot
(up to ``queue_timeout_s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.config import Autoscale, DeploymentConfig
from tokenmill.errors import OverloadedError, ReplicaFullError, UnavailableError
from tokenmill.gateway.admission import Admission
from tokenmill.gateway.autoscale import FirstTokens, Phase
from tokenmill.gateway.idle import QUIET_S, batch_room
from tokenmill.gateway.moves import KvMoves
from tokenmill.gateway.prefix import PrefixIndex, Tier
from tokenmill.gateway.routing import Decision, ReplicaView, RouteQuery, policy
from tokenmill.gateway.routing.cache_aware import MOVE_MIN_TOKENS, PREFILL_S
from tokenmill.gateway.routing.speed import Speed
from tokenmill.gateway.scaling import Scaler
from tokenmill.gateway.scaling import targets as scale_targets
from tokenmill.kvblocks import BLOCK_TOKENS, BlockSnapshot, CacheEvent, chain
from tokenmill.replicas import ADMITTING, ReplicaHost, ReplicaState, build_host

log = logging.getLogger("tokenmill.gateway")

# A replica that stops hands at most this many of its cached sequences to the others.
HAND_OFF_MAX = 64


class Replica:
    """One replica of a deployment: its host, and the gateway's routing counters."""

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
        self.in_flight = 0
        self.last_used = time.monotonic()
        self.touched = self.last_used  # last used outside routing (tokenizing, preparing)
        self.speed = Speed()  # measured from its streams (RequestStream)
        # "active": counted and routed to; "draining": finishing its streams before it
        # stops; "off": an autoscaled deployment's spare (tokenmill.gateway.scaling).
        self.phase: Phase = "active"
        # Started by the autoscaler and not ready yet: its slots join admission only
        # when it serves (requests wait in the queue meanwhile, not on its inbox).
        self.joining = False
        # The deployment's recent first tokens, which the autoscaler watches.
        self.first_tokens = first_tokens if first_tokens is not None else FirstTokens()

    @property
    def state(self) -> ReplicaState:
        return self.host.state

    def serving(self) -> bool:
        return self.phase == "active" and self.host.state == "ready"

    def looks_full(self, weight: int) -> bool:
        """A shared replica's last report leaves no room for ``weight`` slots."""
        return self.slots - self.host.health().running < weight

    def movable(self) -> bool:
        """Its engine exports and imports KV state (reported with its health)."""
        try:
            return self.host.health().moves_kv
        except Exception:  # not loaded yet: nothing to move
            return False

    def available(self) -> bool:
        """Counts toward the deployment's capacity: serving, or loads on demand."""
        if self.joining:
            return False
        return self.phase == "active" and self.host.state in ADMITTING

    def describe(self) -> dict[str, Any]:
        h = self.host.health()
        where = self.host.location()
        out: dict[str, Any] = {
            "index": self.index,
            "host": self.host.kind,
            "pid": where.pid,
            "state": self.host.state,
            "phase": self.phase,
            "in_flight": self.in_flight,
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
        if self.host.kind == "ray":
            out["node_id"] = where.node_id
            out["node_address"] = where.node_address
            if where.actor_id is not None:
                out["actor_id"] = where.actor_id
        if self.pool is not None:  # shared: its own count of slots taken, by any gateway
            out["pool"] = self.pool
            out["running"] = h.running
        return out


@dataclass
class _Idle:
    task: asyncio.Task[None] | None = None


class Deployment:
    def __init__(
        self,
        config: DeploymentConfig,
        hosts: list[ReplicaHost] | None = None,
        *,
        ray_address: str | None = None,
    ) -> None:
        self.config = config
        self.id = config.id
        autoscale: Autoscale | None = getattr(config, "autoscale", None)
        initial = getattr(config, "replicas", 1)
        if hosts is None:
            # Autoscaled: every replica it may run, the spares off until wanted.
            n = initial if autoscale is None else autoscale.max_replicas
            hosts = [build_host(config, ray_address=ray_address, index=i) for i in range(n)]
        slots = config.max_num_seqs
        self.pool: str | None = getattr(config, "pool", None)
        self.first_tokens = FirstTokens()
        self.replicas = [
            Replica(self.id, i, h, slots, self.pool, self.first_tokens) for i, h in enumerate(hosts)
        ]
        for replica in self.replicas:
            if autoscale is not None and replica.index >= initial:
                replica.phase = "off"
        self.scaler: Scaler | None = None
        if autoscale is not None:
            decider = None
            if self.pool is not None:  # one decision for every gateway of the pool
                from tokenmill.gateway.poolscale import PoolDecider

                decider = PoolDecider(
                    self.pool, scale_targets(autoscale, slots), initial, ray_address
                )
            self.scaler = Scaler(self, autoscale, slots, initial, decider)
        self.admission = Admission(
            capacity=sum(r.slots for r in self.replicas),
            max_queue=config.max_queue,
            queue_timeout_s=config.queue_timeout_s,
            fair=config.admission == "fair",
            promote_after_s=config.promote_after_s,
        )
        # Woken (and replaced) whenever a slot may have come free: a request waiting
        # for a pool's replica then tries again.
        self._room = asyncio.Event()
        self._placing = 0  # requests admitted here, waiting for a pool's replica
        self.routing = policy(config.routing)
        # What each replica's KV cache holds, from the events its host passes on.
        self.prefixes = PrefixIndex()
        self.moves = KvMoves()  # KV state moved between its replicas (routing's moves)
        self._moves_on = bool(getattr(config, "kv_moves", False))
        for replica in self.replicas:
            replica.host.on_change(self._changed(replica.index))
            replica.host.on_cache(self._cached(replica.index))
            replica.host.on_status(self._wake)
        self.created = int(time.time())
        self._load_lock = asyncio.Lock()
        self._idle = _Idle()
        # Requests admitted and being prepared before they are placed on a replica
        # (Gateway.open): no replica has them in flight yet, but an idle replica must
        # not unload under them.
        self.preparing = 0
        self._template: tuple[str | None] | None = None  # the model's, once asked

    async def start(self) -> None:
        if self.config.idle_unload_s is not None:
            self._idle.task = asyncio.create_task(self._unload_idle())
            return  # replicas load on first request
        await asyncio.gather(*(r.host.start() for r in self.replicas if r.phase == "active"))
        self.refresh_capacity()
        if self.scaler is not None:
            self.scaler.begin()

    async def close(self) -> None:
        if self._idle.task is not None:
            self._idle.task.cancel()
        if self.scaler is not None:
            await self.scaler.close()
        await asyncio.gather(*(r.host.close() for r in self.replicas), return_exceptions=True)

    async def serving(self) -> list[Replica]:
        """The replicas serving now (loading those of an idle-unloaded deployment);
        ``UnavailableError`` when none is."""
        ready = [r for r in self.replicas if r.serving()]
        if not ready:
            active = [r for r in self.replicas if r.phase == "active"]
            if active and all(r.state == "unloaded" for r in active):
                if self.scaler is not None:  # up from zero: this request is the load
                    self.scaler.observe(time.monotonic())
                async with self._load_lock:
                    try:
                        await asyncio.gather(
                            *(r.host.start() for r in active if r.state == "unloaded")
                        )
                    finally:
                        self.refresh_capacity()
                ready = [r for r in self.replicas if r.serving()]
                for r in ready:
                    r.touched = time.monotonic()  # loaded for a request: not idle yet
            if not ready:
                states = ", ".join(r.state for r in self.replicas if r.phase != "off")
                raise UnavailableError(
                    f"deployment {self.id!r} has no ready replica ({states}); retry shortly"
                )
        return ready

    async def pick(self, weight: int = 1, avoid: Collection[Replica] = ()) -> Replica:
        """A replica for ``weight`` slots by the routing policy, knowing no prompt."""
        replica, _ = await self.route(RouteQuery(weight=weight), avoid=avoid)
        return replica

    async def route(
        self,
        query: RouteQuery,
        prompt: Sequence[int] = (),
        avoid: Collection[Replica] = (),
    ) -> tuple[Replica, Decision]:
        """The replica the routing policy chooses for ``query`` (``prompt``: its token
        ids, looked up in the replicas' caches), not one in ``avoid`` (refused the
        request: full) if another serves, with ``query.weight`` slots counted busy on it
        until :meth:`release`."""
        ready = await self.serving()
        ready = [r for r in ready if r not in avoid] or ready
        cached: dict[int, int] = {}
        continued: set[int] = set()
        tiers: dict[int, Tier] = {}
        if prompt:
            names = chain(prompt)
            blocks = self.prefixes.cached_blocks(names)
            cached = {i: n * BLOCK_TOKENS for i, n in blocks.items()}
            continued = self.prefixes.continued(names, blocks)
            tiers = self.prefixes.tiers(names, blocks)
        views = [
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
                movable=self._moves_on and r.movable(),
                move_s=self.moves.move_s,
            )
            for r in self.replicas
        ]
        decision = self.routing.choose(views, query)
        best = self.replicas[decision.index]
        best.in_flight += query.weight
        best.last_used = time.monotonic()
        return best, decision

    async def place(
        self, request_id: str, query: RouteQuery, prompt: Sequence[int] = ()
    ) -> tuple[Replica, Decision]:
        """Route a request (:meth:`route`) and claim its slots there: the replica,
        counted busy, and the decision. A pool's replica that is full (other gateways hold its
        slots) refuses at once: the others are tried, then, all full, the request waits
        for a replica to report a free slot, up to ``queue_timeout_s`` (then 429)."""
        weight = query.weight
        refused: set[Replica] = set()
        deadline: float | None = None
        while True:
            room = self._room  # set by any report or release from now on
            if refused and not any(r.serving() and r not in refused for r in self.replicas):
                if deadline is None:
                    deadline = time.monotonic() + self.config.queue_timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OverloadedError(
                        f"every replica of pool {self.pool!r} stayed full for "
                        f"{self.config.queue_timeout_s:g}s (gateways sharing it hold their "
                        "slots); retry later",
                        retry_after=self.admission.retry_after(),
                        code="queue_timeout",
                    )
                self._placing += 1
                try:
                    await asyncio.wait_for(room.wait(), left)
                except TimeoutError:
                    continue
                finally:
                    self._placing -= 1
                refused = {r for r in refused if r.serving() and r.looks_full(weight)}
                if len(refused) == len([r for r in self.replicas if r.serving()]):
                    continue  # nothing reports room yet
            replica, decision = await self.route(query, prompt, avoid=refused)
            try:
                await replica.host.reserve(request_id, weight)
            except ReplicaFullError:
                self.release(replica, weight)
                refused.add(replica)
                continue
            except BaseException:
                self.release(replica, weight)
                raise
            if decision.move_from is not None:
                try:
                    decision = await self._move(decision, replica, prompt)
                except BaseException:  # the caller gave up meanwhile: nothing is held
                    replica.host.cancel(request_id)  # a pool's replica holds its slots
                    self.release(replica, weight)
                    raise
            return replica, decision

    async def _move(self, decision: Decision, target: Replica, prompt: Sequence[int]) -> Decision:
        """Carry out the decision's move to ``target`` (:mod:`.moves`); the decision as
        it turned out (``moved``)."""
        assert decision.move_from is not None
        donor = self.replicas[decision.move_from]
        # Worth waiting for no longer than computing what it brings would take.
        gain = decision.cached_tokens - self.prefixes.cached_tokens(chain(prompt)).get(
            target.index, 0
        )
        budget = gain * (target.speed.prefill_s or PREFILL_S)
        outcome = await self.moves.move(
            donor.host, target.host, prompt, min_tokens=MOVE_MIN_TOKENS, budget_s=budget
        )
        return dataclasses.replace(decision, moved=outcome)

    def _wake(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    async def any_host(self) -> ReplicaHost:
        """A serving replica, for work outside admission (tokenizing, preparing).

        Loads the replicas of an idle-unloaded deployment as a generation would.
        """
        ready = await self.serving()
        replica = min(ready, key=lambda r: (r.in_flight, r.index))
        # Used now, though not routed to: the idle unloader waits from here (last_used,
        # which routing breaks ties on, is left alone).
        replica.touched = time.monotonic()
        return replica.host

    async def chat_template(self) -> str | None:
        """The model's own chat template (asked of a replica once: it is fixed), or
        None where the engine renders no chat itself (an upstream server's is its own)."""
        if self.config.engine != "llamacpp":
            return None
        if self._template is None:
            host = await self.any_host()
            self._template = ((await host.tokenizer_info()).chat_template,)
        return self._template[0]

    def batch_room(self, own: int) -> int:
        """How many more Batch API lines may start here now (:mod:`~tokenmill.gateway.
        idle`); ``own``: lines the caller already started. An idle-unloaded deployment
        takes one, which loads it."""
        if own == 0 and all(r.state == "unloaded" for r in self.replicas if r.phase == "active"):
            return 1
        waiting = self.admission.waiting + self._placing
        busy = time.monotonic() - self.admission.last_urgent < QUIET_S
        return batch_room(
            self.admission.capacity,
            self.admission.active,
            waiting,
            own,
            busy=busy,
            turnover_s=self.admission.turnover_s(),
            beside_share=self.config.batch_share,
        )

    def refresh_capacity(self) -> None:
        """Admit against the slots of the replicas that can serve right now."""
        capacity = sum(r.slots for r in self.replicas if r.available())
        # A draining replica's streams hold admission slots that are not the staying
        # replicas': counted beside them until each ends (tokenmill.gateway.scaling).
        capacity += sum(r.in_flight for r in self.replicas if r.phase == "draining")
        if capacity != self.admission.capacity:
            log.info("deployment %s: capacity %d slots", self.id, capacity)
            self.admission.resize(capacity)
        self._wake()

    def ongoing(self) -> float:
        """Requests holding or waiting for its slots, Batch API lines among them: what
        the autoscaler sizes the replicas for. (Those waiting for a pool's replica are
        admitted already: among ``active``.)"""
        return self.admission.active + self.admission.waiting

    async def hand_off(self, donor: Replica, budget_s: float) -> int:
        """Move the sequences ``donor`` holds to the replicas that stay, before it stops
        (autoscaling: :mod:`.scaling`): most recently used first, each to the serving
        replica that holds the least, for up to ``budget_s``. The number moved; none
        where moves are off or the engines cannot move state."""
        staying = [r for r in self.replicas if r is not donor and r.serving() and r.movable()]
        if not (self._moves_on and staying and donor.movable()):
            return 0
        deadline = time.monotonic() + budget_s
        try:
            held = await donor.host.held_kv(MOVE_MIN_TOKENS)
        except Exception as e:  # it stops anyway: what it held is computed again
            log.warning("replica %s/%d listed no KV state to hand off: %s", self.id, donor.index, e)
            return 0
        moved = 0
        for tokens in held[:HAND_OFF_MAX]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            target = min(staying, key=lambda r: (self.prefixes.blocks(r.index), r.index))
            outcome = await self.moves.move(
                donor.host, target.host, tokens, min_tokens=len(tokens), budget_s=left
            )
            if outcome == "moved":
                moved += 1
                self.moves.handed_off += 1
        if held:
            log.info(
                "replica %s/%d handed %d of its %d cached sequence(s) to the replicas that stay",
                self.id,
                donor.index,
                moved,
                len(held),
            )
        return moved

    async def unload(self, replica: Replica) -> None:
        """Stop ``replica`` where it stands, idle: it stays ``unloaded`` and counted, and
        the next request loads it again (:meth:`serving`)."""
        async with self._load_lock:
            if replica.in_flight or self.preparing:  # a request came meanwhile
                return
            log.info("unloading idle replica %s/%d", self.id, replica.index)
            await replica.host.close()
            self.refresh_capacity()

    def _changed(self, index: int) -> Callable[[], None]:
        def changed() -> None:
            if not self.replicas[index].serving():
                self.prefixes.drop(index)  # its next snapshot says what it holds
            self.refresh_capacity()

        return changed

    def _cached(self, index: int) -> Callable[[CacheEvent], None]:
        def cached(event: CacheEvent) -> None:
            if isinstance(event, BlockSnapshot):
                self.prefixes.reset(index, event.slots, event.n_slots, event.disk)
            else:
                self.prefixes.update(index, event)

        return cached

    def release(self, replica: Replica, weight: int = 1) -> None:
        replica.in_flight -= weight
        replica.last_used = time.monotonic()
        if self.pool is not None:
            self._wake()

    async def _unload_idle(self) -> None:
        limit = self.config.idle_unload_s
        assert limit is not None
        while True:
            await asyncio.sleep(min(limit / 2, 5.0))
            now = time.monotonic()
            for r in self.replicas:
                idle_s = now - max(r.last_used, r.touched)
                if (
                    r.state == "ready"
                    and r.in_flight == 0
                    and not self.preparing
                    and idle_s > limit
                ):
                    await self.unload(r)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "deployment",
            "engine": self.config.engine,
            "endpoint_type": self.config.endpoint_type,
            "in_flight": sum(r.in_flight for r in self.replicas),
            "queued": self.admission.waiting + self._placing,
            "replicas": [r.describe() for r in self.replicas],
            # Replicas that follow the load (docs/autoscaling.md); absent: fixed.
            **({} if self.scaler is None else {"autoscale": self.scaler.describe()}),
            "admission": self.config.admission,
            # Who waits and runs here, and the share each is owed (docs/fairness.md).
            "accounts": [dataclasses.asdict(v) for v in self.admission.accounts()],
            # KV state moved between its replicas (docs/routing.md).
            "kv_moves": self.moves.describe(),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
