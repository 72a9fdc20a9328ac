"""The two stores: SQLite (one file, the default) and PostgreSQL (several gateways)."""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import psycopg
import psycopg.errors

from tokenmill.ledger.sql import Clock, SqlLedger, Tx

log = logging.getLogger("tokenmill.ledger")

# How long a connection waits for another one's lock on the file.
LOCK_WAIT_S = 10.0


def _enable_wal(conn: sqlite3.Connection, path: Path) -> None:
    """Switch the file to WAL (a no-op once it is), waiting for other connections.

    Switching needs the file to itself for a moment, and SQLite answers "database is
    locked" at once, without its busy timeout, while another connection holds a lock
    on it: two gateways starting on one new file met that about one time in four.
    """
    deadline = time.monotonic() + LOCK_WAIT_S
    waiting = False
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if e.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                conn.close()
                raise
        if not waiting:
            waiting = True
            log.info(
                "ledger: %s is locked by another connection; waiting up to %gs", path, LOCK_WAIT_S
            )
        time.sleep(0.01)


class SqliteLedger(SqlLedger):
    """One writer thread: SQLite serializes writes anyway, so more threads only contend.

    ``BEGIN IMMEDIATE`` takes the write lock up front, which makes each hold's
    read-check-write atomic even against another process on the same file.
    """

    dialect = "sqlite"
    begin = "BEGIN IMMEDIATE"

    def __init__(
        self, path: Path, *, gateway_id: str | None = None, clock: Clock = time.time
    ) -> None:
        super().__init__(workers=1, gateway_id=gateway_id, clock=clock)
        self.path = path
        self.retryable = (sqlite3.OperationalError,)

    def _connect(self) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=LOCK_WAIT_S
        )
        _enable_wal(conn, self.path)
        # WAL + NORMAL: a commit survives a crashed process; only power loss can
        # lose the last transactions, and costs no fsync per hold.
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        return conn


class PostgresLedger(SqlLedger):
    dialect = "postgresql"
    lock = " FOR UPDATE"
    placeholder = "%s"
    retryable = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)

    def __init__(
        self,
        url: str,
        *,
        workers: int = 8,
        gateway_id: str | None = None,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(workers=workers, gateway_id=gateway_id, clock=clock)
        self.url = url

    def _connect(self) -> Any:
        # Autocommit, with explicit BEGIN/COMMIT issued by SqlLedger._transact.
        return psycopg.connect(self.url, autocommit=True, prepare_threshold=None)

    def _migration_lock(self, tx: Tx) -> None:
        tx.run("SELECT pg_advisory_xact_lock(hashtext(current_schema()))")
