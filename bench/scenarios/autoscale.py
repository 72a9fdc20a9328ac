"""Replicas that follow the load (issue 38), simulated on this small machine.

The replicas are scripted-engine processes (``engine = "scripted"``) that this
process drives as a simulated model of a fixed speed, so capacity is the simulation's,
not the 2 cores': each replica loads in ``--load-s`` seconds (its ``hello`` is
answered with ``go`` that much later), and decodes in steps of
``--step-s + --seq-s x running`` seconds, one token to each running stream a step
(its first token included: a prefill of one step). Each replica has ``--slots``
slots.

The load: ``--low`` closed-loop streams for ``--before-s`` seconds, then ``--high``
for ``--step-s-long`` seconds (the step), then ``--low`` again for ``--after-s``
seconds; each stream a completion of ``--tokens`` tokens. Three runs, one after the
other, each on its own gateway:

1. **fixed 1**: one replica;
2. **fixed max**: ``--max-replicas`` replicas;
3. **autoscaled**: ``[deployments.autoscale]`` from 1 to ``--max-replicas``, target
   ``--target`` ongoing requests a replica, ``--up-delay`` / ``--down-delay``.

Reported per run: TTFT p50 and p90 during the step (requests sent in it), replica-
seconds (the replicas loading or serving, sampled every 0.25 s from
``GET /v1/deployments/{id}``, integrated over the run), the scale events and when they
came (from the deployment's ``autoscale.events``), failed requests, and the books:
each account's debit against the usage its streams reported (1 micro-unit a prompt
token, 2 a completion token).

Targets: autoscaled TTFT p90 during the step at most 1.5x fixed max's, with at most
0.6x its replica-seconds; no request fails and the books are exact in every run; at
most one scale event per direction per ``*_delay`` window.

Run alone: ``python bench/scenarios/autoscale.py [--high 12]``; results are printed
and written as JSON to ``--out`` (default ``.bench-cache/autoscale.json``);
``make bench`` runs it as the scenario ``autoscale``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

try:
    from scenarios.fairness import ADMIN_KEY, Gateway, ms, new_tenant, percentile
except ImportError:  # run alone, from bench/scenarios
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scenarios.fairness import ADMIN_KEY, Gateway, ms, new_tenant, percentile

if TYPE_CHECKING:
    from scenario import Bench

DEPLOYMENT = "sim"
PROMPT = "Tell me about the weather on the coast today."  # 9 words: 9 prompt tokens


class SimulatedReplicas:
    """The driver of every scripted replica: a model of fixed speed per replica."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.args = args
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.handlers: set[asyncio.Task[Any]] = set()
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._engine, path=str(self.path))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self.tasks):
            t.cancel()
        for w in list(self.writers):  # each handler reads its end and returns
            w.close()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def _engine(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        if handler is not None:
            self.handlers.add(handler)
        self.writers.add(writer)
        running: dict[str, list[int]] = {}  # id -> [tokens so far, max_tokens]
        changed = asyncio.Event()

        async def decode() -> None:
            while True:
                if not running:
                    changed.clear()
                    await changed.wait()
                    continue
                await asyncio.sleep(self.args.step_s + self.args.seq_s * len(running))
                out = []
                for rid, (done, most) in list(running.items()):
                    out.append(json.dumps({"op": "emit", "id": rid, "n": 1}).encode() + b"\n")
                    if done + 1 >= most:
                        running.pop(rid, None)
                    else:
                        running[rid][0] = done + 1
                writer.write(b"".join(out))
                with contextlib.suppress(ConnectionError):
                    await writer.drain()

        stepper: asyncio.Task[None] | None = None
        try:
            while line := await reader.readline():
                event = json.loads(line)
                kind = event["event"]
                if kind == "hello":
                    await asyncio.sleep(self.args.load_s)  # the model loading
                    writer.write(b'{"op": "go"}\n')
                    await writer.drain()
                    stepper = asyncio.create_task(decode())
                    self.tasks.add(stepper)
                elif kind == "started":
                    running[event["id"]] = [0, int(event["max_tokens"])]
                    changed.set()
                elif kind in ("aborted", "ended"):
                    running.pop(event["id"], None)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if stepper is not None:
                stepper.cancel()
                self.tasks.discard(stepper)
            self.writers.discard(writer)
            writer.close()


def config(args: argparse.Namespace, control: Path, run: str) -> str:
    replicas = args.max_replicas if run == "fixed_max" else 1
    text = (
        f'[[deployments]]\nid = "{DEPLOYMENT}"\nengine = "scripted"\ncontrol = "{control}"\n'
        f"replicas = {replicas}\nmax_num_seqs = {args.slots}\nmax_queue = 4096\n"
        "queue_timeout_s = 600\n"
        "[deployments.price]\nprompt_per_mtok = 1000000\ncompletion_per_mtok = 2000000\n"
    )
    if run == "autoscaled":
        text += (
            f"[deployments.autoscale]\nmin_replicas = 1\nmax_replicas = {args.max_replicas}\n"
            f"target_ongoing_requests = {args.target}\nupscale_delay_s = {args.up_delay}\n"
            f"downscale_delay_s = {args.down_delay}\nlook_back_s = {args.look_back}\n"
        )
    return text


class Run:
    """One run's load and what it saw."""

    def __init__(self, url: str, key: str, args: argparse.Namespace) -> None:
        self.url = url
        self.key = key
        self.args = args
        self.high = False
        self.stop_at = 0.0
        self.ttft_step: list[float] = []
        self.failed: list[str] = []
        self.requests = 0
        self.charged_by_usage = 0
        self.replica_seconds = 0.0
        self.replicas_seen: list[tuple[float, int]] = []

    async def stream(self, client: httpx.AsyncClient) -> None:
        body = {
            "model": DEPLOYMENT,
            "prompt": PROMPT,
            "max_tokens": self.args.tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        in_step = self.high
        sent = time.monotonic()
        first: float | None = None
        usage: dict[str, int] | None = None
        self.requests += 1
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.failed.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.failed.append(str(event["error"])[:200])
                        return
                    if first is None and event["choices"] and event["choices"][0]["text"]:
                        first = time.monotonic()
                    if event.get("usage"):
                        usage = event["usage"]
        except httpx.HTTPError as e:
            self.failed.append(repr(e))
            return
        if usage is None or usage["completion_tokens"] != self.args.tokens:
            self.failed.append(f"usage {usage}")
            return
        self.charged_by_usage += usage["prompt_tokens"] + 2 * usage["completion_tokens"]
        if in_step and first is not None:
            self.ttft_step.append(first - sent)

    async def worker(self, client: httpx.AsyncClient, n: int) -> None:
        while time.monotonic() < self.stop_at:
            if n >= self.args.low and not self.high:
                await asyncio.sleep(0.05)
                continue
            await self.stream(client)

    async def sample(self, client: httpx.AsyncClient, t0: float) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.25)
            d = (await client.get(f"/v1/deployments/{DEPLOYMENT}")).json()
            up = sum(
                1
                for r in d["replicas"]
                if r.get("phase", "active") != "off" and r["state"] != "unloaded"
            )
            now = time.monotonic()
            self.replica_seconds += up * (now - last)
            last = now
            if not self.replicas_seen or self.replicas_seen[-1][1] != up:
                self.replicas_seen.append((round(now - t0, 2), up))

    async def go(self) -> None:
        a = self.args
        headers = {"authorization": f"Bearer {self.key}"}
        limits = httpx.Limits(max_connections=a.high + 8)
        async with httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=600.0, limits=limits
        ) as client:
            t0 = time.monotonic()
            self.stop_at = t0 + a.before_s + a.high_s + a.after_s
            sampler = asyncio.create_task(self.sample(client, t0))
            workers = [asyncio.create_task(self.worker(client, n)) for n in range(a.high)]
            await asyncio.sleep(a.before_s)
            self.high = True
            await asyncio.sleep(a.high_s)
            self.high = False
            await asyncio.gather(*workers)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            self.t0 = t0


