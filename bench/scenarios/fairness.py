"""Fair share between tenants against FIFO, on one tokenmill server (issue 27).

One gateway with the embedded model (or ``--model``), metered by a SQLite ledger
with an admin key, serves two deployments of the same model side by side: ``fair``
(``admission = "fair"``) and ``fifo`` (``admission = "fifo"``), each one replica with
``--slots`` slots. They are measured in turn, never at once:

1. **alone**: the light tenant (one short request at a time) on an idle deployment:
   its time to first token (TTFT) with nobody else.
2. **flood**, on each deployment: a flooding tenant keeps ``--flood`` streams open
   at once for ``--seconds`` while the light tenant goes on one request at a time.
   The light tenant's TTFT p50/p95 against alone and against the flood's own, each
   tenant's share of the tokens, and the total tok/s of the two deployments. The
   windows alternate between the deployments (``--reps`` each), so that drift on a
   shared machine hits both alike.
3. **weighted**: three tenants with weights 1:1:2, each keeping ``--backlog`` streams
   open (so all are backlogged), on each deployment in turn (``--reps`` windows each,
   alternating): on the fair one each tenant's share of the tokens streamed and Jain's
   fairness index over tokens / weight; on both, total tok/s. This is where fair
   share's cost in throughput is measured against FIFO: the same requests, only
   served in another order. Under the flood the two do different work by design
   (fair serves the light tenant several times as often, and each of its requests is
   a prompt to compute for 8 tokens), so that ratio is reported, not judged.

Flood and backlogged requests ask for between half and 1.5x ``--flood-tokens``
(seeded): equal lengths would keep streams that start together in lockstep, the
slots freeing in waves rather than one by one (see :func:`keep_open`).

Tokens are counted as they stream (one per text chunk) inside each window; requests
still open at the end of a window are cancelled (and billed for what they produced).
At the end the books are checked: no hold left open, and every account's balance is
its credit less the sum of its receipts.

Run alone: ``python bench/scenarios/fairness.py [--seconds 30] [--flood 16] [--slots 4]``; the
results are printed and written as JSON to ``--out`` (default
``.bench-cache/fairness.json``); ``make bench`` runs it as the scenario ``fairness``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:  # the runner's; this module also runs alone
    from scenario import Bench

ADMIN_KEY = "bench-fairness-admin"
CREDIT = 10**12  # micro-units: no tenant runs out in a benchmark
PROMPT_PRICE, COMPLETION_PRICE = 1_000_000, 2_000_000  # per million tokens
LIGHT_PROMPT = "Name a colour."
FLOOD_PROMPT = "Write a long story about a lighthouse keeper and the sea."
# The light tenant's answers are short, the flood's longer: the light tenant's
# latency is mostly its wait for a slot, which is what fair share changes. The flood's
# requests must still end many times within a window (--flood-tokens): a window
# shorter than a request measures only who was admitted first.
LIGHT_TOKENS = 8
MODES = ("fair", "fifo")


@dataclass
class Tenant:
    name: str
    key: str
    account: str
    weight: float = 1.0
    ttft_s: list[float] = field(default_factory=list)
    # Monotonic times of the text chunks streamed to this tenant.
    chunk_times: list[float] = field(default_factory=list)
    # Each finished request's time in its slot: first token to last.
    service_s: list[float] = field(default_factory=list)
    # The measured windows (start, end) this tenant ran in.
    windows: list[tuple[float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def tokens_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.chunk_times if start <= t < end)

    def windowed_tokens(self) -> int:
        return sum(self.tokens_between(start, end) for start, end in self.windows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(args: argparse.Namespace) -> str:
    model = f'model = "{args.model}"\n' if args.model else ""
    sections = []
    for admission in ("fair", "fifo"):
        sections.append(
            f'[[deployments]]\nid = "{admission}"\nadmission = "{admission}"\n{model}'
            f"max_num_seqs = {args.slots}\nmax_queue = 256\nqueue_timeout_s = 600\n"
            f"n_ctx = 1024\n"
            f"[deployments.price]\nprompt_per_mtok = {PROMPT_PRICE}\n"
            f"completion_per_mtok = {COMPLETION_PRICE}\n"
        )
    return "\n".join(sections)


class Gateway:
    """A ``tokenmill serve`` child process with the admin key and a SQLite ledger."""

    def __init__(self, args: argparse.Namespace, tmp: Path, text: str | None = None) -> None:
        self.port = free_port()
        cfg = tmp / "tokenmill.toml"
        cfg.write_text(config(args) if text is None else text)
        self.log_path = tmp / "gateway.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env["TOKENMILL_ADMIN_KEY"] = ADMIN_KEY
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(self.port)]
        cmd += ["--data-dir", str(tmp / "data"), "--config", str(cfg)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the gateway was not ready after {timeout:g}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def new_tenant(admin: httpx.Client, name: str, weight: float = 1.0) -> Tenant:
    r = admin.post("/admin/accounts", json={"name": name, "balance": CREDIT, "weight": weight})
    r.raise_for_status()
    account = r.json()["id"]
    r = admin.post("/admin/keys", json={"account": account})
    r.raise_for_status()
    return Tenant(name, r.json()["key"], account, weight)


async def stream_one(
    client: httpx.AsyncClient, tenant: Tenant, model: str, prompt: str, max_tokens: int
) -> None:
    """One streamed chat completion; its TTFT and chunk times go to ``tenant``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every answer as long as asked: comparable runs
        "stream": True,
    }
    headers = {"authorization": f"Bearer {tenant.key}"}
    start = time.monotonic()
    first: float | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            tenant.errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:") or '"content"' not in line:
                continue
            event = json.loads(line[5:])
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                now = time.monotonic()
                if first is None:
                    tenant.ttft_s.append(now - start)
                    first = now
                tenant.chunk_times.append(now)
    if first is not None:
        tenant.service_s.append(time.monotonic() - first)


