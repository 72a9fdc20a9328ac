"""Runs to figures: the medians of a server's runs at a level, one server against another.

``Runs`` is what the scenarios collect: per server name, per concurrency, the reports
of ``tokenmill bench`` (with ``cpu_ms_per_token`` and ``stages_ms`` added by
:func:`load.one_run`), in the order they were made.
"""

from __future__ import annotations

import statistics
from typing import Any

from firsttoken import stage_summary

Runs = dict[str, dict[int, list[dict[str, Any]]]]


def mark(ok: bool) -> str:
    """A target line's verdict."""
    return "PASS" if ok else "MISS"


def median(reports: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for r in reports:
        v: Any = r
        for k in keys:
            v = v[k]
        values.append(float(v))
    return statistics.median(values)


def by_level(runs: Runs) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``runs`` as JSON writes them (levels as strings)."""
    return {name: {str(c): r for c, r in by_c.items()} for name, by_c in runs.items()}


def server_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one server's runs at one level."""
    return {
        "tok_s": median(reports, "output_tokens_per_s"),
        "tok_s_runs": [r["output_tokens_per_s"] for r in reports],
        "req_s": median(reports, "requests_per_s"),
        "ttft_p50_ms": median(reports, "ttft_ms", "p50"),
        "ttft_p95_ms": median(reports, "ttft_ms", "p95"),
        "ttft_p99_ms": median(reports, "ttft_ms", "p99"),
        "itl_p50_ms": median(reports, "itl_ms", "p50"),
        "itl_p99_ms": median(reports, "itl_ms", "p99"),
        "errors": sum(r["errors"] for r in reports),
        "tokens_per_request": median(reports, "tokens_per_request", "mean"),
        "requests": reports[0]["requests"],
        # Staggered runs (see load.Plan): the ramp and the requests the latencies cover.
        "stagger_tokens": reports[0].get("stagger_tokens", 0),
        "ramp_s": statistics.median(r.get("ramp_s", 0.0) for r in reports),
        "measured_requests": reports[0].get("measured_requests", reports[0]["completed"]),
        "cpu_ms_per_token": {
            k: median(reports, "cpu_ms_per_token", k) for k in reports[0]["cpu_ms_per_token"]
        },
    }


def summarize(runs: Runs, name: str = "tokenmill", base: str = "llama-server") -> dict[str, Any]:
    """Per level: the medians of ``name`` and of ``base``, and ``name`` against ``base``."""
    summary: dict[str, Any] = {}
    # After an interruption a level may have runs of one server only: it has no ratio.
    for c in sorted(set(runs[name]) & set(runs[base])):
        row: dict[str, Any] = {n: server_summary(runs[n][c]) for n in (name, base)}
        tm, ls = row[name], row[base]
        row["tok_s_ratio"] = round(tm["tok_s"] / ls["tok_s"], 3) if ls["tok_s"] else 0.0
        row["ttft_p50_ratio"] = round(tm["ttft_p50_ms"] / ls["ttft_p50_ms"], 3)
        row["ttft_p50_diff_ms"] = round(tm["ttft_p50_ms"] - ls["ttft_p50_ms"], 2)
        stages = stage_summary(runs[name][c])
        if stages is not None:
            stages["tokenmill_ttft_p50_ms"] = tm["ttft_p50_ms"]
            stages["llama_server_ttft_p50_ms"] = ls["ttft_p50_ms"]
            row["first_token_stages"] = stages
        summary[str(c)] = row
    return summary


def ramp_lines(summary: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    """For each staggered level of ``summary``: each server's median ramp."""
    out = []
    for c, row in summary.items():
        first = row[names[0]]
        if not first.get("stagger_tokens"):
            continue
        ramps = " / ".join(f"{row[n]['ramp_s']:.2f}" for n in names if n in row)
        out.append(
            f"  c={c:<3} staggered: ramp {ramps} s ({' / '.join(names)}); latencies over "
            f"{first['measured_requests']} of {first['requests']} requests"
        )
    return out
