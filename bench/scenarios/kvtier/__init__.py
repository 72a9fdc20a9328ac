"""KV memory beyond the slots, on one replica (issue 34, part 4).

**Many conversations.** One tokenmill replica of 4 slots (``max_num_seqs = 4``, the rest
at its defaults: a shared pool of 8,192 cells, ``kv_host_bytes`` at its default unless
``--kvtier-host-bytes``) and llama.cpp's own ``llama-server`` built from the same
vendored llama.cpp, reading the file tokenmill serves (``-np 4 -c 8192``, ``--threads``;
everything else at its defaults, so its host-memory prompt cache ``--cache-ram`` is on),
both started together and measured in turn, who goes first alternating from one
repetition to the next. Each gets the same ``--kvtier-conversations`` three-turn
conversations, each opening with its own ~300-token document (made from a seed),
``--kvtier-open`` at a time, pausing 1-3 s (seeded) between turns like a person reading.
Every answer is ``--kvtier-max-tokens`` long (``ignore_eos``). A later turn found its
whole earlier prompt cached when the usage's ``prompt_tokens_details.cached_tokens``
(both servers report it) is at least the previous turn's ``prompt_tokens``. tokenmill's
replica memory is read from ``/proc`` (its pids from ``GET /v1/deployments/{id}``): RSS
after warm-up, then after each window with the peak (VmHWM); the tier's own figures are
what that endpoint reports under each replica's ``kv`` (``host_capacity_bytes`` the
bound).

**One long prompt.** tokenmill with no configuration at all (the embedded default):
``--kvtier-streams`` workers send short requests one after another; once each has had
its first answer, one ~4,500-token prompt goes: its status and TTFT, and the short
requests' TTFT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from probes import memory_mb
from servers import Server, llama_server, llama_server_binary, log, tokenmill_server

from ..routing.workload import Window, ms
from ..versus import served_file
from .report import TIER_KEY, report
from .workload import TURNS, long_beside_short, many

if TYPE_CHECKING:
    from scenario import Bench

DEPLOYMENT = "kvtier"
SLOTS = 4
N_CTX = 8192  # tokenmill's at its defaults: the model's context, in one shared pool
LLAMA_CTX = 8192  # llama-server's -c: the whole pool, as tokenmill's (4 x 2,048)


def config(host_bytes: int | None) -> str:
    # No queue timeout: llama-server has none, and a turn that waited out tokenmill's
    # 30 s default would be an error, not a time.
    text = (
        f'[[deployments]]\nid = "{DEPLOYMENT}"\nmax_num_seqs = {SLOTS}\n'
        "max_queue = 256\nqueue_timeout_s = 600\n"
    )
    return text + ("" if host_bytes is None else f"kv_host_bytes = {host_bytes}\n")


def replicas(server: Server) -> list[dict[str, Any]]:
    d = httpx.get(f"{server.url}/v1/deployments/{DEPLOYMENT}", timeout=30.0).json()
    out: list[dict[str, Any]] = d.get("replicas") or []
    return out


def replica_memory(server: Server) -> dict[str, Any]:
    """RSS and its peak (VmHWM) of the replica processes and their children, MiB, and
    the tier's figures as the deployment reports them (None where it reports none)."""
    rs = replicas(server)
    mems = [memory_mb(int(r["pid"])) for r in rs if r.get("pid")]
    return {
        "rss_mb": round(sum(m["rss_mb"] for m in mems), 1),
        "peak_mb": round(sum(m["hwm_mb"] for m in mems), 1),
        "tier": [r.get(TIER_KEY) for r in rs],
    }


def summarize(windows: list[Window]) -> dict[str, Any]:
    later = [t for w in windows for conv in w.turns for t in conv if t.turn > 1]
    whole = sum(
        1
        for w in windows
        for conv in w.turns
        for prev, t in itertools.pairwise(conv)
        if t.cached_tokens >= prev.prompt_tokens
    )
    first = [t for w in windows for conv in w.turns for t in conv if t.turn == 1]
    return {
        "conversations": sum(len(w.turns) for w in windows),
        "later_turns": len(later),
        "whole_cached": whole,
        "whole_cached_share": round(whole / len(later), 4) if later else None,
        "later_ttft_p50_ms": ms(statistics.median(t.ttft_s for t in later)) if later else None,
        "later_ttft_mean_ms": ms(statistics.fmean(t.ttft_s for t in later)) if later else None,
        "first_ttft_p50_ms": ms(statistics.median(t.ttft_s for t in first)) if first else None,
        "first_prompt_tokens_p50": statistics.median(t.prompt_tokens for t in first)
        if first
        else None,
        "wall_s": [round(w.seconds, 2) for w in windows],
        "wall_p50_s": round(statistics.median(w.seconds for w in windows), 2),
        "errors": [e for w in windows for e in w.errors],
    }


