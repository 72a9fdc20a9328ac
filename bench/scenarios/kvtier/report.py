"""The kvtier scenario's table and targets, from its results alone."""

from __future__ import annotations

from typing import Any

from summary import mark

# The issue's bars.
WHOLE_CACHED = 0.95
TTFT_RATIO = 0.9  # issue 46, at the defaults (issue 34 asked 0.8 of a per-slot replica)
WALL_RATIO = 0.9
TIER_SLACK = 1.1
MB = 2**20

# What GET /v1/deployments/{id} reports of each replica's KV pool and host-memory tier
# (docs/operations.md), and the key of the tier's configured byte bound in it.
TIER_KEY = "kv"
SIZE_KEYS = ("host_capacity_bytes",)


def tier_size(tiers: list[Any], configured: int | None) -> tuple[int | None, str]:
    """The tier's byte bound over the replicas, and where it was read."""
    if configured is not None:
        return configured * max(1, len(tiers)), "--kvtier-host-bytes"
    sizes = []
    for t in tiers:
        if isinstance(t, dict):
            found = next((t[k] for k in SIZE_KEYS if isinstance(t.get(k), int)), None)
            if found is not None:
                sizes.append(found)
    if sizes and len(sizes) == len(tiers):
        return sum(sizes), "GET /v1/deployments/ID"
    return None, "n/a"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + unit


def conversation_lines(section: dict[str, Any]) -> list[str]:
    s, conv = section["settings"], section.get("conversations") or {}
    servers = conv.get("servers") or {}
    lines = [
        "",
        f"kvtier (issue 34): one replica of {s['slots']} slots (n_ctx {s['n_ctx']}) against "
        f"llama-server -np {s['slots']} -c {s['llama_ctx']} -t {s['threads']} (--cache-ram "
        f"at its default); {s['conversations']} conversations x {s['turns']} turns, each "
        f"opening with its own ~300-token document, {s['open']} open at once, 1-3 s between "
        f"turns; answers of {s['max_tokens']} tokens; {s['reps']} repetition(s), servers in turn",
        f"{'server':<13} {'whole cached':>13} {'later ttft p50':>15} {'first ttft p50':>15} "
        f"{'turn-1 prompt':>13} {'wall p50':>9}  walls",
    ]
    for name, p in servers.items():
        whole = f"{p['whole_cached']}/{p['later_turns']}"
        lines.append(
            f"{name:<13} {whole:>13} {fmt(p['later_ttft_p50_ms'], '.0f', ' ms'):>15} "
            f"{fmt(p['first_ttft_p50_ms'], '.0f', ' ms'):>15} "
            f"{fmt(p['first_prompt_tokens_p50'], '.0f'):>13} {p['wall_p50_s']:>7.1f} s  "
            f"{p['wall_s']}"
        )
        if p["errors"]:
            lines.append(f"  {name}: {len(p['errors'])} errors, first: {p['errors'][0]}")
    tm, ls = servers.get("tokenmill"), servers.get("llama-server")
    if tm and ls:
        t = ratio(tm["later_ttft_p50_ms"], ls["later_ttft_p50_ms"])
        mean = ratio(tm.get("later_ttft_mean_ms"), ls.get("later_ttft_mean_ms"))
        w = ratio(tm["wall_p50_s"], ls["wall_p50_s"])
        lines.append(
            f"  tokenmill / llama-server: later-turn TTFT p50 {fmt(t)}x, mean {fmt(mean)}x, "
            f"wall {fmt(w)}x"
        )
    lines.append(
        "  whole cached: later turns whose cached_tokens >= the previous turn's prompt_tokens"
    )
    return lines


