"""Stored responses in the ledger's database, the same suite on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.ledger import ResponseStore, SqlLedger

DAY_S = 24 * 3600.0
USER_TEXT = [{"type": "input_text", "text": "hi"}]
ITEMS: list[dict[str, Any]] = [
    {"type": "message", "id": "msg_1", "role": "user", "content": USER_TEXT},
    {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": '{"t": 3}'},
]
BODY: dict[str, Any] = {"id": "resp_1", "object": "response", "status": "completed", "output": []}


class SetClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_put_then_get_gives_back_items_and_body(ledger: SqlLedger) -> None:
    store = ResponseStore(ledger, retention_s=DAY_S)
    acc = await ledger.create_account("alice")
    put = await store.put("resp_1", acc.id, ITEMS, BODY)
    got = await store.get("resp_1", acc.id)
    assert got == put
    assert got.input_items == ITEMS
    assert got.body == BODY
    assert got.expires == got.created + DAY_S


async def test_another_account_neither_reads_nor_deletes(ledger: SqlLedger) -> None:
    store = ResponseStore(ledger, retention_s=DAY_S)
    alice = await ledger.create_account("alice")
    bob = await ledger.create_account("bob")
    await store.put("resp_1", alice.id, ITEMS, BODY)
    assert await store.get("resp_1", bob.id) is None
    assert await store.delete("resp_1", bob.id) is False
    assert await store.get("resp_1", alice.id) is not None


async def test_delete_once(ledger: SqlLedger) -> None:
    store = ResponseStore(ledger, retention_s=DAY_S)
    acc = await ledger.create_account("alice")
    await store.put("resp_1", acc.id, ITEMS, BODY)
    assert await store.delete("resp_1", acc.id) is True
    assert await store.get("resp_1", acc.id) is None
    assert await store.delete("resp_1", acc.id) is False
    assert await store.get("resp_unknown", acc.id) is None


async def test_expired_is_gone_then_swept(make_ledger: Callable[..., SqlLedger]) -> None:
    clock = SetClock(1_700_000_000.0)
    ledger = make_ledger(clock)
    await ledger.open()
    store = ResponseStore(ledger, retention_s=DAY_S)
    acc = await ledger.create_account("alice")
    await store.put("resp_old", acc.id, ITEMS, BODY)
    clock.now += DAY_S / 2
    await store.put("resp_new", acc.id, ITEMS, BODY)
    clock.now += DAY_S / 2
    assert await store.get("resp_old", acc.id) is None
    assert await store.delete("resp_old", acc.id) is False
    assert await store.get("resp_new", acc.id) is not None
    await ledger.sweep(stale_s=30)
    rows = await ledger.transact(lambda tx: tx.all("SELECT id FROM responses ORDER BY id"))
    assert [r[0] for r in rows] == ["resp_new"]


async def test_a_second_ledger_on_the_same_store_reads_it(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    first, second = make_ledger(), make_ledger()
    await first.open()
    await second.open()
    acc = await first.create_account("alice")
    await ResponseStore(first, retention_s=DAY_S).put("resp_1", acc.id, ITEMS, BODY)
    got = await ResponseStore(second, retention_s=DAY_S).get("resp_1", acc.id)
    assert got is not None and got.input_items == ITEMS
