"""Deployments and their replicas.

A :class:`Deployment` is a named model (the ``model`` clients send) with one or more
:class:`Replica` objects, each wrapping one :class:`~tokenmill.engines.base.Engine`
(an in-process llama.cpp context, a supervised child process, a remote endpoint).
Requests are admitted against the deployment's total slots and routed to the ready
replica with the fewest outstanding requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.config import DeploymentConfig
from tokenmill.engines import Engine, load_engine_class
from tokenmill.engines.threads import available_cpus
from tokenmill.errors import UnavailableError
from tokenmill.gateway.admission import Admission

log = logging.getLogger("tokenmill.gateway")

ReplicaState = Literal["loading", "ready", "unhealthy", "unloaded"]


class Replica:
    def __init__(self, deployment_id: str, index: int, engine: Engine, slots: int) -> None:
        self.deployment_id = deployment_id
        self.index = index
        self.engine = engine
        self.slots = slots
        self.in_flight = 0
        self.state: ReplicaState = "unloaded"
        self.restarts = 0
        self.last_used = time.monotonic()

    async def start(self) -> None:
        self.state = "loading"
        try:
            await self.engine.start()
        except BaseException:
            self.state = "unhealthy"
            raise
        self.state = "ready"

    async def close(self) -> None:
        await self.engine.close()
        self.state = "unloaded"

    def serving(self) -> bool:
        """Ready, and its engine too (a process replica between a crash and its
        restart is ``ready`` here while its engine is not)."""
        return self.state == "ready" and self.engine.health().ready

    def available(self) -> bool:
        """Counts toward the deployment's capacity: serving, or loads on demand."""
        return self.state in ("unloaded", "loading") or self.serving()

    def describe(self) -> dict[str, Any]:
        h = self.engine.health()
        pid = getattr(self.engine, "pid", None)
        state: str = self.state
        if state == "ready" and not h.ready:
            # A process replica between a crash and its restart says which it is.
            state = getattr(self.engine, "state", "unhealthy")
            if state == "ready":
                state = "unhealthy"
        return {
            "index": self.index,
            "pid": pid,
            "state": state,
            "in_flight": self.in_flight,
            "queued": h.waiting,
            "slots": self.slots,
            "restarts": getattr(self.engine, "restarts", self.restarts),
            "tokens_generated": h.tokens_generated,
            "threads": h.threads,
        }


# Not in the engine name table: only a deployment that says engine = "scripted" gets it.
SCRIPTED_ENGINE = "tokenmill.engines.scripted:ScriptedEngine"


