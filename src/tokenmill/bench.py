"""``tokenmill bench``: a closed-loop load generator for any OpenAI-compatible server.

``concurrency`` workers each stream one ``/v1/chat/completions`` request and send the
next one as soon as the previous finished, until ``requests`` have been sent. Every
request asks for exactly ``max_tokens`` tokens (``ignore_eos``, which llama-server
honours and tokenmill ignores) with the same sampling settings and a fixed seed per
request index, so two servers see the same work; the report counts the tokens that
really arrived.

The generator usually shares the CPU with the server it measures, so it stays light:
an SSE line is only JSON-decoded when it can carry text or usage.

``--top-logprobs K`` asks every request for its tokens' log probabilities with the
``K`` likeliest alternatives (``logprobs: true, top_logprobs: K``), to measure what they
cost; the report counts the tokens that came with one.

``--json-schema FILE`` constrains every request to the JSON Schema in FILE
(``response_format``), to measure what structured outputs cost; ``--system FILE``
puts FILE's text before every prompt as a system message.

``--stagger`` starts the workers one after another instead of all at once: each when
the one before has streamed ``max_tokens / concurrency`` tokens of its first request.
Requests then arrive spread over one request's duration and stay so (a closed loop
keeps each worker's phase), instead of in waves of ``concurrency`` that are prefilled
together, whose time to first token jumps by a whole prefill step from run to run.
The workers' first requests (the ramp) count towards tokens/s, not towards the
TTFT, inter-token and latency percentiles.

``--busy N`` runs N busy loops (processes at ordinary priority that only spin) for
the duration of the run: how a server holds up on a host whose cores other work
shares (a build, a log shipper, a neighbour's batch job).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

DEFAULT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "Describe a busy market in a coastal town early in the morning.",
    "Give advice to someone starting to learn the piano as an adult.",
    "What are the main causes of the seasons on Earth? Explain simply.",
    "Write a letter from a cat to its owner about the new dog in the house.",
    "Describe the life cycle of a butterfly in detail.",
    "Tell me about the history of bread and why it matters to people.",
)
# min_p 0 explicitly: llama-server would otherwise add its default min_p 0.05 to the chain.
SAMPLING: dict[str, Any] = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.0}
# Errors kept verbatim in the report; the rest are only counted.
ERROR_SAMPLES = 5


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = math.nan
    latency_s: float = math.nan
    tokens: int = 0  # completion tokens: from usage when sent, else content chunks
    usage_reported: bool = False
    gaps_s: list[float] = field(default_factory=list)  # between content chunks
    logprob_tokens: int = 0  # entries of the chunks' logprobs.content
    error: str = ""
    ramp: bool = False  # a worker's first request while --stagger starts the workers


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def chat_url(url: str) -> str:
    """Accept ``http://host:port`` or ``http://host:port/v1``."""
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one per line)")
    return prompts


