"""``make soak``: load, faults and abuse against the real model, minutes not hours.

Three runs, each against a fresh ``tokenmill serve`` with API keys and prices (the
embedded SmolLM2), each ending with SIGTERM, exit 0 and no hold left in the ledger:

1. books: 1,000 streams from 20 keys at once, 30 % of clients leaving at a random
   event. After: no slot taken or request queued, no hold open, every receipt charged
   exactly ``cost(price, prompt, completion)``, each balance down by exactly its
   receipts, a finished stream billed the usage its client got, and the tokens billed
   equal to the tokens the replica produced (its own counter).
2. overload: 4x the slots' worth of closed-loop clients for 60 s with no queue: every
   answer is a 200 or a 429, ``GET /health`` p99 under 100 ms, gateway RSS at the
   start and the end of the load.
3. kills: two replicas under streaming load; one is SIGKILLed 20 times (each time the
   busier, once it is back from the last kill). Every stream that was cut gets an
   ``error`` event then ``[DONE]`` within 2 s of the kill; each receipt is charged
   once and exactly; the replica is back each time.

Prints the figures and exits 1 if an invariant fails. ``--scale 0.1`` runs a tenth of
everything (streams, seconds, kills) for a quick look. Linux-only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from probes import HealthProbe, health_summary, memory_mb

from tokenmill.config import Price
from tokenmill.metering import cost

ADMIN_KEY = "soak-admin-key"
PRICE = Price(prompt_per_mtok=1_500_000, completion_per_mtok=3_000_000)
BALANCE = 10**10
KEYS = 20
STREAMS = 1000
LEAVING = 0.30
OVERLOAD_FACTOR = 4
OVERLOAD_S = 60.0
KILLS = 20
# The bars.
HEALTH_P99_MS = 100.0
ERROR_WITHIN_S = 2.0
PROMPTS = [
    "Count to twenty.",
    "Name three rivers.",
    "Write a haiku about rain.",
    "What is two plus two?",
    "Describe a cat in one sentence.",
]

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        failures.append(what)


def price_toml() -> str:
    return (
        f"[deployments.price]\nprompt_per_mtok = {PRICE.prompt_per_mtok}\n"
        f"completion_per_mtok = {PRICE.completion_per_mtok}\n"
    )


class Gateway:
    """A ``tokenmill serve`` subprocess with its own data directory."""

    def __init__(self, name: str, deployment: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"tm-soak-{name}-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        (self.dir / "tokenmill.toml").write_text(
            f'[[deployments]]\nid = "smollm2"\n{deployment}\n{price_toml()}'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env["TOKENMILL_ADMIN_KEY"] = ADMIN_KEY
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(self.port)]
        cmd += ["--config", str(self.dir / "tokenmill.toml"), "--data-dir", str(self.dir)]
        self.log_path = self.dir / "server.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name}: exited; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not ready; see {self.log_path}")
            time.sleep(0.2)

    def keys(self, n: int) -> list[tuple[str, str]]:
        out = []
        for i in range(n):
            acc = self.admin.post("/admin/accounts", json={"name": f"k{i}", "balance": BALANCE})
            key = self.admin.post("/admin/keys", json={"account": acc.json()["id"]})
            out.append((acc.json()["id"], key.json()["key"]))
        return out

    def replicas(self) -> list[dict[str, Any]]:
        reps: list[dict[str, Any]] = self.admin.get("/v1/deployments/smollm2").json()["replicas"]
        return reps

    def quiet(self) -> list[dict[str, Any]]:
        """Replicas once nothing runs or waits and the counters stopped moving."""
        last = None
        while True:
            reps = self.replicas()
            snap = [(r["pid"], r["in_flight"], r["queued"], r["tokens_generated"]) for r in reps]
            idle = all(r["state"] == "ready" and r["in_flight"] == r["queued"] == 0 for r in reps)
            if idle and snap == last:
                return reps
            last = snap
            time.sleep(0.6)  # > 2 status intervals of a replica (0.25 s)

    def books(self, keys: list[tuple[str, str]], request_ids: list[str]) -> dict[str, Any]:
        """Receipts of ``request_ids``; per account checks. Returns the receipts."""
        receipts = {}
        for rid in request_ids:
            deadline = time.monotonic() + 60
            while (resp := self.admin.get(f"/v1/usage/{rid}")).status_code == 404:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            receipts[rid] = resp.json() if resp.status_code == 200 else None
        check(all(r is not None for r in receipts.values()), "every admitted request settled")
        got = [r for r in receipts.values() if r is not None]
        exact = all(
            r["charged"] == cost(PRICE, r["prompt_tokens"], r["completion_tokens"]) for r in got
        )
        check(exact, "every receipt charged exactly cost(price, prompt, completion)")
        held = balanced = 0
        for acc, _ in keys:
            state = self.admin.get(f"/admin/accounts/{acc}").json()
            mine = sum(r["charged"] for r in got if r["account"] == acc)
            held += state["held"]
            balanced += BALANCE - state["balance"] == mine
        check(held == 0, f"no credit held ({held})")
        check(balanced == len(keys), f"each balance down by its receipts ({balanced}/{len(keys)})")
        return {rid: r for rid, r in receipts.items() if r is not None}

    def stop(self) -> None:
        """SIGTERM: exit 0 and nothing left held in the ledger."""
        self.admin.close()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        with sqlite3.connect(self.dir / "ledger.sqlite3") as db:
            holds = db.execute("SELECT count(*) FROM holds").fetchone()[0]
            held = db.execute("SELECT coalesce(sum(held), 0) FROM accounts").fetchone()[0]
        check(code == 0 and holds == 0 and held == 0, f"SIGTERM: exit {code}, {holds} holds open")


@dataclass
class Stream:
    account: str
    leave_after: int | None
    status: int = 0
    request_id: str = ""
    content: int = 0
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    error_at: float = 0.0
    done: bool = False
    left: bool = False
    ended_at: float = 0.0
    events: list[str] = field(default_factory=list)


async def stream(client: httpx.AsyncClient, s: Stream, key: str, max_tokens: int) -> Stream:
    body = {
        "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {key}"}
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            s.status = resp.status_code
            s.request_id = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                await resp.aread()
                return s
            n = 0
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    s.done = True
                    continue
                if not line.startswith("data: {"):
                    continue
                n += 1
                event = json.loads(line[6:])
                if "error" in event:
                    s.error, s.error_at = event["error"], time.monotonic()
                    continue
                s.usage = event.get("usage") or s.usage
                if any(c["delta"].get("content") for c in event["choices"]):
                    s.content += 1
                if s.leave_after is not None and n >= s.leave_after:
                    s.left = True
                    break
    finally:
        s.ended_at = time.monotonic()
    return s


def limits() -> httpx.Limits:
    return httpx.Limits(max_connections=None, max_keepalive_connections=None)


# -- 1. the books ----------------------------------------------------------------------


async def run_books(scale: float) -> None:
    n = max(20, int(STREAMS * scale))
    print(f"\n1. books: {n} streams from {KEYS} keys at once, {LEAVING:.0%} leaving", flush=True)
    deployment = "max_num_seqs = 16\nn_ctx = 512\nmax_queue = 4096\nqueue_timeout_s = 3600"
    gw = Gateway("books", deployment)
    try:
        keys = gw.keys(KEYS)
        before = sum(r["tokens_generated"] for r in gw.quiet())
        rng = random.Random(13)
        plans = [
            Stream(keys[i % KEYS][0], rng.randint(1, 12) if rng.random() < LEAVING else None)
            for i in range(n)
        ]
        key_of = dict(keys)
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=gw.url, timeout=3600, limits=limits()) as client:
            done = await asyncio.gather(*(stream(client, s, key_of[s.account], 16) for s in plans))
        took = time.monotonic() - started
        statuses = Counter(s.status for s in done)
        left = sum(s.left for s in done)
        print(f"  {n} streams in {took:.0f}s; statuses {dict(statuses)}; {left} left early")
        check(statuses == Counter({200: n}), "every stream admitted")
        check(all(s.error is None for s in done), "no stream failed")
        reps = gw.quiet()
        check(
            all(r["in_flight"] == 0 and r["queued"] == 0 for r in reps),
            "0 slots left taken, 0 requests queued",
        )
        receipts = gw.books(keys, [s.request_id for s in done])
        finished = [s for s in done if not s.left]
        same = all(
            s.usage is not None
            and receipts[s.request_id]["completion_tokens"] == s.usage["completion_tokens"]
            for s in finished
        )
        check(same and all(s.done for s in finished), "a finished stream billed what it got")
        cut = all(receipts[s.request_id]["completion_tokens"] >= s.content for s in done if s.left)
        check(cut, "a left stream billed at least what it was sent")
        billed = sum(r["completion_tokens"] for r in receipts.values())
        produced = sum(r["tokens_generated"] for r in reps) - before
        charged = sum(r["charged"] for r in receipts.values())
        print(f"  tokens produced {produced}, billed {billed}; charged {charged} micro-units")
        check(billed == produced, "tokens billed == tokens the replica produced")
    finally:
        gw.stop()


# -- 2. overload -----------------------------------------------------------------------


async def run_overload(scale: float) -> None:
    slots = 16
    clients = OVERLOAD_FACTOR * slots
    seconds = max(6.0, OVERLOAD_S * scale)
    print(
        f"\n2. overload: {clients} clients on {slots} slots, no queue, {seconds:.0f}s", flush=True
    )
    gw = Gateway("overload", f"max_num_seqs = {slots}\nn_ctx = 512\nmax_queue = 0")
    try:
        (_, key), *_ = gw.keys(1)
        statuses: Counter[int] = Counter()
        stop_at = time.monotonic() + seconds

        async def client_loop(client: httpx.AsyncClient, i: int) -> None:
            while time.monotonic() < stop_at:
                s = await stream(client, Stream("", None), key, 16)
                statuses[s.status] += 1
                if s.status == 429:
                    await asyncio.sleep(0.05)  # a polite client; Retry-After is 1 s

        async with httpx.AsyncClient(base_url=gw.url, timeout=600, limits=limits()) as client:
            await stream(client, Stream("", None), key, 4)  # warm
            start_mb = memory_mb(gw.proc.pid)["rss_mb"]
            with HealthProbe(gw.url) as probe:
                await asyncio.gather(*(client_loop(client, i) for i in range(clients)))
        end_mb = memory_mb(gw.proc.pid)["rss_mb"]
        health = health_summary([probe])
        print(f"  statuses {dict(statuses)}; /health {health}")
        print(f"  gateway RSS {start_mb:.1f} MB at the start, {end_mb:.1f} MB at the end")
        check(set(statuses) <= {200, 429} and statuses[200] > 0, "only 200s and 429s")
        check(statuses[429] > 0, "the bound was reached (429s)")
        check(health.get("p99_ms", 1e9) < HEALTH_P99_MS, f"/health p99 < {HEALTH_P99_MS:g} ms")
        check(health["failures"] == 0, "/health never failed")
        check(end_mb < start_mb * 1.25 + 5, "gateway RSS flat (within 25 % + 5 MB)")
    finally:
        gw.stop()


# -- 3. kills --------------------------------------------------------------------------


async def run_kills(scale: float) -> None:
    kills = max(2, round(KILLS * scale))
    print(f"\n3. kills: a replica SIGKILLed {kills} times under streaming load", flush=True)
    deployment = (
        "replicas = 2\nmax_num_seqs = 8\nn_threads = 1\nn_ctx = 512\n"
        "max_queue = 512\nqueue_timeout_s = 600"
    )
    gw = Gateway("kills", deployment)
    try:
        keys = gw.keys(4)
        done: list[Stream] = []
        stop = asyncio.Event()

        async def client_loop(client: httpx.AsyncClient, i: int) -> None:
            acc, key = keys[i % len(keys)]
            while not stop.is_set():
                s = await stream(client, Stream(acc, None), key, 48)
                done.append(s)

        kill_times: list[float] = []
        async with httpx.AsyncClient(base_url=gw.url, timeout=600, limits=limits()) as client:
            load = [asyncio.create_task(client_loop(client, i)) for i in range(12)]
            for _ in range(kills):
                while True:  # the busier replica, ready, with streams on it
                    reps = await asyncio.to_thread(gw.replicas)
                    victim = max(reps, key=lambda r: r["in_flight"])
                    if all(r["state"] == "ready" for r in reps) and victim["in_flight"] >= 2:
                        break
                    await asyncio.sleep(0.05)
                kill_times.append(time.monotonic())
                os.kill(victim["pid"], signal.SIGKILL)
                back_by = time.monotonic() + 120
                while True:
                    rep = (await asyncio.to_thread(gw.replicas))[victim["index"]]
                    if rep["state"] == "ready" and rep["pid"] not in (None, victim["pid"]):
                        break
                    if time.monotonic() > back_by:
                        check(False, f"replica {victim['index']} back after a kill")
                        break
                    await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*load)
        cut = [s for s in done if s.error is not None]
        late = []
        for s in cut:
            kill = max(t for t in kill_times if t <= s.error_at)
            late.append(s.error_at - kill)
        restarts = sum(r["restarts"] for r in gw.quiet())
        refused = Counter(s.status for s in done if s.status != 200)
        print(
            f"  {len(done)} streams, {len(cut)} cut by {kills} kills, refused {dict(refused)}; "
            f"error event at most {max(late, default=0) * 1000:.0f} ms after its kill; "
            f"{restarts} restarts"
        )
        check(restarts == kills, "the replica came back after every kill")
        check(all(s.done for s in cut), "every cut stream got [DONE] after its error")
        check(all(x <= ERROR_WITHIN_S for x in late), f"every error within {ERROR_WITHIN_S:g}s")
        check(all(s.done or s.error for s in done if s.status == 200), "no stream hung")
        check(set(refused) <= {502}, "refusals only as 502 (killed while counting a prompt)")
        admitted = [s.request_id for s in done if s.status == 200]
        receipts = gw.books(keys, admitted)
        check(len(receipts) == len(set(admitted)), "one receipt per stream: nothing billed twice")
    finally:
        gw.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the full run")
    parser.add_argument("--only", choices=["books", "overload", "kills"], action="append")
    args = parser.parse_args()
    runs = {"books": run_books, "overload": run_overload, "kills": run_kills}
    started = time.monotonic()
    for name, run in runs.items():
        if args.only is None or name in args.only:
            asyncio.run(run(args.scale))
    print(f"\nsoak: {time.monotonic() - started:.0f}s, {len(failures)} invariant(s) failed")
    for what in failures:
        print(f"  FAILED: {what}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