def build_engine(config: DeploymentConfig) -> Engine:
    """Instantiate the engine one replica of ``config`` runs."""
    if config.engine == "scripted":
        scripted: dict[str, Any] = {
            "control": str(config.control),
            "max_num_seqs": config.max_num_seqs,
            "n_ctx": config.n_ctx,
        }
        if config.isolated:  # driven in replica processes, like llama.cpp
            process = load_engine_class("tokenmill.gateway.process:ProcessEngine")
            return process(  # type: ignore[no-any-return]
                SCRIPTED_ENGINE,
                scripted,
                probe_interval_s=config.health_check_interval_s,
                probe_timeout_s=config.health_check_timeout_s,
            )
        return load_engine_class(SCRIPTED_ENGINE)(**scripted)  # type: ignore[no-any-return]
    if config.engine == "llamacpp":
        kwargs: dict[str, Any] = {
            "model_path": config.model,
            "max_num_seqs": config.max_num_seqs,
            "n_ctx": config.n_ctx,
            "n_threads": config.n_threads,
            "adapt_threads": config.adapt_threads,
        }
        if config.n_threads is None and config.replicas > 1:
            # Replicas of one deployment share the cores; oversubscribed llama.cpp
            # thread pools spin against each other and every replica slows down.
            kwargs["n_threads"] = max(1, available_cpus() // config.replicas)
        if config.isolated:
            cls = load_engine_class("tokenmill.gateway.process:ProcessEngine")
            return cls(  # type: ignore[no-any-return]
                "llamacpp",
                kwargs,
                probe_interval_s=config.health_check_interval_s,
                probe_timeout_s=config.health_check_timeout_s,
                nice=config.replica_nice,
            )
        return load_engine_class("llamacpp")(**kwargs)  # type: ignore[no-any-return]
    return load_engine_class(config.engine)(config)  # type: ignore[no-any-return]


@dataclass
class _Idle:
    task: asyncio.Task[None] | None = None


class Deployment:
    def __init__(self, config: DeploymentConfig, engines: list[Engine] | None = None) -> None:
        self.config = config
        self.id = config.id
        if engines is None:
            n = 1 if config.engine == "upstream" else config.replicas
            engines = [build_engine(config) for _ in range(n)]
        slots = config.max_num_seqs
        self.replicas = [Replica(self.id, i, e, slots) for i, e in enumerate(engines)]
        self.admission = Admission(
            capacity=sum(r.slots for r in self.replicas),
            max_queue=config.max_queue,
            queue_timeout_s=config.queue_timeout_s,
        )
        for replica in self.replicas:
            watch = getattr(replica.engine, "watch", None)
            if callable(watch):  # engines whose replicas can go down and come back
                watch(self.refresh_capacity)
        self.created = int(time.time())
        self._load_lock = asyncio.Lock()
        self._idle = _Idle()

    @property
    def endpoint_type(self) -> str:
        return self.config.endpoint_type

    async def start(self) -> None:
        if self.config.idle_unload_s is not None:
            self._idle.task = asyncio.create_task(self._unload_idle())
            return  # replicas load on first request
        await asyncio.gather(*(r.start() for r in self.replicas))

    async def close(self) -> None:
        if self._idle.task is not None:
            self._idle.task.cancel()
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)

    async def pick(self) -> Replica:
        """The ready replica with the fewest outstanding requests (loading it if idle)."""
        ready = [r for r in self.replicas if r.serving()]
        if not ready:
            if all(r.state == "unloaded" for r in self.replicas):
                async with self._load_lock:
                    try:
                        await asyncio.gather(
                            *(r.start() for r in self.replicas if r.state == "unloaded")
                        )
                    finally:
                        self.refresh_capacity()
                ready = [r for r in self.replicas if r.state == "ready"]
            if not ready:
                states = ", ".join(r.state for r in self.replicas)
                raise UnavailableError(
                    f"deployment {self.id!r} has no ready replica ({states}); retry shortly"
                )
        best = min(ready, key=lambda r: (r.in_flight, r.last_used))
        best.in_flight += 1
        best.last_used = time.monotonic()
        return best

    async def any_engine(self) -> Engine:
        """A serving replica's engine, for work outside admission (tokenizing).

        Loads the replicas of an idle-unloaded deployment as a generation would.
        """
        replica = await self.pick()
        self.release(replica)
        return replica.engine

    def refresh_capacity(self) -> None:
        """Admit against the slots of the replicas that can serve right now."""
        capacity = sum(r.slots for r in self.replicas if r.available())
        if capacity != self.admission.capacity:
            log.info("deployment %s: capacity %d slots", self.id, capacity)
            self.admission.resize(capacity)

    def release(self, replica: Replica) -> None:
        replica.in_flight -= 1
        replica.last_used = time.monotonic()

    async def _unload_idle(self) -> None:
        limit = self.config.idle_unload_s
        assert limit is not None
        while True:
            await asyncio.sleep(min(limit / 2, 5.0))
            now = time.monotonic()
            for r in self.replicas:
                if r.state == "ready" and r.in_flight == 0 and now - r.last_used > limit:
                    async with self._load_lock:
                        log.info("unloading idle replica %s/%d", self.id, r.index)
                        await r.close()
                        self.refresh_capacity()

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "deployment",
            "engine": self.config.engine,
            "endpoint_type": self.config.endpoint_type,
            "in_flight": sum(r.in_flight for r in self.replicas),
            "queued": self.admission.waiting,
            "replicas": [r.describe() for r in self.replicas],
        }
