"""A deployment's autoscaler: the policy of :mod:`tokenmill.gateway.autoscale`,
carried out on its replicas through their :class:`~tokenmill.gateway.replicaset.
ReplicaSet`, whose transitions it calls (it never sets a replica's phase itself).

Every :data:`TICK_S` the :class:`Scaler` samples the deployment (requests running,
waiting in admission and waiting for a pool's replica; the p90 of its recent first
tokens), asks its decider for the desired replica count, and reconciles:

* **Up**: a spare replica (built with the deployment, ``max_replicas`` of them, off
  until wanted) is started: a new child process, or a new Ray actor wherever the
  cluster has the resources (while it has none, the actor stays pending, which is
  what Ray's cluster autoscaler adds nodes for: docs/autoscaling.md). Its slots join
  admission once it is ready; requests wait in the queue meanwhile.
* **Down**: the replica chosen to go stops taking new requests at once (routing no
  longer sees it serving, admission no longer counts its slots), its streams finish,
  and only then is it stopped and forgotten by routing. Streams still running after
  ``drain_s`` end in-band with an error, billed for the tokens they produced, as any
  stream whose replica goes away. Down to zero, the last replica is unloaded in place
  once nothing runs on it, and the next request loads it again (its streamed
  response sends keep-alive pings while it waits).
* A replica that failed for good is retired and a spare takes its place; its index
  is not tried again for :data:`RETRY_FAILED_S`.

Who decides: the policy in this gateway (:class:`LocalDecider`), a pool's one
decision for all its gateways (:class:`~tokenmill.gateway.poolscale.PoolDecider`), or,
for ``idle_unload_s``, :class:`IdleDecider`: every replica while the deployment was
used within that long, none after it. Idle unloading is ``min_replicas = 0``, and
goes to zero the one way the set has (:meth:`~tokenmill.gateway.replicaset.
ReplicaSet.remove`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from tokenmill.config import Autoscale, DeploymentConfig
from tokenmill.gateway.autoscale import (
    LoadSample,
    ReplicaSlot,
    ScaleEvent,
    ScalePolicy,
    ScaleTargets,
    reconcile,
    unix_events,
)
from tokenmill.gateway.replicaset import Replica, ReplicaSet
from tokenmill.kvblocks import BLOCK_TOKENS

log = logging.getLogger("tokenmill.gateway.scaling")

# How often the load is sampled and the replicas reconciled.
TICK_S = 0.25
# A replica that failed to start is not tried again for this long.
RETRY_FAILED_S = 30.0


def targets(config: Autoscale, slots: int) -> ScaleTargets:
    return ScaleTargets(
        min_replicas=config.min_replicas,
        max_replicas=config.max_replicas,
        target_ongoing=config.target_ongoing_requests or float(slots),
        target_ttft_p90_s=config.target_ttft_p90_s,
        upscale_delay_s=config.upscale_delay_s,
        downscale_delay_s=config.downscale_delay_s,
        look_back_s=config.look_back_s,
    )


class Decider(Protocol):
    """Who decides the desired count: this gateway alone (:class:`LocalDecider`), a
    pool's scaler for all its gateways (:class:`~tokenmill.gateway.poolscale.
    PoolDecider`), or idleness (:class:`IdleDecider`)."""

    @property
    def desired(self) -> int: ...

    async def decide(self, sample: LoadSample, off: Sequence[int]) -> int:
        """The desired count after ``sample``; ``off``: the replicas this gateway has
        stopped using (a pool stops one that every gateway has)."""
        ...

    def observe(self, sample: LoadSample) -> int:
        """At once, without waiting for anyone: a request found no replica loaded."""
        ...

    def events(self) -> list[dict[str, Any]]:
        """The recent scale events, ``at`` in Unix time."""
        ...

    async def close(self) -> None: ...


class LocalDecider:
    """The policy, in this gateway."""

    def __init__(self, targets: ScaleTargets, initial: int, label: str) -> None:
        self.policy = ScalePolicy(targets, initial)
        self.label = label

    @property
    def desired(self) -> int:
        return self.policy.desired

    async def decide(self, sample: LoadSample, off: Sequence[int]) -> int:
        return self.observe(sample)

    def observe(self, sample: LoadSample) -> int:
        before = self.policy.desired
        desired = self.policy.observe(sample)
        if desired != before:
            log.info(
                "deployment %s: %d -> %d replicas (ongoing %.2f, ttft p90 %s)",
                self.label,
                before,
                desired,
                sample.ongoing,
                "-" if sample.ttft_p90_s is None else f"{sample.ttft_p90_s:.3f}s",
            )
        return desired

    def events(self) -> list[dict[str, Any]]:
        return unix_events(self.policy.events[-16:], time.time(), time.monotonic())

    async def close(self) -> None:
        return None


class IdleDecider:
    """``idle_unload_s`` as a decision: every replica while the deployment was used
    (a request running or waiting, a replica routed to, released or tokenizing) within
    ``idle_s``, none once it was not. Starts at none: the replicas load on the first
    request."""

    def __init__(self, replicas: ReplicaSet, idle_s: float) -> None:
        self.replicas = replicas
        self.idle_s = idle_s
        self.desired = 0
        self._events: list[ScaleEvent] = []

    async def decide(self, sample: LoadSample, off: Sequence[int]) -> int:
        return self.observe(sample)

    def observe(self, sample: LoadSample) -> int:
        used = sample.ongoing > 0 or sample.at - self.replicas.last_use < self.idle_s
        want = len(self.replicas.replicas) if used else 0
        if want != self.desired:
            log.info("deployment %s: %s", self.replicas.id, "in use" if used else "idle")
            direction: Literal["up", "down"] = "up" if want > self.desired else "down"
            self._events.append(
                ScaleEvent(sample.at, direction, self.desired, want, sample.ongoing, None)
            )
            del self._events[:-16]
            self.desired = want
        return want

    def events(self) -> list[dict[str, Any]]:
        return unix_events(self._events, time.time(), time.monotonic())

    async def close(self) -> None:
        return None


class Scaler:
    def __init__(
        self,
        replicas: ReplicaSet,
        config: Autoscale,
        decider: Decider,
        *,
        shared: bool = False,
    ) -> None:
        self.replicas = replicas
        self.config = config
        self.decider = decider
        # A pool's replicas are drained in index order, the same on every gateway.
        self.shared = shared
        self._task: asyncio.Task[None] | None = None
        self._failed_at: dict[int, float] = {}
        # Replica-seconds: seconds each replica ran (loading or serving), summed.
        self.replica_seconds = 0.0
        self._last_tick: float | None = None
        # A request that finds no replica loaded is the load up from zero.
        replicas.on_demand = lambda: self.observe(time.monotonic())

    @property
    def desired(self) -> int:
        return self.decider.desired

    def begin(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"autoscale-{self.replicas.id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.decider.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick(time.monotonic())
            except Exception:  # a bug here must not stop scaling for good
                log.exception("autoscaling %s failed this tick", self.replicas.id)

    async def tick(self, now: float) -> None:
        rs = self.replicas
        off = [r.index for r in rs.replicas if r.phase == "off"]
        desired = await self.decider.decide(self.sample(now), off)
        now = time.monotonic()  # a pool's answer took a round trip
        plan = reconcile(desired, [self._slot(r, now) for r in rs.replicas])
        for i in plan.retire:
            self._failed_at[i] = now
            rs.retire(rs.replicas[i])
        for i in plan.start:
            rs.add(rs.replicas[i])
        for i in plan.drain:
            rs.remove(rs.replicas[i], self.config.drain_s)

    def observe(self, now: float) -> int:
        """The desired count now, without waiting: a request found no replica loaded
        (at zero), which it then loads itself."""
        return self.decider.observe(self.sample(now))

    def sample(self, now: float) -> LoadSample:
        """The deployment's load now (and the replica-seconds up to now)."""
        rs = self.replicas
        if self._last_tick is not None:
            running = sum(1 for r in rs.replicas if r.state not in ("unloaded", "unhealthy"))
            self.replica_seconds += running * max(0.0, now - self._last_tick)
        self._last_tick = now
        return LoadSample(now, rs.ongoing(), rs.first_tokens.p90(now - self.config.look_back_s))

    def _slot(self, r: Replica, now: float) -> ReplicaSlot:
        rs = self.replicas
        starting = rs.busy(r) and r.phase == "active"
        failed = r.state == "unhealthy" and not starting
        if r.phase == "off":
            failed = now - self._failed_at.get(r.index, -RETRY_FAILED_S) < RETRY_FAILED_S
        return ReplicaSlot(
            index=r.index,
            phase=r.phase,
            running=starting or r.state not in ("unloaded", "unhealthy"),
            failed=failed,
            in_flight=0 if self.shared else r.in_flight,
            cached_tokens=0 if self.shared else rs.prefixes.blocks(r.index) * BLOCK_TOKENS,
        )

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "min_replicas": c.min_replicas,
            "max_replicas": c.max_replicas,
            "desired_replicas": self.decider.desired,
            "target_ongoing_requests": targets(c, self.replicas.replicas[0].slots).target_ongoing,
            "target_ttft_p90_s": c.target_ttft_p90_s,
            "replica_seconds": round(self.replica_seconds, 3),
            "events": self.decider.events(),
        }


def scaler_for(
    config: DeploymentConfig, replicas: ReplicaSet, ray_address: str | None = None
) -> Scaler | None:
    """What drives a deployment's replica count: its ``autoscale`` policy (a pool's:
    one decision for all its gateways), or ``idle_unload_s`` (``min_replicas = 0``);
    None for a fixed count."""
    autoscale: Autoscale | None = getattr(config, "autoscale", None)
    pool: str | None = getattr(config, "pool", None)
    initial = getattr(config, "replicas", 1)
    slots = config.max_num_seqs
    decider: Decider
    if autoscale is not None and pool is not None:
        from tokenmill.gateway.poolscale import PoolDecider

        decider = PoolDecider(pool, targets(autoscale, slots), initial, ray_address)
        return Scaler(replicas, autoscale, decider, shared=True)
    if autoscale is not None:
        decider = LocalDecider(targets(autoscale, slots), initial, config.id)
        return Scaler(replicas, autoscale, decider)
    if config.idle_unload_s is None:
        return None
    idle = Autoscale(
        min_replicas=0, max_replicas=len(replicas.replicas), downscale_delay_s=config.idle_unload_s
    )
    return Scaler(replicas, idle, IdleDecider(replicas, config.idle_unload_s))


__all__ = [
    "RETRY_FAILED_S",
    "TICK_S",
    "IdleDecider",
    "LocalDecider",
    "Scaler",
    "scaler_for",
    "targets",
]
