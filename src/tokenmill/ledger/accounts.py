"""Accounts and API keys: what the admin creates and changes, each change audited.

Every change here runs as one transaction that also appends its entry to the audit
log (:mod:`tokenmill.ledger.audit`) through :meth:`Accounts.audited`: the change and
its entry commit together, or neither does. A key's or account's spend budgets
(:mod:`tokenmill.ledger.budgets`) are set here, with it. What a key or account spends
(holds, settlements, rate and budget windows) is the books' business
(:mod:`tokenmill.ledger.sql`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tokenmill.errors import InvalidRequestError, ResourceNotFoundError
from tokenmill.ledger import audit, budgets, rows
from tokenmill.ledger.audit import SYSTEM, Actor, AuditTrail
from tokenmill.ledger.base import (
    KEEP,
    MAX_WEIGHT,
    Account,
    Keep,
    KeyInfo,
    KeyPriority,
    hash_key,
    new_id,
    new_key,
)
from tokenmill.ledger.budgets import BudgetState, BudgetWindow, OwnerType
from tokenmill.ledger.database import Database, Tx

T = TypeVar("T")


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


def account_state(tx: Tx, acc: Account) -> dict[str, Any]:
    """What the audit log keeps of an account: what an admin sets (not ``held``,
    which every request moves, nor what its budget windows have spent)."""
    return {
        "name": acc.name,
        "balance": acc.balance,
        "weight": acc.weight,
        "max_concurrent": acc.max_concurrent,
        "budget": [w.to_json() for w in budgets.configured(tx, "account", acc.id)],
    }


def key_state(tx: Tx, info: KeyInfo) -> dict[str, Any]:
    """What the audit log keeps of a key (never its hash)."""
    return {
        "account": info.account_id,
        "rpm": info.rpm,
        "tpm": info.tpm,
        "priority": info.priority,
        "revoked": info.revoked,
        "budget": [w.to_json() for w in budgets.configured(tx, "key", info.id)],
    }


class Accounts(Database):
    """Accounts and keys over the ledger's database."""

    async def audited(self, actor: Actor, fn: Callable[[Tx, AuditTrail], T]) -> T:
        """Run ``fn`` as one transaction whose audit entries (``fn`` records them on the
        trail) commit with it; once committed, they are logged."""

        def tx_fn(tx: Tx) -> tuple[T, AuditTrail]:
            trail = AuditTrail(tx, actor, self.gateway_id, self.clock())
            return fn(tx, trail), trail

        result, trail = await self._run(tx_fn)
        audit.export(trail.entries)
        return result

    def _account(self, tx: Tx, account_id: str, lock: str = "") -> Account:
        row = tx.one(f"SELECT {rows.ACCOUNT_COLS} FROM accounts WHERE id = ?{lock}", (account_id,))
        if row is None:
            raise ResourceNotFoundError(f"no account {account_id!r}", code="account_not_found")
        return rows.account(row)

    def _key(self, tx: Tx, key_id: str, *, lock: bool = False) -> KeyInfo | None:
        # Locks the key's row only: a change of a key leaves its account's alone.
        suffix = self.lock + " OF k" if lock and self.lock else ""
        row = tx.one(
            f"SELECT {rows.KEY_COLS} FROM {rows.KEY_JOIN} WHERE k.id = ?{suffix}", (key_id,)
        )
        return None if row is None else rows.key(row)

    # -- accounts -----------------------------------------------------------------
    async def create_account(
        self,
        name: str,
        balance: int = 0,
        *,
        account_id: str | None = None,
        weight: float = 1.0,
        max_concurrent: int | None = None,
        budget: Sequence[BudgetWindow] = (),
        actor: Actor = SYSTEM,
    ) -> Account:
        if balance < 0:
            raise InvalidRequestError("'balance' cannot be negative", param="balance")
        _check_scheduling(weight, max_concurrent)
        windows = budgets.checked(budget)
        acc = Account(
            account_id or new_id("acct"), name, balance, 0, False, self.clock(),
            weight, max_concurrent,
        )  # fmt: skip

        def tx_fn(tx: Tx, trail: AuditTrail) -> Account:
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
            budgets.replace(tx, "account", acc.id, windows, acc.created)
            trail.record("account.created", "account", acc.id, None, account_state(tx, acc))
            return acc

        return await self.audited(actor, tx_fn)

    async def get_account(self, account_id: str) -> Account | None:
        row = await self._run(
            lambda tx: tx.one(
                f"SELECT {rows.ACCOUNT_COLS} FROM accounts WHERE id = ?", (account_id,)
            )
        )
        return None if row is None else rows.account(row)

    async def add_credits(self, account_id: str, amount: int, *, actor: Actor = SYSTEM) -> Account:
        def tx_fn(tx: Tx, trail: AuditTrail) -> Account:
            before = self._account(tx, account_id, self.lock)
            before_state = account_state(tx, before)
            if before.balance + amount < 0:
                raise InvalidRequestError(
                    f"cannot remove {-amount} micro-units: the balance is {before.balance}",
                    param="amount",
                )
            tx.run("UPDATE accounts SET balance = balance + ? WHERE id = ?", (amount, account_id))
            tx.run(
                "INSERT INTO credits (account_id, amount, created) VALUES (?, ?, ?)",
                (account_id, amount, self.clock()),
            )
            after = self._account(tx, account_id)
            trail.record(
                "account.credited", "account", account_id,
                before_state, account_state(tx, after),
            )  # fmt: skip
            return after

        return await self.audited(actor, tx_fn)

    async def update_account(
        self,
        account_id: str,
        *,
        weight: float | Keep = KEEP,
        max_concurrent: int | Keep | None = KEEP,
        budget: Sequence[BudgetWindow] | Keep = KEEP,
        actor: Actor = SYSTEM,
    ) -> Account:
        """Change an account's fair-share settings and budget (what is given; KEEP the
        rest)."""
        _check_scheduling(weight, max_concurrent)
        windows = None if isinstance(budget, Keep) else budgets.checked(budget)
        changes: dict[str, Any] = {}
        if not isinstance(weight, Keep):
            changes["weight"] = weight
        if not isinstance(max_concurrent, Keep):
            changes["max_concurrent"] = max_concurrent

        def tx_fn(tx: Tx, trail: AuditTrail) -> Account:
            before = self._account(tx, account_id, self.lock)
            before_state = account_state(tx, before)
            if changes:
                columns = ", ".join(f"{name} = ?" for name in changes)
                tx.run(
                    f"UPDATE accounts SET {columns} WHERE id = ?", (*changes.values(), account_id)
                )
            if windows is not None:
                budgets.replace(tx, "account", account_id, windows, self.clock())
            after = self._account(tx, account_id)
            trail.record(
                "account.updated", "account", account_id,
                before_state, account_state(tx, after),
            )  # fmt: skip
            return after

        return await self.audited(actor, tx_fn)

    # -- keys ---------------------------------------------------------------------
    async def create_key(
        self,
        account_id: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        priority: KeyPriority = "default",
        budget: Sequence[BudgetWindow] = (),
        actor: Actor = SYSTEM,
    ) -> tuple[KeyInfo, str]:
        plaintext = new_key()
        key_id = new_id("key")
        windows = budgets.checked(budget)

        def tx_fn(tx: Tx, trail: AuditTrail) -> KeyInfo:
            if tx.one("SELECT 1 FROM accounts WHERE id = ?", (account_id,)) is None:
                raise ResourceNotFoundError(f"no account {account_id!r}", code="account_not_found")
            tx.run(
                "INSERT INTO api_keys (id, account_id, key_hash, rpm, tpm, created, priority) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key_id, account_id, hash_key(plaintext), rpm, tpm, self.clock(), priority),
            )
            budgets.replace(tx, "key", key_id, windows, self.clock())
            info = self._key(tx, key_id)
            assert info is not None  # inserted just above
            trail.record("key.created", "key", key_id, None, key_state(tx, info))
            return info

        return await self.audited(actor, tx_fn), plaintext

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
        return await self._run(lambda tx: self._key(tx, key_id))

    async def update_key(
        self,
        key_id: str,
        *,
        priority: KeyPriority | Keep = KEEP,
        budget: Sequence[BudgetWindow] | Keep = KEEP,
        actor: Actor = SYSTEM,
    ) -> KeyInfo | None:
        """Change a key's class and budget (what is given; KEEP the rest); None: no
        such key."""
        windows = None if isinstance(budget, Keep) else budgets.checked(budget)

        def tx_fn(tx: Tx, trail: AuditTrail) -> KeyInfo | None:
            before = self._key(tx, key_id, lock=True)
            if before is None:
                return None
            before_state = key_state(tx, before)
            if not isinstance(priority, Keep):
                tx.run("UPDATE api_keys SET priority = ? WHERE id = ?", (priority, key_id))
            if windows is not None:
                # Under its account's lock, as every hold that counts in its windows.
                self._account(tx, before.account_id, self.lock)
                budgets.replace(tx, "key", key_id, windows, self.clock())
            after = self._key(tx, key_id)
            assert after is not None
            trail.record("key.updated", "key", key_id, before_state, key_state(tx, after))
            return after

        return await self.audited(actor, tx_fn)

    async def set_key_priority(
        self, key_id: str, priority: KeyPriority, *, actor: Actor = SYSTEM
    ) -> KeyInfo | None:
        return await self.update_key(key_id, priority=priority, actor=actor)

    async def revoke_key(self, key_id: str, *, actor: Actor = SYSTEM) -> KeyInfo | None:
        def tx_fn(tx: Tx, trail: AuditTrail) -> KeyInfo | None:
            before = self._key(tx, key_id, lock=True)
            if before is None:
                return None
            tx.run(
                "UPDATE api_keys SET revoked = ? WHERE id = ? AND revoked IS NULL",
                (self.clock(), key_id),
            )
            after = self._key(tx, key_id)
            assert after is not None
            trail.record("key.revoked", "key", key_id, key_state(tx, before), key_state(tx, after))
            return after

        return await self.audited(actor, tx_fn)

    # -- budgets ------------------------------------------------------------------
    async def budget_states(self, owner_type: OwnerType, owner_id: str) -> list[BudgetState]:
        """A key's or account's budget windows as they stand now."""
        return await self._run(lambda tx: budgets.states(tx, owner_type, owner_id, self.clock()))

    async def all_budget_states(self) -> list[tuple[str, str, BudgetState]]:
        """Every budget window of every key and account: (owner type, owner id, state)."""
        return await self._run(lambda tx: budgets.all_states(tx, self.clock()))
