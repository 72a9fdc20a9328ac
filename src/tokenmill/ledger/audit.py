"""The audit log: who changed what in the books, when, and from what to what.

Every admin change (an account created or changed, credit granted or removed, a key
created, changed or revoked, a batch cancelled) appends one entry to ``audit_log``
*inside the transaction that makes the change*, through an :class:`AuditTrail`: the
change and its entry commit together or not at all, so a change that fails leaves no
entry and no entry tells of a change that did not happen. A change that changes
nothing (revoking a revoked key, granting 0) writes none.

The table is append-only: the migration's triggers refuse any ``UPDATE`` or
``DELETE`` (and PostgreSQL's ``TRUNCATE``), and nothing here or in the sweeper ever
asks. Once committed, each entry is also written as one JSON log line on the
``tokenmill.audit`` logger (:func:`export`), for a log pipeline to keep elsewhere.

This module knows rows and JSON; it never knows HTTP. Who the actor is (the admin
key, an API key) is the caller's to say.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.ledger.database import Database, Tx

log = logging.getLogger("tokenmill.audit")

TargetType = Literal["account", "key", "batch"]
Action = Literal[
    "account.created",
    "account.updated",
    "account.credited",
    "key.created",
    "key.updated",
    "key.revoked",
    "batch.cancelled",
]
# The most entries one page lists.
MAX_PAGE = 1000
_COLS = (
    "id, at, actor, action, target_type, target_id, before_state, after_state, "
    "request_id, gateway_id"
)


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a change: ``admin`` (the admin key), ``key:<id>`` (an API key, for what
    an account may change of its own, such as cancelling its batch), or ``system`` (a
    program calling the ledger directly), and the request that asked."""

    name: str
    request_id: str | None = None


SYSTEM = Actor("system")


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    at: float
    actor: str
    action: str
    target_type: str
    target_id: str
    # The target as it was (None: it did not exist) and as it is now.
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    request_id: str | None
    gateway_id: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at,
            "actor": self.actor,
            "action": self.action,
            "target_type": self.target_type,
            "target_id": self.target_id,
            "before": self.before,
            "after": self.after,
            "request_id": self.request_id,
            "gateway_id": self.gateway_id,
        }


def _json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), sort_keys=True)


def _entry(row: Sequence[Any]) -> AuditEntry:
    before = None if row[6] is None else json.loads(row[6])
    after = None if row[7] is None else json.loads(row[7])
    return AuditEntry(
        int(row[0]), float(row[1]), row[2], row[3], row[4], row[5], before, after, row[8], row[9]
    )


@dataclass
class AuditTrail:
    """The entries one transaction appends, written as it goes; :func:`export` them
    once it has committed."""

    tx: Tx
    actor: Actor
    gateway_id: str
    at: float
    entries: list[AuditEntry] = field(default_factory=list)

    def record(
        self,
        action: Action,
        target_type: TargetType,
        target_id: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
    ) -> None:
        """Append an entry for this change, unless it changed nothing."""
        if before == after:
            return
        row = self.tx.one(
            "INSERT INTO audit_log (at, actor, action, target_type, target_id, before_state, "
            "after_state, request_id, gateway_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (
                self.at, self.actor.name, action, target_type, target_id, _json(before),
                _json(after), self.actor.request_id, self.gateway_id,
            ),
        )  # fmt: skip
        self.entries.append(
            AuditEntry(
                int(row[0]), self.at, self.actor.name, action, target_type, target_id,
                before, after, self.actor.request_id, self.gateway_id,
            )
        )  # fmt: skip


def export(entries: Iterable[AuditEntry]) -> None:
    """Write committed entries as JSON log lines (``tokenmill.audit``), one each."""
    for entry in entries:
        log.info(json.dumps({"event": "audit", **entry.to_json()}, sort_keys=False))


@dataclass(frozen=True, slots=True)
class AuditQuery:
    """Which entries to list, newest first: each given filter must match; ``after``
    is the id of the last entry of the previous page."""

    actor: str | None = None
    action: str | None = None
    target_type: str | None = None
    target_id: str | None = None
    since: float | None = None  # at or after this time (seconds since the epoch)
    until: float | None = None  # before this time
    after: int | None = None
    limit: int = 100


@dataclass(frozen=True, slots=True)
class AuditPage:
    data: list[AuditEntry]
    has_more: bool


class AuditLog:
    """The audit log of ``ledger``'s database, for readers."""

    def __init__(self, ledger: Database) -> None:
        self.ledger = ledger

    async def page(self, query: AuditQuery) -> AuditPage:
        where: list[str] = []
        params: list[Any] = []
        for column, value in (
            ("actor", query.actor),
            ("action", query.action),
            ("target_type", query.target_type),
            ("target_id", query.target_id),
        ):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if query.since is not None:
            where.append("at >= ?")
            params.append(query.since)
        if query.until is not None:
            where.append("at < ?")
            params.append(query.until)
        if query.after is not None:
            where.append("id < ?")
            params.append(query.after)
        sql = f"SELECT {_COLS} FROM audit_log"
        if where:
            sql += " WHERE " + " AND ".join(where)
        limit = max(1, min(query.limit, MAX_PAGE))
        rows = await self.ledger.transact(
            lambda tx: tx.all(sql + " ORDER BY id DESC LIMIT ?", [*params, limit + 1])
        )
        return AuditPage([_entry(r) for r in rows[:limit]], len(rows) > limit)
