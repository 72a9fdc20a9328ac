"""The routing scenario's workloads: multi-turn chats sharing a system prompt, and
prompts sharing nothing, streamed with httpx (time to first token, usage)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from servers import SAMPLING, Server

POLICIES = ("cache_aware", "least_loaded", "round_robin")
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


class Refused(RuntimeError):
    """The server answered with an HTTP error instead of a stream."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status


def fresh_connections(max_connections: int | None = None) -> httpx.Limits:
    """A client's limits with a connection per request: llama-server closes idle
    kept-alive connections, and a request sent on one as it closes fails with "Server
    disconnected without sending a response" (a kvtier run lost a turn to it, and a
    kvcluster run stopped on one)."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)


async def stream_turn(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    seed: int,
) -> tuple[str, float, dict[str, Any]]:
    """One streamed chat completion: its text, TTFT in seconds and usage (with
    llama-server's ``timings`` under ``"timings"`` when it sends them)."""
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
    timings: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise Refused(r.status_code, await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - sent
                    text.append(content)
    if ttft is None or not usage:
        raise RuntimeError("stream ended without content or usage")
    if timings:
        usage = {**usage, "timings": timings}
    return "".join(text), ttft, usage


def as_turn(n: int, ttft: float, usage: dict[str, Any]) -> Turn:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None:  # a llama-server without it in usage: its own timings say it
        cached = (usage.get("timings") or {}).get("cache_n")
    return Turn(
        n,
        ttft,
        int(usage["prompt_tokens"]),
        int(cached or 0),
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
