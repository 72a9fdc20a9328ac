"""The ledger's database: one short transaction at a time on a worker thread, over
DB-API connections for SQLite and PostgreSQL, and the migrations that shape it.

The drivers are blocking; a thread hop costs tens of microseconds, far less than a
commit. A transaction the database refused for a race (SQLite's busy, PostgreSQL's
serialization failure) is retried a few times. What the tables mean is the books'
business (:mod:`tokenmill.ledger.sql`), not this module's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("tokenmill.ledger")
T = TypeVar("T")
# The wall clock every timestamp, rate window and heartbeat age is read from (seconds
# since the epoch, as ``time.time``); a test sets its own to step across windows.
Clock = Callable[[], float]
_RETRIES = 5
# Tests only: a file holding the time (seconds since the epoch) that a gateway's ledger
# reads instead of the wall clock, so that a test steps a server across rate and budget
# windows instead of waiting for them, as ``Clock`` lets an in-process test do.
CLOCK_FILE_ENV = "TOKENMILL_LEDGER_CLOCK_FILE"


class FileClock:
    """The time written in a file, read at every call (the writer replaces the file
    whole, so a reader never sees half a number)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> float:
        return float(self.path.read_text())


def clock_from_environment() -> Clock:
    """The wall clock, unless ``TOKENMILL_LEDGER_CLOCK_FILE`` names a test's clock file."""
    path = os.environ.get(CLOCK_FILE_ENV)
    return FileClock(Path(path)) if path else time.time


class Tx:
    """A transaction's cursor with ``?`` placeholders whatever the driver."""

    def __init__(self, conn: Any, placeholder: str) -> None:
        self._conn = conn
        self._ph = placeholder

    def run(self, sql: str, params: Sequence[Any] = ()) -> Any:
        if self._ph != "?":
            sql = sql.replace("?", self._ph)
        return self._conn.execute(sql, params)

    def one(self, sql: str, params: Sequence[Any] = ()) -> Any:
        row: Any = self.run(sql, params).fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return list(self.run(sql, params).fetchall())


class Database:
    """Connections (one per worker thread), transactions and migrations; subclasses
    connect and name their dialect."""

    dialect = ""
    begin = "BEGIN"
    lock = ""  # row-lock suffix for SELECTs of rows about to change
    placeholder = "?"
    retryable: tuple[type[BaseException], ...] = ()

    def __init__(
        self, *, workers: int = 1, gateway_id: str | None = None, clock: Clock = time.time
    ) -> None:
        self.gateway_id = gateway_id or f"gw_{uuid.uuid4().hex[:12]}"
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ledger")
        self._local = threading.local()
        self._conns: list[Any] = []
        self._conns_lock = threading.Lock()

    # -- driver specifics ---------------------------------------------------------
    def _connect(self) -> Any:
        raise NotImplementedError

    def _migration_lock(self, tx: Tx) -> None:
        """Serialize migrations between processes starting at once."""

    # -- plumbing -----------------------------------------------------------------
    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _transact(self, fn: Callable[[Tx], T]) -> T:
        conn = self._conn()
        for attempt in range(_RETRIES):
            conn.execute(self.begin)
            try:
                result = fn(Tx(conn, self.placeholder))
            except self.retryable:
                conn.execute("ROLLBACK")
                if attempt == _RETRIES - 1:
                    raise
                time.sleep(0.005 * (attempt + 1))
                continue
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result
        raise AssertionError("unreachable")

    async def _run(self, fn: Callable[[Tx], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._transact, fn)

    async def transact(self, fn: Callable[[Tx], T]) -> T:
        """Run ``fn`` as one transaction on a worker thread: for the stores that keep
        their tables in the ledger's database (:mod:`tokenmill.ledger.responses`)."""
        return await self._run(fn)

    def _migrate(self, tx: Tx) -> None:
        self._migration_lock(tx)
        tx.run(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied DOUBLE PRECISION NOT NULL)"
        )
        done = {int(r[0]) for r in tx.all("SELECT version FROM schema_migrations")}
        folder = resources.files("tokenmill.ledger") / "migrations" / self.dialect
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if not entry.name.endswith(".sql"):
                continue
            version = int(entry.name.split("_", 1)[0])
            if version in done:
                continue
            text = "\n".join(
                line for line in entry.read_text().splitlines() if not line.startswith("--")
            )
            # A statement ends with a ';' at the end of a line: one inside a line (a
            # trigger's body) does not end it.
            for statement in re.split(r";[ \t]*$", text, flags=re.MULTILINE):
                if statement.strip():
                    tx.run(statement)
            tx.run(
                "INSERT INTO schema_migrations (version, name, applied) VALUES (?, ?, ?)",
                (version, entry.name, self.clock()),
            )
            log.info("ledger: applied migration %s", entry.name)

    async def close_connections(self) -> None:
        """Close every thread's connection, then the worker pool."""

        def close_all() -> None:
            with self._conns_lock:
                for conn in self._conns:
                    conn.close()
                self._conns.clear()

        await asyncio.get_running_loop().run_in_executor(self._pool, close_all)
        self._pool.shutdown(wait=True)
