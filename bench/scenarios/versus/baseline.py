"""The hot path against an earlier commit: the same scenario's tokenmill from a git ref.

``--baseline-ref REF`` adds a fourth server: ``tokenmill serve`` run from a worktree of
``REF`` (its ``src/`` first on ``PYTHONPATH``, the same virtualenv), measured at every
level interleaved with today's, so that a refactoring's claim "no slower" is a ratio of
two runs seen by the same moment of the machine, not of two benchmark runs hours apart.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from servers import ROOT, Server, log, tokenmill_server
from summary import Runs, median, summarize

NAME = "tokenmill-baseline"


def server(tmp: Path, ref: str) -> Server:
    """``tokenmill serve`` from a fresh worktree of ``ref`` under ``tmp``."""
    tree = tmp / "baseline-tree"
    if tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
        check=True,
        capture_output=True,
    )
    commit = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    log(f"baseline: tokenmill at {ref} ({commit}) from {tree}")
    return tokenmill_server(NAME, tmp, env={"PYTHONPATH": str(tree / "src")}, files="baseline")


def remove(tmp: Path) -> None:
    tree = tmp / "baseline-tree"
    if tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])


def compare(runs: Runs, ref: str) -> dict[str, Any] | None:
    """Per level: median output tok/s and TTFT p50 of today's tokenmill and the
    baseline's, and today's over the baseline's."""
    base = runs.get(NAME)
    if not base:
        return None
    out: dict[str, Any] = {"ref": ref, "levels": {}}
    peers: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    if "llama-server" in runs:
        peers = (summarize(runs), summarize(runs, NAME))
    for c, runs_base in sorted(base.items()):
        now = runs["tokenmill"].get(c)
        if not now:
            continue
        tok_now = median(now, "output_tokens_per_s")
        tok_base = median(runs_base, "output_tokens_per_s")
        ttft_now = median(now, "ttft_ms", "p50")
        ttft_base = median(runs_base, "ttft_ms", "p50")
        out["levels"][str(c)] = {
            "tok_s": [tok_now, tok_base],
            "ratio": round(tok_now / tok_base, 3) if tok_base else 0.0,
            "ttft_p50_ms": [ttft_now, ttft_base],
            "runs_now": [r["output_tokens_per_s"] for r in now],
            "runs_base": [r["output_tokens_per_s"] for r in runs_base],
            # each against llama-server, as the versus table reports today's
            "vs_llama_server": [p.get(str(c), {}).get("tok_s_ratio") for p in peers],
        }
    return out


def lines(results: dict[str, Any]) -> list[str]:
    cmp = results.get("baseline")
    if not cmp:
        return []
    rows = [f"against tokenmill at {cmp['ref']} (interleaved, same machine moments):"]
    for c, level in cmp["levels"].items():
        now, base = level["tok_s"]
        t_now, t_base = level["ttft_p50_ms"]
        rows.append(
            f"  c={c:<2} {now:7.1f} vs {base:7.1f} tok/s  ratio {level['ratio']:.3f}  "
            f"TTFT p50 {t_now:.0f} vs {t_base:.0f} ms  runs {level['runs_now']} / "
            f"{level['runs_base']}  against llama-server {level['vs_llama_server']}"
        )
    return rows
