"""``tokenmill bench`` against the real gateway: the load generator's figures add up."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ServerProcess


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tokenmill", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)


def test_bench_json_against_the_gateway(server: ServerProcess) -> None:
    out = run_bench(
        server.url,
        "--model",
        "smollm2",
        "--concurrency",
        "2",
        "--requests",
        "4",
        "--max-tokens",
        "8",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout  # one JSON object, the progress bar went to stderr
    report = json.loads(lines[0])

    assert report["errors"] == 0, report["error_samples"]
    assert report["completed"] == 4
    assert report["concurrency"] == 2
    # Every request asked for exactly 8 tokens; tokenmill reports usage, which is counted.
    assert report["usage_reported"] == 4
    assert 4 <= report["output_tokens"] <= 32
    assert 1 <= report["tokens_per_request"]["min"] <= report["tokens_per_request"]["max"] <= 8
    assert report["output_tokens_per_s"] > 0
    assert report["requests_per_s"] > 0
    wall = report["wall_s"]
    # wall is reported rounded to the millisecond, so compare to 1 %
    assert report["output_tokens_per_s"] == pytest.approx(report["output_tokens"] / wall, rel=0.01)
    ttft = report["ttft_ms"]
    assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"] < wall * 1000
    itl = report["itl_ms"]
    assert not math.isnan(itl["p50"])
    assert 0 <= itl["p50"] <= itl["p99"]
    assert report["latency_ms"]["p50"] >= ttft["p50"]


def test_bench_counts_errors(server: ServerProcess) -> None:
    # An unknown model: every request fails with the server's own error message.
    out = run_bench(
        server.url + "/v1",
        "--model",
        "no-such-model",
        "--concurrency",
        "2",
        "--requests",
        "3",
        "--max-tokens",
        "4",
        "--json",
        "--no-progress",
    )
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["errors"] == 3
    assert report["completed"] == 0
    assert report["output_tokens"] == 0
    assert report["error_samples"][0].startswith("HTTP 404")


def test_bench_human_report(server: ServerProcess) -> None:
    out = run_bench(
        server.url, "--model", "smollm2", "-c", "1", "-n", "1", "--max-tokens", "4", "--no-progress"
    )
    assert out.returncode == 0, out.stderr
    assert "output tokens/s" in out.stdout
    assert "TTFT ms" in out.stdout
    assert "errors 0" in out.stdout


def test_bench_top_logprobs_asks_for_them_and_counts_them(server: ServerProcess) -> None:
    out = run_bench(
        server.url,
        "--model",
        "smollm2",
        "-c",
        "2",
        "-n",
        "2",
        "--max-tokens",
        "8",
        "--top-logprobs",
        "5",
        "--json",
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["errors"] == 0, report["error_samples"]
    assert report["top_logprobs"] == 5
    # Every token streamed came with its log probability.
    assert report["logprob_tokens"] == report["output_tokens"] > 0


def test_bench_without_top_logprobs_counts_none(server: ServerProcess) -> None:
    out = run_bench(
        server.url, "--model", "smollm2", "-c", "1", "-n", "1", "--max-tokens", "4", "--json"
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["top_logprobs"] is None
    assert report["logprob_tokens"] == 0


def test_bench_json_schema_constrains_every_request(server: ServerProcess, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"enum": ["yes", "no"]}))
    system = tmp_path / "system.txt"
    system.write_text("Answer yes or no.")
    args = [server.url, "--model", "smollm2", "-c", "2", "-n", "2", "--max-tokens", "16"]
    out = run_bench(*args, "--json-schema", str(schema), "--system", str(system), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["errors"] == 0, report["error_samples"]
    assert report["json_schema"] == str(schema)
    # ignore_eos asks for all 16 tokens; the grammar is whole after '"yes"' or '"no"'.
    assert 0 < report["output_tokens"] <= 2 * 4


def test_bench_stagger_leaves_the_ramp_out_of_the_latencies(server: ServerProcess) -> None:
    args = [server.url, "--model", "smollm2", "-c", "2", "-n", "5", "--max-tokens", "8"]
    out = run_bench(*args, "--stagger", "--json", "--no-progress")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["errors"] == 0, report["error_samples"]
    assert report["completed"] == 5
    # The second worker starts once the first has streamed ceil(8 / 2) tokens.
    assert report["stagger_tokens"] == 4
    assert 0 < report["ramp_s"] < report["wall_s"]
    # Each worker's first request is the ramp: counted in tokens, not in the latencies.
    assert report["measured_requests"] == 3
    assert report["usage_reported"] == 5


def test_bench_without_stagger_measures_every_request(server: ServerProcess) -> None:
    args = [server.url, "--model", "smollm2", "-c", "2", "-n", "3", "--max-tokens", "4"]
    report = json.loads(run_bench(*args, "--json", "--no-progress").stdout)
    assert report["stagger_tokens"] == 0
    assert report["measured_requests"] == report["completed"] == 3


# -- make bench's kvtier scenario (issue 34): its registration, workload and targets, checked
# without servers by running bench/'s own modules as bench/run.py imports them.

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_python(code: str) -> Any:
    """Run ``code`` with bench/ importable (as bench/run.py sees it); its last line, as JSON."""
    path = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kvtier_runs_in_a_plain_make_bench_and_alone() -> None:
    chosen = bench_python(
        """
        import json
        from run import chosen, parser

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        args = parser().parse_args(["--only-kvtier"])
        print(json.dumps({
            "plain": names(),
            "only": names("--only-kvtier"),
            "without": names("--no-kvtier"),
            "defaults": [args.kvtier_conversations, args.kvtier_open, args.kvtier_streams],
        }))
        """
    )
    assert "kvtier" in chosen["plain"][0]
    assert chosen["only"] == [["kvtier"], "kvtier.json"]
    assert "kvtier" not in chosen["without"][0]
    assert chosen["without"][0] == [n for n in chosen["plain"][0] if n != "kvtier"]
    # The issue's workload: 24 conversations, 8 open at once; 16 streams beside the long one.
    assert chosen["defaults"] == [24, 8, 16]


def test_kvtier_documents_are_seeded_distinct_and_sized() -> None:
    sizes = bench_python(
        """
        import json
        from llama_cpp import Llama
        from scenarios.kvtier.workload import document, long_prompt, opening
        from tokenmill.engines.embedded import embedded_model_path

        vocab = Llama(str(embedded_model_path()), vocab_only=True, verbose=False)

        def tokens(text):
            return vocab.tokenize(text.encode(), add_bos=False, special=False)

        docs = [document(f"doc-34-0-{i}") for i in range(24)]
        heads = {tuple(tokens(d)[:16]) for d in docs}
        print(json.dumps({
            "tokens": [len(tokens(d)) for d in docs],
            "distinct_heads": len(heads),
            "same_again": docs == [document(f"doc-34-0-{i}") for i in range(24)],
            "other_seed_differs": document("doc-34-1-0") != docs[0],
            "opening_holds_it": docs[3] in opening(docs[3]),
            "long": len(tokens(long_prompt("long-34"))),
        }))
        """
    )
    # ~300 tokens each, none sharing its first block of 16 tokens with another.
    assert all(250 <= n <= 350 for n in sizes["tokens"]), sizes["tokens"]
    assert sizes["distinct_heads"] == 24
    assert sizes["same_again"] and sizes["other_seed_differs"] and sizes["opening_holds_it"]
    # Longer than the 2,048 tokens of a default slot; within the model's trained 8,192.
    assert 4_300 <= sizes["long"] <= 4_800


KVTIER_SECTION = """
from scenarios.kvtier.report import report

