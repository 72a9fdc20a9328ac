"""The Batch API's files, in the ledger's database.

A file is its bytes and what OpenAI's file object says of it, owned by an account and
kept ``retention_s`` after it is written: a batch's input, uploaded, or its output and
error files, written by :mod:`tokenmill.ledger.batches` in the transaction that
finalizes the batch (:meth:`FileStore.write`). Another account's file reads as
absent, like an id that never existed. This module knows rows and bytes; it never
knows HTTP nor what a file holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tokenmill.ledger.base import new_id
from tokenmill.ledger.sql import SqlLedger, Tx

_FILE_COLS = "id, account_id, purpose, filename, bytes, created, expires"


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    account_id: str
    purpose: str
    filename: str
    bytes: int
    created: float
    expires: float

    def to_json(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created),
            "expires_at": int(self.expires),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


def _file(row: Sequence[Any]) -> StoredFile:
    return StoredFile(row[0], row[1], row[2], row[3], int(row[4]), float(row[5]), float(row[6]))


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a list (files, batches), and whether more follow it."""

    data: list[T]
    has_more: bool


class FileStore:
    """Files on ``ledger``'s database, kept ``retention_s`` after they are written."""

    def __init__(self, ledger: SqlLedger, retention_s: float) -> None:
        self.ledger = ledger
        self.retention_s = retention_s

    def write(
        self, tx: Tx, account_id: str, purpose: str, filename: str, content: bytes
    ) -> StoredFile:
        """Store a file inside the caller's transaction ``tx`` (a batch's output files
        are written in the transaction that finalizes it)."""
        now = self.ledger.clock()
        f = StoredFile(
            new_id("file"), account_id, purpose, filename, len(content), now, now + self.retention_s
        )
        tx.run(
            f"INSERT INTO files ({_FILE_COLS}, content) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (f.id, f.account_id, f.purpose, f.filename, f.bytes, f.created, f.expires, content),
        )
        return f

    async def put(self, account_id: str, purpose: str, filename: str, content: bytes) -> StoredFile:
        return await self.ledger.transact(
            lambda tx: self.write(tx, account_id, purpose, filename, content)
        )

    async def get(self, file_id: str, account_id: str) -> StoredFile | None:
        now = self.ledger.clock()
        row = await self.ledger.transact(
            lambda tx: tx.one(
                f"SELECT {_FILE_COLS} FROM files WHERE id = ? AND account_id = ? AND expires > ?",
                (file_id, account_id, now),
            )
        )
        return None if row is None else _file(row)

    async def content(self, file_id: str, account_id: str) -> bytes | None:
        now = self.ledger.clock()
        row = await self.ledger.transact(
            lambda tx: tx.one(
                "SELECT content FROM files WHERE id = ? AND account_id = ? AND expires > ?",
                (file_id, account_id, now),
            )
        )
        return None if row is None else bytes(row[0])

    async def page(
        self,
        account_id: str,
        *,
        purpose: str | None = None,
        limit: int = 100,
        after: str | None = None,
        newest_first: bool = True,
    ) -> Page[StoredFile]:
        now = self.ledger.clock()
        order = "DESC" if newest_first else "ASC"
        cmp = "<" if newest_first else ">"

        def tx_fn(tx: Tx) -> list[Any]:
            sql = f"SELECT {_FILE_COLS} FROM files WHERE account_id = ? AND expires > ?"
            params: list[Any] = [account_id, now]
            if purpose is not None:
                sql += " AND purpose = ?"
                params.append(purpose)
            if after is not None:
                cursor = tx.one(
                    "SELECT created FROM files WHERE id = ? AND account_id = ?", (after, account_id)
                )
                if cursor is not None:
                    sql += f" AND (created {cmp} ? OR (created = ? AND id {cmp} ?))"
                    params += [cursor[0], cursor[0], after]
            sql += f" ORDER BY created {order}, id {order} LIMIT ?"
            params.append(limit + 1)
            return tx.all(sql, params)

        rows = await self.ledger.transact(tx_fn)
        return Page([_file(r) for r in rows[:limit]], len(rows) > limit)

    async def delete(self, file_id: str, account_id: str) -> bool:
        now = self.ledger.clock()
        row = await self.ledger.transact(
            lambda tx: tx.one(
                "DELETE FROM files WHERE id = ? AND account_id = ? AND expires > ? RETURNING id",
                (file_id, account_id, now),
            )
        )
        return row is not None
