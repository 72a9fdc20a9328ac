"""One run of load against one server, and the order runs are made in.

A run is one ``tokenmill bench`` process (``src/tokenmill/bench.py``, the closed-loop
load generator) against one server at one concurrency, with the CPU it cost per output
token split between the server's processes and the load generator, and for tokenmill
its requests' first-token stages from its log. :class:`Plan` says how many requests a
level sends and whether its workers start staggered; :func:`interleaved` orders the
runs of several servers so that a slow phase of a shared machine hits all alike.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from firsttoken import log_size, read_stages
from probes import client_cpu_seconds, cpu_split
from servers import SLOTS, Server, log

T = TypeVar("T")

# Levels from STEADY_FROM up send STEADY_REQUESTS_PER_WORKER requests per worker, the
# workers started one after another (``tokenmill bench --stagger``): sent all at once,
# 16 requests arrive together, are prefilled together and end together, in waves whose
# TTFT p50 moves by a whole prefill step from one run to the next. Staggered, every
# request arrives while the 15 others decode, and stays so. The first request of each
# worker is the ramp: in tokens/s, not in the latency figures, so 4 per worker leave
# 3 x 16 = 48 requests measured (2 x 16 + 4 = 36 in waves before).
STEADY_FROM = SLOTS
STEADY_REQUESTS_PER_WORKER = 4


@dataclass(frozen=True, slots=True)
class Plan:
    """How a level's runs send their requests."""

    requests: int
    stagger: bool

    @staticmethod
    def for_level(concurrency: int, lockstep: bool = False) -> Plan:
        """The steady plan from ``STEADY_FROM`` up (unless ``lockstep``: all workers at
        once, as before); below it ``2c + 4`` requests, all workers at once."""
        if concurrency >= STEADY_FROM and concurrency > 1 and not lockstep:
            return Plan(STEADY_REQUESTS_PER_WORKER * concurrency, True)
        return Plan(2 * concurrency + 4, False)

    def describe(self, concurrency: int, max_tokens: int) -> str:
        if not self.stagger:
            return f"c={concurrency}: {self.requests} requests, all workers at once"
        step = math.ceil(max_tokens / concurrency)
        return (
            f"c={concurrency}: {self.requests} requests, workers started {step} "
            f"token{'s' if step != 1 else ''} apart "
            f"(1/{concurrency} of a request); TTFT and ITL over the "
            f"{self.requests - concurrency} after each worker's first"
        )


def plan_line(levels: Sequence[int], max_tokens: int, lockstep: bool = False) -> str:
    """What the levels' runs sent, for a table's header."""
    return "load per run: " + "; ".join(
        Plan.for_level(c, lockstep).describe(c, max_tokens) for c in levels
    )


def run_bench(
    server: Server,
    concurrency: int,
    max_tokens: int,
    plan: Plan,
    busy: int = 0,
    top_logprobs: int | None = None,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``tokenmill bench --json`` against ``server``: its report."""
    # `python -m tokenmill.bench` is `tokenmill bench` without importing the other
    # subcommands, so a broken unrelated CLI module cannot stop the benchmark.
    cmd = [sys.executable, "-m", "tokenmill.bench", server.url, "--model", server.model]
    cmd += ["--concurrency", str(concurrency), "--requests", str(plan.requests)]
    cmd += ["--max-tokens", str(max_tokens), "--busy", str(busy), "--json"]
    if plan.stagger:
        cmd.append("--stagger")
    if top_logprobs is not None:
        cmd += ["--top-logprobs", str(top_logprobs)]
    cmd += extra
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"tokenmill bench printed nothing (exit {out.returncode})")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def cpu_per_token(
    before: dict[str, float], after: dict[str, float], client_s: float, report: dict[str, Any]
) -> dict[str, float]:
    """CPU milliseconds per output token of one run: the server process (tokenmill's
    gateway; all of llama-server), its children (tokenmill's replica) and the load
    generator. With two cores, every one of them is taken from llama.cpp's threads.

    Any other key of ``before`` / ``after`` is a group of processes of the server's tree
    (:attr:`Server.cpu_groups`): each gets its figure, and ``other`` is the rest of the
    tree (the server process and its descendants less every group)."""
    tokens = max(1, int(report["output_tokens"]))

    def ms(key: str) -> float:
        return round((after[key] - before[key]) * 1000 / tokens, 3)

    out = {"server": ms("process"), "children": ms("children")}
    groups = [k for k in after if k not in ("process", "children")]
    for k in groups:
        out[k] = ms(k)
    if groups:
        out["other"] = round(out["server"] + out["children"] - sum(out[k] for k in groups), 3)
    out["client"] = round(client_s * 1000 / tokens, 3)
    return out


def one_run(
    s: Server,
    c: int,
    max_tokens: int,
    plan: Plan,
    busy: int = 0,
    top_logprobs: int | None = None,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One ``tokenmill bench`` run against ``s``, with the CPU it cost per token (and
    for tokenmill, its requests' first-token stages from its log)."""
    offset = log_size(s.log_path)
    before, client_before = cpu_split(s.proc.pid, s.cpu_groups), client_cpu_seconds()
    report = run_bench(s, c, max_tokens, plan, busy, top_logprobs, extra)
    after = cpu_split(s.proc.pid, s.cpu_groups)
    report["cpu_ms_per_token"] = cpu_per_token(
        before, after, client_cpu_seconds() - client_before, report
    )
    if s.is_tokenmill:
        # A request's line is logged once it is settled, just after its [DONE].
        deadline = time.monotonic() + 2.0
        stages = read_stages(s.log_path, offset)
        while len(stages) < report["completed"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stages = read_stages(s.log_path, offset)
        report["stages_ms"] = stages
    return report


def interleaved(
    servers: Sequence[T], levels: Sequence[int], reps: int
) -> Iterator[tuple[int, int, T]]:
    """(rep, concurrency, server) in the order runs are made: every server at each
    level in turn, never two at once, and who goes first alternating from one
    repetition to the next, so that a slow phase of a shared machine hits all alike."""
    for rep in range(reps):
        order = servers[::-1] if rep % 2 else servers
        for c in levels:
            for s in order:
                yield rep, c, s


def log_run(label: str, rep: int, reps: int, c: int, name: str, report: dict[str, Any]) -> None:
    log(
        f"{label}rep {rep + 1}/{reps} c={c:<2} {name:<19} "
        f"{report['output_tokens_per_s']:7.1f} tok/s  "
        f"TTFT p50 {report['ttft_ms']['p50']:7.1f} ms  "
        f"errors {report['errors']}"
    )
