"""With py-spy installed, one more c=SLOTS run on tokenmill, profiled (not measured)."""

from __future__ import annotations

from typing import Any

from load import run_bench
from probes import profile, py_spy
from scenario import Bench
from servers import CACHE, SLOTS, Server, log


def run(bench: Bench, server: Server) -> dict[str, Any] | None:
    if py_spy() is None:
        log("py-spy not installed: no profile (pip install py-spy to get one)")
        return None
    log(f"profiling the gateway with py-spy during one more c={SLOTS} run")
    plan = bench.plan(SLOTS)
    return profile(
        server.proc.pid,
        lambda: run_bench(server, SLOTS, bench.max_tokens, plan),
        CACHE / "profile-c16.txt",
    )


def lines(results: dict[str, Any]) -> list[str]:
    prof = results.get("profile")
    if not prof or "self" not in prof:
        return []
    return [
        f"\npy-spy on the gateway during a c={SLOTS} run ({prof['samples']} samples):",
        "  by thread: " + ", ".join(f"{n} {p}%" for n, p in prof["threads"]),
        "  self time:",
        *(f"    {p:5.1f}%  {n}" for n, p in prof["self"][:12]),
    ]
