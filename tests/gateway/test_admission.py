"""Admission with weights: a request takes one slot per choice, and waits its turn.

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
