"""Ledger fixtures: a fresh SQLite file, or a fresh PostgreSQL schema dropped afterwards."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from tokenmill.ledger import ledger_from_url
from tokenmill.ledger.sql import Clock, SqlLedger

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


@contextlib.contextmanager
def pg_schema() -> Iterator[str]:
    """A URL whose search_path is a fresh schema of its own (dropped after), so parallel
    runs never clash."""
    schema = f"tm_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_URL}?options={quote(f'-c search_path={schema}')}"
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL on a schema of this test's own."""
    with pg_schema() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
async def make_ledger(ledger_url: str) -> AsyncIterator[Callable[..., SqlLedger]]:
    """Open ledgers on the test's store (several = several gateways); all closed after.

    ``clock`` replaces the wall clock they read: a test that sets the time itself
    steps across rate windows and heartbeat ages without waiting for them.
    """
    opened: list[SqlLedger] = []

    def make(clock: Clock = time.time) -> SqlLedger:
        ledger = ledger_from_url(ledger_url, clock=clock)
        opened.append(ledger)
        return ledger

    yield make
    for ledger in opened:
        await ledger.close()


@pytest.fixture
async def ledger(make_ledger: Callable[..., SqlLedger]) -> SqlLedger:
    led = make_ledger()
    await led.open()
    return led
