"""Routing policies against each other on one gateway (issue 26, part 4).

One ``tokenmill serve`` with the embedded model in three deployments, identical but
for ``routing``: ``cache_aware``, ``least_loaded`` and ``round_robin``, each with 2
process replicas of 1 thread. Each repetition runs, on one deployment at a time (the
order rotating from one repetition to the next, so drift hits all alike):

* **chat**: ``--routing-conversations`` support chats of 3 turns sharing one ~250-token
  system prompt. A conversation starts every ``--routing-gap`` seconds on average
  (seeded jitter, 0.5-1.5x), at most ``--routing-concurrency`` at once, and pauses
  0-1.5 s (seeded) between turns, like a person reading. Every policy gets the same
  conversations in a repetition (same text, same seeds); each repetition's are new, so
  none finds a cache left by the one before.
* **no sharing**: ``--routing-prompts`` single-turn prompts, each with its own system
  message (no block of 16 tokens in common), sent by ``--routing-concurrency`` workers.

Every answer is exactly ``--routing-max-tokens`` long (``ignore_eos``), streamed: the
first content chunk is the time to first token (TTFT), the usage chunk
(``stream_options.include_usage``) gives the prompt and cached tokens. A later turn's
whole earlier prompt was cached when its ``cached_tokens`` is at least the previous
turn's ``prompt_tokens``. Each replica's share of the tokens is the difference of its
``tokens_generated`` (``GET /v1/deployments/{id}``) across the chat windows; the
routing reasons are counted from the gateway's request log (``route`` field).

The gateway exposes no timing of the routing decision, so it is measured in-process,
before the gateway starts: what ``Deployment.route`` computes for a 300-token prompt
(its block chain, the lookup in a prefix index holding 2 replicas' slots, the views,
``CacheAware.choose``), with no server and no I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from servers import SAMPLING, Server, log, tokenmill_server
from summary import mark

if TYPE_CHECKING:
    from scenario import Bench

POLICIES = ("cache_aware", "least_loaded", "round_robin")
BASE = "least_loaded"
REPLICAS = 2
SLOTS = 8  # per replica: room for every conversation in flight and some parked
N_CTX = 1024  # per slot: a 3-turn conversation is ~350 + 3 x max_tokens tokens
TURNS = 3
THINK_S = (0.0, 1.5)
SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Outfitters, a shop that sells tents, "
    "sleeping bags, stoves, backpacks and hiking boots online and in twelve stores. "
    "Answer in two or three short sentences, politely and precisely. Orders ship within "
    "two working days from the warehouse in Leeds; delivery takes three to five days in "
    "the United Kingdom and seven to ten days elsewhere in Europe. Customers may return "
    "unused items within sixty days for a full refund; used items are inspected and "
    "refunded in part when they show wear. Boots and tents carry a two-year warranty "
    "against defects of manufacture, not against damage from misuse. Gift cards never "
    "expire and cannot be exchanged for cash. Store opening hours are nine to six on "
    "weekdays and ten to four on Saturdays; stores are closed on Sundays and public "
    "holidays. Never promise a delivery date, a discount or a refund that these rules do "
    "not allow; when unsure, offer to pass the question to a human colleague, who answers "
    "within one working day. Do not ask for card numbers or passwords. Keep the tone "
    "friendly, do not use lists, and do not repeat the customer's question back to them."
)
TOPICS = (
    "a tent whose zip broke after two trips",
    "boots that arrived in the wrong size",
    "a parcel that has not arrived after nine days",
    "a gift card that the checkout refuses",
    "a stove missing its pot stand",
    "a sleeping bag that smells of smoke",
    "a backpack strap that tore on the first day",
    "an order placed twice by mistake",
)
FOLLOW_UPS = (
    "Thanks. Can I do that in a store instead?",
    "And how long does the refund take after that?",
    "What if I no longer have the receipt?",
    "Could you pass this to a colleague, please?",
)


@dataclass
class Turn:
    turn: int  # 1, 2, 3
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Window:
    """One workload on one deployment: its turns, its length, its replicas' tokens."""

    turns: list[list[Turn]] = field(default_factory=list)  # per conversation
    seconds: float = 0.0
    replica_tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    in_flight_s: float = 0.0  # conversation-seconds: / seconds = mean in flight


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def config() -> str:
    sections = []
    for name in POLICIES:
        sections.append(
            f'[[deployments]]\nid = "{name}"\nrouting = "{name}"\nplacement = "process"\n'
            f"replicas = {REPLICAS}\nn_threads = 1\nmax_num_seqs = {SLOTS}\nn_ctx = {N_CTX}\n"
            "max_queue = 256\nqueue_timeout_s = 600\n"
        )
    return "\n".join(sections)


