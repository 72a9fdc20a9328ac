"""``tokenmill bench`` against the real gateway: the load generator's figures add up."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

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
