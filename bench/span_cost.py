"""What another sequence's cells in a unified pool cost a prompt row, and what parking a
cell costs: the measurement behind ``placement.SPAN_PREFILL_MIN``.

At llama.cpp's C API (through :class:`~tokenmill.engines.llamacpp.context.LlamaContext`):
sequence 0 holds 2,048 tokens; a 512-row chunk of it is timed alone and with 4,096
cells of sequence 1 in the pool above it, four times each, interleaved. Then sequence
0's state is saved and restored five times. ``python bench/span_cost.py [GGUF]``
(default: the file the embedded deployment serves).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from tokenmill.config.settings import default_data_dir
from tokenmill.engines.embedded import embedded_model_path
from tokenmill.engines.llamacpp.context import LlamaContext
from tokenmill.engines.llamacpp.weights import served_weights

CACHED, CHUNK, FOREIGN = 2048, 512, 4096


def served_file() -> Path:
    """The file the embedded deployment serves at its defaults (made if not cached)."""
    weights = default_data_dir() / "weights"
    return served_weights(embedded_model_path(), None, weights, embedded=True).served


def fill(context: LlamaContext, rows: list[tuple[int, int, int]]) -> None:
    for i, (token, pos, seq) in enumerate(rows):
        context.add(i, token, pos, seq, False)
    if context.decode(len(rows)) != 0:
        raise RuntimeError("llama_decode failed")


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else served_file()
    context = LlamaContext(
        path, n_slots=4, n_ctx_seq=8192, n_threads=2, batch_size=CHUNK, pool_tokens=16384
    )
    for start in range(0, CACHED, CHUNK):
        fill(context, [(100 + (start + i) % 1000, start + i, 0) for i in range(CHUNK)])
    times: dict[str, list[float]] = {"alone": [], "foreign": []}
    for rep in range(4):
        for mode in ("alone", "foreign") if rep % 2 == 0 else ("foreign", "alone"):
            context.drop(1, -1)
            if mode == "foreign":
                for start in range(0, FOREIGN, CHUNK):
                    fill(context, [(300, start + i, 1) for i in range(CHUNK)])
            t = time.perf_counter()
            fill(context, [(400 + i, CACHED + i, 0) for i in range(CHUNK)])
            times[mode].append(time.perf_counter() - t)
            context.drop(0, CACHED)
    alone, foreign = statistics.median(times["alone"]), statistics.median(times["foreign"])
    print("chunk ms alone", [round(x * 1000) for x in times["alone"]])
    print("chunk ms with foreign cells", [round(x * 1000) for x in times["foreign"]])
    print(f"a foreign cell, per prompt row: {(foreign - alone) / (CHUNK * FOREIGN) * 1e9:.0f} ns")
    context.drop(1, -1)
    saves, restores = [], []
    for _ in range(5):
        t = time.perf_counter()
        state = context.save_seq(0)
        saves.append(time.perf_counter() - t)
        assert state is not None
        t = time.perf_counter()
        if not context.restore_seq(2, state):
            raise RuntimeError("restore refused")
        restores.append(time.perf_counter() - t)
        context.drop(2, -1)
    park, back = statistics.median(saves), statistics.median(restores)
    print(f"park {park / CACHED * 1e6:.1f} us a cell, restore {back / CACHED * 1e6:.1f} us a cell")
    context.close()


if __name__ == "__main__":
    main()
