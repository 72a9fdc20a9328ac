"""Admission: a bounded FIFO queue in front of a deployment's slots.

A request either gets its slots now, waits in a queue of at most ``max_queue`` for at
most ``queue_timeout_s``, or is refused with :class:`OverloadedError` (429 with
``Retry-After``). Nothing waits unboundedly and an admitted request is never dropped.
Released slots go straight to the oldest waiter, so capacity returns to the pool the
instant a stream ends.

A request takes one slot per choice it generates (``n``, several prompts): its
``weight``. Waiters are served strictly in order: a heavy request at the head waits
until its slots are free, and lighter ones behind it do not overtake it (they would
starve it).

Capacity follows the replicas that can serve (:meth:`Admission.resize`): while a
replica restarts its slots leave the pool, and with none left requests wait in the
queue for one to come back instead of failing at once; a request that waited out
its timeout with no replica at all gets 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

from tokenmill.errors import OverloadedError, UnavailableError


@dataclass(slots=True, eq=False)
class _Waiter:
    future: asyncio.Future[None]
    weight: int


class Admission:
    def __init__(self, capacity: int, max_queue: int, queue_timeout_s: float) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0  # slots held by admitted requests
        self._waiters: collections.deque[_Waiter] = collections.deque()
        # Smoothed seconds a permit is held, to tell refused callers when to come back.
        self._hold_s = 1.0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def retry_after(self) -> float:
        per_slot = self._hold_s / max(1, self.capacity)
        return max(1.0, per_slot * (len(self._waiters) + 1))

    async def acquire(self, weight: int = 1) -> float:
        """Take ``weight`` slots; return the seconds spent queued."""
        if self.active + weight <= self.capacity and not self._waiters:
            self.active += weight
            return 0.0
        if len(self._waiters) >= self.max_queue:
            raise OverloadedError(
                f"the deployment is at capacity ({self.capacity} running, "
                f"{len(self._waiters)} queued); retry later",
                retry_after=self.retry_after(),
            )
        start = time.monotonic()
        waiter = _Waiter(asyncio.get_running_loop().create_future(), weight)
        fut = waiter.future
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return time.monotonic() - start  # granted at the last moment: keep it
            fut.cancel()
            self._remove(waiter)
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
                self.release(weight=weight)
            else:
                fut.cancel()
                self._remove(waiter)
            raise
        return time.monotonic() - start

    def release(self, held_s: float | None = None, weight: int = 1) -> None:
        if held_s is not None:
            self._hold_s = 0.8 * self._hold_s + 0.2 * held_s
        self.active -= weight
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to the waiters, oldest first, while the oldest fits."""
        waiters = self._waiters
        while waiters:
            head = waiters[0]
            if head.future.done():  # gave up meanwhile
                waiters.popleft()
                continue
            if self.active + head.weight > self.capacity:
                return
            waiters.popleft()
            self.active += head.weight
            head.future.set_result(None)

    def _remove(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:  # else already handed its slots and popped
            self._waiters.remove(waiter)
        self._grant()  # a heavy head that gave up may have held lighter ones back

    def resize(self, capacity: int) -> None:
        """Change the slot count (replicas added or lost); wake waiters that now fit."""
        self.capacity = capacity
        self._grant()
