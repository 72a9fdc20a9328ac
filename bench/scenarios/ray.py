"""Ray: tokenmill's replica as a Ray actor, and the gateway behind Ray Serve's proxy.

Three tokenmill servers on the same model, threads and slots, measured in turn and
interleaved at concurrency 1 and 16: a process replica (the baseline), a Ray replica
(``placement = "ray"``, a private local Ray instance) and one gateway cell behind Ray
Serve's proxy (``--ray-serve --cells 1``, process replica). CPU per output token is
split between the gateway, the replica, Ray's daemons (raylet, gcs_server), Serve's
proxy and the rest of each server's process tree. Skipped (with a line saying so)
when ray is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import httpx
from firsttoken import STAGES, stage_summary
from load import interleaved, log_run, plan_line
from probes import parent_pid, processes_below, ray_daemons
from scenario import Bench
from servers import N_CTX, SLOTS, Server, log, tokenmill_server
from summary import Runs, by_level, ramp_lines, summarize

LEVELS = (1, SLOTS)
# The three servers of the Ray section, in the table's order: the first is the baseline.
PROCESS, RAY, SERVE = "tm-process", "tm-ray", "tm-serve"
# The bar for a Ray replica against a process replica.
RAY_TOK_S_RATIO_TARGET = 0.95
RAY_TTFT_DIFF_TARGET_MS = 5.0
# Ray's CPU accounting: the actor reserves next to nothing, so a 2-core machine's
# private instance schedules it whatever else it holds.
RAY_NUM_CPUS = 0.1


def deployment_toml(path: Path, threads: int, placement: str) -> Path:
    """A config with the embedded model as the other tokenmill runs serve it (16 slots of
    N_CTX tokens, ``threads`` threads), at ``placement``."""
    lines = [
        "[[deployments]]",
        'id = "smollm2"',
        f"n_threads = {threads}",
        f"max_num_seqs = {SLOTS}",
        f"n_ctx = {N_CTX}",
        f'placement = "{placement}"',
    ]
    if placement == "ray":
        lines.append(f"ray_num_cpus = {RAY_NUM_CPUS}")
    path.write_text("\n".join(lines) + "\n")
    return path


def servers(threads: int, tmp: Path) -> list[Server]:
    """tokenmill with a process replica, with a Ray replica, and one gateway cell on Ray
    Serve (process replica): the same model, threads and slots."""
    # "local" through RAY_ADDRESS too: ray.init() with no address joins the cluster named
    # in /tmp/ray/ray_current_cluster (anyone's `ray start` on this host) if there is one.
    ray_env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local"}
    process_cfg = deployment_toml(tmp / "process.toml", threads, "process")
    ray_cfg = deployment_toml(tmp / "ray.toml", threads, "ray")
    return [
        tokenmill_server(name, tmp, ("--config", str(cfg), *extra), env)
        for name, cfg, extra, env in (
            (PROCESS, process_cfg, (), {}),
            (RAY, ray_cfg, (), ray_env),
            (SERVE, process_cfg, ("--ray-serve", "--cells", "1"), ray_env),
        )
    ]


def locate(s: Server) -> dict[str, Any]:
    """Fill ``s.cpu_groups``: its gateway, its replica (the pid ``GET /v1/deployments``
    shows: a child process, or the Ray actor's process), Ray's daemons and Serve's proxy."""
    info = httpx.get(f"{s.url}/v1/deployments/{s.model}", timeout=10.0).json()
    replica = int(info["replicas"][0]["pid"])
    # Behind Serve the gateway is the cell's actor: the process replica's parent.
    gateway = parent_pid(replica) if s.name == SERVE else s.proc.pid
    groups: dict[str, list[int]] = {"gateway": [gateway], "replica": [replica]}
    if s.name != PROCESS:
        groups["ray_daemons"] = ray_daemons(s.proc.pid)
    if s.name == SERVE:
        groups["proxy"] = processes_below(s.proc.pid, "ProxyActor")
    s.cpu_groups = groups
    return {k: v for k, v in groups.items()}


def targets(summary: dict[str, Any]) -> list[str]:
    out = []
    for c, row in summary.get("ray", {}).items():
        r, d = row["tok_s_ratio"], row["ttft_p50_diff_ms"]
        ok_r, ok_d = r >= RAY_TOK_S_RATIO_TARGET, d <= RAY_TTFT_DIFF_TARGET_MS
        out.append(
            f"{'PASS' if ok_r else 'MISS'} c={c} Ray replica tok/s ratio {r:.3f} "
            f"(target >= {RAY_TOK_S_RATIO_TARGET:.2f})"
        )
        out.append(
            f"{'PASS' if ok_d else 'MISS'} c={c} Ray replica TTFT p50 {d:+.1f} ms "
            f"(target <= +{RAY_TTFT_DIFF_TARGET_MS:g} ms)"
        )
    return out


def stage_lines(stages: dict[str, dict[str, Any]]) -> list[str]:
    """Per level, each first-token stage's p50 for the process replica and the Ray one."""
    rows = ["\nfirst token, p50 per stage (ms; tokenmill.stages), process / ray:"]
    for c in map(str, LEVELS):
        proc = ((stages.get(PROCESS) or {}).get(c) or {}).get("p50_ms") or {}
        ray_ = ((stages.get(RAY) or {}).get(c) or {}).get("p50_ms") or {}
        items = [
            f"{name} {proc[name]:.2f}/{ray_[name]:.2f}"
            for name in STAGES
            if name in proc and name in ray_
        ]
        missing = [name for name in STAGES if name in proc and name not in ray_]
        rows.append(f"  c={c:<3} " + "  ".join(items))
        if missing:
            rows.append(f"        not from the Ray replica (another host's clock): {missing}")
    return rows


def table(results: dict[str, Any]) -> str:
    ray = results["ray"]
    rows = [
        "",
        f"Ray: tokenmill's replica as a child process (process), as a Ray actor on a private "
        f"local Ray instance (ray), and one gateway cell behind Ray Serve's proxy (serve, "
        f"process replica); {results['model_file']}, {results['threads']} threads, {SLOTS} "
        f"slots x {N_CTX} tokens, max_tokens {results['max_tokens']}, {ray['reps']} runs each "
        "(medians)",
        plan_line(LEVELS, results["max_tokens"], results["lockstep"]),
        "",
        f"{'conc':>4} | {'tok/s process':>13} {'ray':>7} {'serve':>7} | {'ray/proc':>8} "
        f"{'serve/proc':>10} | {'TTFT50 process':>14} {'ray':>7} {'serve':>7} | "
        f"{'ray-proc':>8} {'serve-proc':>10} | {'errors':>8}",
        "-" * 124,
    ]
    for c, r in ray["summary"]["ray"].items():
        sv = ray["summary"]["serve"].get(c)
        if sv is None:
            continue
        p, y, v = r[PROCESS], r[RAY], sv[SERVE]
        rows.append(
            f"{c:>4} | {p['tok_s']:>13.1f} {y['tok_s']:>7.1f} {v['tok_s']:>7.1f} | "
            f"{r['tok_s_ratio']:>8.3f} {sv['tok_s_ratio']:>10.3f} | "
            f"{p['ttft_p50_ms']:>14.1f} {y['ttft_p50_ms']:>7.1f} {v['ttft_p50_ms']:>7.1f} | "
            f"{r['ttft_p50_diff_ms']:>+8.1f} {sv['ttft_p50_diff_ms']:>+10.1f} | "
            f"{p['errors']}/{y['errors']}/{v['errors']:<4}"
        )
    rows.append("")
    for c, r in ray["summary"]["ray"].items():
        sv = ray["summary"]["serve"].get(c, {}).get(SERVE, {})
        rows.append(
            f"  c={c:<3} runs tok/s  process {r[PROCESS]['tok_s_runs']}  ray "
            f"{r[RAY]['tok_s_runs']}  serve {sv.get('tok_s_runs')}"
        )
    rows += ramp_lines(ray["summary"]["ray"], (PROCESS, RAY))
    rows.append(
        "\nCPU ms per output token (medians): gateway (behind Serve: the cell's actor), "
        "replica, Ray's daemons (raylet + gcs_server), Serve's proxy actor, the rest of the "
        "server's process tree, and the load generator:"
    )
    for c, r in ray["summary"]["ray"].items():
        sv = ray["summary"]["serve"].get(c, {})
        for name, row in ((PROCESS, r[PROCESS]), (RAY, r[RAY]), (SERVE, sv.get(SERVE))):
            if row is None:
                continue
            cpu = row["cpu_ms_per_token"]
            extra = "".join(
                f"  {label} {cpu[k]:.3f}"
                for k, label in (("ray_daemons", "ray daemons"), ("proxy", "proxy"))
                if k in cpu
            )
            rows.append(
                f"  c={c:<3} {name:<10} gateway {cpu['gateway']:.3f}  replica "
                f"{cpu['replica']:.2f}{extra}  rest {cpu['other']:.3f}  "
                f"(whole tree {cpu['server'] + cpu['children']:.2f})  "
                f"load generator {cpu['client']:.3f}"
            )
    rows += stage_lines(ray.get("stages") or {})
    rows.append("\nServe's proxy path against the direct gateway (one cell, SQLite ledger):")
    for c, sv in ray["summary"]["serve"].items():
        rows.append(
            f"  c={c:<3} tok/s {100 * (sv['tok_s_ratio'] - 1):+.1f} %  TTFT p50 "
            f"{sv['ttft_p50_diff_ms']:+.1f} ms"
        )
    rows.append("")
    rows += [f"  {line}" for line in ray["targets"]]
    left = ray.get("left_running") or {}
    rows.append(
        "  processes left running after stopping the servers (killed): "
        + (", ".join(f"{n}: {v}" for n, v in left.items()) if left else "none")
    )
    return "\n".join(rows)


class Ray:
    """The Ray replica and Serve's proxy path, each against a process replica."""

    name = "ray"
    about = "the Ray replica and Ray Serve runs (against a process replica)"
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, bench: Bench) -> None:
        if importlib.util.find_spec("ray") is None:
            log("ray not installed: no Ray runs (pip install 'tokenmill[ray]')")
            return
        log("Ray: a process replica, a Ray replica and a Ray Serve cell, in turn")
        out: dict[str, Any] = {"reps": bench.reps, "levels": list(LEVELS)}
        bench.results[self.name] = out
        started = servers(bench.args.threads, bench.tmp)
        runs: Runs = {s.name: {} for s in started}
        try:
            for s in started:
                s.wait_ready()
                s.warm_up()
                out.setdefault("pids", {})[s.name] = locate(s)
                log(f"{s.name} ready on {s.url}: {s.cpu_groups}")
            try:
                for rep, c, s in interleaved(started, LEVELS, bench.reps):
                    report = bench.run(s, c)
                    runs[s.name].setdefault(c, []).append(report)
                    log_run("ray ", rep, bench.reps, c, s.name, report)
            except KeyboardInterrupt:
                out["interrupted"] = True
                bench.results["interrupted"] = True
                log("interrupted: reporting the Ray runs completed so far")
        finally:
            left = {}
            for s in started:
                # Serve drains its cell first: give it longer than a plain gateway.
                survived = s.stop(timeout=60.0)
                if survived:
                    left[s.name] = survived
                    log(f"{s.name}: still running after it exited, killed: {survived}")
            out["left_running"] = left
        out["runs"] = by_level(runs)
        out["summary"] = {
            "ray": summarize(runs, RAY, PROCESS),
            "serve": summarize(runs, SERVE, PROCESS),
        }
        out["targets"] = targets(out["summary"])
        # The first token's stages (p50 over every request of a level's runs) of the
        # process and the Ray replica: where a difference in TTFT lies. A Ray replica's
        # own stages are there because its node is this host (same clock).
        out["stages"] = {
            name: {str(c): stage_summary(reports) for c, reports in runs[name].items()}
            for name in (PROCESS, RAY)
        }

    def table(self, results: dict[str, Any]) -> str | None:
        return table(results) if self.name in results else None


SCENARIO = Ray()
