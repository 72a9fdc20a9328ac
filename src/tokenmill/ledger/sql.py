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
:mod:`~tokenmill.ledger.rows`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from tokenmill.errors import (
    AuthenticationError,
    InsufficientCreditError,
    InvalidRequestError,
    NotFoundError,
)
from tokenmill.ledger import rows
from tokenmill.ledger.base import (
    ANONYMOUS_ACCOUNT,
    KEEP,
    MAX_WEIGHT,
    Account,
    HoldProgress,
    HoldSpec,
    Keep,
    KeyInfo,
    KeyPriority,
    Receipt,
    hash_key,
    new_id,
    new_key,
)
from tokenmill.ledger.database import Clock, Database, Tx
from tokenmill.ledger.ratelimits import admit_key, forget_before, give_back, window_of

__all__ = ["Clock", "SqlLedger", "Tx"]

log = logging.getLogger("tokenmill.ledger")
# Holds per progress statement (3 parameters each): far above a gateway's open
# streams, far below SQLite's 32,766 and PostgreSQL's 65,535 parameters a statement.
PROGRESS_BATCH = 2000


def _check_scheduling(weight: float | Keep, max_concurrent: int | Keep | None) -> None:
    """An account's fair-share settings, checked here as well as by the admin API."""
    if not isinstance(weight, Keep) and not 0 < weight <= MAX_WEIGHT:
        raise InvalidRequestError(
            f"'weight' must be above 0 and at most {MAX_WEIGHT:g}, not {weight}", param="weight"
        )
    if isinstance(max_concurrent, int) and max_concurrent < 1:
        raise InvalidRequestError(
            "'max_concurrent' must be at least 1 (or null: no cap)", param="max_concurrent"
        )


