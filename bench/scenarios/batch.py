"""The Batch API on idle capacity (issue 37), on one tokenmill gateway.

One gateway serves the embedded model (or ``--model``) as one replica of ``--slots``
slots, metered by a SQLite ledger and priced (1 and 2 micro-units a prompt and a
completion token; a batch line at the default ``batch_discount`` of 0.5). In turn:

1. **interactive alone**: an interactive tenant sends a short streamed chat every
   ``--interval`` seconds (a steady rate; each asks for 8 tokens), for half of
   ``--seconds``: its time to first token (TTFT).
2. **interactive beside a batch**: a batch of ``--lines`` chat lines (each its own
   question after one shared system prompt, ``--line-tokens`` tokens each, every
   answer that long) is created, and the interactive tenant goes on at the same rate
   for ``--seconds`` while it runs; then the batch is left to finish.
3. **interactive alone** again, for the other half of ``--seconds`` (drift on a
   shared machine hits both sides alike).
4. **the same lines sent directly**, ``--slots`` at a time (full concurrency), as
   non-streamed chat completions by another tenant: tokens/s, from the first sent to
   the last answered.
5. **the batch alone**: the same lines as a second batch, nobody else on the
   gateway: tokens/s from its creation to its completion (polled every 0.2 s).

At the end the books: every line of both batches has a receipt (``/v1/usage/{id}``)
of exactly its tokens at half price (written out here, not computed by tokenmill),
and each account's debit is the sum of its receipts.

Targets: interactive TTFT p50 beside the batch at most 1.25x alone; the batch alone
at least 0.9x the tokens/s of the same lines sent directly; the books exact.

Run alone: ``python bench/scenarios/batch.py [--lines 1000] [--seconds 40]``; results
are printed and written as JSON to ``--out`` (default ``.bench-cache/batch.json``);
``make bench`` runs it as the scenario ``batch``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
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

from tokenmill.gateway.idle import QUIET_S

if TYPE_CHECKING:
    from scenario import Bench

SYSTEM = "You are a concise assistant. Answer in one short sentence."
INTERACTIVE_TOKENS = 8
CREDIT = 10**12


def config(args: argparse.Namespace) -> str:
    model = f'model = "{args.model}"\n' if args.model else ""
    return (
        f'[[deployments]]\nid = "smollm2"\n{model}max_num_seqs = {args.slots}\n'
        "max_queue = 4096\nqueue_timeout_s = 600\nn_ctx = 1024\n"
        "[deployments.price]\nprompt_per_mtok = 1000000\ncompletion_per_mtok = 2000000\n"
    )


def discounted(prompt_tokens: int, completion_tokens: int) -> int:
    """Half price, written out: half a micro-unit a prompt token, one a completion
    token, rounded up."""
    return (prompt_tokens + 1) // 2 + completion_tokens


def chat(question: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def questions(n: int) -> list[str]:
    topics = ("rivers", "bridges", "owls", "glaciers", "markets", "comets", "ferns", "clocks")
    return [f"Give one fact about {topics[i % len(topics)]} (question {i})." for i in range(n)]


async def interactive(url: str, key: str, args: argparse.Namespace, seconds: float) -> list[float]:
    """A streamed chat every ``--interval`` seconds for ``seconds``: their TTFTs."""
    ttfts: list[float] = []
    headers = {"authorization": f"Bearer {key}"}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {**chat(f"Name a colour ({i}).", INTERACTIVE_TOKENS), "stream": True}
        start = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            first = True
            async for line in r.aiter_lines():
                if first and line.startswith("data:") and '"content":"' in line:
                    event = json.loads(line[5:])
                    if any((c.get("delta") or {}).get("content") for c in event["choices"]):
                        ttfts.append(time.monotonic() - start)
                        first = False

    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        tasks = []
        start = time.monotonic()
        i = 0
        while time.monotonic() < start + seconds:
            tasks.append(asyncio.create_task(one(client, i)))
            i += 1
            await asyncio.sleep(max(0.0, start + i * args.interval - time.monotonic()))
        await asyncio.gather(*tasks)
    return ttfts


def create_batch(client: httpx.Client, lines: list[str], tokens: int) -> str:
    rows = [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": chat(q, tokens)}
        for i, q in enumerate(lines)
    ]  # fmt: skip
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    f = client.post(
        "/v1/files", files={"file": ("lines.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}
    )
    f.raise_for_status()
    b = client.post(
        "/v1/batches",
        json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions",
              "completion_window": "24h"},
    )  # fmt: skip
    b.raise_for_status()
    assert b.json()["status"] == "in_progress", b.json()
    return str(b.json()["id"])


def wait_batch(client: httpx.Client, batch_id: str) -> tuple[dict[str, Any], float]:
    """The ended batch, and when it was seen ended (monotonic)."""
    while True:
        b = client.get(f"/v1/batches/{batch_id}").json()
        if b["status"] in ("completed", "failed", "expired", "cancelled"):
            return b, time.monotonic()
        time.sleep(0.2)


def outputs(client: httpx.Client, batch: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            text = client.get(f"/v1/files/{batch[key]}/content").text
            out += [json.loads(x) for x in text.splitlines()]
    return out


def completion_tokens(rows: list[dict[str, Any]]) -> int:
    return sum(
        r["response"]["body"]["usage"]["completion_tokens"]
        for r in rows
        if r["response"] and r["response"]["status_code"] == 200
    )


async def direct(url: str, key: str, lines: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The lines as plain requests, ``--slots`` at a time."""
    headers = {"authorization": f"Bearer {key}"}
    queue = list(lines)
    tokens = 0
    errors: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            q = queue.pop()
            r = await client.post(
                "/v1/chat/completions", json=chat(q, args.line_tokens), headers=headers
            )
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                continue
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(
        base_url=url, timeout=600.0, limits=httpx.Limits(max_connections=args.slots + 4)
    ) as client:
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(args.slots)))
        seconds = time.monotonic() - start
    return {"tokens": tokens, "seconds": round(seconds, 2),
            "tok_per_s": round(tokens / seconds, 2), "errors": errors[:5]}  # fmt: skip