def server(whole, later_ms, wall):
    return {
        "conversations": 24, "later_turns": 48, "whole_cached": whole,
        "whole_cached_share": whole / 48, "later_ttft_p50_ms": later_ms,
        "first_ttft_p50_ms": 900.0, "first_prompt_tokens_p50": 330, "wall_s": [wall],
        "wall_p50_s": wall, "errors": [],
    }

def section(tier, status):
    windows = [{"rss_mb": 700.0, "peak_mb": 760.0, "tier": [tier]}]
    return {
        "settings": {
            "slots": 4, "n_ctx": 2048, "llama_ctx": 8192, "threads": 2,
            "conversations": 24, "open": 8, "turns": 3, "max_tokens": 32, "reps": 1,
            "host_bytes": None, "streams": 16,
        },
        "conversations": {
            "servers": {
                "tokenmill": server(47, 240.0, 40.0),
                "llama-server": server(48, 400.0, 47.0),
            },
            "memory": {"after_warm_up": {"rss_mb": 690.0}, "windows": windows},
        },
        "long": {
            "status": status, "error": "" if status == 200 else "HTTP 400: too long",
            "ttft_ms": 9000.0 if status == 200 else None, "prompt_tokens": 4540,
            "long_s": 12.0, "short_requests": 40, "short_ttft_p50_ms": 800.0,
            "short_errors": [],
        },
    }
