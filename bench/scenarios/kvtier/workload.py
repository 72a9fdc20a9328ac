"""The kvtier scenario's workloads: many document conversations on one replica, and one
long prompt beside short streams. The client (one streamed turn, its TTFT and usage) is
the routing scenario's (``routing.workload``); the documents are made here from a seed,
so that every run sends the same text and nothing is downloaded."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..routing.workload import Turn, Window, as_turn, fresh_connections, ms, stream_turn

TURNS = 3
THINK_S = (1.0, 3.0)  # a person reading the answer before the next turn
# Words of one document: ~300 tokens of SmolLM2's tokenizer (measured: ~1.55 tokens a
# word for these sentences, numbers and names included).
DOC_WORDS = 185
# Documents in the long prompt: ~4,500 tokens with its instruction.
LONG_DOCS = 15
LONG_MAX_TOKENS = 16

CITIES = (
    "Leeds", "Porto", "Tampere", "Ghent", "Brno", "Lyon", "Bergen", "Cork", "Graz", "Turin",
    "Malmo", "Utrecht", "Bilbao", "Krakow", "Aarhus", "Basel",
)  # fmt: skip
PRODUCTS = (
    "water pumps", "bicycle frames", "solar panels", "ceramic tiles", "wool blankets",
    "circuit boards", "oak tables", "glass bottles", "brake pads", "garden hoses",
    "printer drums", "kayak paddles", "steel hinges", "lamp shades", "rice cookers",
)  # fmt: skip
PEOPLE = (
    "Amira Haddad", "Jonas Weber", "Lucia Moreno", "Kofi Mensah", "Ingrid Solberg",
    "Tomasz Nowak", "Priya Raman", "Hugo Lefevre", "Mei Tanaka", "Sean Byrne",
    "Elena Petrova", "Ravi Kapoor", "Nora Lindqvist", "Diego Alvarez",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
)  # fmt: skip
CAUSES = (
    "a late delivery of raw material", "a broken conveyor belt", "a strike at the port",
    "a new supplier of packaging", "an unusually cold week", "a software update at the "
    "warehouse", "a recall of an older model", "a large order from a hotel chain",
    "a shortage of drivers", "a fire drill that took a whole afternoon",
)  # fmt: skip
QUESTIONS = (
    "Which figure in the report matters most, and why?",
    "Write a short title for the report and name one risk it leaves open.",
)


def sentence(rng: random.Random) -> str:
    city, product, person = rng.choice(CITIES), rng.choice(PRODUCTS), rng.choice(PEOPLE)
    month, n, pct = rng.choice(MONTHS), rng.randrange(120, 98_000), rng.randrange(2, 61)
    forms = (
        f"In {month} the plant in {city} made {n:,} {product}, {pct} % "
        f"{rng.choice(('more', 'fewer'))} than planned, because of {rng.choice(CAUSES)}.",
        f"{person} reported that returns of {product} rose to {pct} per thousand after "
        f"{rng.choice(CAUSES)}.",
        f"The {city} team shipped {n:,} {product} to {rng.choice(CITIES)} at a cost of "
        f"{rng.randrange(3, 900)} euros a pallet.",
        f"Stock of {product} in {city} stood at {n:,} units on {month} {rng.randrange(1, 29)}, "
        f"enough for {rng.randrange(2, 40)} days.",
        f"{person} proposed moving {pct} % of the {product} line from {city} to "
        f"{rng.choice(CITIES)} before {month}.",
    )
    return rng.choice(forms)


def document(seed: str, words: int = DOC_WORDS) -> str:
    """A made-up operations report of about ``words`` words, the same for the same seed
    and different from every other seed's from its first sentence on."""
    rng = random.Random(seed)
    title = f"Operations report {rng.randrange(100, 999)}-{rng.choice(CITIES)}"
    out, count = [title + "."], 3
    while count < words:
        s = sentence(rng)
        out.append(s)
        count += len(s.split())
    return " ".join(out)


def opening(doc: str) -> str:
    return f"Read this report and summarize it in two sentences.\n\n{doc}"


def long_prompt(seed: str, docs: int = LONG_DOCS) -> str:
    body = "\n\n".join(document(f"{seed}-{k}") for k in range(docs))
    return f"Here are {docs} operations reports.\n\n{body}\n\nWhich city appears most often?"


