"""tokenmill against llama.cpp's own ``llama-server``: same GGUF, same threads, same slots.

Both servers are started side by side (16 slots of 2048 tokens each) but measured in
turn, never at the same time: ``tokenmill bench`` at each of ``--concurrency``'s levels,
``--reps`` times, interleaved so that drift on a shared machine hits both alike. The
medians go into the table with the ratios. Riding on those runs, in turn with them:

* ``ceiling``: the engine alone, no HTTP, at 1 and 16 sequences (``--no-ceiling``);
* ``metrics_cost``: tokenmill with ``TOKENMILL_METRICS=0`` at c=16 (``--no-metrics-cost``);
* ``scenarios/logprobs``: each of tokenmill's c=16 runs has a twin with
  ``top_logprobs`` (``--no-logprobs-cost``);
* ``GET /health`` timed during tokenmill's c=16 runs;
* ``baseline``: with ``--baseline-ref REF``, tokenmill from that git ref at every level.

Then, on the same two servers: ``second_turn`` (``--second-turns``), ``shared_host``
(``--busy``), ``memory`` and, with py-spy, a ``profile`` of one more c=16 run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import httpx
from load import interleaved, log_run
from probes import HealthProbe, health_summary, memory_mb
from scenario import Bench
from servers import SLOTS, Server, llama_server, llama_server_binary, log, tokenmill_server
from summary import Runs, by_level, summarize

from .. import logprobs
from . import baseline, ceiling, levels, memory, metrics_cost, profile, second_turn, shared_host
from .ceiling import Ceiling
from .levels import first_token_targets, health_targets


class Versus:
    name = "versus"
    about = "tokenmill against llama-server at each level, with the in-process ceiling"
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--concurrency", default=f"1,4,{SLOTS}", help="comma-separated levels")
        parser.add_argument("--no-ceiling", action="store_true", help="skip the in-process ceiling")
        parser.add_argument("--no-profile", action="store_true", help="skip the py-spy run")
        parser.add_argument(
            "--no-metrics-cost", action="store_true", help="skip the metrics-off tokenmill runs"
        )
        parser.add_argument(
            "--busy",
            type=int,
            default=os.cpu_count() or 1,
            help="busy loops beside the server in the shared-host runs (0: skip them)",
        )
        parser.add_argument(
            "--contended-reps", type=int, default=2, help="shared-host runs per server and level"
        )
        parser.add_argument(
            "--no-logprobs-cost",
            action="store_true",
            help=f"skip tokenmill's c={SLOTS} runs with logprobs (top {logprobs.TOP})",
        )
        parser.add_argument(
            "--peer-file",
            choices=["served", "shipped"],
            default="served",
            help="the file llama-server reads: the one tokenmill serves (its weights key: "
            "Q8_0 made from the shipped file by default), or the shipped GGUF",
        )
        parser.add_argument(
            "--peer-kv",
            choices=["streams", "unified"],
            default="streams",
            help="llama-server's KV layout: a stream per slot (its default for -np 16 -c "
            "32768), or one pool all slots share (--kv-unified, tokenmill's default layout)",
        )
        parser.add_argument(
            "--baseline-ref",
            default="",
            help="also run tokenmill from this git ref (a worktree), interleaved at every "
            "level, and report today's throughput over it (a refactoring's 'no slower')",
        )
        parser.add_argument(
            "--second-turns",
            type=int,
            default=4,
            help="two-turn chats per server and repetition at c=1, for the second turn's TTFT "
            "against llama-server's prompt cache (0: skip them)",
        )
        parser.add_argument(
            "--turn-pause",
            type=float,
            default=1.0,
            help="seconds between a chat's first answer and its second message: a person "
            "reading it (0: a program that sends the next turn at once)",
        )

    def run(self, bench: Bench) -> None:
        args = bench.args
        bench.results["levels"] = [int(x) for x in args.concurrency.split(",")]
        log("llama-server: building if not cached (several minutes the first time)")
        binary = llama_server_binary()
        bench.results["llama_server"] = str(binary)
        the_ceiling = None
        servers: list[Server] = []
        try:
            if not args.no_ceiling:
                log("in-process ceiling: the engine alone, loaded beside the servers")
                the_ceiling = Ceiling(bench.max_tokens, args.threads)
            tm = tokenmill_server("tokenmill", bench.tmp)
            servers.append(tm)
            tm.start()
            peer = served_file(tm) if args.peer_file == "served" else bench.gguf
            bench.results["peer_file"] = peer.name
            log(f"llama-server reads {peer}")
            extra = ["--kv-unified"] if args.peer_kv == "unified" else []
            bench.results["peer_kv"] = args.peer_kv
            servers.append(llama_server(binary, peer, args.threads, bench.tmp, extra=extra))
            if SLOTS in bench.results["levels"] and not args.no_metrics_cost:
                servers.append(metrics_cost.server(bench.tmp))
            if args.baseline_ref:
                servers.append(baseline.server(bench.tmp, args.baseline_ref))
            for s in servers[1:]:
                s.start()
            measure_all(bench, servers, the_ceiling)
        finally:
            if the_ceiling is not None:
                the_ceiling.close()
            for s in servers:
                s.stop()
            if args.baseline_ref:
                baseline.remove(bench.tmp)

    def table(self, results: dict[str, Any]) -> str | None:
        if "summary" not in results:
            return None
        rows = levels.table_lines(results)
        rows += shared_host.lines(results)
        rows += levels.stages_lines(results)
        rows += second_turn.lines(results)
        rows += ceiling.lines(results)
        rows += metrics_cost.lines(results)
        rows += baseline.lines(results)
        rows += logprobs.lines(results.get("logprobs_cost"))
        rows += memory.lines(results)
        rows += ["", *(f"  {line}" for line in results["targets"])]
        rows += profile.lines(results)
        return "\n".join(rows)


SCENARIO = Versus()


def served_file(server: Server) -> Path:
    """The model file ``server``'s replica loads (its weights key applied)."""
    status = httpx.get(f"{server.url}/v1/deployments/{server.model}", timeout=30.0).json()
    return Path(status["replicas"][0]["weights"]["served"])


