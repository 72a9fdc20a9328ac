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
from summary import Runs, summarize

NAME = "tokenmill-baseline"


def server(tmp: Path, ref: str) -> Server:
    """``tokenmill serve`` from a fresh worktree of ``ref`` under ``tmp``."""
    remove(tmp)
    tree = tmp / "baseline-tree"
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
    """Per level: today's tokenmill and the baseline's medians (output tok/s, TTFT p50),
    today's over the baseline's, and each against llama-server."""
    if not runs.get(NAME):
        return None
    against = summarize(runs, base=NAME)
    peers = (summarize(runs), summarize(runs, NAME)) if "llama-server" in runs else ({}, {})
    levels: dict[str, Any] = {}
    for c, row in against.items():
        now, base = row["tokenmill"], row[NAME]
        levels[c] = {
            "tok_s": [now["tok_s"], base["tok_s"]],
            "ratio": row["tok_s_ratio"],
            "ttft_p50_ms": [now["ttft_p50_ms"], base["ttft_p50_ms"]],
            "runs_now": now["tok_s_runs"],
            "runs_base": base["tok_s_runs"],
            "vs_llama_server": [p.get(c, {}).get("tok_s_ratio") for p in peers],
        }
    return {"ref": ref, "levels": levels}


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