async def conversation(
    client: httpx.AsyncClient,
    model: str,
    seed: str,
    max_tokens: int,
    think_s: tuple[float, float],
) -> list[Turn]:
    """Three turns about one document, pausing ``think_s`` (seeded) between them."""
    rng = random.Random(f"think-{seed}")
    messages = [{"role": "user", "content": opening(document(f"doc-{seed}"))}]
    turns: list[Turn] = []
    for n in range(1, TURNS + 1):
        if n > 1:
            await asyncio.sleep(rng.uniform(*think_s))
            messages.append({"role": "user", "content": QUESTIONS[n - 2]})
        text, ttft, usage = await stream_turn(client, model, messages, max_tokens, n)
        turns.append(as_turn(n, ttft, usage))
        messages.append({"role": "assistant", "content": text})
    return turns


async def many(url: str, model: str, rep: int, args: argparse.Namespace) -> Window:
    """``--kvtier-conversations`` conversations, ``--kvtier-open`` at a time (the next
    one opens when one ends). Every server gets the same ones in a repetition; each
    repetition's are new, so that none finds a cache left by the one before."""
    window = Window()
    gate = asyncio.Semaphore(args.kvtier_open)
    start = time.perf_counter()

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with gate:
            began = time.perf_counter()
            try:
                seed = f"{args.kvtier_seed}-{rep}-{i}"
                turns = await conversation(client, model, seed, args.kvtier_max_tokens, THINK_S)
                window.turns.append(turns)
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
                window.errors.append(f"conversation {i}: {e}")
            window.in_flight_s += time.perf_counter() - began

    limits = fresh_connections(args.kvtier_open + 4)  # for both servers alike
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        await asyncio.gather(*(one(i, client) for i in range(args.kvtier_conversations)))
    window.seconds = time.perf_counter() - start
    return window


@dataclass
class LongBeside:
    """One long prompt beside short streams: its status (0: no HTTP answer), TTFT and
    prompt size, and the short requests' TTFTs."""

    status: int = 0
    error: str = ""
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    seconds: float = 0.0
    short: list[float] = field(default_factory=list)  # TTFT of every short request
    short_errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "error": self.error[:300],
            "ttft_ms": ms(self.ttft_s),
            "prompt_tokens": self.prompt_tokens,
            "long_s": round(self.seconds, 2),
            "short_requests": len(self.short),
            "short_ttft_p50_ms": ms(statistics.median(self.short)) if self.short else None,
            "short_errors": self.short_errors[:5],
        }


async def long_beside_short(url: str, model: str, args: argparse.Namespace) -> LongBeside:
    """``--kvtier-streams`` workers send short requests one after another until the long
    prompt has ended (and at least ``--kvtier-short-requests`` each); the long prompt
    goes once every worker's first request has ended, so that it meets every stream
    running (their second requests)."""
    out = LongBeside()
    streams = args.kvtier_streams
    started = asyncio.Event()
    first_tokens = 0
    long_done = asyncio.Event()

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        nonlocal first_tokens
        k = 0
        while k < args.kvtier_short_requests or not long_done.is_set():
            line = sentence(random.Random(f"{w}-{k}"))
            messages = [{"role": "user", "content": f"In one sentence, what does this say? {line}"}]
            try:
                _, ttft, _ = await stream_turn(
                    client, model, messages, args.kvtier_max_tokens, w * 1000 + k
                )
                out.short.append(ttft)
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
                out.short_errors.append(f"stream {w}: {e}")
                if long_done.is_set():
                    return
            if k == 0:
                first_tokens += 1
                if first_tokens == streams:
                    started.set()
            k += 1

    async def long(client: httpx.AsyncClient) -> None:
        try:
            await asyncio.wait_for(started.wait(), timeout=600.0)
            messages = [{"role": "user", "content": long_prompt(f"long-{args.kvtier_seed}")}]
            began = time.perf_counter()
            try:
                _, ttft, usage = await stream_turn(
                    client, model, messages, LONG_MAX_TOKENS, args.kvtier_seed
                )
                out.status, out.ttft_s = 200, ttft
                out.prompt_tokens = int(usage["prompt_tokens"])
            except RuntimeError as e:  # routing.workload.Refused carries the status
                out.status, out.error = int(getattr(e, "status", 0)), str(e)
            except httpx.HTTPError as e:
                out.error = f"{type(e).__name__}: {e}"
            out.seconds = time.perf_counter() - began
        finally:
            long_done.set()

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        await asyncio.gather(long(client), *(worker(w, client) for w in range(streams)))
    return out
