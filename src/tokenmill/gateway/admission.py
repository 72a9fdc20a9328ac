"""Admission: a bounded, fair queue in front of a deployment's slots.

A request either gets its slots now, waits in a queue of at most ``max_queue`` for at
most ``queue_timeout_s``, or is refused with :class:`OverloadedError` (429 with
``Retry-After``). Nothing waits unboundedly and an admitted request is never dropped.
Released slots go straight to the next waiter, so capacity returns to the pool the
instant a stream ends.

Which waiter is next is :mod:`tokenmill.gateway.fairqueue`'s decision (priority
class, then fair share between accounts, then arrival order within one account), or
plain arrival order with ``fair = False``. The service it shares out is counted by
:meth:`Admission.serve` as the tokens are produced.

A request takes one slot per choice it generates (``n``, several prompts): its
``weight``. A heavy request that is next waits until its slots are free, and lighter
ones do not overtake it (they would starve it).

An account with ``max_concurrent`` runs at most that many requests at once here, and
has at most as many again waiting (its own share of the queue): a request beyond
that is refused with 429 ``account_concurrency_exceeded``, so one tenant cannot fill
``max_queue``.

Capacity follows the replicas that can serve (:meth:`Admission.resize`): while a
replica restarts its slots leave the pool, and with none left requests wait in the
queue for one to come back instead of failing at once; a request that waited out
its timeout with no replica at all gets 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time

from tokenmill.config import DEFAULT_PROMOTE_AFTER_S
from tokenmill.errors import OverloadedError, UnavailableError
from tokenmill.gateway.fairqueue import AccountView, Entry, FairQueue
from tokenmill.identity import Tenant

ANYONE = Tenant()
# Requests an account at its max_concurrent may keep waiting, per stream it may run:
# each running stream has one successor ready, so the account loses no turn, and a
# flood beyond that is refused instead of filling the queue for everyone.
QUEUED_PER_STREAM = 1
# Permits given back before their smoothed hold time is taken as measured.
TURNOVER_SAMPLES = 8


class Admission:
    def __init__(
        self,
        capacity: int,
        max_queue: int,
        queue_timeout_s: float,
        *,
        fair: bool = True,
        promote_after_s: float = DEFAULT_PROMOTE_AFTER_S,
    ) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0  # slots held by admitted requests
        self._queue: FairQueue[asyncio.Future[None]] = FairQueue(
            fair=fair, promote_after_s=promote_after_s
        )
        # Smoothed seconds a permit is held, to tell refused callers when to come back.
        self._hold_s = 1.0
        # When a request of a class above ``batch`` last asked for a slot (monotonic).
        self.last_urgent = -float("inf")
        self._released = 0  # permits given back: how far ``_hold_s`` is measured

    @property
    def fair(self) -> bool:
        return self._queue.fair

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def waiting_by_class(self) -> dict[str, int]:
        """Requests queued, by the priority class they asked for."""
        counts: dict[str, int] = {}
        for entry in self._queue:
            counts[entry.tenant.priority] = counts.get(entry.tenant.priority, 0) + 1
        return counts

    def accounts(self) -> list[AccountView]:
        return self._queue.accounts()

    def turnover_s(self) -> float | None:
        """How often a slot frees, on average, once a few permits were given back
        (None before: not measured yet)."""
        if self._released < TURNOVER_SAMPLES or self.capacity <= 0:
            return None
        return self._hold_s / self.capacity

    def retry_after(self) -> float:
        per_slot = self._hold_s / max(1, self.capacity)
        return max(1.0, per_slot * (len(self._queue) + 1))

    async def acquire(self, weight: int = 1, tenant: Tenant = ANYONE) -> float:
        """Take ``weight`` slots for ``tenant``; return the seconds spent queued."""
        self._check_share(tenant)
        start = time.monotonic()
        if tenant.priority != "batch":
            self.last_urgent = start  # a Batch API batch makes room (gateway.idle)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = self._queue.push(fut, tenant, weight, start)
        self._grant()
        if fut.done():
            return 0.0
        if len(self._queue) > self.max_queue:
            self._remove(entry)
            raise OverloadedError(
                f"the deployment is at capacity ({self.capacity} running, "
                f"{len(self._queue)} queued); retry later",
                retry_after=self.retry_after(),
            )
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return time.monotonic() - start  # granted at the last moment: keep it
            fut.cancel()
            self._remove(entry)
            if self.capacity == 0:
                raise UnavailableError(
                    f"no replica was ready to serve within {self.queue_timeout_s:g}s; retry later",
                    retry_after=self.retry_after(),
                ) from None
            raise OverloadedError(
                f"the request waited {self.queue_timeout_s:g}s in the queue without "
                "getting a slot; retry later",
                retry_after=self.retry_after(),
                code="queue_timeout",
            ) from None
        except BaseException:
            # Cancelled while queued (client gone): give back slots granted meanwhile.
            if fut.done() and not fut.cancelled():
                self.release(weight=weight, account=tenant.account)
            else:
                fut.cancel()
                self._remove(entry)
            raise
        return time.monotonic() - start

    def _check_share(self, tenant: Tenant) -> None:
        cap = tenant.max_concurrent
        if cap is None or not self.fair:
            return
        account = tenant.account
        if self._queue.running(account) + self._queue.queued(account) < cap * (
            1 + QUEUED_PER_STREAM
        ):
            return
        raise OverloadedError(
            f"this account runs at most {cap} stream(s) at once on this deployment, "
            f"with {cap * QUEUED_PER_STREAM} more waiting, and has that many open; "
            "retry when one ends",
            retry_after=max(1.0, self._hold_s),
            code="account_concurrency_exceeded",
        )

    def release(
        self, held_s: float | None = None, weight: int = 1, account: str = ANYONE.account
    ) -> None:
        if held_s is not None:
            self._hold_s = 0.8 * self._hold_s + 0.2 * held_s
            self._released += 1
        self.active -= weight
        self._queue.finish(account)
        self._grant()

    def serve(self, account: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count tokens produced for ``account``: its share of what follows shrinks."""
        self._queue.serve(account, prompt_tokens, completion_tokens)

    def _grant(self) -> None:
        """Hand free slots to the waiters the queue names, while the next one fits."""
        now = time.monotonic()
        while True:
            entry = self._queue.pop_next(self.capacity - self.active, now)
            if entry is None:
                return
            if entry.item.done():  # gave up meanwhile: it took no slots
                self._queue.finish(entry.tenant.account)
                continue
            self.active += entry.slots
            entry.item.set_result(None)

    def _remove(self, entry: Entry[asyncio.Future[None]]) -> None:
        self._queue.remove(entry)  # False when already handed its slots
        self._grant()  # a heavy head that gave up may have held lighter ones back

    def resize(self, capacity: int) -> None:
        """Change the slot count (replicas added or lost); wake waiters that now fit."""
        self.capacity = capacity
        self._grant()
