"""A deployment's replicas and their transitions (tokenmill.gateway.replicaset), with
hosts a test scripts: every transition leaves the admitted capacity right by itself,
the one way to zero leaves the last replica loadable, and idle unloading is a decision
(min_replicas = 0) like the autoscaler's. Nothing here waits on a clock: each
transition is awaited until the set says it is done."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from tokenmill.engines import EngineHealth
from tokenmill.gateway.admission import Admission
from tokenmill.gateway.autoscale import LoadSample
from tokenmill.gateway.replicaset import ReplicaSet
from tokenmill.gateway.scaling import IdleDecider
from tokenmill.replicas import ReplicaHost, ReplicaState

SLOTS = 2


class Host:
    """A replica host whose start and close take effect at once, as its state says."""

    kind = "process"

    def __init__(self, state: ReplicaState = "ready") -> None:
        self.state: ReplicaState = state
        self.changed: list[Callable[[], None]] = []
        self.starts = self.closes = 0

    def on_change(self, callback: Callable[[], None]) -> None:
        self.changed.append(callback)

    def on_cache(self, callback: Any) -> None: ...

    def on_status(self, callback: Any) -> None: ...

    def _become(self, state: ReplicaState) -> None:
        self.state = state
        for callback in self.changed:
            callback()

    async def start(self) -> None:
        self.starts += 1
        self._become("ready")

    async def close(self) -> None:
        self.closes += 1
        self._become("unloaded")

    def health(self) -> EngineHealth:
        return EngineHealth(ready=self.state == "ready", slots=SLOTS, running=0)

    async def held_kv(self, min_tokens: int) -> list[tuple[int, ...]]:
        return []


def replica_set(*states: ReplicaState, spares_from: int | None = None) -> ReplicaSet:
    hosts = [cast(ReplicaHost, Host(s)) for s in states]
    admission = Admission(capacity=0, max_queue=8, queue_timeout_s=1.0)
    return ReplicaSet("d", hosts, SLOTS, admission, spares_from=spares_from)


def phases(rs: ReplicaSet) -> list[tuple[str, str]]:
    return [(r.phase, r.state) for r in rs.replicas]


async def test_every_transition_refreshes_the_capacity_itself() -> None:
    rs = replica_set("ready", "unloaded", spares_from=1)
    spare = rs.replicas[1]
    assert phases(rs) == [("active", "ready"), ("off", "unloaded")]
    assert rs.admission.capacity == SLOTS  # the spare's slots are not admitted
    rs.add(spare)  # started: joins admission once it serves
    await rs.settled(spare)
    assert phases(rs) == [("active", "ready"), ("active", "ready")]
    assert rs.admission.capacity == 2 * SLOTS
    rs.take(spare, 1)
    rs.remove(spare, drain_s=3600.0)  # draining: its stream's slot stays counted
    assert spare.phase == "draining" and rs.admission.capacity == SLOTS + 1
    assert [r.index for r in rs.serving()] == [0]
    rs.release(spare)  # its last stream ended: it goes
    await rs.settled(spare)
    assert phases(rs) == [("active", "ready"), ("off", "unloaded")]
    assert rs.admission.capacity == SLOTS


async def test_a_draining_replica_wanted_again_serves_on_warm() -> None:
    rs = replica_set("ready", "ready")
    leaving = rs.replicas[1]
    rs.take(leaving, 1)
    rs.remove(leaving, drain_s=3600.0)
    rs.add(leaving)
    await rs.settled(leaving)
    assert phases(rs) == [("active", "ready"), ("active", "ready")]
    assert cast(Host, leaving.host).closes == 0 and rs.admission.capacity == 2 * SLOTS


async def test_the_one_way_to_zero_leaves_the_last_replica_loadable() -> None:
    rs = replica_set("ready")
    (last,) = rs.replicas
    asked: list[bool] = []
    rs.on_demand = lambda: asked.append(True)
    rs.preparing = 1  # a request being prepared: nothing unloads under it
    rs.remove(last, drain_s=0.0)
    await rs.settled(last)
    assert phases(rs) == [("active", "ready")]
    rs.preparing = 0
    rs.remove(last, drain_s=0.0)
    await rs.settled(last)
    # Unloaded in place: still active and counted, so a request waits for it.
    assert phases(rs) == [("active", "unloaded")] and rs.admission.capacity == SLOTS
    ready = await rs.ready()  # the next request loads it, and says so first
    assert ready == [last] and asked == [True] and last.state == "ready"


async def test_a_failed_replica_is_retired_out_of_admission() -> None:
    rs = replica_set("ready", "unhealthy")
    assert rs.admission.capacity == SLOTS  # an unhealthy replica is not counted
    failed = rs.replicas[1]
    rs.retire(failed)
    await rs.settled(failed)
    assert phases(rs) == [("active", "ready"), ("off", "unloaded")]
    assert rs.admission.capacity == SLOTS


def test_idle_unloading_is_a_decision_to_have_none() -> None:
    rs = replica_set("unloaded", "unloaded")
    idle = IdleDecider(rs, idle_s=10.0)
    # Never used: none (the replicas load on the first request).
    assert idle.observe(LoadSample(at=100.0, ongoing=0)) == 0
    assert idle.observe(LoadSample(at=100.0, ongoing=1)) == 2  # a request: all of them
    rs.last_use = 100.0  # it ended then
    assert idle.observe(LoadSample(at=109.9, ongoing=0)) == 2
    assert idle.observe(LoadSample(at=110.0, ongoing=0)) == 0
    moves = [(e["replicas_from"], e["replicas_to"]) for e in idle.events()]
    assert moves == [(0, 2), (2, 0)]
