"""Structured outputs: what a JSON-schema constraint costs (``--no-constrained`` skips it).

One tokenmill server at c=16: each plain run next to one where every request is
constrained by ``bench/schemas/people.json`` (an array of 1,000 objects with strings,
bounded integers, an enum and a boolean: the grammar never completes before
``max_tokens``, so both runs stream the same number of tokens), who goes first
alternating from one repetition to the next. The ratio of their tokens/s is the cost
seen through the whole gateway.

Beside it, the mask itself, in-process: llguidance's mask for that schema over the
model's vocabulary, applied to a logits row and advanced by one token, timed per token
along a greedy walk through random logits (what the decode loop adds per constrained
sequence per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from load import plan_line
from scenario import Bench
from servers import ROOT, SLOTS, log, tokenmill_server

SCHEMA = ROOT / "bench" / "schemas" / "people.json"
CONSTRAINED = "tokenmill-json-schema"
RATIO_TARGET = 0.95
MASK_TOKENS = 400


def mask_cost(tokens: int = MASK_TOKENS) -> dict[str, Any]:
    """Microseconds per token of the constrained step's extra work (mask + consume)."""
    import llama_cpp as ll
    import numpy as np

    from tokenmill.engines import Constraint
    from tokenmill.engines.embedded import embedded_model_path
    from tokenmill.engines.llamacpp.grammar import GrammarCache
    from tokenmill.engines.llamacpp.vocab import Vocab, init_backend

    init_backend()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(embedded_model_path()).encode(), params)
    try:
        vocab = Vocab(model)
        eog = [t for t in range(vocab.n_tokens) if vocab.is_eog(t)]
        cache = GrammarCache(vocab.handle, vocab.n_tokens, eog)
        started = time.perf_counter()
        grammar = cache.start(Constraint("json_schema", SCHEMA.read_text()))
        build_s = time.perf_counter() - started
        rng = np.random.default_rng(0)
        per_token: list[float] = []
        for _ in range(tokens):
            logits = rng.standard_normal(vocab.n_tokens, dtype=np.float32)
            started = time.perf_counter()
            grammar.mask(logits)
            token = int(np.argmax(logits))
            grammar.consume(token)
            per_token.append(time.perf_counter() - started)
            if grammar.done:
                break
        us = sorted(t * 1e6 for t in per_token)
        return {
            "tokens": len(us),
            "p50_us": round(statistics.median(us), 1),
            "p99_us": round(us[int(0.99 * (len(us) - 1))], 1),
            "mean_us": round(statistics.fmean(us), 1),
            "first_use_s": round(build_s, 3),  # llguidance's tokenizer + compile
        }
    finally:
        ll.llama_model_free(model)


def cost(plain: list[dict[str, Any]], constrained: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not plain or not constrained:
        return None

    def tok_s(reports: list[dict[str, Any]]) -> float:
        return float(statistics.median(r["output_tokens_per_s"] for r in reports))

    a, b = tok_s(plain), tok_s(constrained)
    return {
        "plain_tok_s": a,
        "constrained_tok_s": b,
        "ratio": round(b / a, 3) if a else 0.0,
        "plain_runs": [r["output_tokens_per_s"] for r in plain],
        "constrained_runs": [r["output_tokens_per_s"] for r in constrained],
        "plain_ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in plain),
        "constrained_ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in constrained),
        "tokens_per_request": [
            round(r["output_tokens"] / max(1, r["completed"]), 1) for r in constrained
        ],
        "errors": sum(r["errors"] for r in constrained),
    }


class Constrained:
    """Interleaved plain / constrained runs at c=SLOTS on one tokenmill server, and the
    mask's own cost.

    Both kinds of run send the same system message naming the schema, so both
    prefill the same prompts and the difference is the constraint alone (a request
    whose messages do not name its schema gets it added: a cost of its own, in
    prompt tokens).
    """

    name = "constrained"
    about = (
        f"tokenmill's c={SLOTS} runs with and without a JSON-schema constraint "
        "(bench/schemas/people.json), interleaved on one server, and the mask's own cost"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, bench: Bench) -> None:
        log("structured outputs: plain and JSON-schema runs on one tokenmill, in turn")
        out: dict[str, Any] = {"reps": bench.reps, "schema": SCHEMA.name}
        bench.results[self.name] = out
        system = bench.tmp / "constrained-system.txt"
        schema_text = json.dumps(json.loads(SCHEMA.read_text()))
        system.write_text(f"Respond with JSON only, following this JSON schema:\n{schema_text}")
        plain_args = ("--system", str(system))
        constrained_args = (*plain_args, "--json-schema", str(SCHEMA))
        plain: list[dict[str, Any]] = []
        constrained: list[dict[str, Any]] = []
        server = tokenmill_server("tokenmill", bench.tmp, files="tokenmill-constrained")
        try:
            server.start()
            for rep in range(bench.reps):
                order = [False, True] if rep % 2 == 0 else [True, False]
                for constrain in order:
                    report = bench.run(
                        server, SLOTS, extra=constrained_args if constrain else plain_args
                    )
                    (constrained if constrain else plain).append(report)
                    log(
                        f"rep {rep + 1}/{bench.reps} c={SLOTS} "
                        f"{'json-schema' if constrain else 'plain':<11} "
                        f"{report['output_tokens_per_s']:7.1f} tok/s  "
                        f"TTFT p50 {report['ttft_ms']['p50']:7.1f} ms  errors {report['errors']}"
                    )
        except KeyboardInterrupt:
            out["interrupted"] = True
            bench.results["interrupted"] = True
        finally:
            server.stop()
        out["cost"] = cost(plain, constrained)
        out["mask"] = mask_cost()

    def table(self, results: dict[str, Any]) -> str | None:
        if self.name not in results:
            return None
        return table(results, SLOTS)


SCENARIO = Constrained()


def table(results: dict[str, Any], slots: int) -> str:
    section = results["constrained"]
    rows = [
        "",
        f"tokenmill with and without a JSON-schema constraint ({section['schema']}): "
        f"{results['model_file']}, {results['threads']} threads, max_tokens "
        f"{results['max_tokens']}, {section['reps']} runs each at c={slots} (medians)",
        plan_line([slots], results["max_tokens"], results["lockstep"]),
        "",
    ]
    c, m = section["cost"], section["mask"]
    if c:
        rows += [
            f"  plain {c['plain_tok_s']:.1f} tok/s, constrained {c['constrained_tok_s']:.1f} "
            f"tok/s, ratio {c['ratio']:.3f} ({100 * (c['ratio'] - 1):+.1f} %)",
            f"  runs tok/s  plain {c['plain_runs']}  constrained {c['constrained_runs']}  "
            f"tokens/request {c['tokens_per_request']}  errors {c['errors']}",
            f"  TTFT p50 plain {c['plain_ttft_p50_ms']:.1f} / constrained "
            f"{c['constrained_ttft_p50_ms']:.1f} ms",
        ]
    rows.append(
        f"  mask + consume per token (in-process, {m['tokens']} tokens): p50 {m['p50_us']} us, "
        f"p99 {m['p99_us']} us, mean {m['mean_us']} us; first use (tokenizer + compile) "
        f"{m['first_use_s']} s"
    )
    if c:
        ok = c["ratio"] >= RATIO_TARGET and not c["errors"]
        rows += [
            "",
            f"  {'PASS' if ok else 'MISS'} c={slots} constrained tok/s {c['ratio']:.3f} of plain "
            f"(target >= {RATIO_TARGET:.2f})",
        ]
    return "\n".join(rows)
