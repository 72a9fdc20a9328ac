"""Prometheus metrics: a gateway :class:`~tokenmill.gateway.core.Observer` plus gauges.

Counters and histograms are fed by the gateway's observer hooks, so they count what
the gateway itself settled: ``tokenmill_generation_tokens_total`` moves by exactly
the ``completion_tokens`` of every request, including streams whose client left
(those tokens were produced and are paid for). Gauges (running, waiting, KV cache)
are read from the deployments when Prometheus scrapes, so they cost nothing between
scrapes. Names follow vLLM's (``vllm:`` becomes ``tokenmill_``) and every series has
a ``deployment`` label.

Fair share shows by priority class (three values: bounded): queue time and tokens
served per class. Tokens served per account are opt-in (``metrics_per_account``): one
series per account is unbounded where accounts are many.

Each :class:`GatewayMetrics` owns its own :class:`CollectorRegistry`: several apps
in one process (tests, embedded use) never clash on the global registry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill import stages
from tokenmill.gateway import Gateway, RequestRecord

log = logging.getLogger("tokenmill.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# The stages of a first token (tokenmill.stages): tens of microseconds to a prefill.
STAGE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip
# A llama.cpp replica's KV pool, host and disk tiers, by its health().kv key
# (docs/operations.md).
KV_SERIES: dict[str, tuple[str, str]] = {
    "pool_tokens": ("gauge", "KV cells of the replica's pool."),
    "pool_used_tokens": ("gauge", "KV cells of the pool holding tokens (running or cached)."),
    "host_bytes": ("gauge", "Bytes of KV sequences parked in host memory."),
    "host_capacity_bytes": ("gauge", "The host tier's bound in bytes (kv_host_bytes)."),
    "host_entries": ("gauge", "Sequences parked in host memory as a cache."),
    "host_parks": ("counter", "Sequences parked in host memory."),
    "host_hits": ("counter", "Prompts whose longest cached prefix was parked in host memory."),
    "host_restores": ("counter", "Parked sequences restored into a slot (hits and resumes)."),
    "host_evictions": ("counter", "Parked sequences dropped, least recently used, for room."),
    "preemptions": ("counter", "Running sequences swapped out of a full KV pool."),
    "span_trims": (
        "counter",
        "Free slots cut to what they share before a long prefill (a tight attention span).",
    ),
    "exports": ("counter", "Sequences' KV states handed to another replica."),
    "imports": ("counter", "Sequences' KV states taken from another replica."),
    "spec_drafted": ("counter", "Draft tokens verified (speculative decoding)."),
    "spec_accepted": (
        "counter",
        "Draft tokens kept: tokens written without a decode step of their own.",
    ),
    "disk_bytes": ("gauge", "Bytes of the disk tier's files (kv_disk_dir)."),
    "disk_capacity_bytes": ("gauge", "The disk tier's bound in bytes (kv_disk_bytes)."),
    "disk_entries": ("gauge", "Sequences in the disk tier's files."),
    "disk_written_bytes": ("counter", "Bytes of parked sequences written to the disk tier."),
    "disk_hits": ("counter", "Prompts whose longest cached prefix was a disk tier file."),
    "disk_restored_tokens": ("counter", "Tokens restored from the disk tier that prompts reused."),
    "disk_dropped": ("counter", "Disk tier files deleted as stale, foreign or corrupt."),
}
QUEUE_BUCKETS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class _Bound:
    """One deployment's metric children, bound once so the hot path skips ``labels()``."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram
    prompt: Counter
    generation: Counter
    spend: Counter


