"""Autoscaling policy: a deployment's measured load to the replicas it should have.

Pure (no I/O, no clock of its own: every call is given ``now``), so it is tested on
synthetic load traces without a model; :mod:`tokenmill.gateway.scaling` feeds it the
deployment's state every tick and carries out what it decides.

Two decisions, kept apart:

* :class:`ScalePolicy` turns load samples into a **desired replica count**. The load
  is the requests running or waiting (``ongoing``), averaged over ``look_back_s``
  so a burst is not a trend; it asks for ``ceil(ongoing / target_ongoing_requests)``
  replicas, one more than now when the first-token latency's p90 is past
  ``target_ttft_p90_s``. A change takes effect only once the load asked for it
  continuously for ``upscale_delay_s`` (``downscale_delay_s``) *and* at least that
  long has passed since the last change in that direction: at most one scale event
  per direction per window, and noise around a boundary changes nothing. The one
  exception is zero replicas with a request waiting: it gets a replica at once (a
  delay would only be the caller's wait).
* :func:`reconcile` turns the desired count and the replicas' states into actions:
  which replicas to start (the lowest indices not running) and which to drain (the
  least loaded, then the one with the least cache worth keeping, then the newest). A
  replica that died is not a scale event: it is no longer running, so the next
  reconcile starts another in its place while the desired count stands.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# A replica whose first tokens come this close to the TTFT target keeps its replicas.
TTFT_KEEP_FRACTION = 0.8
# How many first-token latencies the p90 is taken over, at most.
TTFT_SAMPLES = 256

Phase = Literal["off", "active", "draining"]


@dataclass(frozen=True, slots=True)
class ScaleTargets:
    """What the policy aims at: ``[deployments.autoscale]`` with its defaults applied."""

    min_replicas: int
    max_replicas: int
    target_ongoing: float
    target_ttft_p90_s: float | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_s: float = 10.0


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The deployment's load at ``at``: requests running or waiting, all gateways'."""

    at: float
    ongoing: float
    ttft_p90_s: float | None = None


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    """A change of the desired count, and the load that asked for it."""

    at: float
    direction: Literal["up", "down"]
    replicas_from: int
    replicas_to: int
    ongoing: float
    ttft_p90_s: float | None


@dataclass
class ScalePolicy:
    """Load samples in, desired replica count out (see the module docstring)."""

    targets: ScaleTargets
    desired: int
    samples: deque[LoadSample] = field(default_factory=deque)
    events: list[ScaleEvent] = field(default_factory=list)
    _up_since: float | None = None
    _down_since: float | None = None
    _last_up: float = -math.inf
    _last_down: float = -math.inf

    def observe(self, sample: LoadSample) -> int:
        """Take one sample; the desired replica count after it."""
        t = self.targets
        self.samples.append(sample)
        while self.samples and self.samples[0].at < sample.at - t.look_back_s:
            self.samples.popleft()
        now = sample.at
        ongoing = sum(s.ongoing for s in self.samples) / len(self.samples)
        want = self.wanted(ongoing, sample.ttft_p90_s)
        if self.desired == 0 and sample.ongoing > 0:
            # From zero: a request waits for a replica, now.
            return self._change(now, "up", max(1, want), ongoing, sample.ttft_p90_s)
        if want > self.desired:
            self._down_since = None
            if self._up_since is None:
                self._up_since = now
            if (
                now - self._up_since >= t.upscale_delay_s
                and now - self._last_up >= t.upscale_delay_s
            ):
                return self._change(now, "up", want, ongoing, sample.ttft_p90_s)
        elif want < self.desired:
            self._up_since = None
            if self._down_since is None:
                self._down_since = now
            if (
                now - self._down_since >= t.downscale_delay_s
                and now - self._last_down >= t.downscale_delay_s
            ):
                return self._change(now, "down", want, ongoing, sample.ttft_p90_s)
        else:
            self._up_since = self._down_since = None
        return self.desired

    def wanted(self, ongoing: float, ttft_p90_s: float | None) -> int:
        """The replicas this load asks for, before any delay: within the bounds."""
        t = self.targets
        # A hair under a whole number is that number (averages of integers drift).
        want = math.ceil(ongoing / t.target_ongoing - 1e-9)
        if t.target_ttft_p90_s is not None and ttft_p90_s is not None and ongoing > 0:
            if ttft_p90_s > t.target_ttft_p90_s:
                want = max(want, self.desired + 1)
            elif ttft_p90_s > TTFT_KEEP_FRACTION * t.target_ttft_p90_s:
                want = max(want, self.desired)  # close to the target: keep what it has
        return min(t.max_replicas, max(t.min_replicas, want))

    def _change(
        self,
        now: float,
        direction: Literal["up", "down"],
        to: int,
        ongoing: float,
        ttft: float | None,
    ) -> int:
        to = min(self.targets.max_replicas, max(self.targets.min_replicas, to))
        if to == self.desired:
            return to
        self.events.append(ScaleEvent(now, direction, self.desired, to, round(ongoing, 3), ttft))
        del self.events[:-64]  # the recent ones, for the describe
        self.desired = to
        self._up_since = self._down_since = None
        if direction == "up":
            self._last_up = now
        else:
            self._last_down = now
        return to


