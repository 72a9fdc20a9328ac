"""The in-process ceiling: tokenmill's llama.cpp engine driven directly with asyncio.

No HTTP, no gateway, no client process: the engine alone at 1 and ``SLOTS`` concurrent
sequences, in a child process of its own (``bench/run.py --ceiling-child``) kept loaded
for the whole run, so that it is measured in turn with the servers, at the same moments
of the machine, as often as they are (medians, like theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from servers import N_CTX, ROOT, SLOTS
from summary import mark

if TYPE_CHECKING:
    from tokenmill.engines.llamacpp import LlamaCppEngine

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# The levels it runs at (of the levels the servers run at).
LEVELS = (1, SLOTS)
# Issue #16's: one stream through the whole gateway against the engine alone.
C1_RATIO_TARGET = 0.97


def child_main(max_tokens: int, threads: int) -> None:
    """Child process: the engine alone, no HTTP. Says ``{"ready": true}`` once loaded and
    warm, then for each line on stdin (a number of sequences) runs them and prints one
    JSON line, until stdin ends."""
    from tokenmill.engines import ChatMessage, GenerationRequest, SamplingParams
    from tokenmill.engines.llamacpp import LlamaCppEngine

    async def measure(engine: LlamaCppEngine, n: int, seed: int) -> dict[str, float]:
        async def one(i: int) -> int:
            request = GenerationRequest(
                request_id=f"ceiling-{seed}-{i}",
                messages=(ChatMessage("user", PROMPT),),
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
    """The child, loaded and warm; :meth:`run` measures it once."""

    name = "ceiling"

    def __init__(self, max_tokens: int, threads: int) -> None:
        cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--ceiling-child"]
        cmd += ["--max-tokens", str(max_tokens), "--threads", str(threads)]
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


def lines(results: dict[str, Any]) -> list[str]:
    ceil = results.get("ceiling")
    if not ceil:
        return []
    # After an interruption it may have run at one level only.
    levels = [str(c) for c in LEVELS if str(c) in ceil]
    rows = [
        "\nin-process ceiling (engine alone, no HTTP; medians of runs made in turn with "
        "the servers'): "
        + ", ".join(
            f"{c} seq{'s' if c != '1' else ''} {ceil[c]['tok_s']:.1f} tok/s {ceil[c]['runs']}"
            for c in levels
        )
    ]
    for c in levels:
        row = results["summary"].get(c)
        if row and ceil[c]["tok_s"]:
            rows.append(
                f"  c={c:<3} tok/s / ceiling: tokenmill "
                f"{row['tokenmill']['tok_s'] / ceil[c]['tok_s']:.3f}, llama-server "
                f"{row['llama-server']['tok_s'] / ceil[c]['tok_s']:.3f}"
            )
    return rows


def targets(results: dict[str, Any]) -> list[str]:
    s1 = results["summary"].get("1")
    ceil = (results.get("ceiling") or {}).get("1", {}).get("tok_s")
    if not s1 or not ceil:
        return []
    r = s1["tokenmill"]["tok_s"] / ceil
    return [
        f"{mark(r >= C1_RATIO_TARGET)} c=1 tok/s {r:.3f} of the in-process ceiling "
        f"(target >= {C1_RATIO_TARGET})"
    ]