def memory_lines(section: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The memory lines and the memory target's line (none if nothing was measured)."""
    mem = (section.get("conversations") or {}).get("memory") or {}
    base, windows = mem.get("after_warm_up"), mem.get("windows") or []
    if not base or not windows:
        return [], []
    last = windows[-1]
    peak = max(w["peak_mb"] for w in windows)
    size, where = tier_size(last["tier"], section["settings"].get("host_bytes"))
    size_mb = None if size is None else size / MB
    tiers = last["tier"]
    stats = "n/a" if all(t is None for t in tiers) else str(tiers)
    lines = [
        f"  tokenmill replica RSS: {base['rss_mb']:.0f} MB after warm-up, "
        f"{last['rss_mb']:.0f} MB after the last window, peak {peak:.0f} MB; tier size "
        f"{fmt(size_mb, '.0f', ' MB')} ({where}); llama-server "
        f"{fmt(mem.get('llama_server_mb'), '.0f', ' MB')}",
        f"  tier ({TIER_KEY} of each replica): {stats}",
    ]
    growth = peak - base["rss_mb"]
    if size_mb is None:
        target = (
            f"{mark(False)} replica RSS grew {growth:.0f} MB over its warm-up size; tier size "
            f"n/a (bar: <= tier size x {TIER_SLACK})"
        )
    else:
        target = (
            f"{mark(growth <= size_mb * TIER_SLACK)} replica RSS grew {growth:.0f} MB over its "
            f"warm-up size (peak), tier size {size_mb:.0f} MB (<= x {TIER_SLACK})"
        )
    return lines, [target]


def long_lines(section: dict[str, Any]) -> tuple[list[str], list[str]]:
    long, s = section.get("long") or {}, section["settings"]
    if not long:
        return [], []
    answered = long["status"] == 200
    short = fmt(long["short_ttft_p50_ms"], ".0f", " ms")
    lines = [
        f"  long prompt at the default configuration beside {s['streams']} short streams: "
        f"status {long['status'] or 'none'}, TTFT {fmt(long['ttft_ms'], '.0f', ' ms')}, prompt "
        f"{long['prompt_tokens'] or 'n/a'} tokens, {long['long_s']} s in all; short streams: "
        f"{long['short_requests']} requests, TTFT p50 {short}",
    ]
    if long["error"]:
        lines.append(f"    long prompt's answer: {long['error']}")
    if long["short_errors"]:
        lines.append(f"    short stream errors (first): {long['short_errors'][:2]}")
    target = f"{mark(answered)} the ~4,500-token prompt answered beside the short streams"
    return lines, [target + f" (status {long['status'] or 'none'})"]


def targets(section: dict[str, Any]) -> list[str]:
    servers = (section.get("conversations") or {}).get("servers") or {}
    tm, ls = servers.get("tokenmill"), servers.get("llama-server")
    out = []
    if tm and tm["whole_cached_share"] is not None:
        share = tm["whole_cached_share"]
        out.append(
            f"{mark(share >= WHOLE_CACHED)} {share:.1%} of tokenmill's later turns found "
            f"their whole earlier prompt cached (>= {WHOLE_CACHED:.0%})"
        )
    if tm and ls:
        t = ratio(tm["later_ttft_p50_ms"], ls["later_ttft_p50_ms"])
        if t is not None:
            out.append(
                f"{mark(t <= TTFT_RATIO)} later-turn TTFT p50 {t:.2f}x llama-server's "
                f"(<= {TTFT_RATIO}x)"
            )
        w = ratio(tm["wall_p50_s"], ls["wall_p50_s"])
        if w is not None:
            out.append(
                f"{mark(w <= WALL_RATIO)} wall time {w:.2f}x llama-server's (<= {WALL_RATIO}x)"
            )
    return out


def report(section: dict[str, Any]) -> str:
    lines = conversation_lines(section)
    mem, mem_target = memory_lines(section)
    long, long_target = long_lines(section)
    s = section["settings"]
    lines += mem + long
    lines.append(
        f"  load average (1, 5, 15 min) before {s.get('load_average_before')}, "
        f"after {s.get('load_average_after')}"
    )
    lines += targets(section) + long_target + mem_target
    return "\n".join(lines)