def books(url: str, admin: httpx.Client, tenant: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every line's receipt is its tokens at half price; the debit is their sum."""
    headers = {"authorization": f"Bearer {tenant.key}"}
    wrong = 0
    total = 0
    with httpx.Client(base_url=url, headers=headers, timeout=60.0) as client:
        for row in rows:
            if not row["response"]:
                continue
            r = client.get(f"/v1/usage/{row['response']['request_id']}").json()
            usage = row["response"]["body"].get("usage")
            expected = discounted(r["prompt_tokens"], r["completion_tokens"])
            if r["charged"] != expected or (
                usage and usage["completion_tokens"] != r["completion_tokens"]
            ):
                wrong += 1
            total += r["charged"]
    acc = admin.get(f"/admin/accounts/{tenant.account}").json()
    debit = CREDIT - acc["balance"]
    exact = wrong == 0 and total == debit and acc["held"] == 0
    return {"lines": len(rows), "receipts_wrong": wrong, "receipts_sum": total, "debit": debit,
            "held": acc["held"], "exact": exact}  # fmt: skip


async def measure_all(args: argparse.Namespace, url: str, admin: httpx.Client) -> dict[str, Any]:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results: dict[str, Any] = {"settings": settings}
    person = new_tenant(admin, "interactive")
    lines = questions(args.lines)
    half = args.seconds / 2
    alone = await interactive(url, person.key, args, half)
    print(f"interactive alone: {len(alone)} requests", flush=True)

    batcher = new_tenant(admin, "batch-beside")
    client = httpx.Client(
        base_url=url, headers={"authorization": f"Bearer {batcher.key}"}, timeout=120.0
    )
    first = create_batch(client, lines, args.line_tokens)
    beside = await interactive(url, person.key, args, args.seconds)
    print(f"interactive beside the batch: {len(beside)} requests", flush=True)
    b1, _ = await asyncio.to_thread(wait_batch, client, first)
    rows1 = outputs(client, b1)
    alone += await interactive(url, person.key, args, half)
    print(f"interactive alone again: {len(alone)} requests", flush=True)

    sender = new_tenant(admin, "direct")
    results["direct"] = await direct(url, sender.key, lines, args)
    print(f"direct: {results['direct']}", flush=True)

    # Alone means alone: past the window in which other traffic keeps a batch to a
    # share of the slots (tokenmill.gateway.idle.QUIET_S).
    await asyncio.sleep(QUIET_S + 1)
    alone_batcher = new_tenant(admin, "batch-alone")
    client2 = httpx.Client(
        base_url=url, headers={"authorization": f"Bearer {alone_batcher.key}"}, timeout=120.0
    )
    start = time.monotonic()
    second = create_batch(client2, lines, args.line_tokens)
    b2, seen = await asyncio.to_thread(wait_batch, client2, second)
    rows2 = outputs(client2, b2)
    tokens = completion_tokens(rows2)
    results["batch_alone"] = {
        "status": b2["status"], "request_counts": b2["request_counts"], "tokens": tokens,
        "seconds": round(seen - start, 2), "tok_per_s": round(tokens / (seen - start), 2),
    }  # fmt: skip
    print(f"batch alone: {results['batch_alone']}", flush=True)
    results["batch_beside"] = {"status": b1["status"], "request_counts": b1["request_counts"]}
    results["interactive"] = {
        "alone": {"requests": len(alone), "ttft_p50_ms": ms(statistics.median(alone)),
                  "ttft_p99_ms": ms(percentile(alone, 0.99))},
        "beside_batch": {"requests": len(beside), "ttft_p50_ms": ms(statistics.median(beside)),
                         "ttft_p99_ms": ms(percentile(beside, 0.99))},
    }  # fmt: skip
    results["books"] = {
        "beside": books(url, admin, batcher, rows1),
        "alone": books(url, admin, alone_batcher, rows2),
    }
    await asyncio.to_thread(client.close)
    await asyncio.to_thread(client2.close)
    return results


def report(results: dict[str, Any]) -> str:
    i = results["interactive"]
    a, b = i["alone"], i["beside_batch"]
    ttft = b["ttft_p50_ms"] / a["ttft_p50_ms"] if a["ttft_p50_ms"] else None
    d, ba = results["direct"], results["batch_alone"]
    tput = ba["tok_per_s"] / d["tok_per_s"] if d["tok_per_s"] else None
    bk = results["books"]
    exact = bk["beside"]["exact"] and bk["alone"]["exact"]
    lines = [
        f"interactive alone: TTFT p50 {a['ttft_p50_ms']} ms, p99 {a['ttft_p99_ms']} ms "
        f"({a['requests']} requests)",
        f"interactive beside a {results['settings']['lines']}-line batch: TTFT p50 "
        f"{b['ttft_p50_ms']} ms, p99 {b['ttft_p99_ms']} ms ({b['requests']} requests); "
        f"p50 ratio {ttft and round(ttft, 3)}",
        f"the lines sent directly ({results['settings']['slots']} at a time): "
        f"{d['tok_per_s']} tok/s in {d['seconds']} s; as a batch alone: {ba['tok_per_s']} "
        f"tok/s in {ba['seconds']} s ({ba['request_counts']}); ratio {tput and round(tput, 3)}",
        f"books: beside {bk['beside']}, alone {bk['alone']}",
    ]
    checks = [
        ("interactive TTFT p50 beside the batch <= 1.25x alone", ttft is not None and ttft <= 1.25),
        (
            "batch alone >= 0.9x the tok/s of the lines sent directly",
            tput is not None and tput >= 0.9,
        ),
        ("every line's receipt at half price, the debit their sum", exact),
    ]
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in checks]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=1000, help="lines of each batch")
    parser.add_argument("--line-tokens", type=int, default=16, help="max_tokens of each line")
    parser.add_argument("--slots", type=int, default=8, help="slots of the replica")
    parser.add_argument(
        "--seconds", type=float, default=40.0, help="the interactive window beside the batch"
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between interactive requests"
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path(".bench-cache/batch.json"))
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    gateway = Gateway(args, tmp, config(args))
    try:
        gateway.wait_ready()
        with httpx.Client(
            base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60.0
        ) as admin:
            return asyncio.run(measure_all(args, gateway.url, admin))
    finally:
        gateway.stop()


class Batch:
    """This module as a scenario of ``make bench`` (``--only-batch``, ``--no-batch``)."""

    name = "batch"
    about = (
        "the Batch API on idle capacity: interactive TTFT beside a batch, and a batch's "
        "throughput against the same lines sent directly (issue 37)"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--batch-lines", type=int, default=1000, help="lines of each batch")
        parser.add_argument(
            "--batch-seconds", type=float, default=40.0, help="the interactive window"
        )

    def run(self, bench: Bench) -> None:
        a = bench.args
        flags = {"--lines": a.batch_lines, "--seconds": a.batch_seconds, "--model": bench.gguf}
        args = parse_args([str(x) for pair in flags.items() for x in pair])
        tmp = bench.tmp / "batch"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            bench.results[self.name] = measure(args, tmp)
        except KeyboardInterrupt:
            bench.results["interrupted"] = True

    def table(self, results: dict[str, Any]) -> str | None:
        section = results.get(self.name)
        return None if section is None else report(section)


SCENARIO = Batch()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tm-batch-") as tmp:
        results = measure(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
