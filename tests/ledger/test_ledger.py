"""The ledger's behaviour, the same suite on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest

from tests.waiting import HANG_S, wait_until
from tokenmill.errors import (
    InvalidRequestError,
    OverloadedError,
    PaymentRequiredError,
    ResourceNotFoundError,
    UnauthenticatedError,
)
from tokenmill.ledger import ledger_from_url
from tokenmill.ledger.base import HoldProgress, HoldSpec, hash_key
from tokenmill.ledger.ratelimits import RATE_WINDOW_S
from tokenmill.ledger.sql import SqlLedger

# The start of a rate window (a minute of 2023): tests step from there.
WINDOW_START = 28_333_333 * RATE_WINDOW_S


class SetClock:
    """A wall clock that moves only when the test moves it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def spec(
    request_id: str,
    account: str,
    amount: int,
    *,
    key: str | None = None,
    prompt: int = 10,
    max_tokens: int = 20,
    min_charge: int = 0,
) -> HoldSpec:
    return HoldSpec(request_id, account, key, "dep", prompt, max_tokens, amount, min_charge)


async def settle(ledger: SqlLedger, rid: str, charged: int, completion: int = 5) -> None:
    await ledger.settle(
        rid, prompt_tokens=10, completion_tokens=completion, finish_reason="stop", charged=charged
    )


