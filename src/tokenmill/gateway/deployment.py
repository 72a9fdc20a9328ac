"""Deployments: a named model and the requests placed on its replicas.

A :class:`Deployment` is a named model (the ``model`` clients send) with one or more
replicas, each on a :class:`~tokenmill.replicas.host.ReplicaHost` (the engine in this
process, in a supervised child process, or in a Ray actor), built by
:func:`~tokenmill.replicas.placement.build_host` and owned, with every change in
their lives, by its :class:`~tokenmill.gateway.replicaset.ReplicaSet`. Requests are
admitted against the slots that set counts and routed by the deployment's routing
policy (:mod:`tokenmill.gateway.routing`), which sees each serving replica's load,
measured speeds and, from the replicas' published KV caches
(:mod:`tokenmill.gateway.prefix`), how much of the prompt each one holds; a decision
to move cached state first is carried out by :mod:`tokenmill.gateway.moves`.

Replicas follow the load where an autoscaler (:mod:`tokenmill.gateway.scaling`) drives
the set: ``autoscale``'s policy, or ``idle_unload_s`` (every replica while used, none
once idle: ``min_replicas = 0``).

A deployment of a pool (``pool = "..."``, :mod:`tokenmill.replicas.pool`) shares its
replicas with other gateways, so its admission's slots are an upper bound, not a
promise: a replica whose slots other gateways hold refuses the request's
``reserve``, and :meth:`Deployment.place` tries the others, then waits for one to
report a free slot (up to ``queue_timeout_s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Collection, Sequence
from typing import Any

from tokenmill.config import Autoscale, DeploymentConfig
from tokenmill.errors import OverloadedError, ReplicaFullError
from tokenmill.gateway.admission import Admission
from tokenmill.gateway.idle import QUIET_S, batch_room
from tokenmill.gateway.moves import KvMoves
from tokenmill.gateway.prefix import PrefixIndex
from tokenmill.gateway.replicaset import Replica, ReplicaSet
from tokenmill.gateway.routing import Decision, RouteQuery, policy
from tokenmill.gateway.routing.history import RouteHistory
from tokenmill.gateway.scaling import scaler_for
from tokenmill.replicas import ReplicaHost, build_host


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
        self.pool: str | None = getattr(config, "pool", None)
        self.admission = Admission(
            capacity=0,
            max_queue=config.max_queue,
            queue_timeout_s=config.queue_timeout_s,
            fair=config.admission == "fair",
            promote_after_s=config.promote_after_s,
        )
        self.replica_set = ReplicaSet(
            self.id,
            hosts,
            config.max_num_seqs,
            self.admission,
            pool=self.pool,
            spares_from=None if autoscale is None else initial,
        )
        self.moves = KvMoves()  # KV state moved between its replicas (routing's moves)
        self._moves_on = bool(getattr(config, "kv_moves", False))
        if self._moves_on:
            self.replica_set.hand_off = lambda donor, staying, budget_s: self.moves.hand_off(
                donor, staying, self.prefixes, budget_s
            )
        self.scaler = scaler_for(config, self.replica_set, ray_address)
        self.routing = policy(config.routing)
        self.history = RouteHistory()  # what routing remembers between requests
        self.created = int(time.time())
        self._template: tuple[str | None] | None = None  # the model's, once asked

    @property
    def replicas(self) -> list[Replica]:
        return self.replica_set.replicas

    @property
    def prefixes(self) -> PrefixIndex:
        return self.replica_set.prefixes

    @property
    def preparing(self) -> int:
        """Requests admitted and being prepared (Gateway.open), not yet on a replica."""
        return self.replica_set.preparing

    @preparing.setter
    def preparing(self, n: int) -> None:
        self.replica_set.preparing = n

    async def start(self) -> None:
        if self.config.idle_unload_s is None:  # else replicas load on first request
            await self.replica_set.start()
        if self.scaler is not None:
            self.scaler.begin()

    async def close(self) -> None:
        if self.scaler is not None:
            await self.scaler.close()
        await self.replica_set.close()

    async def serving(self) -> list[Replica]:
        """The replicas serving now (loading those of a deployment at zero);
        ``UnavailableError`` when none is."""
        return await self.replica_set.ready()

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
        views = self.replica_set.views(ready, prompt, self._moves_on, self.moves.move_s)
        decision = self.history.choose(self.routing, views, query)
        best = self.replicas[decision.index]
        self.replica_set.take(best, query.weight)
        return best, decision

    async def place(
        self, request_id: str, query: RouteQuery, prompt: Sequence[int] = ()
    ) -> tuple[Replica, Decision]:
        """Route a request (:meth:`route`) and claim its slots there, with the state
        routing chose to move there first (:meth:`.moves.KvMoves.fetch`): the replica,
        counted busy, and the decision. A pool's replica that is full (other gateways
        hold its slots) refuses at once: the others are tried, then, all full, the
        request waits for a replica to report a free slot, up to ``queue_timeout_s``
        (then 429). Given up meanwhile, it holds nothing."""
        weight = query.weight
        refused: set[Replica] = set()
        deadline: float | None = None
        while True:
            room = self.replica_set.room()  # set by any report or release from now on
            if refused and not any(r.serving() and r not in refused for r in self.replicas):
                deadline = deadline or time.monotonic() + self.config.queue_timeout_s
                refused = await self._wait_for_room(room, refused, weight, deadline)
                continue
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
            if decision.move_from is None:
                return replica, decision
            donor = self.replicas[decision.move_from]
            try:
                moved = await self.moves.fetch(decision, donor, replica, prompt, self.prefixes)
            except BaseException:  # the caller gave up meanwhile: nothing is held
                replica.host.cancel(request_id)  # a pool's replica holds its slots
                self.release(replica, weight)
                raise
            return replica, moved

    async def _wait_for_room(
        self, room: asyncio.Event, refused: set[Replica], weight: int, deadline: float
    ) -> set[Replica]:
        """Every serving replica refused: wait for one to report room (``room``) until
        ``deadline`` (then 429); the refused ones that still look full."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise OverloadedError(
                f"every replica of pool {self.pool!r} stayed full for "
                f"{self.config.queue_timeout_s:g}s (gateways sharing it hold their "
                "slots); retry later",
                retry_after=self.admission.retry_after(),
                code="queue_timeout",
            )
        self.replica_set.placing += 1
        try:
            await asyncio.wait_for(room.wait(), left)
        except TimeoutError:
            return refused
        finally:
            self.replica_set.placing -= 1
        return {r for r in refused if r.serving() and r.looks_full(weight)}

    def release(self, replica: Replica, weight: int = 1) -> None:
        self.replica_set.release(replica, weight)

    async def any_host(self) -> ReplicaHost:
        """A serving replica, for work outside admission (tokenizing, preparing).

        Loads the replicas of a deployment at zero as a generation would.
        """
        ready = await self.serving()
        replica = min(ready, key=lambda r: (r.in_flight, r.index))
        # Used now, though not routed to: idle unloading counts from here (last_used,
        # which routing breaks ties on, is left alone).
        self.replica_set.touch(replica)
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
        idle`); ``own``: lines the caller already started. A deployment at zero takes
        one, which loads it."""
        if own == 0 and all(r.state == "unloaded" for r in self.replicas if r.phase == "active"):
            return 1
        waiting = self.admission.waiting + self.replica_set.placing
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

    def ongoing(self) -> float:
        """Requests holding or waiting for its slots (:meth:`.ReplicaSet.ongoing`)."""
        return self.replica_set.ongoing()

    def describe(self) -> dict[str, Any]:
        autoscaled = getattr(self.config, "autoscale", None) is not None
        return {
            "id": self.id,
            "object": "deployment",
            "engine": self.config.engine,
            "endpoint_type": self.config.endpoint_type,
            "in_flight": sum(r.in_flight for r in self.replicas),
            "queued": self.admission.waiting + self.replica_set.placing,
            "replicas": [r.describe() for r in self.replicas],
            # Replicas that follow the load (docs/autoscaling.md); absent: fixed.
            **({"autoscale": self.scaler.describe()} if self.scaler and autoscaled else {}),
            "admission": self.config.admission,
            # Who waits and runs here, and the share each is owed (docs/fairness.md).
            "accounts": [dataclasses.asdict(v) for v in self.admission.accounts()],
            # KV state moved between its replicas (docs/routing.md).
            "kv_moves": self.moves.describe(),
        }
