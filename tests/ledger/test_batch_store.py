"""The Batch API's store on SQLite and PostgreSQL: a line is claimed by one gateway,
written only by the gateway that holds it, taken back from a dead one, and a batch is
finalized once, its output and error files written with it."""

from __future__ import annotations

import json
from collections.abc import Callable

from tokenmill.gateway.idle import batch_room, usable
from tokenmill.ledger.batches import BatchStore, LineSpec, output_line
from tokenmill.ledger.files import FileStore
from tokenmill.ledger.sql import SqlLedger

CHAT = "/v1/chat/completions"


def specs(n: int) -> list[LineSpec]:
    return [LineSpec(i, f"c{i}", "m", CHAT, {"messages": [], "n": i}) for i in range(n)]


async def new_batch(store: BatchStore, account: str, n: int, window_s: float = 3600.0) -> str:
    fields = {"endpoint": CHAT, "input_file_id": "file_x", "completion_window": "1h"}
    batch = await store.create(account, None, fields, window_s, specs(n))
    assert batch.status == "in_progress" and batch.total == n
    return batch.id


def ok(custom_id: str) -> dict[str, object]:
    return output_line(custom_id, "req", 200, {"ok": True})


async def test_two_gateways_never_claim_one_line(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    a, b = make_ledger(), make_ledger()
    await a.open()
    await b.open()
    acct = (await a.create_account("x", 0)).id
    sa, sb = BatchStore(a, FileStore(a, 60)), BatchStore(b, FileStore(b, 60))
    batch = await new_batch(sa, acct, 5)
    first = await sa.claim(a.gateway_id, "m", 3)
    second = await sb.claim(b.gateway_id, "m", 3)
    assert [c.line for c in first] == [0, 1, 2] and [c.line for c in second] == [3, 4]
    assert await sa.claim(a.gateway_id, "m", 3) == []
    assert await sa.claim(a.gateway_id, "other", 3) == []
    # Only the holder writes a line's outcome.
    assert not await sb.finish(first[0], b.gateway_id, "completed", ok("c0"))
    assert await sa.finish(first[0], a.gateway_id, "completed", ok("c0"))
    assert not await sa.finish(first[0], a.gateway_id, "failed", ok("c0"))
    # A line given back is claimed again, with a new request id; a skipped batch is not.
    assert await sa.unclaim(first[1], a.gateway_id)
    assert await sb.claim(b.gateway_id, "m", 3, skip=[batch]) == []
    again = await sb.claim(b.gateway_id, "m", 3)
    assert [c.line for c in again] == [1] and again[0].request_id != first[1].request_id
    assert again[0].attempts == 1
    got = await sa.get(batch, acct)
    assert got is not None and got.completed == 1 and got.status == "in_progress"
    assert await sa.get(batch, "someone-else") is None


async def test_a_batch_is_finalized_once_with_its_files(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    led = make_ledger()
    await led.open()
    acct = (await led.create_account("x", 0)).id
    files = FileStore(led, 60)
    store = BatchStore(led, files)
    batch = await new_batch(store, acct, 3)
    claimed = await store.claim(led.gateway_id, "m", 3)
    assert await store.finalize() == []  # lines still running
    await store.finish(claimed[0], led.gateway_id, "completed", ok("c0"))
    await store.finish(claimed[1], led.gateway_id, "failed", output_line("c1", "r", 400, {}))
    await store.finish(claimed[2], led.gateway_id, "completed", ok("c2"))
    (final,) = await store.finalize()
    assert final.status == "completed" and await store.finalize() == []
    got = await store.get(batch, acct)
    assert got is not None and got.status == "completed"
    assert (got.completed, got.failed, got.total) == (2, 1, 3)
    out = await files.content(final.output_file_id or "", acct)
    err = await files.content(final.error_file_id or "", acct)
    assert out is not None and err is not None
    assert [json.loads(x)["custom_id"] for x in out.decode().splitlines()] == ["c0", "c2"]
    assert [json.loads(x)["custom_id"] for x in err.decode().splitlines()] == ["c1"]
    assert await files.content(final.output_file_id or "", "someone-else") is None


async def test_cancel_and_expiry_end_lines_not_started(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    now = [1000.0]
    led = make_ledger(clock=lambda: now[0])
    await led.open()
    acct = (await led.create_account("x", 0)).id
    store = BatchStore(led, FileStore(led, 60))
    cancelled = await new_batch(store, acct, 3)
    running = (await store.claim(led.gateway_id, "m", 1))[0]
    got = await store.cancel(cancelled, acct)
    assert got is not None and got.status == "cancelling"
    assert await store.claim(led.gateway_id, "m", 5) == []
    assert await store.finalize() == []  # its running line finishes first
    await store.finish(running, led.gateway_id, "completed", ok("c0"))
    (final,) = await store.finalize()
    assert final.status == "cancelled" and final.lines == {"completed": 1, "cancelled": 2}

    expiring = await new_batch(store, acct, 2, window_s=10.0)
    running = (await store.claim(led.gateway_id, "m", 1))[0]
    now[0] += 11.0
    assert await store.claim(led.gateway_id, "m", 5) == []  # past its window
    assert await store.expire() == [expiring]
    await store.finish(running, led.gateway_id, "completed", ok("c0"))
    (final,) = await store.finalize()
    assert final.status == "expired" and final.lines == {"completed": 1, "expired": 1}


async def test_a_dead_gateways_lines_run_once_more_then_fail(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    now = [1000.0]
    dead, alive = make_ledger(clock=lambda: now[0]), make_ledger(clock=lambda: now[0])
    await dead.open()
    await alive.open()
    acct = (await alive.create_account("x", 0)).id
    sd, sa = BatchStore(dead, FileStore(dead, 60)), BatchStore(alive, FileStore(alive, 60))
    await new_batch(sa, acct, 1)
    (first,) = await sd.claim(dead.gateway_id, "m", 1)
    assert await sa.take_back(alive.gateway_id, 30.0) == 0  # its gateway still beats
    now[0] += 31.0
    await alive.heartbeat()
    assert await sa.take_back(alive.gateway_id, 30.0) == 1
    assert not await sd.finish(first, dead.gateway_id, "completed", ok("c0"))  # too late
    (second,) = await sd.claim(dead.gateway_id, "m", 1)  # it runs again (as if elsewhere)
    assert second.attempts == 2
    now[0] += 31.0
    await alive.heartbeat()
    assert await sa.take_back(alive.gateway_id, 30.0) == 1
    (final,) = await sa.finalize()
    assert final.lines == {"failed": 1}


async def test_files_are_owned_paged_and_kept_for_their_retention(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    now = [1000.0]
    led = make_ledger(clock=lambda: now[0])
    await led.open()
    a = (await led.create_account("a", 0)).id
    b = (await led.create_account("b", 0)).id
    files = FileStore(led, 100.0)
    made = []
    for i in range(3):
        made.append(await files.put(a, "batch", f"f{i}.jsonl", b"x" * i))
        now[0] += 1
    page = await files.page(a, limit=2)
    assert [f.id for f in page.data] == [made[2].id, made[1].id] and page.has_more
    rest = await files.page(a, limit=2, after=made[1].id)
    assert [f.id for f in rest.data] == [made[0].id] and not rest.has_more
    assert (await files.page(b)).data == []
    assert not await files.delete(made[0].id, b)
    assert await files.delete(made[0].id, a)
    now[0] += 100
    assert await files.get(made[2].id, a) is None  # past its retention
    await led.sweep(30.0)
    assert (await files.page(a)).data == []


def test_a_batch_starts_lines_only_into_idle_slots() -> None:
    assert [usable(c, busy=False) for c in (0, 1, 2, 8, 16)] == [0, 1, 1, 7, 15]
    # Beside other traffic: a quarter of the slots by default, at least one.
    assert [usable(c, busy=True) for c in (1, 2, 3, 8, 16)] == [1, 1, 1, 2, 4]
    assert usable(16, busy=True, beside_share=0.125) == 2
    # Slots measured to free quickly: a quiet deployment is filled whole.
    assert [usable(c, busy=False, turnover_s=0.1) for c in (1, 2, 8)] == [1, 2, 8]
    assert usable(8, busy=False, turnover_s=2.0) == 7
    assert usable(8, busy=True, turnover_s=0.1) == 2
    assert batch_room(16, active=0, waiting=0, own=0) == 15
    assert batch_room(16, active=10, waiting=0, own=4) == 6
    assert batch_room(16, active=4, waiting=0, own=10) == 5  # its own, not yet admitted
    assert batch_room(16, active=16, waiting=0, own=0) == 0
    assert batch_room(16, active=2, waiting=1, own=0) == 0  # someone waits: they go first
    # Other traffic came lately: its share of the slots, its own lines counted.
    assert batch_room(16, active=1, waiting=0, own=0, busy=True) == 4
    assert batch_room(16, active=8, waiting=0, own=3, busy=True) == 1
    assert batch_room(16, active=8, waiting=0, own=3, busy=True, beside_share=0.125) == 0
    assert batch_room(1, active=0, waiting=0, own=0) == 1
    assert batch_room(0, active=0, waiting=0, own=0) == 0
