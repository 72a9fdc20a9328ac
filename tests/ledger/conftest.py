"""Ledger fixtures: a fresh SQLite file, or a fresh PostgreSQL schema dropped afterwards."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from tests.postgres import pg_schema
from tokenmill.ledger import ledger_from_url
from tokenmill.ledger.sql import Clock, SqlLedger


@pytest.fixture
def pg_url(postgres: str) -> Iterator[str]:
    """A PostgreSQL URL on a schema of this test's own."""
    with pg_schema(postgres) as url:
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
