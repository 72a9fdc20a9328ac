"""How much of a deployment a Batch API batch may use: its idle capacity.

A batch's lines run in the lowest class of the fair queue, so a waiting request of
any other class is always admitted first; this decides how many lines are *started*
at all. Lines start only while nobody waits, and never into a deployment's last
slot (where it has two): a request that comes while a batch runs finds one free at
once, rather than waiting for a line to end. While no other traffic has come for
``QUIET_S``, a batch may fill every other slot; once other requests come, it keeps
to ``beside_share`` of the slots: the rest stay free for them, and each decode
step, shared by every running sequence, stays short (on a CPU a step's time grows
with the sequences in it, and a new request's first token waits for the step under
way and shares the next). Pure: tested without a model.
"""

from __future__ import annotations

# Seconds without another request after which a batch may take every slot.
QUIET_S = 10.0
# The share of the slots a batch keeps to while other requests come (at least one).
BESIDE_SHARE = 0.25


def usable(capacity: int, busy: bool, beside_share: float = BESIDE_SHARE) -> int:
    """The slots a batch may fill: all but one while it is alone (``busy`` False), else
    ``beside_share`` of them; at least one, and never the last where there are two."""
    if capacity < 2:
        return capacity
    if not busy:
        return capacity - 1
    return max(1, min(capacity - 1, int(capacity * beside_share)))


def batch_room(capacity: int, active: int, waiting: int, own: int, *, busy: bool = False) -> int:
    """How many more lines may start on a deployment with ``capacity`` slots,
    ``active`` of them taken, ``waiting`` requests queued, ``own`` lines already
    started by this runner (some not yet admitted, so not yet in ``active``), and
    other traffic seen lately (``busy``)."""
    if capacity <= 0 or waiting > 0:
        return 0
    most = usable(capacity, busy)
    return max(0, min(most - own, capacity - active))