async def stream_turn(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    seed: int,
) -> tuple[str, float, dict[str, Any]]:
    """One streamed chat completion: its text, TTFT in seconds and usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        **SAMPLING,
    }
    sent = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - sent
                    text.append(content)
    if ttft is None or not usage:
        raise RuntimeError("stream ended without content or usage")
    return "".join(text), ttft, usage


def as_turn(n: int, ttft: float, usage: dict[str, Any]) -> Turn:
    details = usage.get("prompt_tokens_details") or {}
    return Turn(
        n,
        ttft,
        int(usage["prompt_tokens"]),
        int(details.get("cached_tokens") or 0),
        int(usage["completion_tokens"]),
    )


async def conversation(
    client: httpx.AsyncClient, model: str, rep: int, i: int, max_tokens: int, window: Window
) -> None:
    rng = random.Random(f"think-{rep}-{i}")
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {
            "role": "user",
            "content": f"Hello, I am customer {rep}-{i} (order {4000 + 97 * i + rep}). "
            f"I am writing about {TOPICS[(i + rep) % len(TOPICS)]}. What can I do?",
        },
    ]
    turns: list[Turn] = []
    for n in range(1, TURNS + 1):
        if n > 1:
            await asyncio.sleep(rng.uniform(*THINK_S))
            messages.append({"role": "user", "content": FOLLOW_UPS[(i + n) % len(FOLLOW_UPS)]})
        text, ttft, usage = await stream_turn(client, model, messages, max_tokens, rep * 1000 + i)
        turns.append(as_turn(n, ttft, usage))
        messages.append({"role": "assistant", "content": text})
    window.turns.append(turns)


async def chat(url: str, model: str, rep: int, args: argparse.Namespace) -> Window:
    window = Window()
    rng = random.Random(f"arrivals-{rep}")
    gate = asyncio.Semaphore(args.routing_concurrency)
    start = time.perf_counter()

    async def one(i: int, at: float, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        async with gate:
            began = time.perf_counter()
            try:
                await conversation(client, model, rep, i, args.routing_max_tokens, window)
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
                window.errors.append(f"conversation {i}: {e}")
            window.in_flight_s += time.perf_counter() - began

    arrivals, at = [], 0.0
    for _ in range(args.routing_conversations):
        arrivals.append(at)
        at += args.routing_gap * rng.uniform(0.5, 1.5)
    limits = httpx.Limits(max_connections=args.routing_concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        await asyncio.gather(*(one(i, a, client) for i, a in enumerate(arrivals)))
    window.seconds = time.perf_counter() - start
    return window


async def no_sharing(url: str, model: str, rep: int, args: argparse.Namespace) -> Window:
    window = Window()
    queue = list(range(args.routing_prompts))
    start = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            # A distinct first block: nothing of one prompt is in any other's cache.
            messages = [
                {"role": "system", "content": f"Ticket {rep}-{i}-{random.Random(i).random()}."},
                {
                    "role": "user",
                    "content": f"Describe item number {i * 7919 + rep} of the catalogue, "
                    f"{TOPICS[i % len(TOPICS)]} aside, in a few sentences.",
                },
            ]
            try:
                _, ttft, usage = await stream_turn(
                    client, model, messages, args.routing_max_tokens, rep * 1000 + i
                )
                window.turns.append([as_turn(1, ttft, usage)])
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
                window.errors.append(f"prompt {i}: {e}")

    limits = httpx.Limits(max_connections=args.routing_concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.routing_concurrency)))
    window.seconds = time.perf_counter() - start
    return window


def replica_tokens(url: str, deployment: str) -> list[int]:
    d = httpx.get(f"{url}/v1/deployments/{deployment}", timeout=30.0).json()
    return [int(r["tokens_generated"]) for r in d["replicas"]]


def measured(
    server: Server, deployment: str, run: Callable[[], Coroutine[Any, Any, Window]]
) -> Window:
    """``run`` (chat or no_sharing) on one deployment, with its replicas' token deltas."""
    before = replica_tokens(server.url, deployment)
    window = asyncio.run(run())
    after = replica_tokens(server.url, deployment)
    window.replica_tokens = [a - b for a, b in zip(after, before, strict=True)]
    return window


