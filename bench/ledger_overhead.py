"""Hold + settle latency on the SQLite ledger: what metering adds to each request.

Run: .venv/bin/python bench/ledger_overhead.py [--n 2000]. The issue's bar is p50 <= 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from tokenmill.ledger.backends import SqliteLedger
from tokenmill.ledger.base import HoldSpec


async def run(n: int, warmup: int = 100) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        ledger = SqliteLedger(Path(tmp) / "ledger.sqlite3")
        await ledger.open()
        acc = await ledger.create_account("bench", 10**15)
        key, _ = await ledger.create_key(acc.id, rpm=10**9, tpm=10**12)
        samples: list[float] = []
        for i in range(n + warmup):
            rid = f"req-{i}"
            t0 = time.perf_counter()
            await ledger.hold(HoldSpec(rid, acc.id, key.id, "dep", 40, 256, 1000, 60))
            await ledger.settle(
                rid, prompt_tokens=40, completion_tokens=100, finish_reason="stop", charged=360
            )
            if i >= warmup:
                samples.append((time.perf_counter() - t0) * 1000)
        await ledger.close()
    samples.sort()
    return {
        "n": n,
        "p50_ms": statistics.median(samples),
        "p90_ms": samples[int(0.9 * len(samples))],
        "p99_ms": samples[int(0.99 * len(samples))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    result = asyncio.run(run(parser.parse_args().n))
    print(
        f"ledger hold+settle (SQLite, rate-limited key): n={result['n']} "
        f"p50={result['p50_ms']:.3f} ms p90={result['p90_ms']:.3f} ms "
        f"p99={result['p99_ms']:.3f} ms"
    )


if __name__ == "__main__":
    main()
