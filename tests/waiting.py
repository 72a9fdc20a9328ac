"""Waiting in tests: for a condition, never for a length of time.

A test that needs something to become true (a request queued, a replica back, a
receipt written) polls for it with :func:`wait_until`. Its timeout only stops a test
that would otherwise hang: it is far beyond any machine's slowness, so a slow or
loaded machine makes a test take longer, never fail. Where the order of two things is
the point, a test asserts the order (see ``tests/driver.py``), not a duration.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Only a hang gets this far; the per-test timeout (pyproject: 300 s) is the backstop.
HANG_S = 120.0
# Often enough not to slow a test, rarely enough not to load the machine.
POLL_S = 0.02


def wait_until(
    check: Callable[[], T | None],
    what: str,
    *,
    timeout: float = HANG_S,
    interval: float = POLL_S,
) -> T:
    """Call ``check`` until it returns something truthy, and return that.

    ``check`` may return None for "not yet": what comes back is never None, and is
    typed so (a ``dict | None`` check gives a ``dict``). ``what`` names the awaited
    condition for the failure message, which also shows the last value ``check``
    returned.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            assert value is not None  # for the type checker: truthy is never None
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g}s waiting for {what}; last: {value!r}")
        time.sleep(interval)


async def wait_until_async(
    check: Callable[[], T | None],
    what: str,
    *,
    limit_s: float = HANG_S,
    interval: float = POLL_S,
) -> T:
    """:func:`wait_until` for a test on the event loop: polls without blocking it."""
    deadline = time.monotonic() + limit_s
    while True:
        value = check()
        if value:
            assert value is not None
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {limit_s:g}s waiting for {what}; last: {value!r}")
        await asyncio.sleep(interval)
