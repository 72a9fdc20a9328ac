"""What metering costs: hold + settle latency per request, and the progress flush.

Run: .venv/bin/python bench/ledger_overhead.py [--n 2000] [--postgres URL]. The
issue's bar for hold + settle is p50 <= 1 ms (SQLite). The progress flush is the one
statement a gateway writes each second for all its open holds
(tokenmill.gateway.progress): its latency at 1 to 256 open holds says what a second
of recorded progress costs. ``--postgres`` measures the flush on PostgreSQL too, in
a schema of its own that is dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg

from tokenmill.ledger import SqlLedger, ledger_from_url
from tokenmill.ledger.backends import SqliteLedger
from tokenmill.ledger.base import HoldProgress, HoldSpec

OPEN_HOLDS = (1, 16, 64, 256)
FLUSHES = 200


def summary(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "n": len(samples),
        "p50_ms": statistics.median(samples),
        "p90_ms": samples[int(0.9 * len(samples))],
        "p99_ms": samples[int(0.99 * len(samples))],
    }


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
    return summary(samples)


async def flush(ledger: SqlLedger, holds: int, flushes: int = FLUSHES) -> dict[str, float]:
    """Latency of one progress write covering ``holds`` open holds of this gateway."""
    await ledger.open()
    acc = await ledger.create_account("bench", 10**15)
    rids = [f"flush-{holds}-{i}" for i in range(holds)]
    for rid in rids:
        await ledger.hold(HoldSpec(rid, acc.id, None, "dep", 40, 4096, 10**6, 60))
    samples: list[float] = []
    for step in range(flushes + 10):
        progress = [HoldProgress(rid, step, 60 + step * 3) for rid in rids]
        t0 = time.perf_counter()
        await ledger.record_progress(progress)
        if step >= 10:
            samples.append((time.perf_counter() - t0) * 1000)
    for rid in rids:
        await ledger.settle(
            rid, prompt_tokens=40, completion_tokens=1, finish_reason="stop", charged=63
        )
    await ledger.close()
    return summary(samples)


@contextlib.contextmanager
def pg_schema(url: str) -> Iterator[str]:
    schema = f"tm_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        sep = "&" if "?" in url else "?"
        yield f"{url}{sep}options={quote(f'-c search_path={schema}')}"
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


async def flushes(postgres: str | None) -> list[tuple[str, int, dict[str, float]]]:
    results = []
    for holds in OPEN_HOLDS:
        with tempfile.TemporaryDirectory() as tmp:
            ledger = SqliteLedger(Path(tmp) / "ledger.sqlite3")
            results.append(("SQLite", holds, await flush(ledger, holds)))
        if postgres is not None:
            with pg_schema(postgres) as url:
                results.append(("PostgreSQL", holds, await flush(ledger_from_url(url), holds)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--postgres", metavar="URL", help="also measure the flush on PostgreSQL")
    args = parser.parse_args()
    result = asyncio.run(run(args.n))
    print(
        f"ledger hold+settle (SQLite, rate-limited key): n={result['n']} "
        f"p50={result['p50_ms']:.3f} ms p90={result['p90_ms']:.3f} ms "
        f"p99={result['p99_ms']:.3f} ms"
    )
    for store, holds, r in asyncio.run(flushes(args.postgres)):
        # One flush a second: p50 ms per flush is also the ledger's ms per second.
        print(
            f"progress flush ({store}, {holds} open holds, one statement): n={r['n']} "
            f"p50={r['p50_ms']:.3f} ms p90={r['p90_ms']:.3f} ms p99={r['p99_ms']:.3f} ms "
            f"= {r['p50_ms'] / 10:.4f} % of a second"
        )


if __name__ == "__main__":
    main()