def request_body(args: argparse.Namespace, prompt: str, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": args.seed + index,
        "ignore_eos": True,
        **SAMPLING,
    }
    system = getattr(args, "system_text", None)
    if system is not None:
        body["messages"].insert(0, {"role": "system", "content": system})
    top = getattr(args, "top_logprobs", None)
    if top is not None:
        body["logprobs"] = True
        body["top_logprobs"] = top
    schema = getattr(args, "schema", None)
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": schema},
        }
    return body


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode("utf-8", errors="replace")
    return f"HTTP {status}: {message}"


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    on_chunk: Callable[[int], None] | None = None,
) -> RequestResult:
    """One streamed request; ``on_chunk`` is told the count of text chunks so far."""
    start = time.perf_counter()
    first = last = 0.0
    chunks = 0
    logprob_tokens = 0
    gaps: list[float] = []
    usage_tokens: int | None = None
    done = False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return RequestResult(
                    False, error=_error_text(response.status_code, await response.aread())
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                # Cheap filter: a chunk without text or usage (role-only, finish) needs no parse.
                has_usage = '"usage"' in data and '"usage":null' not in data
                if '"content"' not in data and not has_usage and '"error"' not in data:
                    continue
                event = json.loads(data)
                if "error" in event and not event.get("choices"):
                    return RequestResult(False, error=str(event["error"].get("message", event)))
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                        chunks += 1
                        if on_chunk is not None:
                            on_chunk(chunks)
                    logprobs = choice.get("logprobs")
                    if logprobs:
                        logprob_tokens += len(logprobs.get("content") or ())
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, ValueError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if not done:
        return RequestResult(False, error="the stream ended without [DONE]")
    if chunks == 0:
        return RequestResult(False, error="the stream carried no text")
    return RequestResult(
        True,
        ttft_s=first - start,
        latency_s=end - start,
        tokens=usage_tokens if usage_tokens is not None else chunks,
        usage_reported=usage_tokens is not None,
        gaps_s=gaps,
        logprob_tokens=logprob_tokens,
    )


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes that spin at ordinary priority until the block ends."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin, stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


async def run_load(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    url = chat_url(args.url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    results: list[RequestResult] = []
    next_index = 0
    bar = tqdm(
        total=args.requests, file=sys.stderr, unit="req", disable=args.no_progress, leave=False
    )
    step = stagger_tokens(args)
    # Worker k waits for starts[k]: all set at once, or (--stagger) each set by the worker
    # before it once its first request has streamed `step` chunks (or ended).
    starts = [asyncio.Event() for _ in range(args.concurrency)]
    for event in starts if not step else starts[:1]:
        event.set()
    ramp_s = 0.0

    def release(k: int) -> Callable[[int], None]:
        def on_chunk(chunks: int) -> None:
            if chunks >= step:
                starts[k].set()

        return on_chunk

    async def worker(client: httpx.AsyncClient, k: int) -> None:
        nonlocal next_index, ramp_s
        await starts[k].wait()
        ramp_s = max(ramp_s, time.perf_counter() - started)
        following = k + 1 < len(starts)
        first = True
        while next_index < args.requests:
            index = next_index
            next_index += 1
            body = request_body(args, prompts[index % len(prompts)], index)
            on_chunk = release(k + 1) if step and first and following else None
            result = await one_request(client, url, body, on_chunk)
            result.ramp = bool(step) and first
            if following:
                starts[k + 1].set()  # the request ended short of `step` chunks: no waiting
            first = False
            results.append(result)
            bar.update(1)
            if not result.ok:
                bar.set_postfix(errors=sum(not r.ok for r in results), refresh=False)
        if following:
            starts[k + 1].set()  # no request left for this worker

    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client, k) for k in range(args.concurrency)))
        wall = time.perf_counter() - started
    bar.close()
    return summarize(args, results, wall, ramp_s)


def stagger_tokens(args: argparse.Namespace) -> int:
    """Chunks a worker's first request streams before the next worker starts (0: all at once)."""
    if not getattr(args, "stagger", False) or args.concurrency < 2:
        return 0
    return math.ceil(int(args.max_tokens) / int(args.concurrency))