def measure_all(bench: Bench, servers: list[Server], the_ceiling: Ceiling | None) -> None:
    """Every run on the started servers, then the figures into ``bench.results``."""
    args, results = bench.args, bench.results
    tm, ls = servers[0], servers[1]
    runs: Runs = {s.name: {} for s in servers}
    mem: dict[str, dict[str, float]] = {s.name: {} for s in servers}
    health: list[HealthProbe] = []
    contended: Runs = {tm.name: {}, ls.name: {}}
    turns: dict[str, Any] = {}
    try:
        measure(bench, servers, runs, mem, health, the_ceiling)
        if args.second_turns > 0:
            second_turn.measure(bench, tm, ls, turns)
        if args.busy > 0:
            shared_host.measure(bench, [tm, ls], contended)
    except KeyboardInterrupt:
        # Stopped early (Ctrl-C, SIGTERM from a timeout): report what was measured.
        results["interrupted"] = True
        log("interrupted: reporting the runs completed so far")
    if the_ceiling is not None and the_ceiling.runs:
        results["ceiling"] = the_ceiling.summary()
        log(f"ceiling: {results['ceiling']}")
    for s in servers:
        mem[s.name] = mem[s.name] or memory_mb(s.proc.pid)
    results["runs"] = by_level(runs)
    if turns.get("summary"):
        results["second_turn"] = turns
    results["summary"] = summarize(runs)
    results["busy"] = args.busy
    results["contended_runs"] = by_level(contended)
    results["contended"] = summarize(contended)
    results["metrics_cost"] = metrics_cost.cost(runs)
    if args.baseline_ref:
        results["baseline"] = baseline.compare(runs, args.baseline_ref)
    results["logprobs_cost"] = logprobs.cost(runs)
    results["memory"] = memory.summary(mem, tm, bench.gguf, results["model_mb"])
    if health:
        results["health"] = health_summary(health)
    summary = results["summary"]
    results["targets"] = (
        levels.targets(summary)
        + shared_host.targets(results)
        + levels.error_targets(summary)
        + memory.targets(results)
        + health_targets(results.get("health"))
        + logprobs.targets(results["logprobs_cost"])
        + first_token_targets(summary)
        + ceiling.targets(results)
        + second_turn.targets(results)
    )
    if not args.no_profile and not bench.interrupted:
        results["profile"] = profile.run(bench, tm)


def measure(
    bench: Bench,
    servers: list[Server],
    runs: Runs,
    mem: dict[str, dict[str, float]],
    health: list[HealthProbe],
    the_ceiling: Ceiling | None = None,
) -> None:
    """Fill ``runs``, ``mem`` and ``health`` as runs complete, so an interruption
    keeps them. With ``the_ceiling``, it runs at its levels in turn with the servers.

    The metrics-off tokenmill runs at c=SLOTS only, always next to the metrics-on one,
    so the on/off pair sees the same moment of the machine. During tokenmill's c=SLOTS
    runs a probe times ``GET /health``. Unless ``--no-logprobs-cost``, each of those
    runs has a twin with logprobs on the same server right before or after it,
    alternately.
    """
    tm, ls, *off = servers
    every: list[Server | Ceiling] = [*off, tm, ls, *([the_ceiling] if the_ceiling else [])]
    for rep, c, s in interleaved(every, bench.results["levels"], bench.reps):
        if isinstance(s, Ceiling):
            if c in ceiling.LEVELS:
                log(f"rep {rep + 1}/{bench.reps} c={c:<2} {s.name:<19} {s.run(c):7.1f} tok/s")
            continue
        if s.name == metrics_cost.NAME and c != SLOTS:
            continue
        if s is tm and c == SLOTS:
            twin = not bench.args.no_logprobs_cost
            if twin and rep % 2 == 1:
                logprobs.twin_run(bench, s, runs, rep)
            with HealthProbe(s.url) as probe:
                report = bench.run(s, c)
            health.append(probe)
            if twin and rep % 2 == 0:
                logprobs.twin_run(bench, s, runs, rep)
        else:
            report = bench.run(s, c)
        runs[s.name].setdefault(c, []).append(report)
        memory.keep_largest(mem[s.name], s.proc.pid)
        log_run("", rep, bench.reps, c, s.name, report)