def warm_up(server: Server, max_tokens: int) -> None:
    """A few concurrent requests on every deployment: both replicas run and are measured."""

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=600.0) as client:
            for model in POLICIES:
                await asyncio.gather(
                    *(
                        stream_turn(
                            client,
                            model,
                            [{"role": "user", "content": f"Warm-up {k}: say hello."}],
                            max_tokens,
                            k,
                        )
                        for k in range(2 * REPLICAS)
                    )
                )

    asyncio.run(go())


def decision_cost(iterations: int) -> dict[str, Any]:
    """What routing a 300-token prompt costs in the gateway, in microseconds: the chain,
    the index lookup over 2 replicas' slots, the views and ``CacheAware.choose``."""
    from tokenmill.gateway.prefix import PrefixIndex
    from tokenmill.gateway.routing import ReplicaView, RouteQuery
    from tokenmill.gateway.routing.cache_aware import CacheAware
    from tokenmill.kvblocks import chain

    rng = random.Random(26)
    system = [rng.randrange(49_000) for _ in range(250)]
    index = PrefixIndex()
    for replica in range(REPLICAS):
        slots = [chain(system + [rng.randrange(49_000) for _ in range(250)]) for _ in range(SLOTS)]
        index.reset(replica, slots)
    prompt = system + [rng.randrange(49_000) for _ in range(50)]
    policy = CacheAware()
    samples: list[float] = []
    for k in range(iterations):
        began = time.perf_counter()
        cached = index.cached_tokens(chain(prompt))
        views = [
            ReplicaView(
                index=r,
                serving=True,
                slots=SLOTS,
                in_flight=(k + r) % 4,
                cached_tokens=cached.get(r, 0),
                prefill_s=1e-3,
                decode_s=2e-2,
                last_used=float(k),
            )
            for r in range(REPLICAS)
        ]
        policy.choose(views, RouteQuery(prompt_tokens=len(prompt), session=f"s{k % 64}"))
        samples.append(time.perf_counter() - began)
    micro = [s * 1e6 for s in samples]
    return {
        "iterations": iterations,
        "prompt_tokens": len(prompt),
        "p50_us": round(statistics.median(micro), 1),
        "p99_us": round(percentile(micro, 0.99) or 0.0, 1),
    }


def route_reasons(log_path: Path) -> dict[str, dict[str, int]]:
    """Routing reasons per deployment, from the gateway's request log lines."""
    out: dict[str, dict[str, int]] = {p: {} for p in POLICIES}
    for line in log_path.read_text(errors="replace").splitlines():
        at = line.find('{"event": "request"')
        if at < 0:
            continue
        try:
            entry = json.loads(line[at:])
        except ValueError:
            continue
        route, deployment = entry.get("route"), entry.get("deployment")
        if route and deployment in out:
            counts = out[deployment]
            counts[route["reason"]] = counts.get(route["reason"], 0) + 1
    return out


