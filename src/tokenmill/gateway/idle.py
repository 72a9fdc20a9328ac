"""How much of a deployment a Batch API batch may use: its idle capacity.

A batch's lines run in the lowest class of the fair queue, so a waiting interactive
request is always admitted first; this decides how many lines are *started* at all.
Lines start only while nobody waits, and never into the last slots: those are kept
for the interactive requests that arrive while a batch runs, which would otherwise
wait for a line to finish. Pure: tested without a model.
"""

from __future__ import annotations


def reserve_for(capacity: int) -> int:
    """Slots a batch leaves free: one in eight, and at least one where there are two."""
    return 0 if capacity < 2 else max(1, capacity // 8)


def batch_room(capacity: int, active: int, waiting: int, own: int) -> int:
    """How many more lines may start on a deployment with ``capacity`` slots,
    ``active`` of them taken, ``waiting`` requests queued, and ``own`` lines already
    started by this runner (some not yet admitted, so not yet in ``active``)."""
    if capacity <= 0 or waiting > 0:
        return 0
    usable = capacity - reserve_for(capacity)
    return max(0, min(usable - own, usable - active))
