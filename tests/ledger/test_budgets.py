"""Spend budgets that reset, the same suite on SQLite and on PostgreSQL: a hold that
would exceed a window of its key or account is refused with nothing held, settling
gives back what was not charged, a new window starts from 0, and concurrent holds
from two gateways never overshoot a window."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from tests.ledger.test_ledger import SetClock, settle, spec
from tokenmill.errors import InvalidRequestError, OverloadedError
from tokenmill.ledger import BudgetWindow
from tokenmill.ledger.sql import SqlLedger

# 2026-03-04 10:00:15 UTC, a Wednesday: 15 s into a minute, 10 hours into a day.
NOW = datetime(2026, 3, 4, 10, 0, 15, tzinfo=UTC).timestamp()
DAY_END = datetime(2026, 3, 5, tzinfo=UTC).timestamp()
HOUR_END = datetime(2026, 3, 4, 11, tzinfo=UTC).timestamp()


async def opened(make_ledger: Callable[..., SqlLedger], clock: SetClock) -> SqlLedger:
    ledger = make_ledger(clock)
    await ledger.open()
    return ledger


async def test_a_key_budget_refuses_what_would_exceed_it_and_holds_nothing(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    clock = SetClock(NOW)
    ledger = await opened(make_ledger, clock)
    acc = await ledger.create_account("acme", 10_000)
    key, _ = await ledger.create_key(acc.id, budget=[BudgetWindow(250, "24h")])
    await ledger.hold(spec("r1", acc.id, 100, key=key.id))
    await ledger.hold(spec("r2", acc.id, 100, key=key.id))
    with pytest.raises(OverloadedError) as refused:
        await ledger.hold(spec("r3", acc.id, 100, key=key.id))
    assert refused.value.code == "budget_exceeded" and refused.value.status == 429
    assert refused.value.retry_after == DAY_END - NOW
    assert "2026-03-05T00:00:00Z" in refused.value.message
    state = await ledger.get_account(acc.id)
    assert state is not None and state.held == 200  # r3 held nothing
    assert await ledger.open_holds(acc.id) == 2
    [window] = await ledger.budget_states("key", key.id)
    assert (window.spent, window.remaining, window.resets_at) == (200, 50, DAY_END)

    # Settled for less than held: the rest comes back to the window.
    await settle(ledger, "r1", 30)
    [window] = await ledger.budget_states("key", key.id)
    assert window.spent == 130
    await ledger.hold(spec("r3", acc.id, 100, key=key.id))
    await settle(ledger, "r2", 100)
    await settle(ledger, "r3", 70)
    [window] = await ledger.budget_states("key", key.id)
    assert window.spent == 30 + 100 + 70

    # The next day starts from 0, exactly.
    clock.now = DAY_END + 5
    [window] = await ledger.budget_states("key", key.id)
    assert (window.spent, window.remaining, window.window_start) == (0, 250, DAY_END)
    await ledger.hold(spec("r4", acc.id, 250, key=key.id))
    [window] = await ledger.budget_states("key", key.id)
    assert window.spent == 250


async def test_a_hold_of_the_last_window_keeps_its_charge_there(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    clock = SetClock(NOW)
    ledger = await opened(make_ledger, clock)
    acc = await ledger.create_account("late", 10_000)
    key, _ = await ledger.create_key(acc.id, budget=[BudgetWindow(100, "1h")])
    await ledger.hold(spec("old", acc.id, 100, key=key.id))
    clock.now = HOUR_END + 1
    await ledger.hold(spec("new", acc.id, 60, key=key.id))
    await settle(ledger, "old", 10)  # gives back nothing to the new window
    [window] = await ledger.budget_states("key", key.id)
    assert window.spent == 60


async def test_the_account_budget_covers_all_its_keys_and_the_latest_reset_answers(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    ledger = await opened(make_ledger, SetClock(NOW))
    acc = await ledger.create_account(
        "team", 10_000, budget=[BudgetWindow(300, "1h"), BudgetWindow(1000, "1d")]
    )
    k1, _ = await ledger.create_key(acc.id)
    k2, _ = await ledger.create_key(acc.id, budget=[BudgetWindow(200, "30m")])
    await ledger.hold(spec("a", acc.id, 150, key=k1.id))
    await ledger.hold(spec("b", acc.id, 150, key=k2.id))
    with pytest.raises(OverloadedError) as refused:
        await ledger.hold(spec("c", acc.id, 1, key=k1.id))
    assert refused.value.retry_after == HOUR_END - NOW  # the hour's window is the full one
    with pytest.raises(OverloadedError) as refused:
        await ledger.hold(spec("d", acc.id, 60, key=k2.id))  # over the key's 30m and the hour
    assert refused.value.retry_after == HOUR_END - NOW
    hour, day = await ledger.budget_states("account", acc.id)
    assert (hour.duration, hour.spent, day.duration, day.spent) == ("1h", 300, "1d", 300)


async def test_a_request_beyond_a_whole_window_is_a_400_not_a_429(ledger: SqlLedger) -> None:
    acc = await ledger.create_account("small", 10_000)
    key, _ = await ledger.create_key(acc.id, budget=[BudgetWindow(99, "1mo")])
    with pytest.raises(InvalidRequestError) as refused:
        await ledger.hold(spec("big", acc.id, 100, key=key.id))
    assert refused.value.code == "request_too_large" and refused.value.param == "max_tokens"
    assert await ledger.open_holds(acc.id) == 0


async def test_changing_a_budget_keeps_what_its_window_spent(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    ledger = await opened(make_ledger, SetClock(NOW))
    acc = await ledger.create_account("moving", 10_000)
    key, _ = await ledger.create_key(acc.id, budget=[BudgetWindow(500, "1d")])
    await ledger.hold(spec("r", acc.id, 120, key=key.id))
    await ledger.update_key(key.id, budget=[BudgetWindow(200, "1d"), BudgetWindow(50, "1h")])
    hour, day = await ledger.budget_states("key", key.id)  # shortest first
    assert (day.amount, day.spent, hour.amount, hour.spent) == (200, 120, 50, 0)
    await ledger.update_key(key.id, budget=[])
    assert await ledger.budget_states("key", key.id) == []
    await ledger.hold(spec("free", acc.id, 5000, key=key.id))


@pytest.mark.parametrize(
    ("window", "param"),
    [
        (BudgetWindow(10, "1w"), "budget.0"),
        (BudgetWindow(10, "1d", "Mars/Olympus_Mons"), "budget.0"),
        (BudgetWindow(-1, "1d"), "budget.0.amount"),
    ],
)
async def test_bad_windows_are_refused_naming_them(
    ledger: SqlLedger, window: BudgetWindow, param: str
) -> None:
    acc = await ledger.create_account("bad", 0)
    with pytest.raises(InvalidRequestError) as refused:
        await ledger.create_key(acc.id, budget=[window])
    assert refused.value.param == param
    with pytest.raises(InvalidRequestError, match="two windows"):
        await ledger.update_account(acc.id, budget=[BudgetWindow(1, "1d")] * 2)


async def test_concurrent_holds_from_two_gateways_never_overshoot_a_window(
    make_ledger: Callable[..., SqlLedger],
) -> None:
    clock = SetClock(NOW)
    a, b = make_ledger(clock), make_ledger(clock)
    await a.open()
    await b.open()
    acc = await a.create_account("raced", 10**6, budget=[BudgetWindow(1050, "1d")])
    key, _ = await a.create_key(acc.id, budget=[BudgetWindow(2000, "1h")])

    async def one(i: int) -> bool:
        gw = (a, b)[i % 2]
        try:
            await gw.hold(spec(f"r{i}", acc.id, 100, key=key.id))
        except OverloadedError:
            return False
        return True

    admitted = await asyncio.gather(*(one(i) for i in range(64)))
    assert sum(admitted) == 10  # 10 x 100 fit in the account's 1050
    [day] = await b.budget_states("account", acc.id)
    assert day.spent == 1000
    state = await b.get_account(acc.id)
    assert state is not None and state.held == 1000
