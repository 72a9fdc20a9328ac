"""The head-to-head's own figures: per level, tokenmill against llama-server.

The table of medians and ratios, each run's tok/s, the CPU per output token, the first
token's stages at c=1, and their targets (throughput, TTFT, errors, /health).
"""

from __future__ import annotations

from typing import Any

from firsttoken import stage_lines
from load import plan_line
from probes import HEALTH_TARGET_MS
from servers import N_CTX, SLOTS
from summary import mark, ramp_lines

# The bars against llama-server.
C16_TOK_S_RATIO_TARGET = 1.2
C1_TOK_S_RATIO_TARGET = 1.05
C1_TTFT_DIFF_TARGET_MS = 5.0
# Issue #16's, for one stream's first token.
C1_TTFT_DIFF_STRICT_MS = 2.0


def table_lines(results: dict[str, Any]) -> list[str]:
    layout = "one unified KV pool" if results.get("peer_kv") == "unified" else "a KV stream a slot"
    rows = [
        "",
        f"tokenmill vs llama-server: {results['model_file']} ({results['model_mb']:.0f} MB) "
        f"shipped, llama-server reading {results.get('peer_file', results['model_file'])} "
        f"({layout}), "
        f"{results['threads']} threads, {SLOTS} slots x {N_CTX} tokens, "
        f"max_tokens {results['max_tokens']}, {results['reps']} runs each (medians)",
        plan_line(results["levels"], results["max_tokens"], results["lockstep"]),
        "",
        f"{'conc':>4} | {'tok/s tm':>9} {'tok/s ls':>9} {'ratio':>6} | "
        f"{'TTFT50 tm':>9} {'TTFT50 ls':>9} {'diff ms':>8} {'ratio':>6} | "
        f"{'ITL50 tm':>8} {'ITL50 ls':>8} | {'TTFT99 tm':>9} {'TTFT99 ls':>9} | {'err':>7}",
        "-" * 132,
    ]
    for c, row in results["summary"].items():
        tm, ls = row["tokenmill"], row["llama-server"]
        rows.append(
            f"{c:>4} | {tm['tok_s']:>9.1f} {ls['tok_s']:>9.1f} {row['tok_s_ratio']:>6.2f} | "
            f"{tm['ttft_p50_ms']:>9.1f} {ls['ttft_p50_ms']:>9.1f} {row['ttft_p50_diff_ms']:>+8.1f} "
            f"{row['ttft_p50_ratio']:>6.2f} | {tm['itl_p50_ms']:>8.2f} {ls['itl_p50_ms']:>8.2f} | "
            f"{tm['ttft_p99_ms']:>9.1f} {ls['ttft_p99_ms']:>9.1f} | "
            f"{tm['errors']:>3}/{ls['errors']:<3}"
        )
    rows.append("")
    for c, row in results["summary"].items():
        tm, ls = row["tokenmill"], row["llama-server"]
        rows.append(
            f"  c={c:<3} runs tok/s  tokenmill {tm['tok_s_runs']}  llama-server {ls['tok_s_runs']}"
            f"   tokens/request tm {tm['tokens_per_request']} ls {ls['tokens_per_request']}"
        )
    rows += ramp_lines(results["summary"], ("tokenmill", "llama-server"))
    rows.append(
        "\nCPU ms per output token (medians; all threads; 2 cores give 2 ms per ms of wall):"
    )
    for c, row in results["summary"].items():
        tm, ls = row["tokenmill"]["cpu_ms_per_token"], row["llama-server"]["cpu_ms_per_token"]
        rows.append(
            f"  c={c:<3} tokenmill gateway {tm['server']:.3f} + replica {tm['children']:.2f}"
            f" | llama-server {ls['server']:.2f}"
            f" | load generator (whole process) {tm['client']:.3f} / {ls['client']:.3f}"
        )
    return rows


def stages_lines(results: dict[str, Any]) -> list[str]:
    """tokenmill's first-token stages at c=1 beside both servers' TTFT."""
    first = results["summary"].get("1", {}).get("first_token_stages")
    return ["", *stage_lines("1", first)] if first else []


def targets(summary: dict[str, Any]) -> list[str]:
    out = []
    s16, s1 = summary.get(str(SLOTS)), summary.get("1")
    if s16:
        r = s16["tok_s_ratio"]
        out.append(
            f"{mark(r >= C16_TOK_S_RATIO_TARGET)} c={SLOTS} tok/s ratio {r:.2f} "
            f"(target >= {C16_TOK_S_RATIO_TARGET:.2f})"
        )
    if s1:
        r, d = s1["tok_s_ratio"], s1["ttft_p50_diff_ms"]
        out.append(
            f"{mark(r >= C1_TOK_S_RATIO_TARGET)} c=1 tok/s ratio {r:.2f} "
            f"(target >= {C1_TOK_S_RATIO_TARGET:.2f})"
        )
        out.append(
            f"{mark(d <= C1_TTFT_DIFF_TARGET_MS)} c=1 TTFT p50 {d:+.1f} ms vs llama-server "
            f"(target <= +{C1_TTFT_DIFF_TARGET_MS:g} ms)"
        )
    return out


def error_targets(summary: dict[str, Any]) -> list[str]:
    errors = sum(row["tokenmill"]["errors"] for row in summary.values())
    return [f"{mark(errors == 0)} tokenmill errors: {errors}"]


def health_targets(health: dict[str, Any] | None) -> list[str]:
    """``GET /health`` timed during tokenmill's c=SLOTS runs."""
    if not health or not health.get("probes"):
        return []
    worst = health["max_ms"]
    return [
        f"{mark(worst <= HEALTH_TARGET_MS and not health['failures'])} GET /health during "
        f"c={SLOTS}: p50 {health['p50_ms']:.1f} ms, p99 {health['p99_ms']:.1f} ms, "
        f"max {worst:.1f} ms over {health['probes']} probes, {health['failures']} failed "
        f"(target <= {HEALTH_TARGET_MS:g} ms)"
    ]


def first_token_targets(summary: dict[str, Any]) -> list[str]:
    """Issue #16's: one stream's TTFT within 2 ms of llama-server's."""
    s1 = summary.get("1")
    if not s1:
        return []
    d = s1["ttft_p50_diff_ms"]
    return [
        f"{mark(d <= C1_TTFT_DIFF_STRICT_MS)} c=1 TTFT p50 {d:+.1f} ms vs llama-server "
        f"(target <= +{C1_TTFT_DIFF_STRICT_MS:g} ms)"
    ]
