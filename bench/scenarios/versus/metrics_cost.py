"""What the Prometheus observer costs: tokenmill with ``TOKENMILL_METRICS=0`` beside it.

A third server, the same tokenmill with metrics off, runs the ``SLOTS`` level only,
always right next to the metrics-on tokenmill's runs (see ``versus.measure``), so the
on/off pair sees the same moment of the machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servers import SLOTS, Server, tokenmill_server
from summary import Runs, median

NAME = "tokenmill-nometrics"


def server(tmp: Path) -> Server:
    return tokenmill_server(NAME, tmp, env={"TOKENMILL_METRICS": "0"}, files="nometrics")


def cost(runs: Runs) -> dict[str, Any] | None:
    """Median c=SLOTS throughput of tokenmill with and without the metrics observer."""
    on, off = runs["tokenmill"].get(SLOTS), runs.get(NAME, {}).get(SLOTS)
    if not on or not off:
        return None
    on_tok_s = median(on, "output_tokens_per_s")
    off_tok_s = median(off, "output_tokens_per_s")
    return {
        "on_tok_s": on_tok_s,
        "off_tok_s": off_tok_s,
        "ratio": round(on_tok_s / off_tok_s, 3) if off_tok_s else 0.0,
        "on_runs": [r["output_tokens_per_s"] for r in on],
        "off_runs": [r["output_tokens_per_s"] for r in off],
        "errors_off": sum(r["errors"] for r in off),
    }


def lines(results: dict[str, Any]) -> list[str]:
    cost = results.get("metrics_cost")
    if not cost:
        return []
    return [
        f"metrics cost at c={SLOTS}: on {cost['on_tok_s']:.1f} tok/s, "
        f"off {cost['off_tok_s']:.1f} tok/s, ratio on/off {cost['ratio']:.3f}",
        f"  runs tok/s  metrics on {cost['on_runs']}  off {cost['off_runs']}  "
        f"errors off {cost['errors_off']}",
    ]