class GatewayMetrics:
    """Observer feeding Prometheus metrics; attach with ``gateway.observers.append``."""

    def __init__(
        self,
        gateway: Gateway,
        registry: CollectorRegistry | None = None,
        *,
        per_account: bool = False,
    ) -> None:
        self.gateway = gateway
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "tokenmill_time_to_first_token_seconds",
            "Time from arrival to the first token, in seconds.",
            ["deployment"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenmill_inter_token_latency_seconds",
            "Time between successive streamed text chunks of one request, in seconds.",
            ["deployment"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenmill_e2e_request_latency_seconds",
            "Time from arrival to the end of the request, in seconds.",
            ["deployment"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "tokenmill_request_queue_time_seconds",
            "Time a request waited in the admission queue, in seconds.",
            ["deployment"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.class_queue = Histogram(
            "tokenmill_queue_time_by_priority_seconds",
            "Time a request waited in the admission queue, by its priority class.",
            ["deployment", "priority"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.served = Counter(
            "tokenmill_served_tokens",
            "Prompt and completion tokens served, by priority class.",
            ["deployment", "priority"],
            registry=r,
        )
        self.account_served = (
            Counter(
                "tokenmill_account_served_tokens",
                "Prompt and completion tokens served, by account (metrics_per_account).",
                ["deployment", "account"],
                registry=r,
            )
            if per_account
            else None
        )
        self.stage = Histogram(
            "tokenmill_first_token_stage_seconds",
            "Time a request's first token spent in each stage of its way, from the "
            "request's first byte to the token's SSE event written (tokenmill.stages).",
            ["deployment", "stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self._stages: dict[tuple[str, str], Histogram] = {}
        # prometheus_client appends the ``_total`` suffix to counters itself.
        self.prompt = Counter(
            "tokenmill_prompt_tokens",
            "Prompt tokens of admitted requests.",
            ["deployment"],
            registry=r,
        )
        self.generation = Counter(
            "tokenmill_generation_tokens",
            "Tokens generated, including those of requests whose client left.",
            ["deployment"],
            registry=r,
        )
        self.success = Counter(
            "tokenmill_request_success",
            "Requests that ended without error, by finish reason (abort: client left).",
            ["deployment", "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "tokenmill_request_errors",
            "Requests that failed or were refused, by OpenAI error code.",
            ["deployment", "code"],
            registry=r,
        )
        self.spend = Counter(
            "tokenmill_spend",
            "Amount charged, in micro-units of the price currency.",
            ["deployment"],
            registry=r,
        )
        self.routed = Counter(
            "tokenmill_routing_decisions",
            "Requests routed, by the replica chosen, why, and the tier where it held the "
            "prompt's cached prefix (slot, host, or none) (docs/routing.md).",
            ["deployment", "replica", "reason", "tier"],
            registry=r,
        )
        self.cache_hits = Counter(
            "tokenmill_cache_hit_tokens",
            "Prompt tokens a replica found in its KV cache (usage.cached_tokens).",
            ["deployment", "replica"],
            registry=r,
        )
        self.registry.register(_LoadCollector(gateway))
        self._budgets = _BudgetCollector()
        self.registry.register(self._budgets)
        self._bound: dict[str, _Bound] = {}
        # request id -> monotonic time of its previous text chunk (inter-token latency).
        self._last_chunk: dict[str, float] = {}
        for name in gateway.deployments:
            self._bind(name)

    def _bind(self, deployment: str) -> _Bound:
        b = self._bound.get(deployment)
        if b is None:
            b = _Bound(
                ttft=self.ttft.labels(deployment),
                itl=self.itl.labels(deployment),
                e2e=self.e2e.labels(deployment),
                queue=self.queue.labels(deployment),
                prompt=self.prompt.labels(deployment),
                generation=self.generation.labels(deployment),
                spend=self.spend.labels(deployment),
            )
            self._bound[deployment] = b
        return b

    # -- Observer ---------------------------------------------------------------------

    def on_start(self, record: RequestRecord) -> None:
        try:
            self._bind(record.deployment).queue.observe(record.queue_s)
            self.class_queue.labels(record.deployment, record.caller.priority).observe(
                record.queue_s
            )
            route = record.route
            if route is not None:
                tier = route.tier or "none"
                self.routed.labels(record.deployment, str(route.index), route.reason, tier).inc()
        except Exception:  # an observer must never break a request
            log.exception("metrics: on_start failed")

    def on_tokens(self, record: RequestRecord, now: float) -> None:
        # The hot path: one dict lookup, one store, one histogram observe.
        rid = record.request_id
        last = self._last_chunk.get(rid)
        self._last_chunk[rid] = now
        if last is not None:
            b = self._bound.get(record.deployment)
            if b is not None:
                b.itl.observe(now - last)

    def on_finish(self, record: RequestRecord) -> None:
        try:
            self._finish(record)
        except Exception:
            log.exception("metrics: on_finish failed")

    def _finish(self, record: RequestRecord) -> None:
        self._last_chunk.pop(record.request_id, None)
        b = self._bind(record.deployment)
        if record.status == "rejected":
            # Refused before generation (queue full, no credit): nothing ran.
            self.errors.labels(record.deployment, record.error_code or "unknown").inc()
            return
        b.prompt.inc(record.prompt_tokens)
        b.generation.inc(record.completion_tokens)
        served = record.prompt_tokens + record.completion_tokens
        self.served.labels(record.deployment, record.caller.priority).inc(served)
        if self.account_served is not None:
            self.account_served.labels(record.deployment, record.caller.account_id).inc(served)
        if record.route is not None and record.cached_tokens:
            self.cache_hits.labels(record.deployment, str(record.route.index)).inc(
                record.cached_tokens
            )
        if record.charged:
            b.spend.inc(record.charged)
        b.e2e.observe(record.duration_s)
        if record.ttft_s is not None:
            b.ttft.observe(record.ttft_s)
            for name, seconds in stages.durations(record.marks).items():
                key = (record.deployment, name)
                child = self._stages.get(key)
                if child is None:
                    child = self._stages[key] = self.stage.labels(*key)
                child.observe(seconds)
        if record.status == "error":
            self.errors.labels(record.deployment, record.error_code or "engine_error").inc()
        else:
            self.success.labels(record.deployment, record.finish_reason).inc()

    # -- exposition -------------------------------------------------------------------

    def render(self, budgets: Iterable[BudgetReading] = ()) -> bytes:
        """The registry in Prometheus text format, with ``budgets`` (read from the
        ledger for this scrape) as the budget gauges."""
        self._budgets.readings = list(budgets)
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class BudgetReading:
    """One budget window of a key or account as the ledger has it now."""

    owner_type: str  # account or key
    owner: str
    duration: str
    spent: int
    remaining: int


class _BudgetCollector(Collector):
    """Spend budgets' windows (docs/metering.md#budgets): one series a window an admin
    set, so as many as the budgets configured, whatever the traffic."""

    def __init__(self) -> None:
        self.readings: list[BudgetReading] = []

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        remaining, spent = self._families()
        for b in self.readings:
            labels = [b.owner_type, b.owner, b.duration]
            remaining.add_metric(labels, b.remaining)
            spent.add_metric(labels, b.spent)
        yield remaining
        yield spent

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        labels = ["owner_type", "owner", "duration"]
        return (
            GaugeMetricFamily(
                "tokenmill_budget_remaining_micro_units",
                "What a budget window has left to spend until it resets.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "tokenmill_budget_spent_micro_units",
                "What a budget window has charged, and holds for requests running.",
                labels=labels,
            ),
        )


class _LoadCollector(Collector):
    """Gauges read from the deployments at scrape time."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        for dep_id, dep in self.gateway.deployments.items():
            running = waiting = 0
            usage: list[float] = []
            for replica in dep.replicas:
                try:
                    h = replica.host.health()
                except Exception:  # an unloaded or crashed replica: nothing to report
                    continue
                running += h.running
                waiting += h.waiting
                if h.ready:
                    usage.append(h.kv_cache_usage)
            # Requests queued in admission wait just like those in the engines' inboxes.
            waiting += dep.admission.waiting
            families[0].add_metric([dep_id], running)
            families[1].add_metric([dep_id], waiting)
            families[2].add_metric([dep_id], sum(usage) / len(usage) if usage else 0.0)
        yield from families
        yield from self._kv_families()
        yield from self._move_families()
        yield from self._scaling_families()

    def _scaling_families(self) -> Iterator[Metric]:
        """What an autoscaler outside tokenmill (KEDA, an HPA) scales on, and what
        tokenmill's own decided (docs/autoscaling.md)."""
        desired = GaugeMetricFamily(
            "tokenmill_replicas_desired",
            "Replicas the deployment wants now: its autoscaler's decision, or its fixed "
            "replica count.",
            labels=["deployment"],
        )
        replicas = GaugeMetricFamily(
            "tokenmill_replicas",
            "The deployment's replicas by phase (active, draining, off) and whether they "
            "serve now.",
            labels=["deployment", "phase", "serving"],
        )
        queued = GaugeMetricFamily(
            "tokenmill_queue_depth",
            "Requests waiting in the deployment's admission queue, by priority class.",
            labels=["deployment", "class"],
        )
        slots = GaugeMetricFamily(
            "tokenmill_slot_usage_perc",
            "Fraction of the deployment's admitted slots in use (0 to 1; above 1 while "
            "draining replicas finish streams).",
            labels=["deployment"],
        )
        for dep_id, dep in self.gateway.deployments.items():
            wanted = dep.scaler.desired if dep.scaler is not None else len(dep.replicas)
            desired.add_metric([dep_id], wanted)
            counts: dict[tuple[str, str], int] = {}
            for r in dep.replicas:
                key = (r.phase, str(r.serving()).lower())
                counts[key] = counts.get(key, 0) + 1
            for (phase, serving), n in sorted(counts.items()):
                replicas.add_metric([dep_id, phase, serving], n)
            by_class = dep.admission.waiting_by_class()
            for klass in ("interactive", "default", "batch"):
                queued.add_metric([dep_id, klass], by_class.get(klass, 0))
            capacity = dep.admission.capacity
            slots.add_metric([dep_id], dep.admission.active / capacity if capacity else 0.0)
        yield from (desired, replicas, queued, slots)

    def _move_families(self) -> Iterator[Metric]:
        """KV state moved between each deployment's replicas (tokenmill.gateway.moves)."""
        moves = CounterMetricFamily(
            "tokenmill_kv_moves",
            "KV state moves between replicas that routing decided, by outcome (moved, "
            "missing, refused, failed).",
            labels=["deployment", "outcome"],
        )
        moved = CounterMetricFamily(
            "tokenmill_kv_moved_bytes",
            "Bytes of KV state moved between replicas.",
            labels=["deployment"],
        )
        for dep_id, dep in self.gateway.deployments.items():
            for outcome, count in dep.moves.outcomes.items():
                moves.add_metric([dep_id, outcome], count)
            moved.add_metric([dep_id], dep.moves.bytes_moved)
        yield moves
        yield moved

    def _kv_families(self) -> Iterator[Metric]:
        """Every llama.cpp replica's KV pool and host-memory tier (``health().kv``)."""
        families = {
            name: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"tokenmill_kv_{name}", doc, labels=["deployment", "replica"]
            )
            for name, (kind, doc) in KV_SERIES.items()
        }
        for dep_id, dep in self.gateway.deployments.items():
            for replica in dep.replicas:
                try:
                    kv = replica.host.health().kv
                except Exception:  # an unloaded or crashed replica: nothing to report
                    continue
                for name, family in families.items():
                    if name in kv:
                        family.add_metric([dep_id, str(replica.index)], kv[name])
        yield from families.values()

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "tokenmill_num_requests_running",
                "Requests generating on the deployment's replicas.",
                labels=["deployment"],
            ),
            GaugeMetricFamily(
                "tokenmill_num_requests_waiting",
                "Requests admitted or queued but not yet generating.",
                labels=["deployment"],
            ),
            GaugeMetricFamily(
                "tokenmill_kv_cache_usage_perc",
                "Fraction of KV cache in use (0 to 1), averaged over ready replicas.",
                labels=["deployment"],
            ),
        ]
