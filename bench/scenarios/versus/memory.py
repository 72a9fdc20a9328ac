"""Memory: tokenmill's gateway process alone, its replica less model and KV cache, and
llama-server's process beside them (RSS, the largest seen after a run).

The gateway process alone is what the target is about: the model and the KV cache live
in the replica child, and the gateway must not even have the model file mapped.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from probes import maps_file, memory_mb
from servers import N_CTX, ROOT, SLOTS, Server, log
from summary import mark

GATEWAY_TARGET_MB = 150


def kv_child(gguf: Path, n_ctx: int) -> None:
    """Child process: print the f16 KV cache size, in MiB, for ``n_ctx`` cells of ``gguf``.

    llama-server at its default verbosity no longer logs its KV buffer, so the size is
    computed from the model's shape: both servers allocate the same cells (16 x 2048) of
    the same type (f16, the default in each), so the figure holds for both.
    """
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
    run_py = ROOT / "bench" / "run.py"
    cmd = [sys.executable, str(run_py), "--kv-child", str(gguf), "--kv-ctx", str(n_ctx)]
    # llama.cpp logs the model load on stderr: not part of the report.
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        log(f"KV cache size: the child exited with {out.returncode}; counted as 0")
        return {"kv_mb": 0.0}
    info: dict[str, Any] = json.loads(lines[-1])
    return info


def keep_largest(mem: dict[str, float], pid: int) -> None:
    """After a run: each figure's largest value seen so far."""
    for key, value in memory_mb(pid).items():
        mem[key] = max(value, mem.get(key, 0.0))


def summary(
    mem: dict[str, dict[str, float]], tm: Server, gguf: Path, model_mb: float
) -> dict[str, Any]:
    """``mem`` (per server, see :func:`keep_largest`) with the model and KV cache taken off."""
    kv = kv_cache(gguf, SLOTS * N_CTX)
    kv_mb = kv["kv_mb"]
    tm_mem, ls_mem = mem["tokenmill"], mem["llama-server"]
    return {
        **mem,
        "kv_cache": kv,
        "kv_cache_mb": round(kv_mb, 1),
        "gateway_mb": round(tm_mem["rss_mb"], 1),
        "gateway_peak_mb": round(tm_mem["hwm_mb"], 1),
        "replica_mb": round(tm_mem["children_rss_mb"], 1),
        "replica_other_mb": round(tm_mem["children_rss_mb"] - model_mb - kv_mb, 1),
        "llama_server_mb": round(ls_mem["tree_rss_mb"], 1),
        "llama_server_other_mb": round(ls_mem["tree_rss_mb"] - model_mb - kv_mb, 1),
        # Checked, not assumed: the gateway process must not have the model mapped.
        "gateway_maps_model": maps_file(tm.proc.pid, gguf),
    }


def lines(results: dict[str, Any]) -> list[str]:
    mem = results["memory"]
    return [
        f"memory (RSS, largest seen after a run; model file {results['model_mb']:.0f} MB, "
        f"KV cache {mem['kv_cache_mb']:.0f} MB for {SLOTS} x {N_CTX} f16 cells in each server):",
        f"  tokenmill gateway process {mem['gateway_mb']:.0f} MB "
        f"(peak {mem['gateway_peak_mb']:.0f} MB); model file mapped in it: "
        f"{'yes' if mem.get('gateway_maps_model') else 'no'}",
        f"  tokenmill replica process(es) {mem['replica_mb']:.0f} MB, "
        f"less model and KV cache {mem['replica_other_mb']:.0f} MB",
        f"  llama-server {mem['llama_server_mb']:.0f} MB, "
        f"less model and KV cache {mem['llama_server_other_mb']:.0f} MB",
    ]


def targets(results: dict[str, Any]) -> list[str]:
    # The model and the KV cache live in the replica child: the gateway process alone is
    # the "gateway memory excluding the model" the target is about.
    gw = results["memory"]["gateway_mb"]
    return [f"{mark(gw < GATEWAY_TARGET_MB)} gateway process memory {gw:.0f} MB (target < 150)"]