@dataclass(frozen=True, slots=True)
class ReplicaSlot:
    """A replica as :func:`reconcile` sees it: its phase here, whether its host is
    running (loading, ready or restarting: not unloaded), whether it failed (for good,
    or recently enough not to be tried again yet), its load and cache."""

    index: int
    phase: Phase
    running: bool
    failed: bool = False
    in_flight: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """Replicas to start (or bring back from draining), to drain, and to retire
    (active ones that failed for good: their place is taken by another)."""

    start: tuple[int, ...] = ()
    drain: tuple[int, ...] = ()
    retire: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.start or self.drain or self.retire)


def reconcile(desired: int, replicas: Sequence[ReplicaSlot]) -> Plan:
    """What to start, drain and retire so that ``desired`` replicas run.

    A live replica is active, running and not failed. When fewer are live than
    desired: first an active one not running (the one left loadable at zero
    replicas), then one still draining (it is loaded and warm), then the lowest
    spare indices. When more: the least loaded drain first, then the one with the
    least cache worth keeping, then the newest. Zero desired drains every live one
    (the deployment keeps one loadable for its next request).
    """
    usable = [r for r in replicas if not r.failed]
    retire = tuple(r.index for r in replicas if r.phase == "active" and r.failed)
    live = [r for r in usable if r.phase == "active" and r.running]
    start: list[int] = []
    drain: tuple[int, ...] = ()
    if len(live) < desired:
        standby = [r.index for r in usable if r.phase == "active" and not r.running]
        draining = [
            r.index
            for r in sorted(
                (r for r in usable if r.phase == "draining" and r.running),
                key=lambda r: (-r.in_flight, -r.cached_tokens, r.index),
            )
        ]
        spare = [r.index for r in usable if r.phase == "off"]
        start = (standby + draining + spare)[: desired - len(live)]
    elif len(live) > desired:
        victims = sorted(live, key=lambda r: (r.in_flight, r.cached_tokens, -r.index))
        drain = tuple(r.index for r in victims[: len(live) - desired])
    return Plan(start=tuple(start), drain=drain, retire=retire)


@dataclass
class FirstTokens:
    """The deployment's recent first-token latencies: when each came, and how long."""

    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=TTFT_SAMPLES))

    def add(self, at: float, ttft_s: float) -> None:
        self.samples.append((at, ttft_s))

    def p90(self, since: float) -> float | None:
        """The p90 of those that came at or after ``since``; None when none did."""
        return p90([s for at, s in self.samples if at >= since])


def unix_events(events: Sequence[ScaleEvent], now_unix: float, now: float) -> list[dict[str, Any]]:
    """Scale events with ``at`` as Unix time, given both clocks read now (their
    monotonic time is this process's)."""
    return [{**dataclasses.asdict(e), "at": round(now_unix - (now - e.at), 3)} for e in events]


def p90(values: Sequence[float]) -> float | None:
    """The 90th percentile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


__all__ = [
    "TTFT_SAMPLES",
    "FirstTokens",
    "LoadSample",
    "Plan",
    "ReplicaSlot",
    "ScaleEvent",
    "ScalePolicy",
    "ScaleTargets",
    "p90",
    "reconcile",
    "unix_events",
]
