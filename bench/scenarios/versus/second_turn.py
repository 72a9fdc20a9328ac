"""A chat's second turn at c=1, against llama-server's prompt cache (issue #16).

Two-turn chats (``firsttoken.second_turn``: a system prompt, a first exchange, then the
history sent back with one new user message ``--turn-pause`` seconds after the answer)
against tokenmill and llama-server in turn, who goes first alternating, the same
conversations on each.
"""

from __future__ import annotations

import statistics
from typing import Any

from firsttoken import FIRST_TURN_TOKENS, second_turn
from scenario import Bench
from servers import SAMPLING, Server, log
from summary import mark


def measure(bench: Bench, tm: Server, ls: Server, out: dict[str, Any]) -> None:
    """Fill ``out`` with the runs and, after each repetition, their p50s (so that an
    interruption keeps the repetitions completed)."""
    n, pause = bench.args.second_turns, bench.args.turn_pause
    out.update(first_turn_tokens=FIRST_TURN_TOKENS, pause_s=pause)
    runs: dict[str, list[dict[str, Any]]] = {tm.name: [], ls.name: []}
    out["runs"] = runs
    for rep in range(bench.reps):
        order = (tm, ls) if rep % 2 == 0 else (ls, tm)
        for s in order:
            for k in range(n):
                result = second_turn(s.url, s.model, rep * n + k, SAMPLING, pause)
                runs[s.name].append(result)
        log(
            f"second turn rep {rep + 1}/{bench.reps}: TTFT ms "
            + "  ".join(f"{s.name} {[r['ttft2_ms'] for r in runs[s.name][-n:]]}" for s in (tm, ls))
        )
        out["summary"] = summary(runs)


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        name: {
            "ttft1_p50_ms": statistics.median(r["ttft1_ms"] for r in rs),
            "ttft2_p50_ms": statistics.median(r["ttft2_ms"] for r in rs),
            "cached2_p50": statistics.median(r["cached2"] or 0 for r in rs),
            "prompt2_p50": statistics.median(r["prompt2"] or 0 for r in rs),
        }
        for name, rs in runs.items()
        if rs
    }


def lines(results: dict[str, Any]) -> list[str]:
    turns = results.get("second_turn") or {}
    summary = turns.get("summary") or {}
    tm, ls = summary.get("tokenmill"), summary.get("llama-server")
    if not tm or not ls:
        return []
    return [
        f"\nsecond turn of a chat at c=1 (system prompt, a first exchange of "
        f"{turns['first_turn_tokens']} tokens, one new user message sent "
        f"{turns.get('pause_s', 0.0):g} s after the answer; llama-server with "
        f"cache_prompt), {len(turns['runs']['tokenmill'])} conversations each, p50:",
        f"  TTFT turn 2 tokenmill {tm['ttft2_p50_ms']:.1f} ms, llama-server "
        f"{ls['ttft2_p50_ms']:.1f} ms (diff {tm['ttft2_p50_ms'] - ls['ttft2_p50_ms']:+.1f} ms); "
        f"turn 1 {tm['ttft1_p50_ms']:.1f} / {ls['ttft1_p50_ms']:.1f} ms",
        f"  turn 2 prompt tokens {tm['prompt2_p50']:.0f} / {ls['prompt2_p50']:.0f}, cached "
        f"{tm['cached2_p50']:.0f} / {ls['cached2_p50']:.0f}",
    ]


def targets(results: dict[str, Any]) -> list[str]:
    summary = (results.get("second_turn") or {}).get("summary") or {}
    if "tokenmill" not in summary or "llama-server" not in summary:
        return []
    tm, ls = summary["tokenmill"]["ttft2_p50_ms"], summary["llama-server"]["ttft2_p50_ms"]
    return [
        f"{mark(tm < ls)} second turn TTFT p50 {tm:.1f} ms vs llama-server {ls:.1f} ms "
        "(target: lower)"
    ]
