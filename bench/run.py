"""``make bench``: tokenmill against llama.cpp's own ``llama-server`` and against itself.

Runs the scenarios of ``bench/scenarios/`` (listed in ``scenarios.SCENARIOS``) in turn,
each with its own servers, then prints each one's table. A plain run runs every default
scenario; ``--only-NAME`` runs one alone (its results in ``.bench-cache/NAME.json``),
``--no-NAME`` leaves one out. Today's:

* ``versus``: tokenmill against llama-server (same GGUF, threads and slots) at
  concurrency 1, 4 and 16, interleaved, with the in-process ceiling, what metrics and
  logprobs cost, /health latency, a chat's second turn, the shared host, memory and a
  py-spy profile;
* ``logprobs`` (only with ``--only-logprobs``): logprobs' cost alone on one server;
* ``constrained``: what a JSON-schema constraint costs;
* ``ray``: a Ray replica and a Ray Serve cell against a process replica;
* ``fairness``: fair share against FIFO on one gateway;
* ``routing``: the routing policies on one gateway of 2 replicas;
* ``kvtier``: many conversations on one 4-slot replica against llama-server's
  host-memory prompt cache, and one long prompt beside 16 streams (issue 34);
* ``weights``: the shipped Q4_1 file served as-is against the Q8_0 made from it,
  prefill and c=16 decode tokens/s as ratios (issue 47);
* ``kvdrift``: probes alone before and after 192 streams on tokenmill (both KV
  layouts) and llama-server's unified KV: answers changed, the largest drift, streams
  ended at once (issue 46).

Levels of 16 and more send their requests from staggered workers (``load.Plan``;
``--lockstep`` sends them in waves as before). The results of a plain run are written
to ``.bench-cache/last.json``. How to add a scenario: ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scenario import Bench, Scenario
from scenarios import SCENARIOS
from scenarios.versus.ceiling import child_main as ceiling_child
from scenarios.versus.memory import kv_child
from servers import CACHE, N_CTX, SLOTS, log


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--reps", type=int, default=3, help="runs per server and concurrency")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--lockstep",
        action="store_true",
        help=f"send every level's requests in waves of its concurrency, as before (levels "
        f"of {SLOTS} and more otherwise start their workers staggered)",
    )
    for s in SCENARIOS:
        p.add_argument(f"--only-{s.name}", action="store_true", help=f"only {s.about}")
        if s.default:
            p.add_argument(f"--no-{s.name}", action="store_true", help=f"skip {s.about}")
        s.add_arguments(p)
    p.add_argument("--ceiling-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kv-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--kv-ctx", type=int, default=SLOTS * N_CTX, help=argparse.SUPPRESS)
    return p


def chosen(args: argparse.Namespace) -> tuple[list[Scenario], str]:
    """The scenarios to run, in order, and the results file's name."""
    only = [s for s in SCENARIOS if getattr(args, f"only_{s.name}")]
    if len(only) > 1:
        raise SystemExit("bench/run.py: at most one --only-NAME")
    if only:
        return only, f"{only[0].name}.json"
    return [s for s in SCENARIOS if s.default and not getattr(args, f"no_{s.name}")], "last.json"


def main() -> int:
    args = parser().parse_args()
    if args.ceiling_child:
        ceiling_child(args.max_tokens, args.threads)
        return 0
    if args.kv_child:
        kv_child(args.kv_child, args.kv_ctx)
        return 0

    from tokenmill.engines.llamacpp import embedded_model_path

    scenarios, out_name = chosen(args)
    # SIGTERM (from `timeout`, say) ends the runs like Ctrl-C: what was measured is reported.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    CACHE.mkdir(exist_ok=True)
    gguf = embedded_model_path()
    model_mb = gguf.stat().st_size / 2**20
    results: dict[str, Any] = {
        "model_file": gguf.name,
        "model_mb": round(model_mb, 1),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "lockstep": args.lockstep,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    bench = Bench(args, Path(tempfile.mkdtemp(prefix="tokenmill-bench-")), results, gguf)
    for s in scenarios:
        if bench.interrupted:
            log(f"interrupted: {s.name} not run")
            continue
        try:
            s.run(bench)
        except KeyboardInterrupt:
            results["interrupted"] = True
            log(f"interrupted during {s.name}: reporting what was measured")
    out_file = CACHE / out_name
    out_file.write_text(json.dumps(results, indent=2))
    for s in scenarios:
        text = s.table(results)
        if text:
            print(text, flush=True)
    print(f"\nfull results: {out_file}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
