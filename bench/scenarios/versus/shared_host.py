"""The shared host: tokenmill and llama-server with busy loops beside them.

The same runs as the levels', with ``--busy`` busy loops (processes at ordinary
priority that only spin, ``tokenmill bench --busy``) for the length of each run: how
each server holds up on a host whose cores other work shares. Each server meets the
same number, in turn, alternating who goes first.
"""

from __future__ import annotations

from typing import Any

from load import interleaved, log_run
from scenario import Bench
from servers import SLOTS, Server
from summary import Runs, mark

# The levels: one person, a full server.
LEVELS = (1, SLOTS)
TOK_S_RATIO_TARGET = 1.0


def measure(bench: Bench, servers: list[Server], runs: Runs) -> None:
    """Fill ``runs`` (tokenmill's and llama-server's) as the runs complete."""
    busy, reps = bench.args.busy, bench.args.contended_reps
    for rep, c, s in interleaved(servers, LEVELS, reps):
        report = bench.run(s, c, busy=busy)
        runs[s.name].setdefault(c, []).append(report)
        log_run(f"contended ({busy} busy loops) ", rep, reps, c, s.name, report)


def lines(results: dict[str, Any]) -> list[str]:
    contended = results.get("contended")
    if not contended:
        return []
    rows = [
        f"\nshared host: {results['busy']} busy loops beside the server during each run "
        "(medians; CPU ms per output token of the servers' own processes):"
    ]
    for c, row in contended.items():
        tm, ls = row["tokenmill"], row["llama-server"]
        tm_cpu, ls_cpu = tm["cpu_ms_per_token"], ls["cpu_ms_per_token"]
        rows.append(
            f"  c={c:<3} tok/s {tm['tok_s']:.1f} / {ls['tok_s']:.1f} "
            f"(ratio {row['tok_s_ratio']:.2f})  TTFT p50 {tm['ttft_p50_ms']:.1f} / "
            f"{ls['ttft_p50_ms']:.1f} ms  CPU/token gateway {tm_cpu['server']:.3f} + "
            f"replica {tm_cpu['children']:.2f} | llama-server {ls_cpu['server']:.2f}  "
            f"runs {tm['tok_s_runs']} / {ls['tok_s_runs']}  "
            f"errors {tm['errors']}/{ls['errors']}"
        )
    return rows


def targets(results: dict[str, Any]) -> list[str]:
    return [
        f"{mark(row['tok_s_ratio'] >= TOK_S_RATIO_TARGET)} shared host c={c} tok/s ratio "
        f"{row['tok_s_ratio']:.2f} (target >= {TOK_S_RATIO_TARGET:.2f})"
        for c, row in (results.get("contended") or {}).items()
    ]
