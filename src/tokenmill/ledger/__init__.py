"""The books: accounts, hashed API keys, credit holds, receipts and rate limits, the
audit log of every admin change, and the stores of the Responses and Batch APIs.

:func:`build_ledger` picks the store from the settings: PostgreSQL for a
``postgresql://`` URL, otherwise a SQLite file in the data folder.
"""

from __future__ import annotations

import time
from pathlib import Path

from tokenmill.config import Settings
from tokenmill.ledger.audit import SYSTEM, Actor, AuditEntry, AuditLog, AuditQuery
from tokenmill.ledger.base import (
    ANONYMOUS_ACCOUNT,
    KEEP,
    MAX_WEIGHT,
    Account,
    HoldSpec,
    KeyInfo,
    KeyPriority,
    Receipt,
    hash_key,
)
from tokenmill.ledger.batches import BatchStore
from tokenmill.ledger.budgets import BudgetState, BudgetWindow
from tokenmill.ledger.database import clock_from_environment
from tokenmill.ledger.files import FileStore
from tokenmill.ledger.meter import LedgerMeter
from tokenmill.ledger.ratelimits import RateState
from tokenmill.ledger.responses import ResponseStore
from tokenmill.ledger.sql import Clock, SqlLedger

__all__ = [
    "ANONYMOUS_ACCOUNT",
    "KEEP",
    "MAX_WEIGHT",
    "SYSTEM",
    "Account",
    "Actor",
    "AuditEntry",
    "AuditLog",
    "AuditQuery",
    "BatchStore",
    "BudgetState",
    "BudgetWindow",
    "FileStore",
    "HoldSpec",
    "KeyInfo",
    "KeyPriority",
    "LedgerMeter",
    "RateState",
    "Receipt",
    "ResponseStore",
    "SqlLedger",
    "build_ledger",
    "data_dir",
    "hash_key",
    "ledger_from_url",
]


def data_dir(settings: Settings) -> Path:
    return settings.data_path()


def ledger_from_url(url: str, *, clock: Clock = time.time) -> SqlLedger:
    """``postgresql://...`` or ``sqlite:///path/to/file``."""
    from tokenmill.ledger.backends import PostgresLedger, SqliteLedger

    if url.startswith(("postgresql://", "postgres://")):
        return PostgresLedger(url, clock=clock)
    if url.startswith("sqlite:///"):
        return SqliteLedger(Path(url.removeprefix("sqlite:///")), clock=clock)
    raise ValueError(f"unsupported ledger URL {url!r}: use postgresql://... or sqlite:///path")


def build_ledger(settings: Settings) -> SqlLedger:
    clock = clock_from_environment()
    if settings.ledger:
        return ledger_from_url(settings.ledger, clock=clock)
    from tokenmill.ledger.backends import SqliteLedger

    return SqliteLedger(data_dir(settings) / "ledger.sqlite3", clock=clock)
