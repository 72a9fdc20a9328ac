"""Log probabilities' cost: tokenmill at c=SLOTS with and without ``top_logprobs``.

Each plain run has a twin on the same server where every request asks for ``logprobs``
with the top ``TOP`` alternatives, right before or after it (alternately): their
ratio of tokens/s is the cost, with each one's CPU per token to show where it goes.
In a plain ``make bench`` the twins ride on the ``versus`` scenario's tokenmill runs
(``--no-logprobs-cost`` drops them); ``--only-logprobs`` runs them alone on one server.
"""

from __future__ import annotations

import argparse
from typing import Any

from load import log_run, plan_line
from scenario import Bench
from servers import SLOTS, Server, log, tokenmill_server
from summary import Runs, by_level, median

# tokenmill's own c=SLOTS runs with logprobs asked: their label in ``runs``, the
# alternatives asked (chat's top_logprobs) and the bar (<= 5 %).
NAME = "tokenmill-logprobs"
TOP = 5
RATIO_TARGET = 0.95


def twin_run(bench: Bench, s: Server, runs: Runs, rep: int) -> None:
    """One c=SLOTS run against ``s`` where every request asks for logprobs, filed under
    ``NAME`` in ``runs``."""
    report = bench.run(s, SLOTS, top_logprobs=TOP)
    runs.setdefault(NAME, {}).setdefault(SLOTS, []).append(report)
    log_run("", rep, bench.reps, SLOTS, NAME, report)


def cost(runs: Runs) -> dict[str, Any] | None:
    """Median c=SLOTS throughput of tokenmill's plain runs and of its runs with logprobs
    made right beside them on the same server; each run's CPU ms per token (gateway,
    replica, load generator) to show where the cost goes."""
    plain, lp = runs["tokenmill"].get(SLOTS), runs.get(NAME, {}).get(SLOTS)
    if not plain or not lp:
        return None
    plain_tok_s = median(plain, "output_tokens_per_s")
    lp_tok_s = median(lp, "output_tokens_per_s")

    def cpu(reports: list[dict[str, Any]]) -> dict[str, float]:
        return {
            k: round(median(reports, "cpu_ms_per_token", k), 3)
            for k in ("server", "children", "client")
        }

    return {
        "top_logprobs": TOP,
        "plain_tok_s": plain_tok_s,
        "logprobs_tok_s": lp_tok_s,
        "ratio": round(lp_tok_s / plain_tok_s, 3) if plain_tok_s else 0.0,
        "plain_runs": [r["output_tokens_per_s"] for r in plain],
        "logprobs_runs": [r["output_tokens_per_s"] for r in lp],
        # Each logprobs run against the plain run next to it (the same moment of the host).
        "pair_ratios": [
            round(b["output_tokens_per_s"] / a["output_tokens_per_s"], 3)
            for a, b in zip(plain, lp, strict=False)
            if a["output_tokens_per_s"]
        ],
        "plain_ttft_p50_ms": median(plain, "ttft_ms", "p50"),
        "logprobs_ttft_p50_ms": median(lp, "ttft_ms", "p50"),
        "plain_cpu_ms_per_token": cpu(plain),
        "logprobs_cpu_ms_per_token": cpu(lp),
        # Tokens that came with their logprobs, of all tokens streamed: 1.0 when every one did.
        "logprob_coverage": round(
            sum(r.get("logprob_tokens", 0) for r in lp)
            / max(1, sum(r["output_tokens"] for r in lp)),
            3,
        ),
        "errors_logprobs": sum(r["errors"] for r in lp),
    }


def lines(cost: dict[str, Any] | None) -> list[str]:
    """The table's rows for :func:`cost`."""
    if not cost:
        return []
    p, q = cost["plain_cpu_ms_per_token"], cost["logprobs_cpu_ms_per_token"]
    return [
        f"logprobs (top {cost['top_logprobs']}) cost at c={SLOTS}, same server: plain "
        f"{cost['plain_tok_s']:.1f} tok/s, logprobs {cost['logprobs_tok_s']:.1f} tok/s, "
        f"ratio logprobs/plain {cost['ratio']:.3f} "
        f"({100 * (cost['ratio'] - 1):+.1f} %)",
        f"  runs tok/s  plain {cost['plain_runs']}  logprobs {cost['logprobs_runs']}  "
        f"pairs {cost['pair_ratios']}  errors {cost['errors_logprobs']}  tokens with "
        f"logprobs {100 * cost['logprob_coverage']:.0f} %",
        f"  TTFT p50 plain {cost['plain_ttft_p50_ms']:.1f} / logprobs "
        f"{cost['logprobs_ttft_p50_ms']:.1f} ms; CPU ms per token plain / logprobs: gateway "
        f"{p['server']:.3f} / {q['server']:.3f}, replica {p['children']:.2f} / "
        f"{q['children']:.2f}, load generator {p['client']:.3f} / {q['client']:.3f}",
    ]


def targets(cost: dict[str, Any] | None) -> list[str]:
    if not cost:
        return []
    r = cost["ratio"]
    ok = r >= RATIO_TARGET and not cost["errors_logprobs"]
    return [
        f"{'PASS' if ok else 'MISS'} c={SLOTS} logprobs (top {cost['top_logprobs']}) tok/s "
        f"{r:.3f} of plain ({100 * (r - 1):+.1f} %, target >= {RATIO_TARGET:.2f}: "
        f"at most {100 * (1 - RATIO_TARGET):.0f} % slower)"
    ]


class Logprobs:
    """``--only-logprobs``: one tokenmill server at c=SLOTS, each plain run next to its
    twin with logprobs, who goes first alternating from one repetition to the next."""

    name = "logprobs"
    about = f"tokenmill's c={SLOTS} runs with and without logprobs (top {TOP}) on one server"
    default = False  # in a plain make bench, the twins ride on versus's runs

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, bench: Bench) -> None:
        out: dict[str, Any] = {"reps": bench.reps, "top_logprobs": TOP}
        bench.results[self.name] = out
        s = tokenmill_server("tokenmill", bench.tmp, files="tokenmill-logprobs")
        runs: Runs = {s.name: {}, NAME: {}}
        try:
            s.start()
            try:
                for rep in range(bench.reps):
                    if rep % 2 == 1:
                        twin_run(bench, s, runs, rep)
                    report = bench.run(s, SLOTS)
                    runs[s.name].setdefault(SLOTS, []).append(report)
                    log_run("", rep, bench.reps, SLOTS, s.name, report)
                    if rep % 2 == 0:
                        twin_run(bench, s, runs, rep)
            except KeyboardInterrupt:
                out["interrupted"] = True
                bench.results["interrupted"] = True
                log("interrupted: reporting the runs completed so far")
        finally:
            s.stop()
        out["runs"] = by_level(runs)
        out["cost"] = cost(runs)
        out["targets"] = targets(out["cost"])

    def table(self, results: dict[str, Any]) -> str | None:
        lp = results.get(self.name)
        if not lp:
            return None
        rows = [
            "",
            f"tokenmill with and without logprobs: {results['model_file']}, "
            f"{results['threads']} threads, max_tokens {results['max_tokens']}, "
            f"{lp['reps']} runs each at c={SLOTS} (medians)",
            plan_line([SLOTS], results["max_tokens"], results["lockstep"]),
            "",
            *lines(lp["cost"]),
            "",
            *(f"  {line}" for line in lp["targets"]),
        ]
        return "\n".join(rows)


SCENARIO = Logprobs()
