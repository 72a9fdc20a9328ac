"""The autoscaling policy on synthetic load traces (tokenmill.gateway.autoscale): pure,
no model, no clock: every sample carries its own time."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable

from tokenmill.gateway.autoscale import (
    FirstTokens,
    LoadSample,
    Plan,
    ReplicaSlot,
    ScalePolicy,
    ScaleTargets,
    p90,
    reconcile,
)

TICK = 0.25


def targets(**keys: float | int | None) -> ScaleTargets:
    base: dict[str, float | int | None] = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_ongoing": 4.0,
        "upscale_delay_s": 5.0,
        "downscale_delay_s": 20.0,
        "look_back_s": 2.0,
    }
    base.update(keys)
    return ScaleTargets(**base)  # type: ignore[arg-type]


def run(
    policy: ScalePolicy,
    load: Callable[[float], float],
    until: float,
    start: float = 0.0,
    ttft: Callable[[float], float | None] = lambda t: None,
) -> list[tuple[float, int]]:
    """Feed ``load(t)`` every tick from ``start`` to ``until``: (t, desired) each tick."""
    out = []
    for i in range(round((until - start) / TICK)):
        t = start + i * TICK
        out.append((t, policy.observe(LoadSample(t, load(t), ttft(t)))))
    return out


def changes(trace: Iterable[tuple[float, int]]) -> list[tuple[float, int]]:
    last = None
    out = []
    for t, n in trace:
        if n != last:
            out.append((t, n))
            last = n
    return out


def test_a_step_up_waits_the_delay_then_jumps_to_what_the_load_needs() -> None:
    policy = ScalePolicy(targets(), desired=1)
    trace = run(policy, lambda t: 2.0 if t < 10 else 12.0, until=30)
    # 12 ongoing at 4 a replica: 3 replicas, once the 2 s average passed 4 (at 10.25)
    # and stayed there for the 5 s delay.
    assert changes(trace) == [(0.0, 1), (15.25, 3)], changes(trace)
    [event] = policy.events
    assert (event.direction, event.replicas_from, event.replicas_to) == ("up", 1, 3)


def test_a_spike_shorter_than_the_delay_changes_nothing() -> None:
    policy = ScalePolicy(targets(), desired=1)
    trace = run(policy, lambda t: 30.0 if 10 <= t < 13 else 1.0, until=60)
    assert {n for _, n in trace} == {1}
    assert policy.events == []


def test_noise_around_a_boundary_never_flaps() -> None:
    policy = ScalePolicy(targets(), desired=2)
    # Around 8 ongoing (2 replicas' worth), +-3 every other tick: the 2 s average
    # stays within a hair of 8.
    trace = run(policy, lambda t: 8.0 + (3.0 if int(t / TICK) % 2 else -3.0), until=120)
    assert {n for _, n in trace} == {2}, changes(trace)


def test_a_ramp_scales_up_at_most_once_per_delay_window_and_down_after_idle() -> None:
    policy = ScalePolicy(targets(max_replicas=6), desired=1)

    # 0 -> 24 ongoing over 40 s, held 20 s, then nothing.
    def load(t: float) -> float:
        return min(24.0, 24.0 * t / 40) if t < 60 else 0.0

    trace = run(policy, load, until=120)
    ups = [e for e in policy.events if e.direction == "up"]
    assert len(ups) >= 2 and ups[-1].replicas_to == 6, policy.events
    for a, b in itertools.pairwise(ups):
        assert b.at - a.at >= 5.0, policy.events
    downs = [e for e in policy.events if e.direction == "down"]
    # Idle from 60 s (the average empty by 62 s): down to the minimum 20 s later.
    assert [(d.replicas_from, d.replicas_to) for d in downs] == [(6, 1)], policy.events
    assert 80.0 <= downs[0].at <= 82.5
    assert trace[-1][1] == 1


def test_down_steps_are_one_per_window() -> None:
    policy = ScalePolicy(targets(downscale_delay_s=10.0), desired=6)
    # 20 ongoing (5 replicas), then 8 (2) right after the first step down.
    trace = run(policy, lambda t: 20.0 if t < 12.5 else 8.0, until=40)
    downs = [(e.at, e.replicas_to) for e in policy.events]
    assert downs[0][1] == 5 and downs[1][1] == 2, downs
    assert downs[1][0] - downs[0][0] >= 10.0, downs
    assert trace[-1][1] == 2


def test_bounds_hold_whatever_the_load() -> None:
    policy = ScalePolicy(targets(min_replicas=2, max_replicas=3), desired=2)
    run(policy, lambda t: 100.0, until=20)
    assert policy.desired == 3
    run(policy, lambda t: 0.0, start=20, until=80)
    assert policy.desired == 2


def test_zero_replicas_get_one_at_once_for_a_waiting_request() -> None:
    policy = ScalePolicy(targets(min_replicas=0, downscale_delay_s=5.0), desired=1)
    trace = run(policy, lambda t: 0.0, until=10)
    assert policy.desired == 0 and changes(trace)[-1][1] == 0
    # A request arrives: no upscale delay from zero (it would only be its wait).
    assert policy.observe(LoadSample(10.0, 1.0)) == 1
    assert policy.events[-1].direction == "up"


def test_a_slow_first_token_adds_a_replica_below_the_ongoing_target() -> None:
    policy = ScalePolicy(targets(target_ttft_p90_s=1.0), desired=1)
    # 3 ongoing fit one replica by count, but its first tokens take 2 s.
    trace = run(policy, lambda t: 3.0, until=8, ttft=lambda t: 2.0)
    assert changes(trace) == [(0.0, 1), (5.0, 2)], changes(trace)
    # Close to the target (0.9 s): the replicas it has stay, though the count says 1.
    run(policy, lambda t: 3.0, start=8, until=60, ttft=lambda t: 0.9)
    assert policy.desired == 2
    # Well under it: back to what the count asks for.
    run(policy, lambda t: 3.0, start=60, until=100, ttft=lambda t: 0.2)
    assert policy.desired == 1


def slots(*specs: tuple[str, bool], failed: Iterable[int] = ()) -> list[ReplicaSlot]:
    return [
        ReplicaSlot(index=i, phase=phase, running=running, failed=i in set(failed))  # type: ignore[arg-type]
        for i, (phase, running) in enumerate(specs)
    ]


def test_reconcile_starts_the_lowest_spares_and_drains_the_least_loaded() -> None:
    replicas = slots(("active", True), ("off", False), ("off", False), ("off", False))
    assert reconcile(3, replicas) == Plan(start=(1, 2))
    loaded = [
        ReplicaSlot(0, "active", True, in_flight=2, cached_tokens=64),
        ReplicaSlot(1, "active", True, in_flight=0, cached_tokens=512),
        ReplicaSlot(2, "active", True, in_flight=0, cached_tokens=32),
    ]
    assert reconcile(1, loaded) == Plan(drain=(2, 1))
    assert not reconcile(3, loaded)


def test_a_draining_replica_is_brought_back_before_a_cold_spare() -> None:
    replicas = [
        ReplicaSlot(0, "active", True),
        ReplicaSlot(1, "off", False),
        ReplicaSlot(2, "draining", True, in_flight=1),
    ]
    assert reconcile(2, replicas) == Plan(start=(2,))


def test_a_replica_that_dies_during_a_scale_up_is_replaced_not_counted() -> None:
    policy = ScalePolicy(targets(upscale_delay_s=0.0), desired=1)
    assert policy.observe(LoadSample(0.0, 12.0)) == 3
    replicas = slots(("active", True), ("off", False), ("off", False), ("off", False))
    plan = reconcile(policy.desired, replicas)
    assert plan.start == (1, 2)
    # Replica 2 fails to load: retired, and spare 3 takes its place; the desired count
    # stands (no scale event for a death).
    replicas = slots(
        ("active", True), ("active", True), ("active", False), ("off", False), failed=[2]
    )
    assert reconcile(policy.desired, replicas) == Plan(start=(3,), retire=(2,))
    # Retired and recently failed: not tried again while another spare exists.
    replicas = slots(
        ("active", True), ("active", True), ("off", False), ("active", True), failed=[2]
    )
    assert not reconcile(policy.desired, replicas)
    assert len(policy.events) == 1


def test_zero_desired_drains_every_live_replica() -> None:
    replicas = slots(("active", True), ("active", True), ("off", False))
    assert reconcile(0, replicas) == Plan(drain=(1, 0))
    # At zero, the one left loadable (active, unloaded) is what comes back first.
    assert reconcile(1, slots(("off", False), ("active", False))) == Plan(start=(1,))


def test_first_token_p90() -> None:
    window = FirstTokens()
    for i in range(20):
        window.add(float(i), 0.1 if i % 10 else 5.0)
    assert window.p90(since=0.0) == 0.1
    assert window.p90(since=10.0) == 0.1
    assert window.p90(since=19.5) is None
    assert p90([3.0]) == 3.0
    assert math.isclose(p90([float(v) for v in range(1, 11)]) or 0.0, 9.0)