async def keep_open(
    client: httpx.AsyncClient,
    tenant: Tenant,
    model: str,
    streams: int,
    prompt: str,
    max_tokens: int,
    until: float,
) -> None:
    """``streams`` requests of ``tenant`` open at once until ``until``, then cancelled.

    Each asks for between half and 1.5x ``max_tokens`` (seeded, uniform: ``max_tokens``
    on average), as a real tenant's answers vary. Answers all of one length keep
    streams that started together in lockstep: the slots then free in waves, all at
    once every ``max_tokens`` steps, and whoever arrives between two waves waits for
    the next, however it is queued (seen: the gaps between slot releases bunched at
    0-50 and 500-800 ms, never near the 200 ms average)."""
    lengths = random.Random(f"{tenant.name}-{model}")

    async def loop() -> None:
        while time.monotonic() < until:
            n = lengths.randint(max(1, max_tokens // 2), max_tokens + max_tokens // 2)
            await stream_one(client, tenant, model, prompt, n)

    tasks = [asyncio.create_task(loop()) for _ in range(streams)]
    await asyncio.sleep(max(0.0, until - time.monotonic()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    total = sum(xs)
    squares = sum(x * x for x in xs)
    return total * total / (len(xs) * squares) if squares else 1.0


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def alone(url: str, light: Tenant, seconds: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            await stream_one(client, light, "fair", LIGHT_PROMPT, LIGHT_TOKENS)
    return {
        "requests": len(light.ttft_s),
        "ttft_p50_ms": ms(statistics.median(light.ttft_s)),
        "ttft_p95_ms": ms(percentile(light.ttft_s, 0.95)),
    }


async def flood(
    url: str, model: str, flooder: Tenant, light: Tenant, args: argparse.Namespace
) -> None:
    """One window of the flood beside the light tenant; what happened goes to them."""
    async with httpx.AsyncClient(
        base_url=url, timeout=600.0, limits=httpx.Limits(max_connections=args.flood + 8)
    ) as client:
        start = time.monotonic()
        until = start + args.seconds
        # The flood fills the queue first; the light tenant starts a moment later.
        flooding = asyncio.create_task(
            keep_open(client, flooder, model, args.flood, FLOOD_PROMPT, args.flood_tokens, until)
        )
        await asyncio.sleep(min(2.0, args.seconds / 10))
        while time.monotonic() < until:
            await stream_one(client, light, model, LIGHT_PROMPT, LIGHT_TOKENS)
        await flooding
    flooder.windows.append((start, until))
    light.windows.append((start, until))


def flood_summary(flooder: Tenant, light: Tenant, args: argparse.Namespace) -> dict[str, Any]:
    tokens = {t.name: t.windowed_tokens() for t in (flooder, light)}
    total = sum(tokens.values())
    seconds = sum(end - start for start, end in flooder.windows)
    # One slot's turnover: how long until some slot frees, on average.
    turnover = statistics.mean(flooder.service_s) / args.slots if flooder.service_s else None
    return {
        "windows": len(flooder.windows),
        "light_requests": len(light.ttft_s),
        "light_ttft_p50_ms": ms(statistics.median(light.ttft_s)) if light.ttft_s else None,
        "light_ttft_p95_ms": ms(percentile(light.ttft_s, 0.95)),
        "flood_ttft_p50_ms": ms(statistics.median(flooder.ttft_s)) if flooder.ttft_s else None,
        "slot_turnover_ms": ms(turnover),
        "tokens": tokens,
        "share": {name: round(n / total, 4) if total else 0.0 for name, n in tokens.items()},
        "tok_per_s": round(total / seconds, 2),
        "errors": flooder.errors + light.errors,
    }


async def backlogged(
    url: str, model: str, tenants: list[Tenant], args: argparse.Namespace
) -> tuple[dict[str, int], float]:
    """One window of every tenant keeping ``--backlog`` streams open: the tokens each
    was streamed in it, and its length."""
    async with httpx.AsyncClient(
        base_url=url,
        timeout=600.0,
        limits=httpx.Limits(max_connections=args.backlog * len(tenants) + 8),
    ) as client:
        warm = min(5.0, args.seconds / 5)  # everyone backlogged before counting starts
        start = time.monotonic() + warm
        until = start + args.seconds
        await asyncio.gather(
            *(
                keep_open(client, t, model, args.backlog, FLOOD_PROMPT, args.flood_tokens, until)
                for t in tenants
            )
        )
    return {t.name: t.tokens_between(start, until) for t in tenants}, until - start


def weighted_summary(
    tenants: list[Tenant], tokens: dict[str, int], seconds: float
) -> dict[str, Any]:
    total = sum(tokens.values()) or 1
    total_weight = sum(t.weight for t in tenants)
    return {
        "weights": {t.name: t.weight for t in tenants},
        "tokens": tokens,
        "share": {t.name: round(tokens[t.name] / total, 4) for t in tenants},
        "target_share": {t.name: round(t.weight / total_weight, 4) for t in tenants},
        "jain_index": round(jain([tokens[t.name] / t.weight for t in tenants]), 4),
        "tok_per_s": round(sum(tokens.values()) / seconds, 2),
        "errors": [e for t in tenants for e in t.errors],
    }


async def weighted(
    url: str, groups: dict[str, list[Tenant]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """The backlogged tenants on each deployment, ``--reps`` windows each, interleaved:
    the same work on both, so their tok/s differ only by the order it is served in."""
    tokens: dict[str, dict[str, int]] = {m: {t.name: 0 for t in groups[m]} for m in MODES}
    seconds = dict.fromkeys(MODES, 0.0)
    for rep in range(args.reps):
        for model in MODES if rep % 2 == 0 else MODES[::-1]:
            got, length = await backlogged(url, model, groups[model], args)
            for name, n in got.items():
                tokens[model][name] += n
            seconds[model] += length
            print(f"weighted window {rep + 1}/{args.reps} on {model} done", flush=True)
    return {m: weighted_summary(groups[m], tokens[m], seconds[m]) for m in MODES}


def books(admin: httpx.Client, tenants: list[Tenant]) -> dict[str, Any]:
    """Every hold settled, and every balance equal to credit less its receipts."""

    def settled() -> bool:
        return all(admin.get(f"/admin/accounts/{t.account}").json()["held"] == 0 for t in tenants)

    deadline = time.monotonic() + 120
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.5)
    out: dict[str, Any] = {"balanced": True, "accounts": {}}
    for t in tenants:
        acc = admin.get(f"/admin/accounts/{t.account}").json()
        receipts = admin.get(f"/admin/accounts/{t.account}/usage", params={"limit": 1000}).json()
        charged = sum(r["charged"] for r in receipts["data"])
        ok = (
            acc["held"] == 0 and acc["balance"] == CREDIT - charged and len(receipts["data"]) < 1000
        )
        out["accounts"][t.name] = {"receipts": len(receipts["data"]), "charged": charged, "ok": ok}
        out["balanced"] = out["balanced"] and ok
    return out


async def run(args: argparse.Namespace, url: str, admin: httpx.Client) -> dict[str, Any]:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results: dict[str, Any] = {"settings": settings}
    light_alone = new_tenant(admin, "light-alone")
    results["alone"] = await alone(url, light_alone, min(args.seconds, 15.0))
    everyone = [light_alone]
    pairs = {m: (new_tenant(admin, f"flood-{m}"), new_tenant(admin, f"light-{m}")) for m in MODES}
    everyone += [t for pair in pairs.values() for t in pair]
    # Interleaved (fair, fifo, fifo, fair, ...): drift on a shared machine hits both alike.
    for rep in range(args.reps):
        for model in MODES if rep % 2 == 0 else MODES[::-1]:
            await flood(url, model, *pairs[model], args)
            print(f"flood window {rep + 1}/{args.reps} on {model} done", flush=True)
    results["flood"] = {m: flood_summary(*pairs[m], args) for m in MODES}
    groups = {
        m: [new_tenant(admin, f"w{i}-{w:g}-{m}", w) for i, w in enumerate(args.weights)]
        for m in MODES
    }
    everyone += [t for tenants in groups.values() for t in tenants]
    both = await weighted(url, groups, args)
    results["weighted"], results["weighted_fifo"] = both["fair"], both["fifo"]
    results["books"] = books(admin, everyone)
    return results


def report(results: dict[str, Any]) -> str:
    alone_p50 = results["alone"]["ttft_p50_ms"]
    fair, fifo = results["flood"]["fair"], results["flood"]["fifo"]
    w = results["weighted"]
    lines = [
        f"light tenant alone: TTFT p50 {alone_p50} ms, p95 {results['alone']['ttft_p95_ms']} ms",
    ]
    for name, r in (("fair", fair), ("fifo", fifo)):
        lines.append(
            f"flood + light, {name}:  light TTFT p50 {r['light_ttft_p50_ms']} ms, "
            f"p95 {r['light_ttft_p95_ms']} ms; flood TTFT p50 {r['flood_ttft_p50_ms']} ms; "
            f"slot turnover {r['slot_turnover_ms']} ms; token share {r['share']}; "
            f"{r['tok_per_s']} tok/s"
        )
    light_more = (
        round(fair["light_requests"] / fifo["light_requests"], 1)
        if fifo["light_requests"]
        else None
    )
    flood_ratio = fair["tok_per_s"] / fifo["tok_per_s"] if fifo["tok_per_s"] else None
    lines.append(
        f"flood + light tok/s fair / fifo: {flood_ratio and round(flood_ratio, 3)} (not the "
        f"same work: fair served the light tenant {light_more}x as many requests, each a "
        "prompt to compute for 8 tokens)"
    )
    wf = results.get("weighted_fifo")
    ratio = w["tok_per_s"] / wf["tok_per_s"] if wf and wf["tok_per_s"] else None
    lines.append(
        f"weighted {w['weights']}: shares {w['share']} (target {w['target_share']}), "
        f"Jain's index {w['jain_index']}, {w['tok_per_s']} tok/s"
    )
    if wf:
        lines.append(
            f"the same backlogged tenants on fifo: shares {wf['share']}, {wf['tok_per_s']} "
            f"tok/s; total tok/s fair / fifo, same work: {ratio and round(ratio, 3)}"
        )
    lines.append(f"books balance: {results['books']['balanced']}")
    # The targets.
    checks = []
    if fair["light_ttft_p50_ms"] and fair["flood_ttft_p50_ms"]:
        checks.append(
            (
                "light p50 <= 1/3 flood p50",
                fair["light_ttft_p50_ms"] * 3 <= fair["flood_ttft_p50_ms"],
            )
        )
    if fair["light_ttft_p50_ms"] and fair["slot_turnover_ms"] and alone_p50:
        extra = fair["light_ttft_p50_ms"] - alone_p50
        checks.append(
            (
                "light p50 - alone p50 <= 1.5 x slot turnover",
                extra <= 1.5 * fair["slot_turnover_ms"],
            )
        )
    if ratio is not None:
        checks.append(("tok/s fair >= 0.97 x fifo (backlogged tenants, same work)", ratio >= 0.97))
    checks.append(
        (
            "weighted shares within 10 % of target",
            all(
                abs(w["share"][n] - w["target_share"][n]) <= 0.1 * w["target_share"][n]
                for n in w["share"]
            ),
        )
    )
    checks.append(("books balance", results["books"]["balanced"]))
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in checks]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="length of each measured window"
    )
    parser.add_argument(
        "--flood", type=int, default=16, help="the flooding tenant's open streams (16-32)"
    )
    parser.add_argument(
        "--backlog", type=int, default=8, help="open streams of each weighted tenant"
    )
    parser.add_argument(
        "--flood-tokens",
        type=int,
        default=32,
        help="max_tokens of the flood's and the weighted tenants' requests, on average "
        "(each between half and 1.5x this)",
    )
    parser.add_argument(
        "--reps", type=int, default=2, help="flood windows on each deployment, interleaved"
    )
    parser.add_argument("--slots", type=int, default=4, help="slots of each deployment's replica")
    parser.add_argument(
        "--weights",
        type=float,
        nargs="+",
        default=[1.0, 1.0, 2.0],
        help="the backlogged tenants' weights",
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path(".bench-cache/fairness.json"))
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Start the gateway in ``tmp``, run every window, stop it: the results."""
    gateway = Gateway(args, tmp)
    try:
        gateway.wait_ready()
        with httpx.Client(
            base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60.0
        ) as admin:
            return asyncio.run(run(args, gateway.url, admin))
    finally:
        gateway.stop()


class Fairness:
    """This module as a scenario of ``make bench`` (``--only-fairness``, ``--no-fairness``)."""

    name = "fairness"
    about = (
        "fair share against FIFO: a flooding tenant beside a light one, and three "
        "backlogged tenants weighted 1:1:2 (issue 27)"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--fairness-seconds", type=float, default=30.0, help="each fairness window's length"
        )
        parser.add_argument(
            "--fairness-flood", type=int, default=16, help="the flooding tenant's open streams"
        )
        parser.add_argument(
            "--fairness-reps", type=int, default=2, help="flood windows per admission mode"
        )

    def run(self, bench: Bench) -> None:
        a = bench.args
        flags = {"--seconds": a.fairness_seconds, "--flood": a.fairness_flood}
        flags |= {"--reps": a.fairness_reps, "--model": bench.gguf}
        args = parse_args([str(x) for pair in flags.items() for x in pair])
        tmp = bench.tmp / "fairness"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            bench.results[self.name] = measure(args, tmp)
        except KeyboardInterrupt:
            bench.results["interrupted"] = True

    def table(self, results: dict[str, Any]) -> str | None:
        section = results.get(self.name)
        return None if section is None else report(section)


SCENARIO = Fairness()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tm-fairness-") as tmp:
        results = measure(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
