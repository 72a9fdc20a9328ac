"""Speculative decoding by prompt lookup (issue 39): tokenmill with and without drafts,
and llama.cpp's own server without and with its n-gram modes, in one run.

Servers, one at a time (each alone on the machine while it is measured), the same
model, threads and slots: tokenmill (``speculative = "off"``), tokenmill
(``speculative = "ngram"``), llama-server, ``llama-server --spec-type ngram-simple``
and ``--spec-type ngram-mod``. Workloads, each as greedy chat completions of up to
``--max-tokens`` tokens, streamed:

* **copy-heavy**: a function to rewrite with one name changed, a JSON to repair, a
  paragraph to quote: most of each answer is in its prompt;
* **chat**: ordinary questions, whose answers are not.

Each at ``c=1`` (one request at a time) and ``c=16`` (16 at once, closed loop), for
``--reps`` repetitions, the servers interleaved within each repetition (drift on a
shared machine hits them alike). Reported: decode tokens/s (completion tokens after
the first, over the time from first token to last, summed over requests; at c=16 the
completion tokens over the wall time), each server's ratio to tokenmill without
drafts, tokenmill's acceptance (drafted and kept tokens from its replica's
counters), and whether each server's greedy answers are its own without drafts.

Targets: copy-heavy c=1 at least 1.5x tokenmill without drafts and at least 1.1x
llama-server's best n-gram mode; chat at c=1 and every workload at c=16 at least
0.97x without drafts; greedy answers identical to those without drafts.

Run alone: ``python bench/scenarios/speculative.py``; results are printed and written
as JSON to ``--out`` (default ``.bench-cache/speculative.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

try:
    from servers import Server, free_port, llama_server, llama_server_binary
except ImportError:  # run alone, from bench/scenarios
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from servers import Server, free_port, llama_server, llama_server_binary
from scenarios.routing.workload import fresh_connections

if TYPE_CHECKING:
    from scenario import Bench

SOURCE = """def order_total(order, tax_rate):
    subtotal = 0
    for line in order.lines:
        subtotal = subtotal + line.unit_price * line.quantity
    discount = order.discount if order.discount else 0
    taxed = (subtotal - discount) * (1 + tax_rate)
    return round(taxed, 2)
