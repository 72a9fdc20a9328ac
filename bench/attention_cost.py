"""Where a long prompt's time goes at depth, by llama.cpp's attention settings: the
measurement behind keeping flash attention at llama.cpp's default and the KV cache in
F16 (issues 47 and 49).

At llama.cpp's C API (one :class:`~tokenmill.engines.llamacpp.context.LlamaContext`,
one sequence, 2 threads, 512-token ubatches): the sequence is filled to DEPTH tokens,
then a 512-row chunk and eight one-row steps are timed after it, three times. Each
configuration is a fresh context: flash attention on or off, and the K and V cache
types (F16, or Q8_0 as llama-server's ``-ctk``/``-ctv`` make them). The context
parameters are set by wrapping ``llama_context_default_params`` for the context's
creation, since tokenmill itself does not offer these settings.

``python bench/attention_cost.py [DEPTH] [CONFIG,...]`` (default 8192, every config:
fa-f16, nofa-f16, fa-q8, fa-k8); minutes a config at 8k (the fill is timed too).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import llama_cpp as ll
from span_cost import fill, served_file

from tokenmill.engines.llamacpp import context as context_module

CHUNK = 512
F16, Q8_0 = 1, 8  # ggml types
# name: (flash_attn_type, type_k, type_v); flash_attn_type 1 on, 0 off
CONFIGS = {
    "fa-f16": (1, F16, F16),
    "nofa-f16": (0, F16, F16),
    "fa-q8": (1, Q8_0, Q8_0),
    "fa-k8": (1, Q8_0, F16),
}


def main() -> None:
    depth = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CONFIGS)
    path = served_file()
    default_params = ll.llama_context_default_params
    for name in names:
        fa, type_k, type_v = CONFIGS[name]

        def params(fa: int = fa, type_k: int = type_k, type_v: int = type_v) -> Any:
            p = default_params()
            p.flash_attn_type, p.type_k, p.type_v = fa, type_k, type_v
            return p

        context_module.ll.llama_context_default_params = params
        try:
            context = context_module.LlamaContext(
                path,
                n_slots=1,
                n_ctx_seq=depth + 1024,
                n_threads=2,
                batch_size=CHUNK,
                pool_tokens=depth + 1024,
            )
        finally:
            context_module.ll.llama_context_default_params = default_params
        started = time.perf_counter()
        for start in range(0, depth, CHUNK):
            fill(context, [(100 + (start + i) % 1000, start + i, 0) for i in range(CHUNK)])
        filled = time.perf_counter() - started
        chunks, steps = [], []
        for _ in range(3):
            t = time.perf_counter()
            fill(context, [(400 + i, depth + i, 0) for i in range(CHUNK)])
            chunks.append(time.perf_counter() - t)
            context.drop(0, depth)
            for k in range(8):
                t = time.perf_counter()
                fill(context, [(500 + k, depth + k, 0)])
                steps.append(time.perf_counter() - t)
            context.drop(0, depth)
        print(
            f"{name} at depth {depth}: fill {filled:.1f} s; a 512-row chunk "
            f"{[round(x * 1000) for x in chunks]} ms; a one-row step "
            f"{statistics.median(steps) * 1000:.1f} ms (median of {len(steps)})",
            flush=True,
        )
        context.close()


if __name__ == "__main__":
    main()
