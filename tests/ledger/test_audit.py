"""The audit log, the same suite on SQLite and on PostgreSQL: every admin change
appends one entry in its own transaction (a change that fails leaves none), the
table refuses to be rewritten, and committed entries are logged as JSON lines."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Callable

import psycopg
import pytest

from tokenmill.errors import InvalidRequestError, ResourceNotFoundError
from tokenmill.ledger import SYSTEM, Actor, AuditLog, AuditQuery
from tokenmill.ledger.audit import AuditTrail
from tokenmill.ledger.batches import BatchStore, LineSpec
from tokenmill.ledger.database import Tx
from tokenmill.ledger.files import FileStore
from tokenmill.ledger.sql import SqlLedger

ADMIN = Actor("admin", "req-admin")
# What the database raises when a statement breaks a constraint or a trigger refuses it.
DB_ERRORS = (sqlite3.DatabaseError, psycopg.Error)


async def entries(ledger: SqlLedger, **query: object) -> list[dict[str, object]]:
    page = await AuditLog(ledger).page(AuditQuery(**query))  # type: ignore[arg-type]
    return [e.to_json() for e in page.data]


def logged(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenmill.audit"]


async def test_every_admin_change_is_one_entry_with_before_and_after(
    ledger: SqlLedger, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.audit")
    acc = await ledger.create_account("acme", 100, actor=ADMIN)
    await ledger.add_credits(acc.id, 50, actor=ADMIN)
    await ledger.update_account(acc.id, weight=2.0, max_concurrent=3, actor=ADMIN)
    key, _ = await ledger.create_key(acc.id, rpm=10, tpm=None, actor=ADMIN)
    await ledger.set_key_priority(key.id, "batch", actor=ADMIN)
    revoked = await ledger.revoke_key(key.id, actor=Actor("admin", "req-revoke"))
    assert revoked is not None and revoked.revoked is not None

    found = await entries(ledger)
    assert [e["action"] for e in found] == [
        "key.revoked",
        "key.updated",
        "key.created",
        "account.updated",
        "account.credited",
        "account.created",
    ]
    ids = [e["id"] for e in found]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 6  # type: ignore[type-var]
    assert {e["actor"] for e in found} == {"admin"}
    assert {e["gateway_id"] for e in found} == {ledger.gateway_id}
    by_action = {e["action"]: e for e in found}
    account_before = {
        "name": "acme", "balance": 100, "weight": 1.0, "max_concurrent": None, "budget": [],
    }  # fmt: skip
    assert by_action["account.created"]["before"] is None
    assert by_action["account.created"]["after"] == account_before
    assert by_action["account.created"]["target_type"] == "account"
    assert by_action["account.created"]["target_id"] == acc.id
    assert by_action["account.credited"]["before"] == account_before
    assert by_action["account.credited"]["after"] == {**account_before, "balance": 150}
    assert by_action["account.updated"]["after"] == {
        **account_before, "balance": 150, "weight": 2.0, "max_concurrent": 3,
    }  # fmt: skip
    key_new = {
        "account": acc.id, "rpm": 10, "tpm": None, "priority": "default", "revoked": None,
        "budget": [],
    }  # fmt: skip
    assert by_action["key.created"]["before"] is None
    assert by_action["key.created"]["after"] == key_new
    assert by_action["key.updated"]["after"] == {**key_new, "priority": "batch"}
    assert by_action["key.revoked"]["before"] == {**key_new, "priority": "batch"}
    assert by_action["key.revoked"]["after"] == {
        **key_new, "priority": "batch", "revoked": revoked.revoked,
    }  # fmt: skip
    assert by_action["key.revoked"]["request_id"] == "req-revoke"
    assert by_action["key.created"]["request_id"] == "req-admin"
    # Each committed entry is one JSON log line, in commit order.
    lines = logged(caplog)
    assert [line.pop("event") for line in lines] == ["audit"] * 6
    assert lines == found[::-1]


async def test_a_failing_change_leaves_no_entry(
    ledger: SqlLedger, caplog: pytest.LogCaptureFixture
) -> None:
    acc = await ledger.create_account("thrifty", 100, actor=ADMIN)
    caplog.set_level(logging.INFO, logger="tokenmill.audit")
    with pytest.raises(InvalidRequestError):
        await ledger.add_credits(acc.id, -101, actor=ADMIN)  # refused inside the transaction
    with pytest.raises(InvalidRequestError):
        await ledger.create_account("dup", account_id=acc.id, actor=ADMIN)
    with pytest.raises(ResourceNotFoundError):
        await ledger.create_key("acct_nobody", actor=ADMIN)
    with pytest.raises(ResourceNotFoundError):
        await ledger.update_account("acct_nobody", weight=2.0, actor=ADMIN)
    assert await ledger.revoke_key("key_nobody", actor=ADMIN) is None

    # A change whose entry is written and whose last statement the database refuses
    # (balance >= 0): the entry goes with the change.
    def overdraw(tx: Tx, trail: AuditTrail) -> None:
        trail.record("account.credited", "account", acc.id, {"balance": 100}, {"balance": -1})
        tx.run("UPDATE accounts SET balance = -1 WHERE id = ?", (acc.id,))

    with pytest.raises(DB_ERRORS):
        await ledger.audited(ADMIN, overdraw)
    state = await ledger.get_account(acc.id)
    assert state is not None and state.balance == 100
    assert [e["action"] for e in await entries(ledger)] == ["account.created"]
    assert logged(caplog) == []


async def test_a_change_that_changes_nothing_writes_nothing(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("idle", 0)
    key, _ = await ledger.create_key(acc.id)
    await ledger.revoke_key(key.id)
    await ledger.revoke_key(key.id)  # already revoked
    await ledger.add_credits(acc.id, 0)
    await ledger.update_account(acc.id, weight=1.0)  # the weight it has
    found = await entries(ledger)
    assert [e["action"] for e in found] == ["key.revoked", "key.created", "account.created"]
    assert {e["actor"] for e in found} == {SYSTEM.name}


async def test_the_log_is_append_only(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("kept", 5, actor=ADMIN)
    for statement in (
        "UPDATE audit_log SET actor = 'someone else'",
        "DELETE FROM audit_log",
    ):
        with pytest.raises(DB_ERRORS, match="append-only"):
            await ledger.transact(lambda tx, sql=statement: tx.run(sql))  # type: ignore[misc]
    if ledger.dialect == "postgresql":
        with pytest.raises(psycopg.Error, match="append-only"):
            await ledger.transact(lambda tx: tx.run("TRUNCATE audit_log"))
    [entry] = await entries(ledger)
    assert (entry["actor"], entry["target_id"]) == ("admin", acc.id)


async def test_paging_and_filters(ledger: SqlLedger) -> None:
    accounts = [await ledger.create_account(f"a{i}", actor=ADMIN) for i in range(5)]
    await ledger.create_key(accounts[0].id, actor=Actor("key:key_x"))
    for acc in accounts:
        await ledger.add_credits(acc.id, 7, actor=ADMIN)
    everything = await entries(ledger, limit=1000)
    assert len(everything) == 11

    pages: list[dict[str, object]] = []
    after = None
    while True:
        page = await AuditLog(ledger).page(AuditQuery(limit=4, after=after))
        pages += [e.to_json() for e in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert pages == everything

    credited = await entries(ledger, action="account.credited")
    assert [e["target_id"] for e in credited] == [a.id for a in reversed(accounts)]
    assert [e["action"] for e in await entries(ledger, actor="key:key_x")] == ["key.created"]
    assert [e["action"] for e in await entries(ledger, target_id=accounts[0].id)] == [
        "account.credited",
        "account.created",
    ]
    assert len(await entries(ledger, target_type="key")) == 1
    cut = float(everything[5]["at"])  # type: ignore[arg-type]
    assert all(float(e["at"]) >= cut for e in await entries(ledger, since=cut))  # type: ignore[arg-type]
    assert all(float(e["at"]) < cut for e in await entries(ledger, until=cut))  # type: ignore[arg-type]


async def test_concurrent_revocations_from_two_gateways_write_one_entry(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    a, b = make_ledger(), make_ledger()
    await a.open()
    await b.open()
    acc = await a.create_account("raced")
    key, _ = await a.create_key(acc.id)
    await asyncio.gather(
        *(gw.revoke_key(key.id, actor=Actor(f"admin-{i}")) for i, gw in enumerate([a, b] * 4))
    )
    revocations = await entries(a, action="key.revoked")
    assert len(revocations) == 1


async def test_a_cancelled_batch_is_audited_with_its_actor(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("batcher")
    store = BatchStore(ledger, FileStore(ledger, 3600.0))
    lines = [LineSpec(i, f"c{i}", "dep", "/v1/chat/completions", {}) for i in range(3)]
    fields = {"endpoint": "/v1/chat/completions", "input_file_id": "f", "completion_window": "24h"}
    batch = await store.create(acc.id, None, fields, 3600.0, lines)
    by = Actor("key:key_owner", "req-cancel")
    cancelled = await store.cancel(batch.id, acc.id, actor=by)
    assert cancelled is not None and cancelled.status == "cancelling"
    again = await store.cancel(batch.id, acc.id, actor=by)  # nothing left to change
    assert again is not None
    [entry] = await entries(ledger, target_type="batch")
    assert (entry["action"], entry["actor"], entry["request_id"]) == (
        "batch.cancelled",
        "key:key_owner",
        "req-cancel",
    )
    assert entry["before"] == {"account": acc.id, "status": "in_progress"}
    assert entry["after"] == {"account": acc.id, "status": "cancelling", "lines_not_run": 3}
