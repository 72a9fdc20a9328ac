"""Recording how far open streams got, so that a gateway that dies still bills them.

A stream only bumps an in-memory count as each chunk goes out: nothing on the hot
path touches the meter. One task per gateway hands the counts that changed to the
meter once a second, in one call (the ledger writes them in one statement). A gateway
killed mid-stream thus leaves its holds with a count at most a second behind what it
delivered, never ahead of it, and the sweeper settles them on that count.

It must never slow or fail a stream: a write that fails is logged, and the counts go
again at the next tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Protocol

from tokenmill.metering import Meter, Progress

log = logging.getLogger("tokenmill.ledger")

# How often progress is written: what a dead gateway's bill may miss, in seconds of
# streaming, against one small write a second per gateway (bench/ledger_overhead.py).
PROGRESS_S = 1.0


class Tracked(Protocol):
    """An open stream, as the recorder sees it."""

    def progress(self) -> Progress | None:
        """Its progress, or None if unchanged since :meth:`recorded` was last told."""

    def recorded(self, progress: Progress) -> None:
        """``progress`` is in the books."""


async def record_once(meter: Meter, streams: Collection[Tracked]) -> int:
    """Write the progress of the streams that moved; how many that was."""
    # One pass without awaiting: the set of open streams cannot change under it.
    moved = [(s, p) for s in streams if (p := s.progress()) is not None]
    if not moved:
        return 0
    try:
        await meter.record_progress([p for _, p in moved])
    except Exception:
        log.exception("could not record the progress of %d stream(s); retrying", len(moved))
        return 0
    for stream, progress in moved:
        stream.recorded(progress)
    return len(moved)


async def record_progress(
    meter: Meter, streams: Collection[Tracked], interval_s: float = PROGRESS_S
) -> None:
    """Forever: every ``interval_s``, :func:`record_once` the ``streams`` open then
    (a live collection: the gateway's :class:`~tokenmill.gateway.core.OpenStreams`)."""
    while True:
        await asyncio.sleep(interval_s)
        await record_once(meter, streams)
