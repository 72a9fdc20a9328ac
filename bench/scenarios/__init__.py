"""The scenarios of ``make bench``, in the order they run and print: add a new one here.

Each entry is a module of this package with a ``SCENARIO`` satisfying
``scenario.Scenario`` (see ``bench/README.md``).
"""

from __future__ import annotations

from scenario import Scenario

from . import (
    agents,
    autoscale,
    batch,
    constrained,
    fairness,
    kvcluster,
    kvdrift,
    kvtier,
    logprobs,
    ray,
    routing,
    speculative,
    tracing,
    versus,
    weights,
)

SCENARIOS: tuple[Scenario, ...] = (
    versus.SCENARIO,
    logprobs.SCENARIO,
    constrained.SCENARIO,
    ray.SCENARIO,
    fairness.SCENARIO,
    routing.SCENARIO,
    kvtier.SCENARIO,
    kvcluster.SCENARIO,
    batch.SCENARIO,
    autoscale.SCENARIO,
    speculative.SCENARIO,
    weights.SCENARIO,
    kvdrift.SCENARIO,
    tracing.SCENARIO,
    agents.SCENARIO,
)
