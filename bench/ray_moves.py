"""What a KV move between two Ray replicas costs, through Ray's object store and
through the gateway's connections, side by side.

Run: .venv/bin/python bench/ray_moves.py [--tokens 1000] [--reps 20]. Two Ray
replicas of one llama.cpp thread each (a private local Ray instance) and the embedded
model: replica A computes a prompt of about ``--tokens`` tokens, then its state is
moved to replica B ``--reps`` times each way, alternating which goes first, by
:class:`tokenmill.gateway.moves.KvMoves` as routing's moves are. "gateway" is the
same move with the replicas' links hidden (the way process replicas move state).
Prints each way's median, its cost a token, and the ratio object store / gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from tokenmill.config import LlamaCppDeployment
from tokenmill.engines import GenerationRequest, SamplingParams
from tokenmill.gateway.moves import KvMoves
from tokenmill.replicas import ReplicaHost
from tokenmill.replicas.host import KvLink
from tokenmill.replicas.placement import build_host


class Unlinked:
    """A host whose state goes through the gateway: its link hidden."""

    def __init__(self, host: ReplicaHost) -> None:
        self.host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)

    def kv_link(self) -> KvLink | None:
        return None


async def measure(n_tokens: int, reps: int) -> None:
    config = LlamaCppDeployment(
        id="moves",
        placement="ray",
        replicas=2,
        max_num_seqs=2,
        n_ctx=max(4096, 2 * n_tokens),
        n_threads=1,
        ray_num_cpus=0.5,
        kv_host_bytes=1 << 30,
    )
    a, b = build_host(config, index=0), build_host(config, index=1)
    await asyncio.gather(a.start(), b.start())
    try:
        prompt = "The river carries stones down from the mountains to the sea. " * (n_tokens // 12)
        once = SamplingParams(max_tokens=1, temperature=0.0)
        request = GenerationRequest("p", once, prompt=prompt)
        await a.prepare(request)
        async for _ in a.generate(request):
            pass
        seq = list((await a.held_kv(16))[0])
        hidden: Any = (Unlinked(a), Unlinked(b))
        times: dict[str, list[float]] = {"object_store": [], "gateway": []}
        for i in range(reps):
            order = ("object_store", "gateway") if i % 2 == 0 else ("gateway", "object_store")
            for way in order:
                donor, target = (a, b) if way == "object_store" else hidden
                started = time.perf_counter()
                outcome = await KvMoves().move(donor, target, seq, min_tokens=16, budget_s=60)
                if outcome != "moved":
                    raise SystemExit(f"a move through the {way} was {outcome}")
                times[way].append(time.perf_counter() - started)
        print(f"{len(seq)} tokens, {reps} moves each way")
        for way, got in times.items():
            median = statistics.median(got)
            every = ", ".join(f"{t * 1e3:.1f}" for t in got)
            print(
                f"{way:>12}: median {median * 1e3:.1f} ms, "
                f"{median / len(seq) * 1e6:.1f} us a token (ms: {every})"
            )
        ratio = statistics.median(times["object_store"]) / statistics.median(times["gateway"])
        print(f"object store / gateway: {ratio:.2f}x")
    finally:
        await asyncio.gather(a.close(), b.close())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(measure(args.tokens, args.reps))


if __name__ == "__main__":
    main()
