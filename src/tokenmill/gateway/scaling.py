"""A deployment's autoscaler: the policy of :mod:`tokenmill.gateway.autoscale`,
carried out on its replicas.

Every :data:`TICK_S` the :class:`Scaler` samples the deployment (requests running,
waiting in admission and waiting for a pool's replica; the p90 of its recent first
tokens), asks the policy for the desired replica count, and reconciles:

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from tokenmill.config import Autoscale
from tokenmill.gateway.autoscale import (
    FirstTokens,
    LoadSample,
    Phase,
    ReplicaSlot,
    ScaleEvent,
    ScalePolicy,
    ScaleTargets,
    reconcile,
)
from tokenmill.gateway.prefix import PrefixIndex
from tokenmill.kvblocks import BLOCK_TOKENS
from tokenmill.replicas import ReplicaHost, ReplicaState


class Replica(Protocol):
    """What the scaler reads and sets of a replica (gateway.deployment.Replica)."""

    index: int
    deployment_id: str
    host: ReplicaHost
    phase: Phase
    joining: bool
    in_flight: int
    touched: float

    @property
    def state(self) -> ReplicaState: ...


class Deployment(Protocol):
    """What the scaler reads and drives of its deployment (gateway.deployment)."""

    id: str
    preparing: int
    prefixes: PrefixIndex
    first_tokens: FirstTokens

    @property
    def replicas(self) -> Sequence[Replica]: ...

    def ongoing(self) -> float: ...

    def refresh_capacity(self) -> None: ...

    async def hand_off(self, donor: Any, budget_s: float) -> int: ...

    async def unload(self, replica: Any) -> None: ...


log = logging.getLogger("tokenmill.gateway.scaling")

# How often the load is sampled and the replicas reconciled.
TICK_S = 0.25
# How often a draining replica is checked for its last stream.
DRAIN_POLL_S = 0.05
# A replica that failed to start is not tried again for this long.
RETRY_FAILED_S = 30.0
# A drained replica hands its cached sequences to the others for at most this long.
HAND_OFF_S = 30.0


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


def unix_events(events: Sequence[ScaleEvent]) -> list[dict[str, Any]]:
    """Scale events with ``at`` as Unix time (their monotonic time is this process's)."""
    now_unix, now = time.time(), time.monotonic()
    return [{**dataclasses.asdict(e), "at": round(now_unix - (now - e.at), 3)} for e in events]


class Decider(Protocol):
    """Who decides the desired count: this gateway alone (:class:`LocalDecider`), or a
    pool's scaler for all its gateways (:class:`~tokenmill.gateway.poolscale.
    PoolDecider`)."""

    desired: int

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
        return unix_events(self.policy.events[-16:])

    async def close(self) -> None:
        return None


class Scaler:
    def __init__(
        self,
        deployment: Deployment,
        config: Autoscale,
        slots: int,
        initial: int,
        decider: Decider | None = None,
    ) -> None:
        self.deployment = deployment
        self.config = config
        self.targets = targets(config, slots)
        self.decider = decider or LocalDecider(self.targets, initial, deployment.id)
        # A pool's replicas are drained in index order, the same on every gateway.
        self.shared = decider is not None
        self._task: asyncio.Task[None] | None = None
        self._jobs: dict[int, asyncio.Task[None]] = {}  # a start or a drain, per replica
        self._failed_at: dict[int, float] = {}
        # Replica-seconds: seconds each replica ran (loading or serving), summed.
        self.replica_seconds = 0.0
        self._last_tick: float | None = None

    @property
    def desired(self) -> int:
        return self.decider.desired

    def begin(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"autoscale-{self.deployment.id}")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._jobs.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.decider.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick(time.monotonic())
            except Exception:  # a bug here must not stop scaling for good
                log.exception("autoscaling %s failed this tick", self.deployment.id)

    async def tick(self, now: float) -> None:
        dep = self.deployment
        off = [r.index for r in dep.replicas if r.phase == "off"]
        desired = await self.decider.decide(self.sample(now), off)
        now = time.monotonic()  # a pool's answer took a round trip
        plan = reconcile(desired, [self._slot(r, now) for r in dep.replicas])
        for i in plan.retire:
            self._retire(dep.replicas[i], now)
        for i in plan.start:
            self._start(dep.replicas[i])
        for i in plan.drain:
            self._drain(dep.replicas[i])

    def observe(self, now: float) -> int:
        """The desired count now, without waiting: a request found no replica loaded
        (at zero), which it then loads itself."""
        return self.decider.observe(self.sample(now))

    def sample(self, now: float) -> LoadSample:
        """The deployment's load now (and the replica-seconds up to now)."""
        dep = self.deployment
        if self._last_tick is not None:
            running = sum(1 for r in dep.replicas if r.state not in ("unloaded", "unhealthy"))
            self.replica_seconds += running * max(0.0, now - self._last_tick)
        self._last_tick = now
        return LoadSample(now, dep.ongoing(), dep.first_tokens.p90(now - self.config.look_back_s))

    def _slot(self, r: Replica, now: float) -> ReplicaSlot:
        job = self._jobs.get(r.index)
        starting = job is not None and r.phase == "active"
        failed = r.state == "unhealthy" and not starting
        if r.phase == "off":
            failed = now - self._failed_at.get(r.index, -RETRY_FAILED_S) < RETRY_FAILED_S
        return ReplicaSlot(
            index=r.index,
            phase=r.phase,
            running=starting or r.state not in ("unloaded", "unhealthy"),
            failed=failed,
            in_flight=0 if self.shared else r.in_flight,
            cached_tokens=0
            if self.shared
            else self.deployment.prefixes.blocks(r.index) * BLOCK_TOKENS,
        )

    def _retire(self, r: Replica, now: float) -> None:
        log.warning(
            "deployment %s: replica %d failed; another takes its place", r.deployment_id, r.index
        )
        self._failed_at[r.index] = now
        r.phase = "off"
        self.deployment.refresh_capacity()
        self._job(r, r.host.close())

    def _start(self, r: Replica) -> None:
        job = self._jobs.get(r.index)
        if r.phase == "draining" and job is not None:
            job.cancel()  # wanted again before it went: it serves on, warm
            r.phase = "active"
            self.deployment.refresh_capacity()
            return
        r.phase = "active"
        r.joining = True
        r.touched = time.monotonic()
        self._job(r, self._load(r))

    async def _load(self, r: Replica) -> None:
        try:
            await r.host.start()
        except Exception as e:  # unhealthy now: the next tick retires it
            log.warning("deployment %s: replica %d did not start: %s", r.deployment_id, r.index, e)
        finally:
            r.joining = False
            self.deployment.refresh_capacity()

    def _drain(self, r: Replica) -> None:
        dep = self.deployment
        if self._jobs.get(r.index) is not None:
            return
        others = [x for x in dep.replicas if x.phase == "active" and x is not r]
        if not others:
            # The last one: unloaded in place once nothing runs on it, left active so
            # that the next request loads it (Deployment.serving).
            if r.in_flight == 0 and not dep.preparing:
                self._job(r, dep.unload(r))
            return
        r.phase = "draining"
        dep.refresh_capacity()
        self._job(r, self._finish_drain(r))

    async def _finish_drain(self, r: Replica) -> None:
        dep = self.deployment
        deadline = time.monotonic() + self.config.drain_s
        running = r.in_flight
        while r.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
            if r.in_flight != running:  # its slots leave admission as its streams end
                running = r.in_flight
                dep.refresh_capacity()
        if r.in_flight > 0:
            log.warning(
                "deployment %s: replica %d still ran %d stream(s) after the %gs drain; "
                "they end now, billed for what they produced",
                r.deployment_id,
                r.index,
                r.in_flight,
                self.config.drain_s,
            )
        # Off before the host closes: nothing routes to it while it stops.
        r.phase = "off"
        dep.refresh_capacity()
        # What it caches goes to the replicas that stay: not past the drain limit (its
        # streams end now), nor a pool's (its other gateways may still use it).
        if not self.shared and r.in_flight == 0:
            await dep.hand_off(r, HAND_OFF_S)
        # Its state change drops it from the prefix index and the capacity
        # (Deployment._changed).
        await r.host.close()

    def _job(self, r: Replica, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._jobs[r.index] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._jobs.get(r.index) is t:
                del self._jobs[r.index]
            if not t.cancelled() and t.exception() is not None:
                log.error("deployment %s: replica %d: %s", r.deployment_id, r.index, t.exception())

        task.add_done_callback(done)

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "min_replicas": c.min_replicas,
            "max_replicas": c.max_replicas,
            "desired_replicas": self.decider.desired,
            "target_ongoing_requests": self.targets.target_ongoing,
            "target_ttft_p90_s": c.target_ttft_p90_s,
            "replica_seconds": round(self.replica_seconds, 3),
            "events": self.decider.events(),
        }


__all__ = ["TICK_S", "Scaler"]