def summarize(
    args: argparse.Namespace, results: list[RequestResult], wall: float, ramp_s: float = 0.0
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    # The latency figures leave the ramp out (if anything is left after it).
    measured = [r for r in ok if not r.ramp] or ok
    ttft = [r.ttft_s * 1000 for r in measured]
    gaps = [g * 1000 for r in measured for g in r.gaps_s]
    tokens = [r.tokens for r in ok]
    errors = [r.error for r in results if not r.ok]

    def ms(values: list[float], *qs: int) -> dict[str, float]:
        return {f"p{q}": round(percentile(values, q), 2) for q in qs}

    return {
        "url": args.url,
        "model": args.model,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "busy": args.busy,
        "stagger_tokens": stagger_tokens(args),
        "ramp_s": round(ramp_s, 3),
        "measured_requests": len(measured),
        "top_logprobs": getattr(args, "top_logprobs", None),
        "json_schema": None
        if getattr(args, "json_schema", None) is None
        else str(args.json_schema),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": errors[:ERROR_SAMPLES],
        "wall_s": round(wall, 3),
        "output_tokens": sum(tokens),
        "output_tokens_per_s": round(sum(tokens) / wall, 2) if wall > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else 0.0,
        "tokens_per_request": {
            "min": min(tokens, default=0),
            "mean": round(sum(tokens) / len(tokens), 1) if tokens else 0.0,
            "max": max(tokens, default=0),
        },
        "usage_reported": sum(r.usage_reported for r in ok),
        "logprob_tokens": sum(r.logprob_tokens for r in ok),
        "ttft_ms": ms(ttft, 50, 95, 99),
        "itl_ms": ms(gaps, 50, 99),
        "latency_ms": ms([r.latency_s * 1000 for r in measured], 50, 99),
    }


def format_report(report: dict[str, Any]) -> str:
    ttft, itl, per = report["ttft_ms"], report["itl_ms"], report["tokens_per_request"]
    busy = f"  busy loops={report['busy']}" if report.get("busy") else ""
    if report.get("top_logprobs") is not None:
        busy += f"  top_logprobs={report['top_logprobs']}"
    lines = [
        f"{report['url']}  model={report['model']}  concurrency={report['concurrency']}  "
        f"requests={report['requests']}  max_tokens={report['max_tokens']}{busy}",
        f"  completed        {report['completed']}   errors {report['errors']}"
        f"   wall {report['wall_s']:.2f} s",
        f"  output tokens/s  {report['output_tokens_per_s']:.1f}"
        f"   ({report['output_tokens']} tokens, {per['mean']} per request,"
        f" min {per['min']} max {per['max']})",
        f"  requests/s       {report['requests_per_s']:.2f}",
        *(
            [
                f"  stagger          workers started {report['stagger_tokens']} tokens apart "
                f"(ramp {report['ramp_s']:.2f} s); TTFT, inter-token and latency over the "
                f"{report['measured_requests']} requests after each worker's first"
            ]
            if report.get("stagger_tokens")
            else []
        ),
        *(
            [f"  logprob tokens   {report['logprob_tokens']}"]
            if report.get("top_logprobs") is not None
            else []
        ),
        f"  TTFT ms          p50 {ttft['p50']:.1f}   p95 {ttft['p95']:.1f}   p99 {ttft['p99']:.1f}",
        f"  inter-token ms   p50 {itl['p50']:.2f}   p99 {itl['p99']:.2f}",
    ]
    lines += [f"  error: {e}" for e in report["error_samples"]]
    return "\n".join(lines)


def _bench(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1 or args.busy < 0:
        print(
            "tokenmill bench: --concurrency, --requests and --max-tokens must be >= 1, --busy >= 0",
            file=sys.stderr,
        )
        return 2
    if args.top_logprobs is not None and not 0 <= args.top_logprobs <= 20:
        print("tokenmill bench: --top-logprobs must be 0-20", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(args.prompts)
        args.schema = None if args.json_schema is None else json.loads(args.json_schema.read_text())
        args.system_text = None if args.system is None else args.system.read_text()
    except (OSError, ValueError) as e:
        print(f"tokenmill bench: {e}", file=sys.stderr)
        return 2
    with busy_loops(args.busy):
        report = asyncio.run(run_load(args, prompts))
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    # Non-zero when any request failed, so scripts notice; the figures are printed anyway.
    return 1 if report["errors"] else 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server",
        description="Closed-loop load generator: CONCURRENCY streams, each sending the next "
        "request when its previous one finished, over /v1/chat/completions.",
    )
    p.add_argument("url", help="server address, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--concurrency", "-c", type=int, default=1, help="parallel streams (default 1)")
    p.add_argument(
        "--requests", "-n", type=int, default=None, help="total requests (default 2*C+4)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="tokens asked per request (default 128)"
    )
    p.add_argument("--prompts", type=Path, help="a text file, one prompt per line")
    p.add_argument(
        "--seed", type=int, default=1234, help="seed of request 0; request i uses seed+i"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="run N busy loops beside the server during the run (a shared host)",
    )
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="ask every request for logprobs with the K (0-20) likeliest alternatives",
    )
    p.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="constrain every request to the JSON Schema in FILE (response_format)",
    )
    p.add_argument(
        "--system",
        type=Path,
        default=None,
        metavar="FILE",
        help="a system message (FILE's text) before every prompt",
    )
    p.add_argument(
        "--stagger",
        action="store_true",
        help="start the workers one after another, each once the one before has streamed "
        "MAX_TOKENS/CONCURRENCY tokens, so requests arrive spread out instead of in waves; "
        "the workers' first requests are left out of the latency percentiles",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_bench_main)


def _bench_main(args: argparse.Namespace) -> int:
    if args.requests is None:
        args.requests = 2 * args.concurrency + 4
    return _bench(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenmill.bench``: the same command without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
