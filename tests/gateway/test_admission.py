"""Admission with weights: a request takes one slot per choice, and waits its turn,
which fair queuing between accounts decides (the policy itself: test_fairqueue).

Driven directly on the event loop: what a waiter gets and when is ordered by the
test's own acquire and release calls, never by time.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.waiting import HANG_S, wait_until_async
from tokenmill.errors import OverloadedError
from tokenmill.gateway.admission import Admission
from tokenmill.identity import Tenant


async def queued(admission: Admission, n: int) -> None:
    await wait_until_async(lambda: admission.waiting == n, f"{n} waiter(s)")


async def test_a_heavy_request_waits_for_all_its_slots_and_is_not_overtaken() -> None:
    admission = Admission(capacity=4, max_queue=8, queue_timeout_s=HANG_S)
    assert await admission.acquire(1) == 0.0  # one slot busy
    heavy = asyncio.create_task(admission.acquire(4))
    await queued(admission, 1)
    light = asyncio.create_task(admission.acquire(1))
    await queued(admission, 2)
    # Three slots are free and the light request would fit, but it queued behind the
    # heavy one: letting it pass would starve the heavy request for as long as light
    # ones keep coming.
    assert not heavy.done() and not light.done()
    admission.release(weight=1)
    await heavy
    assert admission.active == 4 and not light.done()
    admission.release(weight=4)
    await light
    assert (admission.active, admission.waiting) == (1, 0)


async def test_a_heavy_head_that_gives_up_lets_the_rest_through() -> None:
    admission = Admission(capacity=4, max_queue=8, queue_timeout_s=HANG_S)
    await admission.acquire(2)
    heavy = asyncio.create_task(admission.acquire(4))
    await queued(admission, 1)
    light = asyncio.create_task(admission.acquire(2))
    await queued(admission, 2)
    heavy.cancel()  # the client left while queued
    with contextlib.suppress(asyncio.CancelledError):
        await heavy
    await light
    assert (admission.active, admission.waiting) == (4, 0)


async def test_capacity_coming_back_admits_a_request_once_all_its_slots_are_there() -> None:
    admission = Admission(capacity=0, max_queue=8, queue_timeout_s=HANG_S)
    wide = asyncio.create_task(admission.acquire(2))
    await queued(admission, 1)
    admission.resize(1)  # one replica slot back: not enough
    assert not wide.done() and admission.active == 0
    admission.resize(2)
    await wide
    assert admission.active == 2


async def test_a_full_queue_refuses_whatever_the_weight() -> None:
    admission = Admission(capacity=2, max_queue=1, queue_timeout_s=HANG_S)
    await admission.acquire(2)
    waiting = asyncio.create_task(admission.acquire(1))
    await queued(admission, 1)
    with pytest.raises(OverloadedError):
        await admission.acquire(1)
    admission.release(weight=2)
    await waiting
    assert admission.active == 1


async def test_a_light_tenant_is_admitted_ahead_of_a_floods_queue() -> None:
    admission = Admission(capacity=2, max_queue=32, queue_timeout_s=HANG_S)
    flood, light = Tenant("flood"), Tenant("light")
    await admission.acquire(1, flood)
    await admission.acquire(1, flood)
    admission.serve("flood", prompt_tokens=10, completion_tokens=30)
    waiting = [asyncio.create_task(admission.acquire(1, flood)) for _ in range(6)]
    await queued(admission, 6)
    mine = asyncio.create_task(admission.acquire(1, light))
    await queued(admission, 7)
    admission.release(weight=1, account="flood")
    await mine  # the next free slot, though six of the flood's came first
    assert not any(t.done() for t in waiting)
    for _ in range(6):
        admission.release(weight=1, account="flood")
        await wait_until_async(lambda: admission.active == 2, "the next flood request admitted")
    await asyncio.gather(*waiting)


async def test_an_account_at_its_cap_with_its_queue_share_used_is_refused() -> None:
    admission = Admission(capacity=8, max_queue=32, queue_timeout_s=HANG_S)
    capped = Tenant("capped", max_concurrent=2)
    await admission.acquire(1, capped)
    await admission.acquire(1, capped)
    # At its cap with slots free: its next requests wait for its own streams.
    queue = [asyncio.create_task(admission.acquire(1, capped)) for _ in range(2)]
    await queued(admission, 2)
    with pytest.raises(OverloadedError) as refused:
        await admission.acquire(1, capped)
    assert refused.value.code == "account_concurrency_exceeded"
    assert refused.value.retry_after >= 1
    # Another account is not held back by it.
    assert await admission.acquire(1, Tenant("other")) == 0.0
    admission.release(weight=1, account="capped")
    await queue[0]
    assert not queue[1].done()
    admission.release(weight=1, account="capped")
    await queue[1]