async def one_run(args: argparse.Namespace, tmp: Path, name: str) -> dict[str, Any]:
    control = tmp / f"{name}.sock"
    sim = SimulatedReplicas(control, args)
    await sim.start()
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    gateway = Gateway(args, run_dir, config(args, control, name))
    try:
        await asyncio.to_thread(gateway.wait_ready)
        with httpx.Client(
            base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60.0
        ) as admin:
            tenant = await asyncio.to_thread(new_tenant, admin, name)
            books = f"/admin/accounts/{tenant.account}"
            before = (await asyncio.to_thread(admin.get, books)).json()
            run = Run(gateway.url, tenant.key, args)
            await run.go()
            # Every stream ended: the books hold nothing and bill what was reported.
            after = (await asyncio.to_thread(admin.get, books)).json()
            d = (await asyncio.to_thread(admin.get, f"/v1/deployments/{DEPLOYMENT}")).json()
        wall = time.time() - (time.monotonic() - run.t0)
        events = [
            {**e, "at": round(e["at"] - wall, 2)}
            for e in (d.get("autoscale") or {}).get("events", [])
        ]
        debit = before["balance"] - after["balance"]
        return {
            "requests": run.requests,
            "failed": len(run.failed),
            "failures": run.failed[:5],
            "step_requests": len(run.ttft_step),
            "ttft_step_p50_ms": ms(percentile(run.ttft_step, 0.5)),
            "ttft_step_p90_ms": ms(percentile(run.ttft_step, 0.9)),
            "replica_seconds": round(run.replica_seconds, 1),
            "replicas_seen": run.replicas_seen,
            "scale_events": events,
            "books": {
                "debit": debit,
                "by_usage": run.charged_by_usage,
                "held": after["held"],
                "exact": debit == run.charged_by_usage and after["held"] == 0,
            },
        }
    finally:
        gateway.stop()
        await sim.close()