class SqlLedger(Database):
    """The books over :class:`~tokenmill.ledger.database.Database`; subclasses connect
    and name their dialect."""

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

    # -- accounts -----------------------------------------------------------------
    async def create_account(
        self,
        name: str,
        balance: int = 0,
        *,
        account_id: str | None = None,
        weight: float = 1.0,
        max_concurrent: int | None = None,
    ) -> Account:
        if balance < 0:
            raise InvalidRequestError("'balance' cannot be negative", param="balance")
        _check_scheduling(weight, max_concurrent)
        acc = Account(
            account_id or new_id("acct"), name, balance, 0, False, self.clock(),
            weight, max_concurrent,
        )  # fmt: skip

        def tx_fn(tx: Tx) -> Account:
            if tx.one("SELECT 1 FROM accounts WHERE id = ?", (acc.id,)) is not None:
                raise InvalidRequestError(f"account {acc.id!r} already exists", param="id")
            tx.run(
                "INSERT INTO accounts "
                "(id, name, balance, held, unlimited, created, weight, max_concurrent) "
                "VALUES (?, ?, ?, 0, 0, ?, ?, ?)",
                (acc.id, name, balance, acc.created, weight, max_concurrent),
            )
            if balance:
                tx.run(
                    "INSERT INTO credits (account_id, amount, created) VALUES (?, ?, ?)",
                    (acc.id, balance, acc.created),
                )
            return acc

        return await self._run(tx_fn)

    async def get_account(self, account_id: str) -> Account | None:
        row = await self._run(
            lambda tx: tx.one(
                f"SELECT {rows.ACCOUNT_COLS} FROM accounts WHERE id = ?", (account_id,)
            )
        )
        return None if row is None else rows.account(row)

    async def add_credits(self, account_id: str, amount: int) -> Account:
        def tx_fn(tx: Tx) -> Account:
            row = tx.one(
                f"SELECT {rows.ACCOUNT_COLS} FROM accounts WHERE id = ?{self.lock}", (account_id,)
            )
            if row is None:
                raise NotFoundError(f"no account {account_id!r}", code="account_not_found")
            acc = rows.account(row)
            if acc.balance + amount < 0:
                raise InvalidRequestError(
                    f"cannot remove {-amount} micro-units: the balance is {acc.balance}",
                    param="amount",
                )
            tx.run("UPDATE accounts SET balance = balance + ? WHERE id = ?", (amount, account_id))
            tx.run(
                "INSERT INTO credits (account_id, amount, created) VALUES (?, ?, ?)",
                (account_id, amount, self.clock()),
            )
            return rows.account(
                tx.one(f"SELECT {rows.ACCOUNT_COLS} FROM accounts WHERE id = ?", (account_id,))
            )

        return await self._run(tx_fn)

    async def update_account(
        self,
        account_id: str,
        *,
        weight: float | Keep = KEEP,
        max_concurrent: int | Keep | None = KEEP,
    ) -> Account:
        """Change an account's fair-share settings (what is given; KEEP the rest)."""
        _check_scheduling(weight, max_concurrent)
        changes: dict[str, Any] = {}
        if not isinstance(weight, Keep):
            changes["weight"] = weight
        if not isinstance(max_concurrent, Keep):
            changes["max_concurrent"] = max_concurrent

        def tx_fn(tx: Tx) -> Account:
            if tx.one("SELECT 1 FROM accounts WHERE id = ?", (account_id,)) is None:
                raise NotFoundError(f"no account {account_id!r}", code="account_not_found")
            if changes:
                columns = ", ".join(f"{name} = ?" for name in changes)
                tx.run(
                    f"UPDATE accounts SET {columns} WHERE id = ?", (*changes.values(), account_id)
                )
            return rows.account(
                tx.one(f"SELECT {rows.ACCOUNT_COLS} FROM accounts WHERE id = ?", (account_id,))
            )

        return await self._run(tx_fn)

    # -- keys ---------------------------------------------------------------------
    async def create_key(
        self,
        account_id: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        priority: KeyPriority = "default",
    ) -> tuple[KeyInfo, str]:
        plaintext = new_key()
        key_id = new_id("key")

        def tx_fn(tx: Tx) -> KeyInfo:
            if tx.one("SELECT 1 FROM accounts WHERE id = ?", (account_id,)) is None:
                raise NotFoundError(f"no account {account_id!r}", code="account_not_found")
            tx.run(
                "INSERT INTO api_keys (id, account_id, key_hash, rpm, tpm, created, priority) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key_id, account_id, hash_key(plaintext), rpm, tpm, self.clock(), priority),
            )
            return rows.key(
                tx.one(f"SELECT {rows.KEY_COLS} FROM {rows.KEY_JOIN} WHERE k.id = ?", (key_id,))
            )

        return await self._run(tx_fn), plaintext

    async def resolve_key(self, plaintext: str) -> KeyInfo | None:
        digest = hash_key(plaintext)
        row = await self._run(
            lambda tx: tx.one(
                f"SELECT {rows.KEY_COLS} FROM {rows.KEY_JOIN} WHERE k.key_hash = ?", (digest,)
            )
        )
        return None if row is None else rows.key(row)

    async def key_by_id(self, key_id: str) -> KeyInfo | None:
        """A key by its id (revoked ones too: ``revoked`` says so)."""
        row = await self._run(
            lambda tx: tx.one(
                f"SELECT {rows.KEY_COLS} FROM {rows.KEY_JOIN} WHERE k.id = ?", (key_id,)
            )
        )
        return None if row is None else rows.key(row)

    async def set_key_priority(self, key_id: str, priority: KeyPriority) -> KeyInfo | None:
        def tx_fn(tx: Tx) -> KeyInfo | None:
            tx.run("UPDATE api_keys SET priority = ? WHERE id = ?", (priority, key_id))
            row = tx.one(f"SELECT {rows.KEY_COLS} FROM {rows.KEY_JOIN} WHERE k.id = ?", (key_id,))
            return None if row is None else rows.key(row)

        return await self._run(tx_fn)

    async def revoke_key(self, key_id: str) -> KeyInfo | None:
        def tx_fn(tx: Tx) -> KeyInfo | None:
            tx.run(
                "UPDATE api_keys SET revoked = ? WHERE id = ? AND revoked IS NULL",
                (self.clock(), key_id),
            )
            row = tx.one(f"SELECT {rows.KEY_COLS} FROM {rows.KEY_JOIN} WHERE k.id = ?", (key_id,))
            return None if row is None else rows.key(row)

        return await self._run(tx_fn)

    # -- holds and settlement -----------------------------------------------------
    async def hold(self, spec: HoldSpec) -> None:
        await self._run(functools.partial(self._hold, spec, self.clock()))

    def _hold(self, spec: HoldSpec, now: float, tx: Tx) -> None:
        row = tx.one(
            f"SELECT balance, held, unlimited FROM accounts WHERE id = ?{self.lock}",
            (spec.account_id,),
        )
        if row is None:
            raise AuthenticationError("the account of this API key no longer exists")
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
        if not unlimited:
            available = balance - held
            if spec.amount > available:
                raise InsufficientCreditError(
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
            "prompt_tokens, max_tokens, amount, min_charge, rate_window, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                spec.request_id, spec.account_id, spec.key_id, self.gateway_id,
                spec.deployment, spec.prompt_tokens, spec.max_tokens, spec.amount,
                min(spec.min_charge, spec.amount), window, now,
            ),
        )  # fmt: skip

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
            "max_tokens, amount, rate_window, created",
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
