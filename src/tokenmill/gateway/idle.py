"""How much of a deployment a Batch API batch may use: its idle capacity.

A batch's lines run in the lowest class of the fair queue, so a waiting request of
any other class is always admitted first; this decides how many lines are *started*
at all. Lines start only while nobody waits, and not into a deployment's last slot
(where it has two) unless slots are measured to free quickly: a request that comes
while a batch runs finds one free at once, or soon, rather than waiting for a long
line to end. While no other traffic has come for ``QUIET_S``, a batch may fill the
other slots; once other requests come, it keeps to ``beside_share`` of the slots:
the rest stay free for them, and each decode step, shared by every running
sequence, stays short (on a CPU a step's time grows with the sequences in it, and a
new request's first token waits for the step under way). Pure: tested without a
model.
"""

from __future__ import annotations

# Seconds without another request after which a batch may take every slot.
QUIET_S = 10.0
# The share of the slots a batch keeps to while other requests come (at least one):
# a deployment's ``batch_share``.
BESIDE_SHARE = 0.25
# A slot freeing at least this often (measured) need not be kept free: a request that
# comes finds one soon enough.
QUICK_TURNOVER_S = 0.25


def usable(
    capacity: int,
    busy: bool,
    turnover_s: float | None = None,
    beside_share: float = BESIDE_SHARE,
) -> int:
    """The slots a batch may fill. Alone (``busy`` False): all but one, or all of them
    where slots are measured to free every ``QUICK_TURNOVER_S`` or sooner
    (``turnover_s``); beside other traffic, ``beside_share`` of them, at least one and
    never the last where there are two."""
    if capacity < 2:
        return capacity
    if not busy:
        quick = turnover_s is not None and turnover_s <= QUICK_TURNOVER_S
        return capacity if quick else capacity - 1
    return max(1, min(capacity - 1, int(capacity * beside_share)))


def batch_room(
    capacity: int,
    active: int,
    waiting: int,
    own: int,
    *,
    busy: bool = False,
    turnover_s: float | None = None,
    beside_share: float = BESIDE_SHARE,
) -> int:
    """How many more lines may start on a deployment with ``capacity`` slots,
    ``active`` of them taken, ``waiting`` requests queued, ``own`` lines already
    started by this runner (some not yet admitted, so not yet in ``active``), other
    traffic seen lately (``busy``: then at most ``beside_share`` of the slots), and a
    slot freeing every ``turnover_s``."""
    if capacity <= 0 or waiting > 0:
        return 0
    most = usable(capacity, busy, turnover_s, beside_share)
    return max(0, min(most - own, capacity - active))
