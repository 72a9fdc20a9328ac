"""The first token, for the bench scenarios: tokenmill's stages, and a chat's second turn.

* :func:`read_stages`: the ``stages_ms`` of the requests tokenmill logged (one JSON line
  per request, see ``tokenmill.stages``) past a point of its log file, so that a run's
  requests are told apart from the warm-up's and the other runs'.
* :func:`stage_summary`: the median of each stage over a level's requests, beside the
  client's TTFT p50 of tokenmill and of llama-server from the same runs.
* :func:`second_turn`: a conversation of two turns with the same system prompt, the
  second sending the first's history back with one new user message, as a chat client
  does. Its TTFT is what a prompt cache is for: the history is already in the KV cache
  (llama-server is asked for ``cache_prompt``, its default; tokenmill reuses prefixes
  on its own, ignoring the field).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

# The order tokenmill.stages lists them (the bench does not import tokenmill).
STAGES = (
    "http", "auth", "parse", "admission", "prepare_hop", "prepare", "prepare_back", "hold",
    "dispatch", "to_replica", "engine_queue", "prefill", "sample", "frame", "to_gateway", "sse",
)  # fmt: skip
REQUEST_LOG = "tokenmill.requests: "

SYSTEM = "You are a concise assistant who answers in plain prose."
FIRST_TURNS = (
    "Tell me about the history of the lighthouse on a rocky northern coast.",
    "How does a refrigerator keep food cold? Explain it to a child.",
    "What should I pack for a week of hiking in the mountains in autumn?",
    "Describe a busy fish market early in the morning in a small harbour town.",
)
SECOND_TURN = "Thanks. Now say the same again in two short sentences."
FIRST_TURN_TOKENS = 48
SECOND_TURN_TOKENS = 8


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_stages(path: Path, offset: int) -> list[dict[str, float]]:
    """``stages_ms`` of every request logged past ``offset`` that had a first token."""
    out: list[dict[str, float]] = []
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            at = line.find(REQUEST_LOG)
            if at < 0:
                continue
            try:
                record = json.loads(line[at + len(REQUEST_LOG) :])
            except ValueError:
                continue
            stages = record.get("stages_ms")
            if isinstance(stages, dict) and stages:
                out.append({k: float(v) for k, v in stages.items()})
    return out


def stage_summary(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Medians per stage over every request of ``reports`` (tokenmill's runs at a level)."""
    samples = [s for r in reports for s in r.get("stages_ms", [])]
    if not samples:
        return None
    p50 = {
        name: round(statistics.median(values), 3)
        for name in STAGES
        if (values := [s[name] for s in samples if name in s])
    }
    return {
        "requests": len(samples),
        "p50_ms": p50,
        "sum_p50_ms": round(sum(p50.values()), 2),
        # The whole server side, request by request (the sum of each one's stages).
        "server_p50_ms": round(statistics.median(sum(s.values()) for s in samples), 2),
    }


def stage_lines(level: str, summary: dict[str, Any]) -> list[str]:
    p50 = summary["p50_ms"]
    width = 100
    lines = [
        f"first token at c={level}, p50 per stage over {summary['requests']} requests (ms; "
        "tokenmill.stages, from the request's first byte to its first SSE event written):"
    ]
    line = " "
    for name in STAGES:
        if name in p50:
            item = f" {name} {p50[name]:.3f}"
            if len(line) + len(item) > width:
                lines.append(line)
                line = " "
            line += item
    lines.append(line)
    outside = [n for n in ("prefill",) if n in p50]
    rest = summary["sum_p50_ms"] - sum(p50[n] for n in outside)
    lines.append(
        f"  sum of stage p50s {summary['sum_p50_ms']:.2f} (of which outside prefill "
        f"{rest:.2f}); server side p50 {summary['server_p50_ms']:.2f}; client TTFT p50 "
        f"tokenmill {summary['tokenmill_ttft_p50_ms']:.1f}, llama-server "
        f"{summary['llama_server_ttft_p50_ms']:.1f}"
    )
    return lines


# -- the second turn of a chat ---------------------------------------------------------


def _stream(
    client: httpx.Client, url: str, body: dict[str, Any]
) -> tuple[float, str, dict[str, Any]]:
    """(TTFT in ms, the text, the last event's usage/timings) of one streamed chat."""
    start = time.perf_counter()
    ttft = float("nan")
    parts: list[str] = []
    tail: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if not parts:
                        ttft = (time.perf_counter() - start) * 1000
                    parts.append(text)
            for key in ("usage", "timings"):
                if event.get(key):
                    tail[key] = event[key]
    return ttft, "".join(parts), tail


def _cached(tail: dict[str, Any]) -> int | None:
    timings = tail.get("timings") or {}
    if "cache_n" in timings:  # llama-server's own count
        return int(timings["cache_n"])
    details = (tail.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return None if cached is None else int(cached)


def second_turn(
    url: str, model: str, conversation: int, sampling: dict[str, Any], pause_s: float = 0.0
) -> dict[str, Any]:
    """One two-turn chat; the TTFT of each turn and the cached prompt tokens of the second.

    ``pause_s`` between the first answer's end and the second message: the person
    reading and typing (0: a program sending it at once)."""
    first = FIRST_TURNS[conversation % len(FIRST_TURNS)]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{first} (conversation {conversation})"},
    ]
    common = {"model": model, "stream": True, "cache_prompt": True, **sampling}
    common["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=120.0, trust_env=False) as client:
        body = {**common, "messages": messages, "max_tokens": FIRST_TURN_TOKENS}
        body["seed"] = 1000 + conversation
        body["ignore_eos"] = True
        ttft1, answer, _ = _stream(client, url, body)
        time.sleep(pause_s)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": SECOND_TURN},
        ]
        body = {**common, "messages": messages, "max_tokens": SECOND_TURN_TOKENS}
        body["seed"] = 2000 + conversation
        ttft2, _, tail = _stream(client, url, body)
    return {
        "ttft1_ms": round(ttft1, 2),
        "ttft2_ms": round(ttft2, 2),
        "cached2": _cached(tail),
        "prompt2": (tail.get("usage") or {}).get("prompt_tokens"),
    }