def summarize(chats: list[Window], plains: list[Window]) -> dict[str, Any]:
    later = [t for w in chats for conv in w.turns for t in conv if t.turn > 1]
    whole = sum(
        1
        for w in chats
        for conv in w.turns
        for prev, t in itertools.pairwise(conv)
        if t.cached_tokens >= prev.prompt_tokens
    )
    every = [t for w in chats for conv in w.turns for t in conv]
    prompt = sum(t.prompt_tokens for t in every)
    ttfts = [t.ttft_s for t in later]
    tokens = [sum(col) for col in zip(*(w.replica_tokens for w in chats), strict=True)]
    total = sum(tokens) or 1
    plain_turns = [t for w in plains for conv in w.turns for t in conv]
    return {
        "conversations": sum(len(w.turns) for w in chats),
        "later_turns": len(later),
        "whole_prompt_cached": round(whole / len(later), 4) if later else None,
        "cached_over_prompt": round(sum(t.cached_tokens for t in every) / prompt, 4)
        if prompt
        else None,
        "later_ttft_p50_ms": ms(statistics.median(ttfts)) if ttfts else None,
        "later_ttft_p99_ms": ms(percentile(ttfts, 0.99)),
        "chat_tok_s": round(
            sum(t.completion_tokens for t in every) / sum(w.seconds for w in chats), 2
        ),
        "mean_in_flight": round(
            sum(w.in_flight_s for w in chats) / sum(w.seconds for w in chats), 2
        ),
        "replica_tokens": tokens,
        "replica_share": [round(n / total, 4) for n in tokens],
        "no_sharing_tok_s": statistics.median(
            round(sum(t.completion_tokens for c in w.turns for t in c) / w.seconds, 2)
            for w in plains
        ),
        "no_sharing_ttft_p50_ms": ms(statistics.median(t.ttft_s for t in plain_turns))
        if plain_turns
        else None,
        "errors": [e for w in chats + plains for e in w.errors],
    }


def measure(bench: Bench) -> dict[str, Any]:
    args = bench.args
    results: dict[str, Any] = {
        "settings": {
            "replicas": REPLICAS,
            "slots": SLOTS,
            "n_threads": 1,
            "conversations": args.routing_conversations,
            "turns": TURNS,
            "gap_s": args.routing_gap,
            "concurrency": args.routing_concurrency,
            "prompts": args.routing_prompts,
            "max_tokens": args.routing_max_tokens,
            "reps": args.routing_reps,
        },
        "decision": decision_cost(args.routing_decisions),
    }
    tmp = bench.tmp / "routing"
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "routing.toml"
    cfg.write_text(config())
    server = tokenmill_server("tokenmill-routing", tmp, ("--config", str(cfg)))
    chats: dict[str, list[Window]] = {p: [] for p in POLICIES}
    plains: dict[str, list[Window]] = {p: [] for p in POLICIES}
    results["policies"] = {}
    try:
        server.start()
        warm_up(server, 8)
        for rep in range(args.routing_reps):
            order = POLICIES[rep % 3 :] + POLICIES[: rep % 3]
            for policy in order:
                common = (server.url, policy, rep, args)
                chats[policy].append(measured(server, policy, partial(chat, *common)))
                plains[policy].append(measured(server, policy, partial(no_sharing, *common)))
                log(f"routing: repetition {rep + 1}/{args.routing_reps} on {policy} done")
    except KeyboardInterrupt:
        bench.results["interrupted"] = True
    finally:
        server.stop()
    done = [p for p in POLICIES if chats[p] and plains[p]]
    results["policies"] = {p: summarize(chats[p], plains[p]) for p in done}
    results["reasons"] = route_reasons(server.log_path)
    return results


