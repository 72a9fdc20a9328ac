"""The weights served: the shipped Q4_1 file as it is against the Q8_0 made from it.

Two tokenmill servers of the same model file, one with ``weights = "as-is"`` (the
shipped Q4_1, which llama.cpp's CPU backend multiplies row by row) and one with
``weights = "q8_0"`` (converted at its start by llama.cpp's quantizer, the embedded
deployment's default; tinyBLAS on x86): each level measured on both in turn
(``load.interleaved``), reported as Q8_0/Q4_1 ratios (issue 47: prefill >= 1.8x,
c=16 >= 1.4x):

* prefill: prompts of ~``PREFILL_WORDS`` words of their own (no cached prefix), one at
  a time, ``max_tokens`` 1: prompt tokens / the request's time;
* decode at c=SLOTS: ``tokenmill bench``'s streams, output tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx
from load import interleaved, log_run, plan_line
from scenario import Bench
from servers import SAMPLING, SLOTS, Server, log, tokenmill_server

# ~1,200 tokens of SmolLM2: a prompt an agent or a pasted document sends, long enough
# that prefill, not the request's overhead, is what is timed.
PREFILL_WORDS = 900
PREFILLS_PER_REP = 3
WORDS = [
    *("river", "stone", "lantern", "harbour", "market", "winter", "orchard", "bridge"),
    *("meadow", "signal", "copper", "garden", "window", "ladder", "candle", "forest"),
    *("valley", "thunder", "pebble", "compass", "village", "kettle", "mountain"),
    *("ribbon", "feather", "quarry", "island", "saddle", "blanket", "chimney"),
]
TARGETS = {"prefill": 1.8, "decode": 1.4}
KINDS = {"q4_1": "as-is", "q8_0": "q8_0"}


def _config(bench: Bench, weights: str) -> str:
    return (
        f'[[deployments]]\nid = "smollm2"\nmodel = "{bench.gguf}"\nweights = "{weights}"\n'
        f"max_num_seqs = {SLOTS}\nn_threads = {bench.args.threads}\n"
    )


def _prompt(tag: str) -> str:
    words = [WORDS[(len(tag) + i * 7 + i // 5) % len(WORDS)] for i in range(PREFILL_WORDS)]
    return f"Notes {tag}: " + " ".join(words)


def prefill_run(s: Server, rep: int) -> dict[str, Any]:
    """Prompt tokens a second over ``PREFILLS_PER_REP`` prompts read one at a time."""
    rates = []
    for i in range(PREFILLS_PER_REP):
        body = {
            "model": s.model,
            "prompt": _prompt(f"{s.name}-{rep}-{i}"),
            "max_tokens": 1,
            **SAMPLING,
        }
        started = time.monotonic()
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=600.0)
        took = time.monotonic() - started
        r.raise_for_status()
        rates.append(r.json()["usage"]["prompt_tokens"] / took)
    return {"prompt_tokens_per_s": round(statistics.median(rates), 1), "runs": rates}


def _ratio(a: float, b: float) -> float:
    return round(b / a, 3) if a else 0.0


class Weights:
    name = "weights"
    about = "the shipped Q4_1 file served as-is against the Q8_0 made from it"
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, bench: Bench) -> None:
        out: dict[str, Any] = {"reps": bench.reps, "prefill_words": PREFILL_WORDS}
        bench.results[self.name] = out
        servers: list[Server] = []
        for kind, weights in KINDS.items():
            config = bench.tmp / f"weights-{kind}.toml"
            config.write_text(_config(bench, weights))
            args = ("--config", str(config))
            servers.append(tokenmill_server(f"tokenmill-{kind}", bench.tmp, args))
        prefill: dict[str, list[float]] = {s.name: [] for s in servers}
        decode: dict[str, list[float]] = {s.name: [] for s in servers}
        try:
            for s in servers:
                s.start()
            for rep, level, s in interleaved(servers, [1, SLOTS], bench.reps):
                if level == 1:
                    got = prefill_run(s, rep)
                    prefill[s.name].append(got["prompt_tokens_per_s"])
                    log(f"weights rep {rep + 1}/{bench.reps} prefill {s.name}: {got}")
                else:
                    report = bench.run(s, SLOTS)
                    decode[s.name].append(report["output_tokens_per_s"])
                    log_run("weights ", rep, bench.reps, SLOTS, s.name, report)
        except KeyboardInterrupt:
            out["interrupted"] = True
            bench.results["interrupted"] = True
            log("interrupted: reporting the runs completed so far")
        finally:
            for s in servers:
                s.stop()
        q4, q8 = (s.name for s in servers)
        out["prefill_tok_s"], out["decode_tok_s"] = prefill, decode

        def med(xs: list[float]) -> float:
            return round(statistics.median(xs), 1) if xs else 0.0

        out["ratios"] = {
            "prefill": _ratio(med(prefill[q4]), med(prefill[q8])),
            "decode": _ratio(med(decode[q4]), med(decode[q8])),
        }
        out["medians"] = {
            name: {"prefill": med(prefill[name]), "decode": med(decode[name])} for name in (q4, q8)
        }

    def table(self, results: dict[str, Any]) -> str | None:
        w = results.get(self.name)
        if not w or "ratios" not in w:
            return None
        q4, q8 = w["medians"]["tokenmill-q4_1"], w["medians"]["tokenmill-q8_0"]
        rows = [
            "",
            f"weights: {results['model_file']} served as-is (Q4_1) and as Q8_0 made from it, "
            f"{results['threads']} threads, {w['reps']} runs each, interleaved (medians)",
            plan_line([SLOTS], results["max_tokens"], results["lockstep"]),
            "",
            f"{'':<20} {'Q4_1 as-is':>10} {'Q8_0':>9} {'Q8_0/Q4_1':>10}",
            f"{'prefill tok/s':<20} {q4['prefill']:>10.1f} {q8['prefill']:>9.1f} "
            f"{w['ratios']['prefill']:>9.2f}x  (~{PREFILL_WORDS}-word prompts, max_tokens 1)",
            f"{f'decode tok/s c={SLOTS}':<20} {q4['decode']:>10.1f} {q8['decode']:>9.1f} "
            f"{w['ratios']['decode']:>9.2f}x",
            "",
        ]
        for key, bar in TARGETS.items():
            r = w["ratios"][key]
            rows.append(f"  {'PASS' if r >= bar else 'MISS'} {key} Q8_0/Q4_1 {r:.2f}x (>= {bar}x)")
        return "\n".join(rows)


SCENARIO = Weights()