async def measure_all(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results: dict[str, Any] = {"settings": settings}
    for name in ("fixed_1", "fixed_max", "autoscaled"):
        results[name] = await one_run(args, tmp, name)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    return results


def events_per_window(events: list[dict[str, Any]], direction: str, window: float) -> bool:
    times = [e["at"] for e in events if e["direction"] == direction]
    return all(b - a >= window for a, b in itertools.pairwise(times))


def report(results: dict[str, Any]) -> str:
    s = results["settings"]
    one, most, auto = results["fixed_1"], results["fixed_max"], results["autoscaled"]
    lines = [
        f"load: {s['low']} -> {s['high']} -> {s['low']} streams of {s['tokens']} tokens "
        f"({s['before_s']:g} s, {s['high_s']:g} s, {s['after_s']:g} s); replicas of "
        f"{s['slots']} slots, loading in {s['load_s']:g} s",
    ]
    for name, r in (("fixed 1", one), (f"fixed {s['max_replicas']}", most), ("autoscaled", auto)):
        lines.append(
            f"{name:>10}: TTFT during the step p50 {r['ttft_step_p50_ms']} ms, p90 "
            f"{r['ttft_step_p90_ms']} ms ({r['step_requests']} requests); "
            f"{r['replica_seconds']} replica-s; {r['requests']} requests, {r['failed']} failed; "
            f"books {'exact' if r['books']['exact'] else r['books']}"
        )
    events = auto["scale_events"]
    lines.append(
        "scale events: "
        + ", ".join(
            f"{e['direction']} {e['replicas_from']}->{e['replicas_to']} at {e['at']}s"
            for e in events
        )
    )
    p90_ratio = (
        auto["ttft_step_p90_ms"] / most["ttft_step_p90_ms"]
        if auto["ttft_step_p90_ms"] and most["ttft_step_p90_ms"]
        else None
    )
    rs_ratio = (
        auto["replica_seconds"] / most["replica_seconds"] if most["replica_seconds"] else None
    )
    lines.append(
        f"autoscaled / fixed max: TTFT p90 {p90_ratio and round(p90_ratio, 3)}x, "
        f"replica-seconds {rs_ratio and round(rs_ratio, 3)}x"
    )
    checks = [
        (
            "autoscaled TTFT p90 in the step <= 1.5x fixed max's",
            p90_ratio is not None and p90_ratio <= 1.5,
        ),
        (
            "autoscaled replica-seconds <= 0.6x fixed max's",
            rs_ratio is not None and rs_ratio <= 0.6,
        ),
        ("no request failed", all(r["failed"] == 0 for r in (one, most, auto))),
        ("the books exact in every run", all(r["books"]["exact"] for r in (one, most, auto))),
        (
            "at most one scale event per direction per delay window",
            events_per_window(events, "up", s["up_delay"])
            and events_per_window(events, "down", s["down_delay"]),
        ),
    ]
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in checks]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--low", type=int, default=1, help="streams before and after the step")
    add("--high", type=int, default=12, help="streams during the step")
    add("--before-s", type=float, default=30.0, help="seconds at --low before the step")
    add("--high-s", type=float, default=40.0, help="seconds of the step")
    add("--after-s", type=float, default=50.0, help="seconds at --low after the step")
    add("--tokens", type=int, default=32, help="tokens of each stream")
    add("--slots", type=int, default=4, help="slots of a replica")
    add("--load-s", type=float, default=2.0, help="seconds a simulated replica takes to load")
    add("--step-s", type=float, default=0.03, help="a decode step's fixed seconds")
    add("--seq-s", type=float, default=0.005, help="a decode step's seconds per running stream")
    add("--max-replicas", type=int, default=4)
    add("--target", type=float, default=3.0, help="target_ongoing_requests")
    add("--up-delay", type=float, default=1.0, help="upscale_delay_s")
    add("--down-delay", type=float, default=10.0, help="downscale_delay_s")
    add("--look-back", type=float, default=1.0, help="look_back_s")
    add("--out", type=Path, default=Path(".bench-cache/autoscale.json"))
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    return asyncio.run(measure_all(args, tmp))


class Autoscaling:
    """This module as a scenario of ``make bench`` (``--only-autoscale``)."""

    name = "autoscale"
    about = (
        "autoscaling on simulated replicas: a step from 1 to 12 streams on 1 replica, "
        "on the maximum, and autoscaled (issue 38)"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--autoscale-high", type=int, default=12, help="streams in the step")

    def run(self, bench: Bench) -> None:
        args = parse_args(["--high", str(bench.args.autoscale_high)])
        tmp = bench.tmp / "autoscale"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            bench.results[self.name] = measure(args, tmp)
        except KeyboardInterrupt:
            bench.results["interrupted"] = True

    def table(self, results: dict[str, Any]) -> str | None:
        section = results.get(self.name)
        return None if section is None else report(section)


SCENARIO = Autoscaling()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A short path: a Unix socket's is limited to about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="tm-as-") as tmp:
        results = measure(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
