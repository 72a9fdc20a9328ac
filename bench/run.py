"""``make bench``: tokenmill against llama.cpp's own ``llama-server``, same GGUF, same threads.

1. The in-process ceiling: tokenmill's llama.cpp engine driven directly with asyncio (no
   HTTP, no gateway) at 1 and 16 concurrent sequences, in a child process of its own,
   kept loaded and measured in turn with the servers of 2. (medians, like theirs).
2. Both servers are started side by side (same model file, same thread count, 16 slots of
   2048 tokens each) but measured in turn, never at the same time: ``tokenmill bench`` at
   concurrency 1, 4 and 16, several repetitions, interleaved so that drift on a shared
   machine hits both alike. The medians go into the table with the ratios.
   A third server, tokenmill with ``TOKENMILL_METRICS=0``, runs the c=16 level too, right
   beside the metrics-on runs, to show what the Prometheus observer costs.
   Log probabilities (``--no-logprobs-cost`` skips them, ``--only-logprobs`` runs them
   alone): beside each of tokenmill's c=16 runs, on the same server, one more where every
   request asks for ``logprobs`` with the top 5 alternatives: their cost in tok/s.
   Structured outputs (``--no-constrained`` skips them, ``--only-constrained`` runs them
   alone): plain and JSON-schema-constrained runs at c=16 on one more tokenmill server,
   interleaved, and the mask's own cost per token (see ``bench/constrained.py``).
3. Memory: the gateway process alone (the target applies to it: the model and the KV
   cache live in the replica child), the replica process less model file and KV cache,
   and llama-server's process beside them.
4. With py-spy installed, one extra c=16 run is profiled on the gateway (not measured).
5. Ray (``--no-ray`` skips it, ``--only-ray`` runs it alone): three tokenmill servers on
   the same model, threads and slots, measured in turn and interleaved like 2. at
   concurrency 1 and 16: a process replica (the baseline), a Ray replica (``placement =
   "ray"``, a private local Ray instance) and one gateway cell behind Ray Serve's proxy
   (``--ray-serve --cells 1``, process replica). CPU per output token is split between
   the gateway, the replica, Ray's daemons (raylet, gcs_server), Serve's proxy and the
   rest of each server's process tree.

The results are also written to ``.bench-cache/last.json`` (``ray.json`` with
``--only-ray``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import constrained
import httpx
from firsttoken import (
    FIRST_TURN_TOKENS,
    STAGES,
    log_size,
    read_stages,
    second_turn,
    stage_lines,
    stage_summary,
)
from probes import (
    HEALTH_TARGET_MS,
    HealthProbe,
    client_cpu_seconds,
    cpu_split,
    health_summary,
    maps_file,
    memory_mb,
    parent_pid,
    process_tree,
    processes_below,
    profile,
    py_spy,
    ray_daemons,
    survivors,
)

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench-cache"
SLOTS = 16
N_CTX = 2048
SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.0}
METRICS_OFF = "tokenmill-nometrics"
# tokenmill's own c=SLOTS runs with logprobs asked (the same server): their label in
# ``runs``, the alternatives asked (chat's top_logprobs) and the bar (<= 5 %).
LOGPROBS = "tokenmill-logprobs"
LOGPROBS_TOP = 5
LOGPROBS_RATIO_TARGET = 0.95
# Concurrency levels of the shared-host runs (the issue's: one person, a full server).
CONTENDED_LEVELS = (1, SLOTS)
T = TypeVar("T")
CEILING_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- llama-server ------------------------------------------------------------------


def llama_server_binary() -> Path:
    script = ROOT / "bench" / "build_llama_server.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True, env=env)
    return Path(out.stdout.strip().splitlines()[-1]).resolve()


# -- processes -----------------------------------------------------------------------


class Server:
    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_path: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env.update(extra_env or {})
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.model = ""
        # Processes of the tree whose CPU is reported apart (the replica, Ray's
        # daemons): filled once the server is up (see ray_section).
        self.cpu_groups: dict[str, list[int]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    models = httpx.get(f"{self.url}/v1/models", timeout=5.0).json()
                    self.model = models["data"][0]["id"]
                    return
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def warm_up(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16,
            **SAMPLING,
        }
        for _ in range(2):
            r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120.0)
            r.raise_for_status()

    def stop(self, timeout: float = 20.0) -> dict[int, str]:
        """SIGTERM, then SIGKILL after ``timeout``; returns the processes of its tree
        still running after it exited (killed then), by pid and command name."""
        tree = process_tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.5)  # children exiting with it
        left = survivors(tree)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return left


def kv_child(gguf: Path, n_ctx: int) -> None:
    """Child process: print the f16 KV cache size, in MiB, for ``n_ctx`` cells of ``gguf``.

    llama-server at its default verbosity no longer logs its KV buffer, so the size is
    computed from the model's shape: both servers allocate the same cells (16 x 2048) of
    the same type (f16, the default in each), so the figure holds for both.
    """
    import ctypes

    import llama_cpp as ll

    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True  # metadata only: no weights read
    model = ll.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise SystemExit(f"cannot read {gguf}")

    def meta(key: str) -> int | None:
        # The GGUF metadata, not llama_model_n_head_kv: that aborts on a vocab-only load.
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return int(buf.value) if n >= 0 else None

    arch = ctypes.create_string_buffer(64)
    ll.llama_model_meta_val_str(model, b"general.architecture", arch, len(arch))
    a = arch.value.decode()
    n_layer, n_head = meta(f"{a}.block_count") or 0, meta(f"{a}.attention.head_count") or 1
    n_head_kv = meta(f"{a}.attention.head_count_kv") or n_head
    # key_length is only written when it differs from n_embd / n_head.
    head_dim = meta(f"{a}.attention.key_length") or (meta(f"{a}.embedding_length") or 0) // n_head
    ll.llama_model_free(model)
    # K and V, per layer, per cell: n_head_kv * head_dim values of 2 bytes (f16).
    kv_bytes = n_ctx * n_layer * 2 * n_head_kv * head_dim * 2
    shape = {"n_layer": n_layer, "n_head_kv": n_head_kv, "head_dim": head_dim}
    print(json.dumps({"kv_mb": kv_bytes / 2**20, "n_ctx": n_ctx, **shape}), flush=True)


def kv_cache(gguf: Path, n_ctx: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--kv-child", str(gguf), "--kv-ctx", str(n_ctx)]
    # llama.cpp logs the model load on stderr: not part of the report.
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        log(f"KV cache size: the child exited with {out.returncode}; counted as 0")
        return {"kv_mb": 0.0}
    info: dict[str, Any] = json.loads(lines[-1])
    return info


# -- load ------------------------------------------------------------------------------


def run_bench(
    server: Server,
    concurrency: int,
    max_tokens: int,
    busy: int = 0,
    top_logprobs: int | None = None,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    # `python -m tokenmill.bench` is `tokenmill bench` without importing the other
    # subcommands, so a broken unrelated CLI module cannot stop the benchmark.
    cmd = [sys.executable, "-m", "tokenmill.bench", server.url, "--model", server.model]
    cmd += ["--concurrency", str(concurrency), "--requests", str(2 * concurrency + 4)]
    cmd += ["--max-tokens", str(max_tokens), "--busy", str(busy), "--json"]
    if top_logprobs is not None:
        cmd += ["--top-logprobs", str(top_logprobs)]
    cmd += extra
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"tokenmill bench printed nothing (exit {out.returncode})")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def ceiling_main(max_tokens: int, threads: int) -> None:
    """Child process: the engine alone, no HTTP. Says ``{"ready": true}`` once loaded and
    warm, then for each line on stdin (a number of sequences) runs them and prints one
    JSON line, until stdin ends."""
    from tokenmill.engines.base import ChatMessage, GenerationRequest, SamplingParams
    from tokenmill.engines.llamacpp import LlamaCppEngine

    async def measure(engine: LlamaCppEngine, n: int, seed: int) -> dict[str, float]:
        async def one(i: int) -> int:
            request = GenerationRequest(
                request_id=f"ceiling-{seed}-{i}",
                messages=(ChatMessage("user", CEILING_PROMPT),),
                sampling=SamplingParams(
                    max_tokens=max_tokens, temperature=0.7, top_k=40, top_p=0.95, seed=seed + i
                ),
            )
            tokens = 0
            async for chunk in engine.generate(request):
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - start
        return {"sequences": n, "tokens": sum(counts), "wall_s": wall, "tok_s": sum(counts) / wall}

    async def main() -> None:
        engine = LlamaCppEngine(max_num_seqs=SLOTS, n_ctx=N_CTX, n_threads=threads)
        await engine.start()
        try:
            await measure(engine, 2, 1)  # warm-up
            print(json.dumps({"ready": True}), flush=True)
            seed = 0
            while line := await asyncio.to_thread(sys.stdin.readline):
                seed += 100
                print(json.dumps(await measure(engine, int(line), seed)), flush=True)
        finally:
            await engine.close()

    asyncio.run(main())


class Ceiling:
    """The in-process ceiling: tokenmill's engine alone (no HTTP, no gateway, no client
    process) in a child kept loaded for the whole run, so that it is measured in turn
    with the servers, at the same moments of the machine, as often as they are."""

    name = "ceiling"

    def __init__(self, max_tokens: int, threads: int) -> None:
        cmd = [sys.executable, __file__, "--ceiling-child", "--max-tokens", str(max_tokens)]
        cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.runs: dict[int, list[float]] = {}
        self._answer()  # loaded and warm

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                return answer
        raise RuntimeError(f"the ceiling child exited ({self.proc.wait()})")

    def run(self, sequences: int) -> float:
        """``sequences`` at once, to the end; their tok/s (also kept in ``runs``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{sequences}\n")
        self.proc.stdin.flush()
        tok_s = float(self._answer()["tok_s"])
        self.runs.setdefault(sequences, []).append(tok_s)
        return tok_s

    def summary(self) -> dict[str, Any]:
        # The median, as for the servers' runs (before stop 23 it was the best of 2
        # runs made before any server started).
        return {
            str(n): {
                "tok_s": round(statistics.median(runs), 1),
                "best": round(max(runs), 1),
                "runs": [round(x, 1) for x in runs],
            }
            for n, runs in self.runs.items()
        }

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- profile ---------------------------------------------------------------------------


# -- report ------------------------------------------------------------------------------


def median(reports: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for r in reports:
        v: Any = r
        for k in keys:
            v = v[k]
        values.append(float(v))
    return statistics.median(values)


def table(results: dict[str, Any]) -> str:
    rows = [
        "",
        f"tokenmill vs llama-server: {results['model_file']} ({results['model_mb']:.0f} MB), "
        f"{results['threads']} threads, {SLOTS} slots x {N_CTX} tokens, "
        f"max_tokens {results['max_tokens']}, {results['reps']} runs each (medians)",
        "",
        f"{'conc':>4} | {'tok/s tm':>9} {'tok/s ls':>9} {'ratio':>6} | "
        f"{'TTFT50 tm':>9} {'TTFT50 ls':>9} {'diff ms':>8} {'ratio':>6} | "
        f"{'ITL50 tm':>8} {'ITL50 ls':>8} | {'TTFT99 tm':>9} {'TTFT99 ls':>9} | {'err':>7}",
        "-" * 132,
    ]
    for c, row in results["summary"].items():
        tm, ls = row["tokenmill"], row["llama-server"]
        rows.append(
            f"{c:>4} | {tm['tok_s']:>9.1f} {ls['tok_s']:>9.1f} {row['tok_s_ratio']:>6.2f} | "
            f"{tm['ttft_p50_ms']:>9.1f} {ls['ttft_p50_ms']:>9.1f} {row['ttft_p50_diff_ms']:>+8.1f} "
            f"{row['ttft_p50_ratio']:>6.2f} | {tm['itl_p50_ms']:>8.2f} {ls['itl_p50_ms']:>8.2f} | "
            f"{tm['ttft_p99_ms']:>9.1f} {ls['ttft_p99_ms']:>9.1f} | "
            f"{tm['errors']:>3}/{ls['errors']:<3}"
        )
    rows.append("")
    for c, row in results["summary"].items():
        tm, ls = row["tokenmill"], row["llama-server"]
        rows.append(
            f"  c={c:<3} runs tok/s  tokenmill {tm['tok_s_runs']}  llama-server {ls['tok_s_runs']}"
            f"   tokens/request tm {tm['tokens_per_request']} ls {ls['tokens_per_request']}"
        )
    rows.append(
        "\nCPU ms per output token (medians; all threads; 2 cores give 2 ms per ms of wall):"
    )
    for c, row in results["summary"].items():
        tm, ls = row["tokenmill"]["cpu_ms_per_token"], row["llama-server"]["cpu_ms_per_token"]
        rows.append(
            f"  c={c:<3} tokenmill gateway {tm['server']:.3f} + replica {tm['children']:.2f}"
            f" | llama-server {ls['server']:.2f}"
            f" | load generator (whole process) {tm['client']:.3f} / {ls['client']:.3f}"
        )
    contended = results.get("contended")
    if contended:
        rows.append(
            f"\nshared host: {results['busy']} busy loops beside the server during each run "
            "(medians; CPU ms per output token of the servers' own processes):"
        )
        for c, row in contended.items():
            tm, ls = row["tokenmill"], row["llama-server"]
            tm_cpu, ls_cpu = tm["cpu_ms_per_token"], ls["cpu_ms_per_token"]
            rows.append(
                f"  c={c:<3} tok/s {tm['tok_s']:.1f} / {ls['tok_s']:.1f} "
                f"(ratio {row['tok_s_ratio']:.2f})  TTFT p50 {tm['ttft_p50_ms']:.1f} / "
                f"{ls['ttft_p50_ms']:.1f} ms  CPU/token gateway {tm_cpu['server']:.3f} + "
                f"replica {tm_cpu['children']:.2f} | llama-server {ls_cpu['server']:.2f}  "
                f"runs {tm['tok_s_runs']} / {ls['tok_s_runs']}  "
                f"errors {tm['errors']}/{ls['errors']}"
            )
    first = results["summary"].get("1", {}).get("first_token_stages")
    if first:
        rows.append("")
        rows += stage_lines("1", first)
    turns = results.get("second_turn")
    if turns:
        rows += second_turn_lines(turns)
    ceil = results.get("ceiling")
    if ceil:
        rows.append(
            f"\nin-process ceiling (engine alone, no HTTP; medians of runs made in turn with "
            "the servers'): "
            f"1 seq {ceil['1']['tok_s']:.1f} tok/s {ceil['1']['runs']}, "
            f"{SLOTS} seqs {ceil[str(SLOTS)]['tok_s']:.1f} tok/s {ceil[str(SLOTS)]['runs']}"
        )
        for c in ("1", str(SLOTS)):
            row = results["summary"].get(c)
            if row and ceil[c]["tok_s"]:
                rows.append(
                    f"  c={c:<3} tok/s / ceiling: tokenmill "
                    f"{row['tokenmill']['tok_s'] / ceil[c]['tok_s']:.3f}, llama-server "
                    f"{row['llama-server']['tok_s'] / ceil[c]['tok_s']:.3f}"
                )
    cost = results.get("metrics_cost")
    if cost:
        rows.append(
            f"metrics cost at c={SLOTS}: on {cost['on_tok_s']:.1f} tok/s, "
            f"off {cost['off_tok_s']:.1f} tok/s, ratio on/off {cost['ratio']:.3f}"
        )
        rows.append(
            f"  runs tok/s  metrics on {cost['on_runs']}  off {cost['off_runs']}  "
            f"errors off {cost['errors_off']}"
        )
    if results.get("logprobs_cost"):
        rows += logprobs_lines(results["logprobs_cost"])
    mem = results["memory"]
    rows.append(
        f"memory (RSS, largest seen after a run; model file {results['model_mb']:.0f} MB, "
        f"KV cache {mem['kv_cache_mb']:.0f} MB for {SLOTS} x {N_CTX} f16 cells in each server):"
    )
    rows.append(
        f"  tokenmill gateway process {mem['gateway_mb']:.0f} MB "
        f"(peak {mem['gateway_peak_mb']:.0f} MB); model file mapped in it: "
        f"{'yes' if mem.get('gateway_maps_model') else 'no'}"
    )
    rows.append(
        f"  tokenmill replica process(es) {mem['replica_mb']:.0f} MB, "
        f"less model and KV cache {mem['replica_other_mb']:.0f} MB"
    )
    rows.append(
        f"  llama-server {mem['llama_server_mb']:.0f} MB, "
        f"less model and KV cache {mem['llama_server_other_mb']:.0f} MB"
    )
    rows.append("")
    for line in results["targets"]:
        rows.append(f"  {line}")
    prof = results.get("profile")
    if prof and "self" in prof:
        rows.append(f"\npy-spy on the gateway during a c={SLOTS} run ({prof['samples']} samples):")
        rows.append("  by thread: " + ", ".join(f"{n} {p}%" for n, p in prof["threads"]))
        rows.append("  self time:")
        rows += [f"    {p:5.1f}%  {n}" for n, p in prof["self"][:12]]
    return "\n".join(rows)


def second_turn_runs(tm: Server, ls: Server, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Two-turn chats at c=1 against tokenmill and llama-server in turn (who goes first
    alternating), the same conversations on each: fills ``out`` as they complete."""
    runs: dict[str, list[dict[str, Any]]] = out.setdefault("runs", {tm.name: [], ls.name: []})
    for rep in range(args.reps):
        order = (tm, ls) if rep % 2 == 0 else (ls, tm)
        for s in order:
            for k in range(args.second_turns):
                conversation = rep * args.second_turns + k
                result = second_turn(s.url, s.model, conversation, SAMPLING, args.turn_pause)
                runs[s.name].append(result)
        log(
            f"second turn rep {rep + 1}/{args.reps}: TTFT ms "
            + "  ".join(
                f"{s.name} {[r['ttft2_ms'] for r in runs[s.name][-args.second_turns :]]}"
                for s in (tm, ls)
            )
        )
    out["summary"] = {
        name: {
            "ttft1_p50_ms": statistics.median(r["ttft1_ms"] for r in rs),
            "ttft2_p50_ms": statistics.median(r["ttft2_ms"] for r in rs),
            "cached2_p50": statistics.median(r["cached2"] or 0 for r in rs),
            "prompt2_p50": statistics.median(r["prompt2"] or 0 for r in rs),
        }
        for name, rs in runs.items()
        if rs
    }


def second_turn_lines(turns: dict[str, Any]) -> list[str]:
    summary = turns.get("summary") or {}
    tm, ls = summary.get("tokenmill"), summary.get("llama-server")
    if not tm or not ls:
        return []
    return [
        f"\nsecond turn of a chat at c=1 (system prompt, a first exchange of "
        f"{turns['first_turn_tokens']} tokens, one new user message sent "
        f"{turns.get('pause_s', 0.0):g} s after the answer; llama-server with "
        f"cache_prompt), {len(turns['runs']['tokenmill'])} conversations each, p50:",
        f"  TTFT turn 2 tokenmill {tm['ttft2_p50_ms']:.1f} ms, llama-server "
        f"{ls['ttft2_p50_ms']:.1f} ms (diff {tm['ttft2_p50_ms'] - ls['ttft2_p50_ms']:+.1f} ms); "
        f"turn 1 {tm['ttft1_p50_ms']:.1f} / {ls['ttft1_p50_ms']:.1f} ms",
        f"  turn 2 prompt tokens {tm['prompt2_p50']:.0f} / {ls['prompt2_p50']:.0f}, cached "
        f"{tm['cached2_p50']:.0f} / {ls['cached2_p50']:.0f}",
    ]


def first_token_targets(results: dict[str, Any]) -> list[str]:
    """Issue #16's: one stream's TTFT and speed, and a chat's second turn."""
    out = []
    s1 = results["summary"].get("1")
    if s1:
        d = s1["ttft_p50_diff_ms"]
        out.append(
            f"{'PASS' if d <= 2.0 else 'MISS'} c=1 TTFT p50 {d:+.1f} ms vs llama-server "
            "(target <= +2 ms)"
        )
        ceil = (results.get("ceiling") or {}).get("1", {}).get("tok_s")
        if ceil:
            r = s1["tokenmill"]["tok_s"] / ceil
            out.append(
                f"{'PASS' if r >= 0.97 else 'MISS'} c=1 tok/s {r:.3f} of the in-process "
                "ceiling (target >= 0.97)"
            )
    summary = (results.get("second_turn") or {}).get("summary") or {}
    if "tokenmill" in summary and "llama-server" in summary:
        tm, ls = summary["tokenmill"]["ttft2_p50_ms"], summary["llama-server"]["ttft2_p50_ms"]
        out.append(
            f"{'PASS' if tm < ls else 'MISS'} second turn TTFT p50 {tm:.1f} ms vs "
            f"llama-server {ls:.1f} ms (target: lower)"
        )
    return out


def targets(
    summary: dict[str, Any],
    memory: dict[str, Any],
    health: dict[str, Any] | None,
    contended: dict[str, Any] | None = None,
) -> list[str]:
    def mark(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    out = []
    s16, s1 = summary.get(str(SLOTS)), summary.get("1")
    if s16:
        r = s16["tok_s_ratio"]
        out.append(f"{mark(r >= 1.2)} c={SLOTS} tok/s ratio {r:.2f} (target >= 1.20)")
    if s1:
        r, d = s1["tok_s_ratio"], s1["ttft_p50_diff_ms"]
        out.append(f"{mark(r >= 1.05)} c=1 tok/s ratio {r:.2f} (target >= 1.05)")
        out.append(f"{mark(d <= 5.0)} c=1 TTFT p50 {d:+.1f} ms vs llama-server (target <= +5 ms)")
    for c, row in (contended or {}).items():
        r = row["tok_s_ratio"]
        out.append(f"{mark(r >= 1.0)} shared host c={c} tok/s ratio {r:.2f} (target >= 1.00)")
    errors = sum(row["tokenmill"]["errors"] for row in summary.values())
    out.append(f"{mark(errors == 0)} tokenmill errors: {errors}")
    # The model and the KV cache live in the replica child: the gateway process alone is
    # the "gateway memory excluding the model" the target is about.
    gw = memory["gateway_mb"]
    out.append(f"{mark(gw < 150)} gateway process memory {gw:.0f} MB (target < 150)")
    if health and health.get("probes"):
        worst = health["max_ms"]
        out.append(
            f"{mark(worst <= HEALTH_TARGET_MS and not health['failures'])} GET /health during "
            f"c={SLOTS}: p50 {health['p50_ms']:.1f} ms, p99 {health['p99_ms']:.1f} ms, "
            f"max {worst:.1f} ms over {health['probes']} probes, {health['failures']} failed "
            f"(target <= {HEALTH_TARGET_MS:g} ms)"
        )
    return out


def server_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one server's runs at one level."""
    return {
        "tok_s": median(reports, "output_tokens_per_s"),
        "tok_s_runs": [r["output_tokens_per_s"] for r in reports],
        "req_s": median(reports, "requests_per_s"),
        "ttft_p50_ms": median(reports, "ttft_ms", "p50"),
        "ttft_p95_ms": median(reports, "ttft_ms", "p95"),
        "ttft_p99_ms": median(reports, "ttft_ms", "p99"),
        "itl_p50_ms": median(reports, "itl_ms", "p50"),
        "itl_p99_ms": median(reports, "itl_ms", "p99"),
        "errors": sum(r["errors"] for r in reports),
        "tokens_per_request": median(reports, "tokens_per_request", "mean"),
        "cpu_ms_per_token": {
            k: median(reports, "cpu_ms_per_token", k) for k in reports[0]["cpu_ms_per_token"]
        },
    }


def summarize(
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    name: str = "tokenmill",
    base: str = "llama-server",
) -> dict[str, Any]:
    """Per level: the medians of ``name`` and of ``base``, and ``name`` against ``base``."""
    summary: dict[str, Any] = {}
    # After an interruption a level may have runs of one server only: it has no ratio.
    for c in sorted(set(runs[name]) & set(runs[base])):
        row: dict[str, Any] = {n: server_summary(runs[n][c]) for n in (name, base)}
        tm, ls = row[name], row[base]
        row["tok_s_ratio"] = round(tm["tok_s"] / ls["tok_s"], 3) if ls["tok_s"] else 0.0
        row["ttft_p50_ratio"] = round(tm["ttft_p50_ms"] / ls["ttft_p50_ms"], 3)
        row["ttft_p50_diff_ms"] = round(tm["ttft_p50_ms"] - ls["ttft_p50_ms"], 2)
        stages = stage_summary(runs[name][c])
        if stages is not None:
            stages["tokenmill_ttft_p50_ms"] = tm["ttft_p50_ms"]
            stages["llama_server_ttft_p50_ms"] = ls["ttft_p50_ms"]
            row["first_token_stages"] = stages
        summary[str(c)] = row
    return summary


def metrics_cost(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any] | None:
    """Median c=SLOTS throughput of tokenmill with and without the metrics observer."""
    on, off = runs["tokenmill"].get(SLOTS), runs.get(METRICS_OFF, {}).get(SLOTS)
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


def logprobs_cost(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any] | None:
    """Median c=SLOTS throughput of tokenmill's plain runs and of its runs with logprobs
    (top ``LOGPROBS_TOP``) made right beside them on the same server; each run's CPU ms
    per token (gateway, replica, load generator) to show where the cost goes."""
    plain, lp = runs["tokenmill"].get(SLOTS), runs.get(LOGPROBS, {}).get(SLOTS)
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
        "top_logprobs": LOGPROBS_TOP,
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


def logprobs_lines(cost: dict[str, Any]) -> list[str]:
    """The table's rows for :func:`logprobs_cost`."""
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


def logprobs_target(cost: dict[str, Any] | None) -> list[str]:
    if not cost:
        return []
    r = cost["ratio"]
    ok = r >= LOGPROBS_RATIO_TARGET and not cost["errors_logprobs"]
    return [
        f"{'PASS' if ok else 'MISS'} c={SLOTS} logprobs (top {cost['top_logprobs']}) tok/s "
        f"{r:.3f} of plain ({100 * (r - 1):+.1f} %, target >= {LOGPROBS_RATIO_TARGET:.2f}: "
        f"at most {100 * (1 - LOGPROBS_RATIO_TARGET):.0f} % slower)"
    ]


def cpu_per_token(
    before: dict[str, float], after: dict[str, float], client_s: float, report: dict[str, Any]
) -> dict[str, float]:
    """CPU milliseconds per output token of one run: the server process (tokenmill's
    gateway; all of llama-server), its children (tokenmill's replica) and the load
    generator. With two cores, every one of them is taken from llama.cpp's threads.

    Any other key of ``before`` / ``after`` is a group of processes of the server's tree
    (:attr:`Server.cpu_groups`): each gets its figure, and ``other`` is the rest of the
    tree (the server process and its descendants less every group)."""
    tokens = max(1, int(report["output_tokens"]))

    def ms(key: str) -> float:
        return round((after[key] - before[key]) * 1000 / tokens, 3)

    out = {"server": ms("process"), "children": ms("children")}
    groups = [k for k in after if k not in ("process", "children")]
    for k in groups:
        out[k] = ms(k)
    if groups:
        out["other"] = round(out["server"] + out["children"] - sum(out[k] for k in groups), 3)
    out["client"] = round(client_s * 1000 / tokens, 3)
    return out


def one_run(
    s: Server,
    c: int,
    max_tokens: int,
    busy: int = 0,
    top_logprobs: int | None = None,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One ``tokenmill bench`` run against ``s``, with the CPU it cost per token (and
    for tokenmill, its requests' first-token stages from its log)."""
    offset = log_size(s.log_path)
    before, client_before = cpu_split(s.proc.pid, s.cpu_groups), client_cpu_seconds()
    report = run_bench(s, c, max_tokens, busy, top_logprobs, extra)
    after = cpu_split(s.proc.pid, s.cpu_groups)
    report["cpu_ms_per_token"] = cpu_per_token(
        before, after, client_cpu_seconds() - client_before, report
    )
    if s.name.startswith(("tokenmill", "tm-")):
        # A request's line is logged once it is settled, just after its [DONE].
        deadline = time.monotonic() + 2.0
        stages = read_stages(s.log_path, offset)
        while len(stages) < report["completed"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stages = read_stages(s.log_path, offset)
        report["stages_ms"] = stages
    return report


def interleaved(
    servers: Sequence[T], levels: list[int] | tuple[int, ...], reps: int
) -> Iterator[tuple[int, int, T]]:
    """(rep, concurrency, server) in the order runs are made: every server at each
    level in turn, never two at once, and who goes first alternating from one
    repetition to the next, so that a slow phase of a shared machine hits all alike."""
    for rep in range(reps):
        order = servers[::-1] if rep % 2 else servers
        for c in levels:
            for s in order:
                yield rep, c, s


def log_run(label: str, rep: int, reps: int, c: int, name: str, report: dict[str, Any]) -> None:
    log(
        f"{label}rep {rep + 1}/{reps} c={c:<2} {name:<19} "
        f"{report['output_tokens_per_s']:7.1f} tok/s  "
        f"TTFT p50 {report['ttft_ms']['p50']:7.1f} ms  "
        f"errors {report['errors']}"
    )


def measure_contended(
    servers: list[Server],
    args: argparse.Namespace,
    runs: dict[str, dict[int, list[dict[str, Any]]]],
) -> None:
    """The shared host: the same runs with ``args.busy`` busy loops beside the server.

    The loops spin at ordinary priority for the length of each run (``tokenmill bench
    --busy``); each server meets the same number, in turn, alternating who goes first.
    """
    for rep, c, s in interleaved(servers[:2], CONTENDED_LEVELS, args.contended_reps):
        report = one_run(s, c, args.max_tokens, args.busy)
        runs[s.name].setdefault(c, []).append(report)
        log_run(f"contended ({args.busy} busy loops) ", rep, args.contended_reps, c, s.name, report)


def logprobs_run(
    s: Server, args: argparse.Namespace, runs: dict[str, dict[int, list[dict[str, Any]]]], rep: int
) -> None:
    """One c=SLOTS run against ``s`` where every request asks for logprobs (top
    ``LOGPROBS_TOP``), filed under ``LOGPROBS``."""
    report = one_run(s, SLOTS, args.max_tokens, top_logprobs=LOGPROBS_TOP)
    runs.setdefault(LOGPROBS, {}).setdefault(SLOTS, []).append(report)
    log_run("", rep, args.reps, SLOTS, LOGPROBS, report)


def measure(
    servers: list[Server],
    levels: list[int],
    args: argparse.Namespace,
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    mem: dict[str, dict[str, float]],
    health: list[HealthProbe],
    ceiling: Ceiling | None = None,
) -> None:
    """Fill ``runs``, ``mem`` and ``health`` as runs complete, so an interruption
    keeps them. With ``ceiling``, it runs at c=1 and c=SLOTS in turn with the servers.

    A server named ``METRICS_OFF`` runs at c=SLOTS only, always next to the metrics-on
    tokenmill, so the on/off pair sees the same moment of the machine. During
    tokenmill's c=SLOTS runs a probe times ``GET /health``. Unless
    ``args.no_logprobs_cost``, each of those runs has a twin with logprobs on the same
    server (``LOGPROBS`` in ``runs``) right before or after it, alternately.
    """
    tm, ls, *off = servers
    every: list[Server | Ceiling] = [*off, tm, ls, *([ceiling] if ceiling else [])]
    for rep, c, s in interleaved(every, levels, args.reps):
        if isinstance(s, Ceiling):
            if c in (1, SLOTS):
                log(f"rep {rep + 1}/{args.reps} c={c:<2} {s.name:<19} {s.run(c):7.1f} tok/s")
            continue
        if s.name == METRICS_OFF and c != SLOTS:
            continue
        if s is tm and c == SLOTS:
            twin = not args.no_logprobs_cost
            if twin and rep % 2 == 1:
                logprobs_run(s, args, runs, rep)
            with HealthProbe(s.url) as probe:
                report = one_run(s, c, args.max_tokens)
            health.append(probe)
            if twin and rep % 2 == 0:
                logprobs_run(s, args, runs, rep)
        else:
            report = one_run(s, c, args.max_tokens)
        runs[s.name].setdefault(c, []).append(report)
        # Each figure's largest value seen after a run.
        for key, value in memory_mb(s.proc.pid).items():
            mem[s.name][key] = max(value, mem[s.name].get(key, 0.0))
        log_run("", rep, args.reps, c, s.name, report)


def logprobs_section(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """``--only-logprobs``: one tokenmill server as in the main runs, at c=SLOTS, each
    plain run next to one with logprobs (top ``LOGPROBS_TOP``), who goes first
    alternating from one repetition to the next."""
    out: dict[str, Any] = {"reps": args.reps, "top_logprobs": LOGPROBS_TOP}
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
    cmd += ["--data-dir", str(tmp / "data")]
    s = Server("tokenmill", cmd, port, tmp / "tokenmill.log")
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {s.name: {}, LOGPROBS: {}}
    try:
        s.wait_ready()
        s.warm_up()
        log(f"{s.name} ready on {s.url} (model {s.model!r})")
        try:
            for rep in range(args.reps):
                if rep % 2 == 1:
                    logprobs_run(s, args, runs, rep)
                report = one_run(s, SLOTS, args.max_tokens)
                runs[s.name].setdefault(SLOTS, []).append(report)
                log_run("", rep, args.reps, SLOTS, s.name, report)
                if rep % 2 == 0:
                    logprobs_run(s, args, runs, rep)
        except KeyboardInterrupt:
            out["interrupted"] = True
            log("interrupted: reporting the runs completed so far")
    finally:
        s.stop()
    out["runs"] = {name: {str(c): r for c, r in by_c.items()} for name, by_c in runs.items()}
    out["cost"] = logprobs_cost(runs)
    out["targets"] = logprobs_target(out["cost"])
    return out


def constrained_section(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Structured outputs' cost (see bench/constrained.py) on one tokenmill server."""

    def start() -> Server:
        port = free_port()
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
        cmd += ["--data-dir", str(tmp / "data-constrained")]
        s = Server("tokenmill", cmd, port, tmp / "tokenmill-constrained.log")
        s.wait_ready()
        s.warm_up()
        log(f"{s.name} ready on {s.url} (model {s.model!r})")
        return s

    def run(s: Server, extra: tuple[str, ...]) -> dict[str, Any]:
        return one_run(s, SLOTS, args.max_tokens, extra=extra)

    return constrained.section(args.reps, SLOTS, start, run, log, tmp)


def logprobs_table(results: dict[str, Any]) -> str:
    lp = results["logprobs"]
    rows = [
        "",
        f"tokenmill with and without logprobs: {results['model_file']}, "
        f"{results['threads']} threads, max_tokens {results['max_tokens']}, "
        f"{lp['reps']} runs each at c={SLOTS} (medians)",
        "",
    ]
    if lp["cost"]:
        rows += logprobs_lines(lp["cost"])
    rows.append("")
    rows += [f"  {line}" for line in lp["targets"]]
    return "\n".join(rows)


# -- Ray: the replica as a Ray actor, and the gateway behind Ray Serve -------------------

RAY_LEVELS = (1, SLOTS)
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


def ray_servers(args: argparse.Namespace, tmp: Path) -> list[Server]:
    """tokenmill with a process replica, with a Ray replica, and one gateway cell on Ray
    Serve (process replica): the same model, threads and slots."""
    # "local" through RAY_ADDRESS too: ray.init() with no address joins the cluster named
    # in /tmp/ray/ray_current_cluster (anyone's `ray start` on this host) if there is one.
    ray_env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local"}
    process_cfg = deployment_toml(tmp / "process.toml", args.threads, "process")
    ray_cfg = deployment_toml(tmp / "ray.toml", args.threads, "ray")
    servers = []
    for name, cfg, extra in (
        (PROCESS, process_cfg, []),
        (RAY, ray_cfg, []),
        (SERVE, process_cfg, ["--ray-serve", "--cells", "1"]),
    ):
        port = free_port()
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
        cmd += ["--config", str(cfg), "--data-dir", str(tmp / f"data-{name}"), *extra]
        env = ray_env if name != PROCESS else {}
        servers.append(Server(name, cmd, port, tmp / f"{name}.log", env))
    return servers


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


def ray_targets(summary: dict[str, Any]) -> list[str]:
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


def ray_stage_lines(stages: dict[str, dict[str, Any]]) -> list[str]:
    """Per level, each first-token stage's p50 for the process replica and the Ray one."""
    rows = ["\nfirst token, p50 per stage (ms; tokenmill.stages), process / ray:"]
    for c in map(str, RAY_LEVELS):
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


def ray_table(results: dict[str, Any]) -> str:
    ray = results["ray"]
    rows = [
        "",
        f"Ray: tokenmill's replica as a child process (process), as a Ray actor on a private "
        f"local Ray instance (ray), and one gateway cell behind Ray Serve's proxy (serve, "
        f"process replica); {results['model_file']}, {results['threads']} threads, {SLOTS} "
        f"slots x {N_CTX} tokens, max_tokens {results['max_tokens']}, {ray['reps']} runs each "
        "(medians)",
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
    rows += ray_stage_lines(ray.get("stages") or {})
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


def ray_section(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The Ray replica and Serve's proxy path, each against a process replica."""
    out: dict[str, Any] = {"reps": args.reps, "levels": list(RAY_LEVELS)}
    servers = ray_servers(args, tmp)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {s.name: {} for s in servers}
    try:
        for s in servers:
            s.wait_ready()
            s.warm_up()
            out.setdefault("pids", {})[s.name] = locate(s)
            log(f"{s.name} ready on {s.url}: {s.cpu_groups}")
        try:
            for rep, c, s in interleaved(servers, RAY_LEVELS, args.reps):
                report = one_run(s, c, args.max_tokens)
                runs[s.name].setdefault(c, []).append(report)
                log_run("ray ", rep, args.reps, c, s.name, report)
        except KeyboardInterrupt:
            out["interrupted"] = True
            log("interrupted: reporting the Ray runs completed so far")
    finally:
        left = {}
        for s in servers:
            # Serve drains its cell first: give it longer than a plain gateway.
            survived = s.stop(timeout=60.0)
            if survived:
                left[s.name] = survived
                log(f"{s.name}: still running after it exited, killed: {survived}")
        out["left_running"] = left
    out["runs"] = {name: {str(c): r for c, r in by_c.items()} for name, by_c in runs.items()}
    out["summary"] = {
        "ray": summarize(runs, RAY, PROCESS),
        "serve": summarize(runs, SERVE, PROCESS),
    }
    out["targets"] = ray_targets(out["summary"])
    # The first token's stages (p50 over every request of a level's runs) of the process
    # and the Ray replica: where a difference in TTFT lies. A Ray replica's own stages
    # are there because its node is this host (same clock).
    out["stages"] = {
        name: {str(c): stage_summary(reports) for c, reports in runs[name].items()}
        for name in (PROCESS, RAY)
    }
    return out


def llama_server_section(
    args: argparse.Namespace,
    levels: list[int],
    binary: Path,
    gguf: Path,
    results: dict[str, Any],
    tmp: Path,
    ceiling: Ceiling | None,
) -> None:
    """tokenmill against llama-server (and tokenmill without metrics), and the
    in-process ceiling in turn with them: fills ``results``."""
    from tokenmill.engines.threads import extra_buffers_work

    model_mb = results["model_mb"]
    servers: list[Server] = []
    try:
        port = free_port()
        tm_cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
        tm_cmd += ["--data-dir", str(tmp / "data")]
        servers.append(Server("tokenmill", tm_cmd, port, tmp / "tokenmill.log"))
        port = free_port()
        ls_cmd = [str(binary), "-m", str(gguf), "-t", str(args.threads)]
        ls_cmd += ["-tb", str(args.threads), "-np", str(SLOTS), "-c", str(SLOTS * N_CTX)]
        ls_cmd += ["--host", "127.0.0.1", "--port", str(port)]
        if not extra_buffers_work():  # as tokenmill loads the model (see threads.py)
            ls_cmd.append("--no-repack")
        servers.append(Server("llama-server", ls_cmd, port, tmp / "llama-server.log"))
        if SLOTS in levels and not args.no_metrics_cost:
            port = free_port()
            off_cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port)]
            off_cmd += ["--data-dir", str(tmp / "data-nometrics")]
            off_env = {"TOKENMILL_METRICS": "0"}
            off_log = tmp / "tokenmill-nometrics.log"
            servers.append(Server(METRICS_OFF, off_cmd, port, off_log, off_env))
        for s in servers:
            s.wait_ready()
            s.warm_up()
            log(f"{s.name} ready on {s.url} (model {s.model!r})")

        runs: dict[str, dict[int, list[dict[str, Any]]]] = {s.name: {} for s in servers}
        mem: dict[str, dict[str, float]] = {s.name: {} for s in servers}
        health: list[HealthProbe] = []
        contended: dict[str, dict[int, list[dict[str, Any]]]] = {s.name: {} for s in servers[:2]}
        turns: dict[str, Any] = {
            "first_turn_tokens": FIRST_TURN_TOKENS,
            "pause_s": args.turn_pause,
        }
        try:
            measure(servers, levels, args, runs, mem, health, ceiling)
            if args.second_turns > 0:
                second_turn_runs(servers[0], servers[1], args, turns)
            if args.busy > 0:
                measure_contended(servers, args, contended)
        except KeyboardInterrupt:
            # Stopped early (Ctrl-C, SIGTERM from a timeout): report what was measured.
            results["interrupted"] = True
            log("interrupted: reporting the runs completed so far")
        if ceiling is not None and ceiling.runs:
            results["ceiling"] = ceiling.summary()
            log(f"ceiling: {results['ceiling']}")
        for s in servers:
            mem[s.name] = mem[s.name] or memory_mb(s.proc.pid)
        results["runs"] = {
            name: {str(c): r for c, r in by_c.items()} for name, by_c in runs.items()
        }
        if turns.get("summary"):
            results["second_turn"] = turns
        results["summary"] = summarize(runs)
        results["busy"] = args.busy
        results["contended_runs"] = {
            name: {str(c): r for c, r in by_c.items()} for name, by_c in contended.items()
        }
        results["contended"] = summarize(contended)
        results["metrics_cost"] = metrics_cost(runs)
        results["logprobs_cost"] = logprobs_cost(runs)
        kv = kv_cache(gguf, SLOTS * N_CTX)
        kv_mb = kv["kv_mb"]
        tm_mem, ls_mem = mem["tokenmill"], mem["llama-server"]
        results["memory"] = {
            **mem,
            "kv_cache": kv,
            "kv_cache_mb": round(kv_mb, 1),
            "gateway_mb": round(tm_mem["rss_mb"], 1),
            "gateway_peak_mb": round(tm_mem["hwm_mb"], 1),
            "replica_mb": round(tm_mem["children_rss_mb"], 1),
            "replica_other_mb": round(tm_mem["children_rss_mb"] - model_mb - kv_mb, 1),
            "llama_server_mb": round(ls_mem["tree_rss_mb"], 1),
            "llama_server_other_mb": round(ls_mem["tree_rss_mb"] - model_mb - kv_mb, 1),
        }
        # Checked, not assumed: the gateway process must not have the model mapped.
        results["memory"]["gateway_maps_model"] = maps_file(servers[0].proc.pid, gguf)
        if health:
            results["health"] = health_summary(health)
        results["targets"] = targets(
            results["summary"], results["memory"], results.get("health"), results["contended"]
        ) + logprobs_target(results["logprobs_cost"])
        results["targets"] += first_token_targets(results)
        if not args.no_profile and not results.get("interrupted"):
            tm_server = servers[0]
            if py_spy() is None:
                log("py-spy not installed: no profile (pip install py-spy to get one)")
            else:
                log(f"profiling the gateway with py-spy during one more c={SLOTS} run")
                results["profile"] = profile(
                    tm_server.proc.pid,
                    lambda: run_bench(tm_server, SLOTS, args.max_tokens),
                    CACHE / "profile-c16.txt",
                )
    finally:
        for s in servers:
            s.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=3, help="runs per server and concurrency")
    parser.add_argument("--concurrency", default=f"1,4,{SLOTS}", help="comma-separated levels")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
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
        "--no-ray", action="store_true", help="skip the Ray replica and Ray Serve runs"
    )
    parser.add_argument(
        "--only-ray",
        action="store_true",
        help="only the Ray replica and Ray Serve runs (against a process replica)",
    )
    parser.add_argument(
        "--no-logprobs-cost",
        action="store_true",
        help=f"skip tokenmill's c={SLOTS} runs with logprobs (top {LOGPROBS_TOP})",
    )
    parser.add_argument(
        "--only-logprobs",
        action="store_true",
        help=f"only tokenmill's c={SLOTS} runs with and without logprobs (top {LOGPROBS_TOP}), "
        "interleaved on one server",
    )
    parser.add_argument(
        "--no-constrained",
        action="store_true",
        help=f"skip tokenmill's c={SLOTS} runs with and without a JSON-schema constraint",
    )
    parser.add_argument(
        "--only-constrained",
        action="store_true",
        help=f"only tokenmill's c={SLOTS} runs with and without a JSON-schema constraint "
        "(bench/schemas/people.json), interleaved on one server, and the mask's own cost",
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
    parser.add_argument("--ceiling-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kv-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kv-ctx", type=int, default=SLOTS * N_CTX, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ceiling_child:
        ceiling_main(args.max_tokens, args.threads)
        return 0
    if args.kv_child:
        kv_child(args.kv_child, args.kv_ctx)
        return 0

    from tokenmill.engines.llamacpp import embedded_model_path

    levels = [int(x) for x in args.concurrency.split(",")]
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
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if args.only_logprobs:
        tmp = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
        results["logprobs"] = logprobs_section(args, tmp)
        out_file = CACHE / "logprobs.json"
        out_file.write_text(json.dumps(results, indent=2))
        print(logprobs_table(results), flush=True)
        print(f"\nfull results: {out_file}", flush=True)
        return 0
    if args.only_constrained:
        results["constrained"] = constrained_section(args, Path(tempfile.mkdtemp()))
        out_file = CACHE / "constrained.json"
        out_file.write_text(json.dumps(results, indent=2))
        print(constrained.table(results, SLOTS), flush=True)
        print(f"\nfull results: {out_file}", flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
    if not args.only_ray:
        log("llama-server: building if not cached (several minutes the first time)")
        binary = llama_server_binary()
        results["llama_server"] = str(binary)
        ceiling = None
        if not args.no_ceiling:
            log("in-process ceiling: the engine alone, loaded beside the servers")
            ceiling = Ceiling(args.max_tokens, args.threads)
        try:
            llama_server_section(args, levels, binary, gguf, results, tmp, ceiling)
        finally:
            if ceiling is not None:
                ceiling.close()
    if not (args.no_constrained or args.only_ray or results.get("interrupted")):
        log("structured outputs: plain and JSON-schema runs on one tokenmill, in turn")
        results["constrained"] = constrained_section(args, tmp)
    if not args.no_ray and not results.get("interrupted"):
        if importlib.util.find_spec("ray") is None:
            log("ray not installed: no Ray runs (pip install 'tokenmill[ray]')")
        else:
            log("Ray: a process replica, a Ray replica and a Ray Serve cell, in turn")
            results["ray"] = ray_section(args, tmp)
    out_file = CACHE / ("ray.json" if args.only_ray else "last.json")
    out_file.write_text(json.dumps(results, indent=2))
    if not args.only_ray:
        print(table(results), flush=True)
    if "constrained" in results:
        print(constrained.table(results, SLOTS), flush=True)
    if "ray" in results:
        print(ray_table(results), flush=True)
    print(f"\nfull results: {out_file}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