async def test_hold_then_settle_charges_and_releases(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("alice", 1000)
    await ledger.hold(spec("r1", acc.id, 300))
    after_hold = await ledger.get_account(acc.id)
    assert after_hold is not None and (after_hold.balance, after_hold.held) == (1000, 300)
    await settle(ledger, "r1", 120)
    done = await ledger.get_account(acc.id)
    assert done is not None and (done.balance, done.held) == (880, 0)
    receipt = await ledger.receipt("r1")
    assert receipt is not None
    assert (receipt.charged, receipt.held, receipt.completion_tokens) == (120, 300, 5)
    assert await ledger.open_holds(acc.id) == 0


async def test_settle_is_exactly_once(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("bob", 1000)
    await ledger.hold(spec("r1", acc.id, 500))
    await asyncio.gather(*(settle(ledger, "r1", 400) for _ in range(10)))
    await settle(ledger, "r1", 10)  # a late, different settlement changes nothing
    done = await ledger.get_account(acc.id)
    assert done is not None and (done.balance, done.held) == (600, 0)
    assert [r.charged for r in await ledger.usage(acc.id)] == [400]


async def test_charge_never_exceeds_the_hold(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("carol", 100)
    await ledger.hold(spec("r1", acc.id, 100))
    await settle(ledger, "r1", 10_000)
    done = await ledger.get_account(acc.id)
    assert done is not None and (done.balance, done.held) == (0, 0)


async def test_insufficient_credit_counts_open_holds(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("dave", 100)
    await ledger.hold(spec("r1", acc.id, 60))
    with pytest.raises(PaymentRequiredError) as e:
        await ledger.hold(spec("r2", acc.id, 41))
    assert e.value.status == 402 and "40 available" in e.value.message
    await ledger.hold(spec("r3", acc.id, 40))
    assert await ledger.open_holds(acc.id) == 2


async def test_anonymous_is_unlimited_but_recorded(ledger: SqlLedger) -> None:
    await ledger.hold(spec("r1", "anonymous", 10**12))
    await settle(ledger, "r1", 10**11)
    receipt = await ledger.receipt("r1")
    assert receipt is not None and receipt.charged == 10**11
    anon = await ledger.get_account("anonymous")
    assert anon is not None and anon.unlimited and anon.balance == 0 and anon.held == 0


async def test_duplicate_request_id_is_refused(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("erin", 100)
    await ledger.hold(spec("r1", acc.id, 10))
    await settle(ledger, "r1", 10)
    with pytest.raises(InvalidRequestError):
        await ledger.hold(spec("r1", acc.id, 10))


async def test_concurrent_holds_cannot_overdraw(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    # Two ledgers = two gateways' connections, racing 200 holds on one account.
    a, b = make_ledger(), make_ledger()
    await a.open()
    await b.open()
    acc = await a.create_account("frank", 1000)

    async def try_hold(i: int) -> bool:
        try:
            await (a if i % 2 else b).hold(spec(f"r{i}", acc.id, 7))
            return True
        except PaymentRequiredError:
            return False

    results = await asyncio.gather(*(try_hold(i) for i in range(200)))
    assert sum(results) == 1000 // 7
    state = await a.get_account(acc.id)
    assert state is not None and state.held == 7 * (1000 // 7) <= state.balance
    # Settle them all concurrently too, from both sides: the books still balance.
    held = [i for i, ok in enumerate(results) if ok]
    await asyncio.gather(*(settle(a if i % 3 else b, f"r{i}", 5) for i in held))
    done = await a.get_account(acc.id)
    assert done is not None and done.held == 0 and done.balance == 1000 - 5 * len(held)


async def test_keys_are_stored_as_hashes_and_revocable(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("gina", 0)
    info, plaintext = await ledger.create_key(acc.id)
    assert plaintext.startswith("tm-") and len(plaintext) > 40
    resolved = await ledger.resolve_key(plaintext)
    assert resolved is not None and resolved.id == info.id and resolved.revoked is None
    assert await ledger.resolve_key(plaintext + "x") is None
    rows = await ledger._run(lambda tx: tx.all("SELECT key_hash FROM api_keys"))
    assert rows == [(hash_key(plaintext),)]
    revoked = await ledger.revoke_key(info.id)
    assert revoked is not None and revoked.revoked is not None
    with pytest.raises(UnauthenticatedError):
        await ledger.hold(spec("r1", acc.id, 0, key=info.id))


async def test_rate_limits_count_held_tokens(make_ledger: Callable[..., SqlLedger]) -> None:
    clock = SetClock(WINDOW_START + 15)
    ledger = make_ledger(clock)
    await ledger.open()
    acc = await ledger.create_account("hank", 10**6)
    info, _ = await ledger.create_key(acc.id, rpm=3, tpm=100)
    # Two in-flight requests of 10 + 30 tokens each: the third would pass 100.
    await ledger.hold(spec("r1", acc.id, 1, key=info.id, prompt=10, max_tokens=30))
    await ledger.hold(spec("r2", acc.id, 1, key=info.id, prompt=10, max_tokens=30))
    with pytest.raises(OverloadedError, match="tokens per minute") as e:
        await ledger.hold(spec("r3", acc.id, 1, key=info.id, prompt=10, max_tokens=30))
    assert e.value.status == 429 and e.value.retry_after == RATE_WINDOW_S - 15
    assert e.value.headers()["Retry-After"] == str(RATE_WINDOW_S - 15)
    # r1 used only 5 of its 30: the unused tokens return to the window.
    await settle(ledger, "r1", 1, completion=5)
    clock.now += 40  # still the same window
    await ledger.hold(spec("r4", acc.id, 1, key=info.id, prompt=10, max_tokens=30))
    with pytest.raises(OverloadedError, match="requests per minute") as e:
        await ledger.hold(spec("r5", acc.id, 1, key=info.id, prompt=1, max_tokens=1))
    assert e.value.retry_after == RATE_WINDOW_S - 55
    # The next window starts empty, whatever the last one held.
    clock.now = WINDOW_START + RATE_WINDOW_S
    await ledger.hold(spec("r6", acc.id, 1, key=info.id, prompt=10, max_tokens=90))


async def test_sweeper_settles_holds_of_a_dead_gateway(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    clock = SetClock(WINDOW_START)
    dead, alive = make_ledger(clock), make_ledger(clock)
    await dead.open()
    await alive.open()
    acc = await dead.create_account("ivan", 1000)
    await dead.hold(spec("r1", acc.id, 500, min_charge=30))
    await alive.hold(spec("r2", acc.id, 100))
    # The live gateway's own beat is fresh: nothing of a live gateway is swept.
    assert await alive.sweep(stale_s=30) == 0
    # ``dead`` stops beating (it crashed); once stale, ``alive`` settles its hold.
    clock.now += 30
    await alive.heartbeat()
    assert await alive.sweep(stale_s=30) == 0  # silent for exactly 30 s: not yet
    clock.now += 1
    await alive.heartbeat()
    assert await alive.sweep(stale_s=30) == 1
    receipt = await alive.receipt("r1")
    assert receipt is not None and receipt.finish_reason == "expired" and receipt.charged == 30
    state = await alive.get_account(acc.id)
    assert state is not None and (state.balance, state.held) == (970, 100)
    assert await alive.open_holds() == 1  # r2 belongs to the live gateway


async def test_sweeper_charges_a_dead_gateways_recorded_progress(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    clock = SetClock(WINDOW_START)
    dead, alive = make_ledger(clock), make_ledger(clock)
    await dead.open()
    await alive.open()
    acc = await dead.create_account("judy", 10_000)
    await dead.hold(spec("r1", acc.id, 500, max_tokens=20, min_charge=30))
    await dead.hold(spec("r2", acc.id, 500, max_tokens=20, min_charge=30))
    await dead.hold(spec("r3", acc.id, 500, max_tokens=20, min_charge=30))
    await alive.hold(spec("r4", acc.id, 500, max_tokens=20, min_charge=30))
    # One write for all of a gateway's holds; a later one replaces the count.
    await dead.record_progress([HoldProgress("r1", 3, 60), HoldProgress("r2", 25, 900)])
    await dead.record_progress([HoldProgress("r1", 7, 100)])
    # A gateway records only its own holds: r4 is ``alive``'s, "gone" is settled.
    await dead.record_progress([HoldProgress("r4", 9, 200), HoldProgress("gone", 1, 1)])
    clock.now += 31
    await alive.heartbeat()
    assert await alive.sweep(stale_s=30) == 3
    got = {rid: await alive.receipt(rid) for rid in ("r1", "r2", "r3")}
    summary = {
        rid: (r.finish_reason, r.completion_tokens, r.charged)
        for rid, r in got.items()
        if r is not None
    }
    assert summary == {
        "r1": ("expired", 7, 100),  # the last recorded count
        "r2": ("expired", 20, 500),  # never more than the hold's max_tokens and amount
        "r3": ("expired", 0, 30),  # no progress recorded: the prompt only
    }
    await alive.settle(
        "r4", prompt_tokens=10, completion_tokens=2, finish_reason="stop", charged=40
    )
    r4 = await alive.receipt("r4")
    assert r4 is not None and (r4.completion_tokens, r4.charged) == (2, 40)
    state = await alive.get_account(acc.id)
    assert state is not None and (state.balance, state.held) == (10_000 - 670, 0)


async def test_sqlite_opens_while_another_connection_holds_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A new file is switched to WAL, which SQLite refuses at once (no busy timeout)
    # while another connection holds a lock: a second gateway starting beside this one.
    path = tmp_path / "ledger.sqlite3"
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("CREATE TABLE other_tool (x INTEGER)")
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO other_tool VALUES (1)")
    caplog.set_level(logging.INFO, logger="tokenmill.ledger")
    led = ledger_from_url(f"sqlite:///{path}")
    opening = asyncio.create_task(led.open())

    def met_the_lock() -> bool:
        return any("is locked by another connection" in r.getMessage() for r in caplog.records)

    # The check polls in a thread: the loop must stay free to run open().
    await asyncio.to_thread(wait_until, met_the_lock, "the ledger to meet the lock")
    assert not opening.done()  # it met the lock and waits, instead of failing
    other.execute("COMMIT")
    other.close()
    try:
        await asyncio.wait_for(opening, HANG_S)
        acc = await led.create_account("after-the-lock", 5)
        got = await led.get_account(acc.id)
        assert got is not None and got.balance == 5
    finally:
        await led.close()


async def test_migrations_are_applied_once(make_ledger: Callable[..., SqlLedger]) -> None:
    first, second = make_ledger(), make_ledger()
    await asyncio.gather(first.open(), second.open())
    rows = await first._run(
        lambda tx: tx.all("SELECT version FROM schema_migrations ORDER BY version")
    )
    folder = resources.files("tokenmill.ledger") / "migrations" / first.dialect
    files = sorted(
        int(f.name.split("_", 1)[0]) for f in folder.iterdir() if f.name.endswith(".sql")
    )
    assert [int(r[0]) for r in rows] == files and files[:3] == [1, 2, 3]


async def test_fair_share_settings_are_stored_changed_and_read_with_the_key(
    ledger: SqlLedger,
) -> None:
    acc = await ledger.create_account("tenant", 10, weight=2.5, max_concurrent=3)
    assert (acc.weight, acc.max_concurrent) == (2.5, 3)
    plain = await ledger.create_account("plain")
    assert (plain.weight, plain.max_concurrent) == (1.0, None)
    info, key = await ledger.create_key(acc.id, priority="interactive")
    assert info.priority == "interactive"
    resolved = await ledger.resolve_key(key)
    assert resolved is not None
    assert (resolved.priority, resolved.weight, resolved.max_concurrent) == ("interactive", 2.5, 3)

    changed = await ledger.update_account(acc.id, max_concurrent=None)
    assert (changed.weight, changed.max_concurrent) == (2.5, None)  # weight kept
    changed = await ledger.update_account(acc.id, weight=4)
    assert (changed.weight, changed.max_concurrent) == (4.0, None)
    lowered = await ledger.set_key_priority(info.id, "batch")
    assert lowered is not None and lowered.priority == "batch"
    resolved = await ledger.resolve_key(key)
    assert resolved is not None and (resolved.priority, resolved.weight) == ("batch", 4.0)
    assert await ledger.set_key_priority("key_missing", "batch") is None


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"weight": 0.0}, "weight"),
        ({"weight": 5000.0}, "weight"),
        ({"max_concurrent": 0}, "max_concurrent"),
    ],
)
async def test_bad_fair_share_settings_are_refused_naming_the_field(
    ledger: SqlLedger, changes: dict[str, float], param: str
) -> None:
    acc = await ledger.create_account("tenant")
    with pytest.raises(InvalidRequestError) as caught:
        await ledger.update_account(acc.id, **changes)  # type: ignore[arg-type]
    assert caught.value.param == param
    with pytest.raises(ResourceNotFoundError):
        await ledger.update_account("acct_missing", weight=2.0)