def report(section: dict[str, Any]) -> str:
    s, policies = section["settings"], section["policies"]
    lines = [
        "",
        f"routing (issue 26): {REPLICAS} process replicas x 1 thread, {s['slots']} slots each; "
        f"chat: {s['conversations']} conversations x {TURNS} turns sharing a ~250-token system "
        f"prompt, one every ~{s['gap_s']} s, <= {s['concurrency']} at once, think 0-1.5 s; "
        f"no sharing: {s['prompts']} distinct prompts from {s['concurrency']} workers; "
        f"max_tokens {s['max_tokens']}; {s['reps']} repetition(s), policies in turn",
        f"{'policy':<13} {'whole':>6} {'cached':>7} {'ttft p50':>9} {'ttft p99':>9} "
        f"{'chat t/s':>9} {'in flt':>6} {'share':>13} {'plain t/s':>9} {'x ll':>6}",
    ]
    base = policies.get(BASE)
    for name, p in policies.items():
        ratio = (
            p["no_sharing_tok_s"] / base["no_sharing_tok_s"]
            if base and base["no_sharing_tok_s"]
            else None
        )
        share = "/".join(f"{x:.2f}" for x in p["replica_share"])
        cells: list[object] = [
            p["whole_prompt_cached"],
            p["cached_over_prompt"],
            p["later_ttft_p50_ms"],
        ]
        cells += [p["later_ttft_p99_ms"], p["chat_tok_s"], p["mean_in_flight"], share]
        cells += [p["no_sharing_tok_s"], "-" if ratio is None else f"{ratio:.3f}"]
        widths = (6, 7, 9, 9, 9, 6, 13, 9, 6)
        lines.append(
            f"{name:<13} " + " ".join(f"{c!s:>{w}}" for c, w in zip(cells, widths, strict=True))
        )
        if p["errors"]:
            lines.append(f"  {name}: {len(p['errors'])} errors, first: {p['errors'][0]}")
    lines.append(
        "  whole: later turns (2, 3) whose cached_tokens >= the previous turn's prompt; "
        "cached: cached / prompt tokens; ttft: later turns, ms; share: replicas' tokens"
    )
    if base and base["later_ttft_p50_ms"]:
        lines.append(
            "  later-turn TTFT p50 x least_loaded: "
            + ", ".join(
                f"{n} {p['later_ttft_p50_ms'] / base['later_ttft_p50_ms']:.2f}"
                for n, p in policies.items()
                if p["later_ttft_p50_ms"]
            )
        )
    lines.append(f"  route reasons (log): {section.get('reasons')}")
    d = section["decision"]
    lines.append(
        f"  routing decision ({d['prompt_tokens']}-token prompt, 2 replicas, in-process, "
        f"{d['iterations']} calls): p50 {d['p50_us']} us, p99 {d['p99_us']} us"
    )
    ca = policies.get("cache_aware")
    if ca:
        if ca["whole_prompt_cached"] is not None:
            lines.append(
                f"{mark(ca['whole_prompt_cached'] >= 0.95)} cache_aware: "
                f"{ca['whole_prompt_cached']:.1%} of later turns whole-prompt cached (>= 95 %)"
            )
        if base and base["later_ttft_p50_ms"] and ca["later_ttft_p50_ms"]:
            r = ca["later_ttft_p50_ms"] / base["later_ttft_p50_ms"]
            lines.append(
                f"{mark(r <= 0.7)} cache_aware later-turn TTFT p50 {r:.2f}x least_loaded (<= 0.7x)"
            )
        if base and base["no_sharing_tok_s"]:
            r = ca["no_sharing_tok_s"] / base["no_sharing_tok_s"]
            lines.append(
                f"{mark(r >= 0.97)} cache_aware no-sharing tok/s {r:.3f}x least_loaded (>= 0.97x)"
            )
        shares = ca["replica_share"]
        lines.append(
            f"{mark(all(0.35 <= x <= 0.65 for x in shares))} cache_aware replica token shares "
            f"{'/'.join(f'{x:.0%}' for x in shares)} (each 35-65 %)"
        )
    lines.append(
        f"{mark(d['p99_us'] < 200)} routing decision p99 {d['p99_us']} us (< 200 us, in-process)"
    )
    return "\n".join(lines)


class Routing:
    """The routing policies on one gateway (``--only-routing``, ``--no-routing``)."""

    name = "routing"
    about = (
        "cache_aware against least_loaded and round_robin routing: multi-turn chats "
        "sharing a system prompt and prompts sharing nothing, on 2 replicas (issue 26)"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--routing-conversations",
            type=int,
            default=12,
            help="3-turn conversations per policy and repetition",
        )
        parser.add_argument(
            "--routing-gap", type=float, default=1.5, help="mean seconds between conversations"
        )
        parser.add_argument(
            "--routing-concurrency",
            type=int,
            default=5,
            help="conversations at once at most (and no-sharing workers)",
        )
        parser.add_argument(
            "--routing-prompts",
            type=int,
            default=20,
            help="no-sharing prompts per policy and repetition",
        )
        parser.add_argument(
            "--routing-max-tokens", type=int, default=32, help="tokens of every answer"
        )
        parser.add_argument(
            "--routing-reps", type=int, default=2, help="repetitions of every policy, rotated"
        )
        parser.add_argument(
            "--routing-decisions",
            type=int,
            default=20_000,
            help="in-process routing decisions timed",
        )

    def run(self, bench: Bench) -> None:
        try:
            bench.results[self.name] = measure(bench)
        except KeyboardInterrupt:
            bench.results["interrupted"] = True

    def table(self, results: dict[str, Any]) -> str | None:
        section = results.get(self.name)
        return None if section is None else report(section)


SCENARIO = Routing()
