"""Stored responses of the Responses API, in the ledger's database.

A stored response is the response object as it was returned and the conversation's
input items up to it (earlier turns included), owned by the account that made it:
another account never sees it (a reader gets ``None``, as for an id that never
existed). Each row carries its own expiry, fixed when it is written from the
retention period in force; a row past it is invisible at once and deleted by the
ledger's sweeper (:meth:`~tokenmill.ledger.sql.SqlLedger.sweep`).

Several gateways on one PostgreSQL database share their stored responses: a
conversation continues on whichever gateway the next request reaches. This module
knows JSON and rows; it never knows HTTP or the API's item shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.ledger.sql import SqlLedger, Tx

_COLS = "id, account_id, created, expires, input_items, body"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    account_id: str
    created: float
    expires: float
    # The conversation up to this response's input, as the API's JSON items.
    input_items: list[dict[str, Any]]
    # The response object as it was returned.
    body: dict[str, Any]


def _stored(row: Any) -> StoredResponse:
    return StoredResponse(
        row[0], row[1], float(row[2]), float(row[3]), json.loads(row[4]), json.loads(row[5])
    )


class ResponseStore:
    """Stored responses on ``ledger``'s database (its connections and transactions)."""

    def __init__(self, ledger: SqlLedger, retention_s: float) -> None:
        self.ledger = ledger
        self.retention_s = retention_s

    async def put(
        self,
        response_id: str,
        account_id: str,
        input_items: list[dict[str, Any]],
        body: dict[str, Any],
    ) -> StoredResponse:
        now = self.ledger.clock()
        stored = StoredResponse(
            response_id, account_id, now, now + self.retention_s, input_items, body
        )

        def tx_fn(tx: Tx) -> None:
            tx.run(
                f"INSERT INTO responses ({_COLS}) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    stored.id,
                    stored.account_id,
                    stored.created,
                    stored.expires,
                    json.dumps(input_items, separators=(",", ":")),
                    json.dumps(body, separators=(",", ":")),
                ),
            )

        await self.ledger.transact(tx_fn)
        return stored

    async def get(self, response_id: str, account_id: str) -> StoredResponse | None:
        """The response, if ``account_id`` owns it and it has not expired."""
        now = self.ledger.clock()
        row = await self.ledger.transact(
            lambda tx: tx.one(
                f"SELECT {_COLS} FROM responses WHERE id = ? AND account_id = ? AND expires > ?",
                (response_id, account_id, now),
            )
        )
        return None if row is None else _stored(row)

    async def delete(self, response_id: str, account_id: str) -> bool:
        """Delete the response if ``account_id`` owns it; whether there was one."""
        now = self.ledger.clock()
        row = await self.ledger.transact(
            lambda tx: tx.one(
                "DELETE FROM responses WHERE id = ? AND account_id = ? AND expires > ? "
                "RETURNING id",
                (response_id, account_id, now),
            )
        )
        return row is not None
