"""Admission: a bounded FIFO queue in front of a deployment's slots.

A request either gets a slot now, waits in a queue of at most ``max_queue`` for at
most ``queue_timeout_s``, or is refused with :class:`OverloadedError` (429 with
``Retry-After``). Nothing waits unboundedly and an admitted request is never dropped.
Releasing a permit hands it straight to the oldest waiter, so capacity returns to
the pool the instant a stream ends.

Capacity follows the replicas that can serve (:meth:`Admission.resize`): while a
replica restarts its slots leave the pool, and with none left requests wait in the
queue for one to come back instead of failing at once; a request that waited out
its timeout with no replica at all gets 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from tokenmill.errors import OverloadedError, UnavailableError


class Admission:
    def __init__(self, capacity: int, max_queue: int, queue_timeout_s: float) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # Smoothed seconds a permit is held, to tell refused callers when to come back.
        self._hold_s = 1.0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def retry_after(self) -> float:
        per_slot = self._hold_s / max(1, self.capacity)
        return max(1.0, per_slot * (len(self._waiters) + 1))

    async def acquire(self) -> float:
        """Take a permit; return the seconds spent queued."""
        if self.active < self.capacity and not self._waiters:
            self.active += 1
            return 0.0
        if len(self._waiters) >= self.max_queue:
            raise OverloadedError(
                f"the deployment is at capacity ({self.capacity} running, "
                f"{len(self._waiters)} queued); retry later",
                retry_after=self.retry_after(),
            )
        start = time.monotonic()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return time.monotonic() - start  # granted at the last moment: keep it
            fut.cancel()
            self._remove(fut)
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
            # Cancelled while queued (client gone): give back a permit granted meanwhile.
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                fut.cancel()
                self._remove(fut)
            raise
        return time.monotonic() - start

    def release(self, held_s: float | None = None) -> None:
        if held_s is not None:
            self._hold_s = 0.8 * self._hold_s + 0.2 * held_s
        if self.active > self.capacity:  # capacity shrank (a replica is down)
            self.active -= 1
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the permit passes on; active is unchanged
                return
        self.active -= 1

    def _remove(self, fut: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):  # already handed a permit and popped
            self._waiters.remove(fut)

    def resize(self, capacity: int) -> None:
        """Change the slot count (replicas added or lost); wake waiters that now fit."""
        self.capacity = capacity
        while self.active < self.capacity and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self.active += 1