"""


def test_kvtier_table_marks_the_issue_targets() -> None:
    tables = bench_python(
        KVTIER_SECTION
        + """
import json
print(json.dumps({
    "met": report(section({"host_entries": 20, "host_capacity_bytes": 64 * 2**20}, 200)),
    "not_met": report(section({"host_entries": 20, "host_capacity_bytes": 32 * 2**20}, 400)),
    "no_tier": report(section(None, 200)),
}))
"""
    )

    def marks(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(("PASS", "MISS"))]

    met = marks(tables["met"])
    # 47 of 48 whole cached; 240/400 ms; 40/47 s; answered; grew 70 MB of a 64 MB tier.
    assert [line[:4] for line in met] == ["PASS"] * 5, met
    assert "97.9%" in met[0] and "0.60x" in met[1] and "0.85x" in met[2]
    assert "70 MB" in met[4] and "64 MB" in met[4]
    not_met = marks(tables["not_met"])
    assert [line[:4] for line in not_met] == ["PASS", "PASS", "PASS", "MISS", "MISS"]
    assert "status 400" in not_met[3]
    # No tier reported (the replica before the tier): its size is n/a, never guessed.
    no_tier = tables["no_tier"]
    assert "tier (kv of each replica): n/a" in no_tier
    assert marks(no_tier)[4].startswith("MISS") and "n/a" in marks(no_tier)[4]


# -- make bench's kvcluster scenario (issue 35): registration and targets, without servers.


def test_kvcluster_runs_in_a_plain_make_bench_and_marks_the_issue_targets() -> None:
    got = bench_python(
        """
        import json
        from run import chosen, parser
        from scenarios.kvcluster.report import report

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        def turns(whole, ms, **more):
            return {"second_turns": 12, "whole_cached": whole, "whole_cached_share": whole / 12,
                    "second_ttft_p50_ms": ms, **more}

        settings = {"slots": 4, "n_ctx": 2048, "llama_ctx": 8192, "conversations": 12,
                    "moves": 8}

        def section(disk_whole, moved_ms):
            return {
                "settings": settings,
                "restart": {
                    "tokenmill-disk": turns(disk_whole, 300.0, kill={"back_s": 2.0}),
                    "tokenmill": turns(0, 1500.0, kill={"back_s": 2.0}),
                    "llama-server": turns(0, 1400.0, kill={"back_s": 1.0}),
                },
                "moves": {
                    "moves-on": turns(8, moved_ms, kv_moves={"moved": 8}),
                    "moves-off": turns(0, 1000.0, kv_moves={"moved": 0}),
                },
            }

        print(json.dumps({
            "plain": names(),
            "only": names("--only-kvcluster"),
            "met": report(section(12, 200.0)),
            "not_met": report(section(10, 600.0)),
        }))
        """
    )
    assert "kvcluster" in got["plain"][0]
    assert got["only"] == [["kvcluster"], "kvcluster.json"]

    def marks(text: str) -> list[str]:
        return [
            line.strip()[:4] for line in text.splitlines() if line.strip()[:4] in ("PASS", "MISS")
        ]

    # 12 of 12 restored (>= 90 %); moved 200 ms against computed 1000 (<= 0.5x).
    assert marks(got["met"]) == ["PASS", "PASS"], got["met"]
    assert "0.21x llama-server's" in got["met"]
    # 10 of 12 (83 %); 600 against 1000 ms.
    assert marks(got["not_met"]) == ["MISS", "MISS"], got["not_met"]


def test_autoscale_runs_in_a_plain_make_bench_and_marks_the_issue_targets() -> None:
    got = bench_python(
        """
        import json
        from run import chosen, parser
        from scenarios.autoscale import report

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        settings = {"low": 1, "high": 12, "tokens": 32, "before_s": 30.0, "high_s": 40.0,
                    "after_s": 50.0, "slots": 4, "load_s": 2.0, "max_replicas": 4,
                    "up_delay": 1.0, "down_delay": 10.0}
        books = {"debit": 10, "by_usage": 10, "held": 0, "exact": True}

        def run(p90, replica_s, failed=0, events=()):
            return {"requests": 100, "failed": failed, "step_requests": 80,
                    "ttft_step_p50_ms": p90 / 2, "ttft_step_p90_ms": p90,
                    "replica_seconds": replica_s, "scale_events": list(events), "books": books}

        def event(at, direction, a, b):
            return {"at": at, "direction": direction, "replicas_from": a, "replicas_to": b}

        def section(auto_p90, auto_s, events):
            return {"settings": settings, "fixed_1": run(3000.0, 120.0),
                    "fixed_max": run(60.0, 480.0), "autoscaled": run(auto_p90, auto_s, 0, events)}

        calm = [event(31.0, "up", 1, 4), event(81.0, "down", 4, 1)]
        flapping = [event(31.0, "up", 1, 2), event(31.5, "up", 2, 4), event(81.0, "down", 4, 1)]
        print(json.dumps({
            "plain": names(),
            "only": names("--only-autoscale"),
            "met": report(section(80.0, 270.0, calm)),
            "not_met": report(section(100.0, 300.0, flapping)),
        }))
        """
    )
    assert "autoscale" in got["plain"][0]
    assert got["only"] == [["autoscale"], "autoscale.json"]
    met = [line for line in got["met"].splitlines() if line.startswith("  [")]
    assert met and all(line.startswith("  [ok]") for line in met), got["met"]
    missed = [line for line in got["not_met"].splitlines() if "[MISSED]" in line]
    assert len(missed) == 3, got["not_met"]
    assert any("TTFT p90" in line for line in missed)
    assert any("replica-seconds" in line for line in missed)
    assert any("one scale event per direction" in line for line in missed)


def test_speculative_runs_in_a_plain_make_bench_and_marks_the_issue_targets() -> None:
    got = bench_python(
        """
        import json
        from run import chosen, parser
        from scenarios.speculative import SERVERS, report

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        keys = ["copy-heavy@1", "copy-heavy@16", "chat@1", "chat@16"]

        def section(copy, chat16, texts):
            speed = {"tokenmill": 50.0, "llama-server": 50.0, "llama-ngram-simple": 45.0,
                     "llama-ngram-mod": 60.0}
            runs = {}
            for name in SERVERS:
                base = speed.get(name)
                runs[name] = {}
                for k in keys:
                    v = base if base is not None else (copy if k == "copy-heavy@1" else
                                                        chat16 if k == "chat@16" else 50.0)
                    same = texts if name == "tokenmill-ngram" else ["a"]
                    runs[name][k] = [{"tok_per_s": v, "texts": same if k.endswith("@1") else []}]
            return {"runs": runs, "acceptance": {"copy-heavy@1": {"drafted": 10, "accepted": 8}}}

        print(json.dumps({
            "plain": names(),
            "only": names("--only-speculative"),
            "met": report(section(80.0, 50.0, ["a"])),
            "not_met": report(section(70.0, 40.0, ["b"])),
        }))
        """
    )
    assert "speculative" in got["plain"][0]
    assert got["only"] == [["speculative"], "speculative.json"]
    met = [line for line in got["met"].splitlines() if line.startswith("  [")]
    assert len(met) == 5 and all(line.startswith("  [ok]") for line in met), got["met"]
    missed = [line for line in got["not_met"].splitlines() if "[MISSED]" in line]
    # 70 tok/s: 1.4x without drafts and 1.17x llama's best; chat at c=16 0.8x; texts differ.
    assert len(missed) == 3, got["not_met"]
    assert "drafted 10, kept 8 (0.80)" in got["met"]


def test_weights_runs_in_a_plain_make_bench_and_marks_the_issue_targets() -> None:
    got = bench_python(
        """
        import json
        from run import chosen, parser
        from scenarios.weights import SCENARIO

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        def table(prefill, decode):
            medians = {
                "tokenmill-q4_1": {"prefill": 100.0, "decode": 50.0},
                "tokenmill-q8_0": {"prefill": 100.0 * prefill, "decode": 50.0 * decode},
            }
            w = {"reps": 1, "medians": medians,
                 "ratios": {"prefill": prefill, "decode": decode}}
            return SCENARIO.table({"weights": w, "model_file": "m.gguf", "threads": 2,
                                   "max_tokens": 32, "lockstep": False})

        print(json.dumps({
            "plain": names(),
            "only": names("--only-weights"),
            "met": table(1.9, 1.5),
            "not_met": table(1.33, 1.37),
        }))
        """
    )
    assert "weights" in got["plain"][0]
    assert got["only"] == [["weights"], "weights.json"]
    assert "PASS prefill Q8_0/Q4_1 1.90x" in got["met"] and "PASS decode" in got["met"]
    assert "190.0" in got["met"] and "75.0" in got["met"]
    assert "MISS prefill Q8_0/Q4_1 1.33x (>= 1.8x)" in got["not_met"]
    assert "MISS decode Q8_0/Q4_1 1.37x (>= 1.4x)" in got["not_met"]


def test_kvdrift_runs_in_a_plain_make_bench_and_judges_changes_drift_and_ends() -> None:
    got = bench_python(
        """
        import json
        from run import chosen, parser
        from scenarios.kvdrift import PROBES, SCENARIO, judge

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        def first(token, logprob, runner_up):
            return {"token": token, "logprob": logprob,
                    "top": [(token, logprob), ("other", runner_up)]}

        before = [first("A", -0.04, -4.2) for _ in PROBES]
        after = [first("A", -0.10, -4.0) for _ in PROBES]
        after[1] = first("The", -0.6, -1.3)  # a clear lead lost: changed
        after[2] = {"token": "A", "logprob": -0.3, "top": [("A", -0.3)]}  # drift 0.26
        raw = {"before": before, "after": after,
               "ended_at_once": [PROBES[0], PROBES[1], PROBES[1]]}
        eos = {PROBES[0]: -2.0, PROBES[1]: -15.0}  # alone: 0.14 and ~0
        judged = judge(raw, eos)
        kept = judge({"before": before, "after": before, "ended_at_once": []}, eos)
        results = {"kvdrift": {"tokenmill-shared": {**raw, **judged},
                               "tokenmill-per-slot": {**raw, **kept},
                               "llama-server": {**raw, **kept}}}
        print(json.dumps({
            "plain": names(),
            "only": names("--only-kvdrift"),
            "judged": judged,
            "table": SCENARIO.table(results),
        }))
        """
    )
    assert "kvdrift" in got["plain"][0]
    assert got["only"] == [["kvdrift"], "kvdrift.json"]
    judged = got["judged"]
    assert len(judged["changed"]) == 1 and "'A' -0.040 -> 'The'" in judged["changed"][0]
    assert judged["max_drift"] == 0.26
    assert judged["ended_at_once"] == 3 and judged["ended_wrongly"] == 2
    assert "MISS tokenmill-shared" in got["table"] and "PASS tokenmill-per-slot" in got["table"]


def test_tracing_runs_in_a_plain_make_bench_and_marks_the_issue_target() -> None:
    got = bench_python(
        """
        import json
        import httpx
        from run import chosen, parser
        from scenarios.tracing import SCENARIO, Sink, off_path_ns

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        def table(on):
            t = {"reps": 1, "medians": {"off": 100.0, "on": on}, "ratio": on / 100.0,
                 "cpu_medians": {"off": 10.0, "on": 10.5}, "off_path_ns": 40.0,
                 "exports": {"/v1/traces": 3, "/v1/metrics": 1}, "export_bytes": 5000}
            return SCENARIO.table({"tracing": t, "model_file": "m.gguf", "threads": 2,
                                   "max_tokens": 32, "lockstep": False})

        # The sink answers an export as a collector does, and counts it.
        sink = Sink()
        answer = httpx.post(f"{sink.endpoint}/v1/traces", content=b"x" * 10,
                            headers={"content-type": "application/x-protobuf"})
        sink.close()
        print(json.dumps({
            "plain": names(),
            "only": names("--only-tracing"),
            "met": table(98.0),
            "not_met": table(95.0),
            "sink": [answer.status_code, sink.exports["/v1/traces"], sink.bytes],
            "off_ns": off_path_ns(),
        }))
        """
    )
    assert "tracing" in got["plain"][0]
    assert got["only"] == [["tracing"], "tracing.json"]
    assert "PASS on/off tok/s at c=16 0.980x (>= 0.97x)" in got["met"]
    assert "MISS on/off tok/s at c=16 0.950x (>= 0.97x)" in got["not_met"]
    assert got["sink"] == [200, 1, 10]
    assert got["off_ns"] > 0


def test_agents_runs_alone_and_its_proxy_measures_a_sessions_main_request(
    server: ServerProcess,
) -> None:
    got = bench_python(
        f"""
        import json
        import httpx
        from run import chosen, parser
        from scenarios.agents import SCENARIO, Proxy

        def names(*argv):
            scenarios, out = chosen(parser().parse_args(list(argv)))
            return [s.name for s in scenarios], out

        tool = {{"name": "shell", "description": "Run a command",
                 "input_schema": {{"type": "object", "properties": {{}}}}}}
        proxy = Proxy({server.url!r}, 8)
        proxy.session()
        # A request without tools (a title, a quota check) passes untouched.
        small = httpx.post(f"{{proxy.url}}/v1/messages", json={{
            "model": "smollm2", "max_tokens": 5,
            "messages": [{{"role": "user", "content": "Hi"}}]}}, timeout=120)
        body = {{"model": "smollm2", "max_tokens": 200, "stream": True, "tools": [tool],
                "messages": [{{"role": "user", "content": "Say hello to the world."}}]}}
        with httpx.stream("POST", f"{{proxy.url}}/v1/messages", json=body, timeout=120) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        main = proxy.main
        # (The proxy marks the request ended after relaying its last byte: wait for it.)
        ended = main.ended.wait(60)
        proxy.close()
        last = [json.loads(e[5:]) for e in events if '"message_delta"' in e][0]

        def session(prompt, cached, ttft, phase):
            return {{"path": "/v1/messages", "status": 200, "ttft_s": ttft,
                     "prompt_tokens": prompt, "cached_tokens": cached, "phase": phase}}

        table = SCENARIO.table({{"model_file": "m.gguf", "agents": {{"claude": {{"sessions": [
            session(20000, 0, 300.0, "fresh server"),
            session(20000, 19000, 30.0, "same server"),
            session(20000, 12000, 90.0, "restarted server")]}}}}}})
        print(json.dumps({{
            "plain": names(), "only": names("--only-agents"),
            "small": small.json()["usage"]["output_tokens"],
            "main": main.record(), "ended": ended,
            "output_tokens": last["usage"]["output_tokens"], "table": table,
        }}))
        """
    )
    assert "agents" not in got["plain"][0]  # minutes of real CLIs: only when asked
    assert got["only"] == [["agents"], "agents.json"]
    assert got["small"] <= 5
    main = got["main"]
    assert main["path"] == "/v1/messages" and main["status"] == 200 and got["ended"]
    assert main["ttft_s"] is not None and main["ttft_s"] > 0
    assert main["prompt_tokens"] > 0 and main["cached_tokens"] is not None
    assert got["output_tokens"] <= 8  # the proxy bounded the main request's answer
    assert "PASS claude session 2 cached 95.0% (>= 80%)" in got["table"]
    assert "PASS claude session 2 TTFT 0.100x session 1's (<= 0.2x)" in got["table"]
    assert "MISS claude session 3 cached 60.0% (>= 80%)" in got["table"]
    assert "MISS claude session 3 TTFT 0.300x session 1's (<= 0.2x)" in got["table"]
