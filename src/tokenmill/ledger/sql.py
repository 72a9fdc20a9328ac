"""The ledger's logic, written once for SQLite and PostgreSQL.

Each operation is one short transaction on the ledger's database
(:mod:`tokenmill.ledger.database`: connections, retries, migrations). Races
between gateways are settled by the database, not by Python locks:

- a hold locks the account row (``FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE``
  on SQLite), checks ``balance - held`` and the key's rate window, and raises
  ``held`` in the same transaction, so concurrent holds cannot overdraw;
- a settle deletes the hold row with ``RETURNING``: whoever deletes it (the gateway,
  or the sweeper after that gateway died) settles, everyone else finds a receipt.

A key's rate limits are counted in the same transactions by
:mod:`~tokenmill.ledger.ratelimits`; rows read back as records through
:mod:`~tokenmill.ledger.rows`. Accounts and keys, the admin's changes, are
:mod:`~tokenmill.ledger.accounts`' (each audited).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError, PaymentRequiredError, UnauthenticatedError
from tokenmill.ledger import budgets, rows
from tokenmill.ledger.accounts import Accounts
from tokenmill.ledger.base import ANONYMOUS_ACCOUNT, HoldProgress, HoldSpec, Receipt
from tokenmill.ledger.database import Clock, Tx
from tokenmill.ledger.ratelimits import (
    RateState,
    admit_key,
    forget_before,
    give_back,
    rate_state,
    window_of,
)

__all__ = ["Clock", "SqlLedger", "Tx"]

log = logging.getLogger("tokenmill.ledger")
# Holds per progress statement (3 parameters each): far above a gateway's open
# streams, far below SQLite's 32,766 and PostgreSQL's 65,535 parameters a statement.
PROGRESS_BATCH = 2000


class SqlLedger(Accounts):
    """The books over :class:`~tokenmill.ledger.database.Database`, with the accounts
    and keys of :class:`~tokenmill.ledger.accounts.Accounts`; subclasses connect and
    name their dialect."""

    async def open(self) -> None:
        await self._run(self._migrate)
        now = self.clock()
        await self._run(
            lambda tx: tx.run(
                "INSERT INTO accounts (id, name, balance, held, unlimited, created) "
                "VALUES (?, ?, 0, 0, 1, ?) ON CONFLICT (id) DO NOTHING",
                (ANONYMOUS_ACCOUNT, ANONYMOUS_ACCOUNT, now),
            )
        )
        await self.heartbeat()

    async def close(self) -> None:
        try:
            await self._run(
                lambda tx: tx.run("DELETE FROM gateways WHERE id = ?", (self.gateway_id,))
            )
        except Exception:
            log.warning("could not unregister gateway %s from the ledger", self.gateway_id)

        await self.close_connections()

    # -- holds and settlement -----------------------------------------------------
    async def hold(self, spec: HoldSpec) -> None:
        await self._run(functools.partial(self._hold, spec, self.clock()))

    def _hold(self, spec: HoldSpec, now: float, tx: Tx) -> None:
        row = tx.one(
            f"SELECT balance, held, unlimited FROM accounts WHERE id = ?{self.lock}",
            (spec.account_id,),
        )
        if row is None:
            raise UnauthenticatedError("the account of this API key no longer exists")
        balance, held, unlimited = int(row[0]), int(row[1]), bool(row[2])
        if (
            tx.one("SELECT 1 FROM holds WHERE request_id = ?", (spec.request_id,)) is not None
            or tx.one("SELECT 1 FROM receipts WHERE request_id = ?", (spec.request_id,)) is not None
        ):
            raise InvalidRequestError(
                f"x-request-id {spec.request_id!r} was already used; send a new one",
                param="x-request-id",
                code="duplicate_request_id",
            )
        window = window_of(now)
        if spec.key_id is not None:
            admit_key(tx, spec, now, window)
        counted = budgets.admit(tx, spec, now)
        if not unlimited:
            available = balance - held
            if spec.amount > available:
                raise PaymentRequiredError(
                    f"insufficient credit: this request may cost up to {spec.amount} "
                    f"micro-units ({spec.prompt_tokens} prompt tokens plus max_tokens "
                    f"{spec.max_tokens}) but the account has {available} available; "
                    "add credit or lower max_tokens"
                )
            tx.run(
                "UPDATE accounts SET held = held + ? WHERE id = ?", (spec.amount, spec.account_id)
            )
        tx.run(
            "INSERT INTO holds (request_id, account_id, key_id, gateway_id, deployment, "
            "prompt_tokens, max_tokens, amount, min_charge, rate_window, created, "
            "budget_windows) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                spec.request_id, spec.account_id, spec.key_id, self.gateway_id,
                spec.deployment, spec.prompt_tokens, spec.max_tokens, spec.amount,
                min(spec.min_charge, spec.amount), window, now, counted,
            ),
        )  # fmt: skip

    async def rate_state(self, key_id: str) -> RateState | None:
        """What the key may still do this minute, as every gateway of the ledger sees
        it (None: a key without limits)."""
        return await self._run(lambda tx: rate_state(tx, key_id, self.clock()))

    async def record_progress(self, progress: Sequence[HoldProgress]) -> None:
        """Record how far this gateway's open holds got: one statement for all of them.

        A hold settled meanwhile is simply not found; holds of other gateways are
        never touched.
        """
        if progress:
            await self._run(functools.partial(self._record_progress, progress))

    def _record_progress(self, progress: Sequence[HoldProgress], tx: Tx) -> None:
        for start in range(0, len(progress), PROGRESS_BATCH):
            batch = progress[start : start + PROGRESS_BATCH]
            params: list[Any] = []
            for p in batch:
                params += (p.request_id, p.completion_tokens, p.charge)
            rows = ", ".join(["(?, ?, ?)"] * len(batch))
            tx.run(
                f"WITH v (request_id, streamed, charge) AS (VALUES {rows}) "
                "UPDATE holds SET streamed = v.streamed, streamed_charge = v.charge FROM v "
                "WHERE holds.request_id = v.request_id AND holds.gateway_id = ?",
                [*params, self.gateway_id],
            )

    async def settle(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        charged: int,
    ) -> Receipt | None:
        fn = functools.partial(
            self._settle, request_id, prompt_tokens, completion_tokens, finish_reason, charged
        )
        return await self._run(fn)

    def _settle(
        self,
        request_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        charged: int,
        tx: Tx,
    ) -> Receipt | None:
        row = tx.one(
            "DELETE FROM holds WHERE request_id = ? RETURNING account_id, key_id, deployment, "
            "max_tokens, amount, rate_window, created, budget_windows",
            (request_id,),
        )
        if row is None:  # settled already (or never held): exactly once
            existing = tx.one(
                f"SELECT {rows.RECEIPT_COLS} FROM receipts WHERE request_id = ?", (request_id,)
            )
            return None if existing is None else rows.receipt(existing)
        account_id, key_id, deployment = row[0], row[1], row[2]
        max_tokens, amount, window, created = int(row[3]), int(row[4]), int(row[5]), row[6]
        charged = max(0, min(charged, amount))
        acc = tx.one(f"SELECT unlimited FROM accounts WHERE id = ?{self.lock}", (account_id,))
        if acc is not None and not bool(acc[0]):
            tx.run(
                "UPDATE accounts SET balance = balance - ?, held = held - ? WHERE id = ?",
                (charged, amount, account_id),
            )
        if key_id is not None:
            give_back(tx, key_id, window, max(0, max_tokens - completion_tokens))
        budgets.give_back(tx, row[7], amount - charged)
        receipt = Receipt(
            request_id, account_id, key_id, deployment, prompt_tokens, completion_tokens,
            amount, charged, finish_reason, float(created), self.clock(),
        )  # fmt: skip
        tx.run(
            f"INSERT INTO receipts ({rows.RECEIPT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                receipt.request_id, receipt.account_id, receipt.key_id, receipt.deployment,
                receipt.prompt_tokens, receipt.completion_tokens, receipt.held,
                receipt.charged, receipt.finish_reason, receipt.created, receipt.settled,
            ),
        )  # fmt: skip
        return receipt

    async def receipt(self, request_id: str) -> Receipt | None:
        row = await self._run(
            lambda tx: tx.one(
                f"SELECT {rows.RECEIPT_COLS} FROM receipts WHERE request_id = ?", (request_id,)
            )
        )
        return None if row is None else rows.receipt(row)

    async def usage(self, account_id: str, limit: int = 100) -> list[Receipt]:
        found = await self._run(
            lambda tx: tx.all(
                f"SELECT {rows.RECEIPT_COLS} FROM receipts WHERE account_id = ? "
                "ORDER BY settled DESC LIMIT ?",
                (account_id, limit),
            )
        )
        return [rows.receipt(r) for r in found]

    async def open_holds(self, account_id: str | None = None) -> int:
        if account_id is None:
            row = await self._run(lambda tx: tx.one("SELECT COUNT(*) FROM holds"))
        else:
            row = await self._run(
                lambda tx: tx.one("SELECT COUNT(*) FROM holds WHERE account_id = ?", (account_id,))
            )
        return int(row[0])

    # -- liveness and the sweeper -------------------------------------------------
    async def heartbeat(self) -> None:
        now = self.clock()
        await self._run(
            lambda tx: tx.run(
                "INSERT INTO gateways (id, heartbeat) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET heartbeat = ?",
                (self.gateway_id, now, now),
            )
        )

    async def sweep(self, stale_s: float) -> int:
        """Settle the holds of gateways silent for ``stale_s`` on their last recorded
        progress: the tokens streamed (at most the hold's ``max_tokens``), at least
        the prompt."""
        cutoff = self.clock() - stale_s
        stale = await self._run(
            lambda tx: tx.all(
                "SELECT h.request_id, h.prompt_tokens, h.min_charge, h.max_tokens, h.streamed, "
                "h.streamed_charge FROM holds h "
                "LEFT JOIN gateways g ON g.id = h.gateway_id "
                "WHERE h.gateway_id <> ? AND (g.heartbeat IS NULL OR g.heartbeat < ?)",
                (self.gateway_id, cutoff),
            )
        )
        swept = 0
        for request_id, prompt_tokens, min_charge, max_tokens, streamed, charge in stale:
            # settle() caps the charge at the hold's amount.
            receipt = await self.settle(
                request_id,
                prompt_tokens=int(prompt_tokens),
                completion_tokens=min(int(streamed), int(max_tokens)),
                finish_reason="expired",
                charged=max(int(min_charge), int(charge)),
            )
            if receipt is not None and receipt.finish_reason == "expired":
                swept += 1
                log.warning(
                    "ledger: settled hold %s of a dead gateway on %d streamed tokens",
                    request_id,
                    receipt.completion_tokens,
                )
        old_window = window_of(self.clock()) - 1

        def tidy(tx: Tx) -> None:
            tx.run(
                "DELETE FROM gateways WHERE heartbeat < ? AND id <> ? AND NOT EXISTS "
                "(SELECT 1 FROM holds WHERE holds.gateway_id = gateways.id)",
                (cutoff, self.gateway_id),
            )
            forget_before(tx, old_window)
            # Stored responses past their retention (tokenmill.ledger.responses).
            tx.run("DELETE FROM responses WHERE expires <= ?", (self.clock(),))
            # Batch API files past their retention (tokenmill.ledger.batches).
            tx.run("DELETE FROM files WHERE expires <= ?", (self.clock(),))

        await self._run(tidy)
        return swept
