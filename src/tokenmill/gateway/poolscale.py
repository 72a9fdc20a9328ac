"""One autoscaling decision for all the gateways of a pool (``pool`` + ``autoscale``).

A pool's replicas are Ray actors that several gateways share (:mod:`tokenmill.
replicas.pool`): if each gateway decided alone, two gateways would each add a replica
for the same load, and one could stop a replica another still serves. So the
decision is made once, by the pool's scaler, a detached Ray actor named
``<pool>/autoscale`` (created by the first gateway that needs it, like the pool's
replicas), from the load every gateway reports:

* Every tick, each gateway reports its own load (its requests running and waiting
  for the pool, its first tokens' p90) and which of the pool's replicas it has
  stopped using (``off``). The scaler sums the loads of the gateways heard from in
  the last :data:`STALE_S` (one that stopped reporting is gone), runs the same policy
  as a lone gateway (:class:`~tokenmill.gateway.autoscale.ScalePolicy`) and answers
  the desired count, with its recent scale events.
* Every gateway reconciles to that count in the same way: it attaches to the lowest
  replica indices, and drains the highest ones (the same on every gateway: load and
  cache differ by gateway, the pool's index does not).
* A replica beyond the desired count is stopped (its actor killed) only once every
  gateway heard from reports it ``off``: each has drained its own streams from it.

This module imports ``ray``: it is loaded only for a pool with ``autoscale``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from tokenmill.gateway.autoscale import LoadSample, ScalePolicy, ScaleTargets, unix_events
from tokenmill.replicas.pool import POOL_NAMESPACE, actor_name, scaler_name
from tokenmill.replicas.rayactor import acquire_ray, release_ray

log = logging.getLogger("tokenmill.gateway.poolscale")

# A gateway not heard from for this long is gone: its load and its view leave the sum.
STALE_S = 5.0


class PoolScalerActor:
    """The pool's scaler: the one policy of every gateway attached (see the module
    docstring). Its methods run one at a time (a plain Ray actor)."""

    def __init__(self, pool: str, targets: dict[str, Any], initial: int) -> None:
        logging.basicConfig(
            level="INFO", format="%(asctime)s %(levelname)s %(name)s[pool scaler]: %(message)s"
        )
        self.pool = pool
        self.policy = ScalePolicy(ScaleTargets(**targets), initial)
        # gateway -> (when heard, its load, its first tokens' p90, the indices it has off)
        self.reports: dict[str, tuple[float, float, float | None, frozenset[int]]] = {}
        self.stopped: set[int] = set()

    def report(
        self, gateway: str, ongoing: float, ttft_p90_s: float | None, off: list[int]
    ) -> tuple[int, list[dict[str, Any]]]:
        """One gateway's tick: the desired count for all, and the recent scale events."""
        now = time.monotonic()
        self.reports[gateway] = (now, ongoing, ttft_p90_s, frozenset(off))
        for other, (heard, *_) in list(self.reports.items()):
            if now - heard > STALE_S:
                del self.reports[other]
        total = sum(r[1] for r in self.reports.values())
        p90s = [r[2] for r in self.reports.values() if r[2] is not None]
        before = self.policy.desired
        desired = self.policy.observe(LoadSample(now, total, max(p90s) if p90s else None))
        if desired != before:
            log.info("pool %s: %d -> %d replicas (ongoing %.2f)", self.pool, before, desired, total)
        self._stop_unused(desired)
        return desired, unix_events(self.policy.events[-16:], time.time(), now)

    def _stop_unused(self, desired: int) -> None:
        self.stopped = {i for i in self.stopped if i >= desired}  # wanted again
        views = [r[3] for r in self.reports.values()]
        beyond = set.intersection(*(set(v) for v in views)) if views else set()
        for index in sorted(i for i in beyond if i >= desired and i not in self.stopped):
            try:
                actor = ray.get_actor(actor_name(self.pool, index), namespace=POOL_NAMESPACE)
            except ValueError:  # never started, or gone already
                self.stopped.add(index)
                continue
            log.info("pool %s: every gateway drained replica %d; stopping it", self.pool, index)
            ray.kill(actor, no_restart=True)
            self.stopped.add(index)


class PoolDecider:
    """A gateway's end of its pool's scaler: reports, and keeps the last answer."""

    def __init__(
        self, pool: str, targets: ScaleTargets, initial: int, ray_address: str | None
    ) -> None:
        self.pool = pool
        self.targets = targets
        self.desired = initial
        self.gateway = uuid.uuid4().hex
        self.address = ray_address
        self._events: list[dict[str, Any]] = []
        self._actor: Any = None
        self._connected = False

    def _scaler(self) -> Any:
        """The pool's scaler actor, created if there is none (blocking)."""
        if not self._connected:
            acquire_ray(self.address)
            self._connected = True
        if self._actor is None:
            actor_class: Any = ray.remote(PoolScalerActor).options(
                name=scaler_name(self.pool),
                namespace=POOL_NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_restarts=0,
            )
            self._actor = actor_class.remote(
                self.pool, dataclasses.asdict(self.targets), self.desired
            )
        return self._actor

    async def decide(self, sample: LoadSample, off: Sequence[int]) -> int:
        actor = self._actor
        if actor is None:  # (connecting and creating block: off the event loop, once)
            actor = await asyncio.to_thread(self._scaler)
        try:
            desired, events = await actor.report.remote(
                self.gateway, sample.ongoing, sample.ttft_p90_s, list(off)
            )
        except RayActorError:  # the scaler died: the next tick creates it again
            self._actor = None
            log.warning("pool %s: its scaler died; keeping %d replicas", self.pool, self.desired)
            return self.desired
        self.desired = int(desired)
        self._events = list(events)
        return self.desired

    def observe(self, sample: LoadSample) -> int:
        return self.desired  # a pool never scales to zero (min_replicas >= 1)

    def events(self) -> list[dict[str, Any]]:
        return self._events

    async def close(self) -> None:
        if self._connected:
            self._connected = False
            await asyncio.to_thread(release_ray)


__all__ = ["STALE_S", "PoolDecider", "PoolScalerActor"]