def conversations(bench: Bench, binary: Path, out: dict[str, Any]) -> None:
    """The many-conversations case, into ``out`` after every window (an interruption
    keeps what was measured)."""
    args = bench.args
    tmp = bench.tmp / "kvtier"
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "kvtier.toml"
    cfg.write_text(config(args.kvtier_host_bytes))
    out["config"] = cfg.read_text()
    tm = tokenmill_server("tokenmill", tmp, ("--config", str(cfg)), files="tokenmill-kvtier")
    servers = [tm]
    windows: dict[str, list[Window]] = {tm.name: []}
    memory: dict[str, Any] = {}
    out["memory"] = memory
    try:
        tm.start()
        # llama-server reads the file tokenmill serves (Q8_0 made from the shipped one).
        peer = served_file(tm)
        ls = llama_server(binary, peer, args.threads, tmp, SLOTS, LLAMA_CTX, "llama-kvtier")
        servers.append(ls)
        out["llama_server_cmd"] = ls.proc.args  # a list of str: written as JSON
        windows[ls.name] = []
        ls.start()
        memory["after_warm_up"] = replica_memory(tm)
        memory["windows"] = []
        for rep in range(args.kvtier_reps):
            for s in (tm, ls) if rep % 2 == 0 else (ls, tm):
                windows[s.name].append(asyncio.run(many(s.url, s.model, rep, args)))
                if s is tm:
                    memory["windows"].append(replica_memory(tm))
                else:
                    memory["llama_server_mb"] = round(memory_mb(ls.proc.pid)["tree_rss_mb"], 1)
                log(
                    f"kvtier: repetition {rep + 1}/{args.kvtier_reps} on {s.name}: "
                    f"{windows[s.name][-1].seconds:.1f} s, "
                    f"{len(windows[s.name][-1].errors)} errors"
                )
                out["servers"] = {n: summarize(w) for n, w in windows.items() if w}
    finally:
        for s in servers:
            s.stop()


def long_prompt(bench: Bench, out: dict[str, Any]) -> None:
    tmp = bench.tmp / "kvtier"
    tmp.mkdir(parents=True, exist_ok=True)
    server = tokenmill_server("tokenmill-default", tmp, files="tokenmill-kvtier-default")
    try:
        server.start()
        result = asyncio.run(long_beside_short(server.url, server.model, bench.args))
        out.update(result.summary())
        log(f"kvtier: long prompt status {result.status}, TTFT {ms(result.ttft_s)} ms")
    finally:
        server.stop()


class KvTier:
    """Many conversations on one replica against llama-server, and one long prompt
    beside short streams (``--only-kvtier``, ``--no-kvtier``)."""

    name = "kvtier"
    about = (
        "many conversations on one 4-slot replica against llama-server's host-memory "
        "prompt cache, and one 4,500-token prompt beside 16 streams at the default "
        "configuration (issue 34)"
    )
    default = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("--kvtier-conversations", type=int, default=24, help="3-turn conversations a server")
        add("--kvtier-open", type=int, default=8, help="conversations open at once")
        add("--kvtier-max-tokens", type=int, default=32, help="tokens of every answer")
        add(
            "--kvtier-reps",
            type=int,
            default=2,
            help="repetitions of the conversations on each server, who goes first alternating",
        )
        add(
            "--kvtier-host-bytes",
            type=int,
            default=None,
            help="tokenmill's kv_host_bytes (default: not set, the deployment's default)",
        )
        add("--kvtier-seed", type=int, default=34, help="seed of the documents and pauses")
        add("--kvtier-streams", type=int, default=16, help="short streams beside the long prompt")
        add(
            "--kvtier-short-requests",
            type=int,
            default=2,
            help="short requests each stream sends at least (more while the long one runs)",
        )
        add("--no-kvtier-long", action="store_true", help="skip the long-prompt case")

    def run(self, bench: Bench) -> None:
        args = bench.args
        section: dict[str, Any] = {
            "settings": {
                "slots": SLOTS,
                "n_ctx": N_CTX,
                "llama_ctx": LLAMA_CTX,
                "threads": args.threads,
                "conversations": args.kvtier_conversations,
                "open": args.kvtier_open,
                "turns": TURNS,
                "max_tokens": args.kvtier_max_tokens,
                "reps": args.kvtier_reps,
                "host_bytes": args.kvtier_host_bytes,
                "streams": args.kvtier_streams,
                "load_average_before": [round(x, 2) for x in os.getloadavg()],
            },
            "conversations": {},
            "long": {},
        }
        bench.results[self.name] = section
        try:
            log("llama-server: building if not cached (several minutes the first time)")
            conversations(bench, llama_server_binary(), section["conversations"])
            if not args.no_kvtier_long:
                long_prompt(bench, section["long"])
        except KeyboardInterrupt:
            bench.results["interrupted"] = True
        section["settings"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]

    def table(self, results: dict[str, Any]) -> str | None:
        section = results.get(self.name)
        return None if section is None else report(section)


SCENARIO = KvTier()