"""
RECORD = (
    '{"id": 4821, "customer": {"name": "Ada Lovelace", "email": "ada@example.com",}, '
    '"items": [{"sku": "A-100", "qty": 2, "price": 9.5}, {"sku": "B-220", "qty": 1, '
    '"price": 24.0},], "status": "paid"'
)
PARAGRAPH = (
    "The harbour master opened the ledger at dawn, as he had every morning for thirty "
    "years, and wrote the names of the ships that had come in overnight: the Marguerite "
    "from Lisbon with salt and cork, the Hollandia with timber, and a small fishing boat "
    "whose name nobody could read through the salt on her bow."
)
COPY_HEAVY = [
    f"Rewrite this function with the variable subtotal renamed to net. Change nothing "
    f"else.\n\n{SOURCE}",
    f"This JSON has syntax errors. Write it back fixed, nothing else:\n\n{RECORD}",
    f"Quote this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Add a docstring to this function and write the whole function back:\n\n{SOURCE}",
]
CHAT = [
    "What are three good habits for a new programmer?",
    "Explain why the sky is blue in a few sentences.",
    "Give me a short recipe for a tomato soup.",
    "What is the difference between a list and a tuple in Python?",
]
WORKLOADS = {"copy-heavy": COPY_HEAVY, "chat": CHAT}
SERVERS = ("tokenmill", "tokenmill-ngram", "llama-server", "llama-ngram-simple", "llama-ngram-mod")


def tokenmill(gguf: Path, args: argparse.Namespace, tmp: Path, speculative: str) -> Server:
    port = free_port()
    cfg = tmp / f"tokenmill-{speculative}.toml"
    cfg.write_text(
        f'[[deployments]]\nid = "m"\nmodel = "{gguf}"\nmax_num_seqs = {args.slots}\n'
        f'n_ctx = 2048\nn_threads = {args.threads}\nspeculative = "{speculative}"\n'
        "max_queue = 256\n"
    )
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--config", str(cfg)]
    cmd += ["--data-dir", str(tmp / f"data-{speculative}")]
    return Server(f"tokenmill-{speculative}", cmd, port, tmp / f"tokenmill-{speculative}.log")


def server(name: str, gguf: Path, args: argparse.Namespace, tmp: Path, binary: Path) -> Server:
    if name == "tokenmill":
        return tokenmill(gguf, args, tmp, "off")
    if name == "tokenmill-ngram":
        return tokenmill(gguf, args, tmp, "ngram")
    extra = () if name == "llama-server" else ("--spec-type", name.removeprefix("llama-"))
    n_ctx = args.slots * 2048
    return llama_server(binary, gguf, args.threads, tmp, args.slots, n_ctx, name, extra)


async def one(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    text: list[str] = []
    usage: dict[str, int] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.monotonic()
                    first = first or now
                    last = now
                    text.append(piece)
    tokens = int(usage.get("completion_tokens", 0))
    decode_s = (last - first) if first is not None and last is not None else 0.0
    return {"text": "".join(text), "tokens": tokens, "decode_s": decode_s}


async def workload(
    url: str, model: str, prompts: list[str], c: int, max_tokens: int
) -> dict[str, Any]:
    # A connection per request, for every server alike.
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=fresh_connections()) as client:
        started = time.monotonic()
        if c == 1:
            results = [await one(client, model, p, max_tokens) for p in prompts]
        else:
            queue = [prompts[i % len(prompts)] for i in range(c * 2)]
            results = []

            async def worker() -> None:
                while queue:
                    results.append(await one(client, model, queue.pop(0), max_tokens))

            await asyncio.gather(*(worker() for _ in range(c)))
        wall = time.monotonic() - started
    tokens = sum(r["tokens"] for r in results)
    decode = sum(max(0, r["tokens"] - 1) for r in results)
    decode_s = sum(r["decode_s"] for r in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "tok_per_s": round(decode / decode_s, 2)
        if c == 1 and decode_s
        else round(tokens / wall, 2),
        "texts": [r["text"] for r in results] if c == 1 else [],
    }


def counters(url: str) -> dict[str, int]:
    kv = httpx.get(f"{url}/v1/deployments/m", timeout=30).json()["replicas"][0].get("kv", {})
    return {"drafted": kv.get("spec_drafted", 0), "accepted": kv.get("spec_accepted", 0)}


def measure(args: argparse.Namespace, gguf: Path, tmp: Path) -> dict[str, Any]:
    binary = llama_server_binary()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    spec: dict[str, dict[str, int]] = {}
    for rep in range(args.reps):
        for name in SERVERS:
            srv = server(name, gguf, args, tmp, binary)
            failed: str | None = None
            try:
                srv.start()
                for wname, prompts in WORKLOADS.items():
                    for c in (1, 16):
                        key = f"{wname}@{c}"
                        if failed is not None:  # the server died: nothing more from it
                            runs.setdefault(name, {}).setdefault(key, []).append(
                                {"error": failed, "tok_per_s": 0.0, "texts": []}
                            )
                            continue
                        before = counters(srv.url) if name == "tokenmill-ngram" else {}
                        try:
                            got = asyncio.run(
                                workload(srv.url, srv.model, prompts, c, args.max_tokens)
                            )
                        except httpx.HTTPError as e:
                            failed = f"{e!r}; see {srv.log_path}"
                            got = {"error": failed, "tok_per_s": 0.0, "texts": []}
                            before = {}
                        runs.setdefault(name, {}).setdefault(key, []).append(got)
                        if before:
                            time.sleep(0.5)  # the replica's counters come with its status
                            after = counters(srv.url)
                            seen = spec.setdefault(key, {"drafted": 0, "accepted": 0})
                            for k in seen:
                                seen[k] += after[k] - before[k]
                        print(f"rep {rep} {name} {key}: {got['tok_per_s']} tok/s", flush=True)
            finally:
                srv.stop()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"settings": settings, "runs": runs, "acceptance": spec}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def parts_at(a: str, b: str) -> int:
    """Where two texts first differ (the shorter one's length if one begins the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def report(results: dict[str, Any]) -> str:
    runs = results["runs"]
    keys = [f"{w}@{c}" for w in WORKLOADS for c in (1, 16)]
    speed = {
        name: {k: median([r["tok_per_s"] for r in runs[name][k]]) for k in keys} for name in runs
    }
    base = speed["tokenmill"]
    lines = ["decode tok/s (median of reps), and the ratio to tokenmill without drafts:"]
    for name in runs:
        cells = ", ".join(
            f"{k} {speed[name][k]} ({speed[name][k] / (base[k] or 1):.3f}x)" for k in keys
        )
        lines.append(f"  {name}: {cells}")
        errors = {r["error"] for k in keys for r in runs[name][k] if "error" in r}
        lines += [f"    {name} failed: {e}" for e in sorted(errors)]
    for key, seen in results["acceptance"].items():
        rate = seen["accepted"] / seen["drafted"] if seen["drafted"] else 0.0
        lines.append(
            f"  tokenmill-ngram {key}: drafted {seen['drafted']}, kept {seen['accepted']} "
            f"({rate:.2f})"
        )

    def same(name: str, ref: str) -> bool:
        return all(
            a["texts"] == b["texts"]
            for k in keys
            if k.endswith("@1")
            for a, b in zip(runs[name][k], runs[ref][k], strict=True)
        )

    tm_same = same("tokenmill-ngram", "tokenmill")
    for name, ref in (("tokenmill-ngram", "tokenmill"), ("llama-ngram-mod", "llama-server")):
        for k in keys:
            if not k.endswith("@1"):
                continue
            for a, b in zip(runs[name][k], runs[ref][k], strict=True):
                for i, (x, y) in enumerate(zip(a["texts"], b["texts"], strict=False)):
                    if x != y:
                        at = parts_at(x, y)
                        lines.append(f"    {name} {k} prompt {i}: parts from {ref} at char {at}")
    lines.append(
        f"greedy answers the same as without drafts: tokenmill {tm_same}, "
        f"ngram-simple {same('llama-ngram-simple', 'llama-server')}, "
        f"ngram-mod {same('llama-ngram-mod', 'llama-server')}"
    )
    ngram = speed["tokenmill-ngram"]
    best_llama = max(
        speed["llama-ngram-simple"]["copy-heavy@1"], speed["llama-ngram-mod"]["copy-heavy@1"]
    )
    checks = [
        (
            "copy-heavy c=1 >= 1.5x without drafts",
            ngram["copy-heavy@1"] >= 1.5 * base["copy-heavy@1"],
        ),
        (
            "copy-heavy c=1 >= 1.1x llama-server's best n-gram mode",
            ngram["copy-heavy@1"] >= 1.1 * best_llama,
        ),
        ("chat c=1 >= 0.97x without drafts", ngram["chat@1"] >= 0.97 * base["chat@1"]),
        (
            "every workload at c=16 >= 0.97x without drafts",
            all(ngram[k] >= 0.97 * base[k] for k in keys if k.endswith("@16")),
        ),
        ("greedy answers identical to those without drafts", tm_same),
    ]
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in checks]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path(".bench-cache/speculative.json"))
    return parser.parse_args(argv)


def embedded_gguf() -> Path:
    from tokenmill.engines.embedded import embedded_model_path

    return Path(embedded_model_path())


class Speculative:
    """This module as a scenario of ``make bench`` (``--only-speculative``)."""

    name = "speculative"
    about = (
        "speculative decoding by prompt lookup: copy-heavy and chat at c=1 and c=16, "
        "tokenmill with and without drafts and llama-server with its n-gram modes (issue 39)"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--speculative-reps", type=int, default=3)

    def run(self, bench: Bench) -> None:
        args = parse_args(["--reps", str(bench.args.speculative_reps)])
        tmp = bench.tmp / "speculative"
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            bench.results[self.name] = measure(args, bench.gguf, tmp)
        except KeyboardInterrupt:
            bench.results["interrupted"] = True

    def table(self, results: dict[str, Any]) -> str | None:
        section = results.get(self.name)
        return None if section is None else report(section)


SCENARIO = Speculative()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf = args.model or embedded_gguf()
    with tempfile.TemporaryDirectory(prefix="tm-spec-") as tmp:
        results = measure(args, gguf, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
