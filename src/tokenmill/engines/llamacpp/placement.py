"""Where a new request's KV cells come from: one decision, with the room it takes (pure).

A request about to be admitted takes a free slot, and the longest cached prefix of its
prompt comes from whatever holds the most of it: the slot itself (kept), another slot
(copied), a sequence parked in host memory (:mod:`.hosttier`, restored) or a file of
the disk tier (:mod:`.disktier`, read and restored). :func:`place` decides all of it
from plain values: the slots' records, the prompt, the best entry each tier offers
(:class:`~.kvslots.KvSlots` looks them up: that reads memory and files) and the pool's
room. It returns a :class:`KvPlacement` that ``KvSlots.assign`` only carries out, with
the :data:`Event` s to count once it has.

The slot, the copy and the parking of what the slot loses in another slot are
:func:`~.slots.plan_placement`'s; this adds, in this order:

* **The host tier**: its entry is restored when it shares at least
  ``KV_COPY_MIN_TOKENS`` more of the prompt than the slots offer, and its cells fit.
* **The disk tier**: its file is read and restored when it shares that much more than
  the slots and the host entry (if it fits) offer, and its cells fit. The file is read
  only once this is decided; should it not check out, :attr:`KvPlacement.fallback` is
  the placement without it.
* **Room**: in a unified pool (see :mod:`.context`), what takes cells (a restore, a
  copy, parking in another slot) needs that many free; free slots' cached cells are
  given up for them, least recently used first (:attr:`KvPlacement.evict`), as
  ``KvSlots.make_room`` does. The destination's own cells are given back first, so a
  restore needs the entry's cells less the destination's. An entry that does not fit
  is not restored; a copy that does not fit is not made (the prompt is computed after
  the destination's own prefix); a parking that does not fit is not done. Cells given
  up for a room check that then fails stay given up.
* **A tight span for a long prefill**: llama.cpp's attention in a unified pool reads
  every cell up to the highest one in use, whichever sequence holds it (the mask
  drops the others' cells from the result, not from the work: each still costs every
  prompt row, as measured at ``SPAN_PREFILL_MIN``). Before ``SPAN_PREFILL_MIN`` or more
  prompt tokens are computed, with the host tier on, every other free slot gives up
  the cells it does not share with ``dest`` (:attr:`KvPlacement.trim`; parked in host
  memory first, as a slot given up for room is): the new tokens then fill the cells freed
  below the highest instead of reading past them, and the prefill costs what it does
  on a fresh replica. A copy's source keeps the prefix ``dest`` shares (those cells
  stay anyway).

llama.cpp may still refuse a restored state: :func:`refused` is the placement then.

No llama.cpp and no I/O here: ``tests/engines/test_placement.py`` checks every branch
without a model.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TypeVar

from tokenmill.engines.llamacpp.slots import (
    KV_COPY_MIN_TOKENS,
    Placement,
    Slot,
    common_prefix,
    plan_placement,
)

__all__ = [
    "SPAN_PREFILL_MIN",
    "DiskOffer",
    "DiskRestored",
    "Event",
    "HostOffer",
    "HostRestored",
    "KvCopied",
    "KvPlacement",
    "Room",
    "Source",
    "place",
    "refused",
]

S = TypeVar("S")

# Prompt tokens still to compute from which a placement trims the free slots (see the
# module's docstring). Measured here (SmolLM2-135M, q8_0, 2 threads, a 512-row chunk
# after 2,048 cached tokens, 4,096 cells of another sequence in the span or not, four
# runs each interleaved): every prompt row reads every cell of the span, ~155 ns a
# cell; parking a cell costs ~15 us (``llama_state_seq_get_data``) and restoring it
# ~2.4 us. Trimming pays from ~120 rows; this is four times that, one prefill chunk.
SPAN_PREFILL_MIN = 512


class Source(Enum):
    """Where the prompt's reused prefix comes from."""

    NONE = "none"  # dest's own cached prefix (or nothing)
    SLOT = "slot"  # another slot's cells, copied into dest
    HOST = "host"  # a sequence parked in host memory, restored into dest
    DISK = "disk"  # a file of the disk tier, read and restored into dest


@dataclass(frozen=True, slots=True)
class HostOffer:
    """The host tier's entry sharing the longest prefix with the prompt (``HostTier.match``
    with no threshold): entry ``key``, ``common`` tokens shared, ``length`` held."""

    key: int
    common: int
    length: int


@dataclass(frozen=True, slots=True)
class DiskOffer:
    """The disk tier's file sharing the longest prefix with the prompt (``DiskTier.match``
    with no threshold): ``common`` tokens shared, ``length`` held."""

    common: int
    length: int


@dataclass(frozen=True, slots=True)
class Room:
    """The pool's room: ``free`` cells no slot holds, and whether giving up a slot's
    cells frees them (``unified``: one shared pool; otherwise every slot has a stream
    of its own, and ``free`` does not change)."""

    free: int
    unified: bool = True


@dataclass(frozen=True, slots=True)
class KvCopied:
    """``streams`` KV streams copied: between slots, or restored from a tier."""

    streams: int


@dataclass(frozen=True, slots=True)
class HostRestored:
    """Host tier entry ``key`` restored, ``reused`` of its tokens kept; ``whole``: the
    slot continues all of it (see ``HostTier.restored``)."""

    key: int
    reused: int
    whole: bool


@dataclass(frozen=True, slots=True)
class DiskRestored:
    """A disk tier file restored, ``reused`` of its tokens kept."""

    reused: int


Event = KvCopied | HostRestored | DiskRestored
"""What carrying out a placement counts, in the engine's counters and the tiers' stats."""


@dataclass(frozen=True, slots=True)
class KvPlacement:
    """What to do to place a request, in this order: give up ``evict``'s cells; with a
    restore (``source`` HOST or DISK), park what ``plan.dest`` holds and restore the
    entry into it; otherwise park ``plan.dest``'s cells in ``plan.park_to``, park what
    it loses in host memory and copy ``plan.copy_from`` into it; then cut it to
    ``plan.keep`` and record ``plan`` (``SlotCache.place``). ``events``: what to count
    once that is done."""

    plan: Placement
    """The slot part: dest, keep, source, copy, parking (a restore has no copy)."""
    source: Source
    evict: tuple[int, ...] = ()
    """Free slots whose cached cells are given up for room first, in this order."""
    host_key: int | None = None
    """With ``source`` HOST: the entry restored."""
    events: tuple[Event, ...] = ()
    fallback: KvPlacement | None = field(default=None, repr=False)
    """With ``source`` DISK: the placement if the file does not read back (its
    ``evict`` are further slots, beyond these already given up)."""
    trim: tuple[tuple[int, int], ...] = ()
    """Once ``dest`` is placed: free slots ``(index, keep)`` cut to their first
    ``keep`` tokens (each parked in host memory first), so that a long prefill's
    attention span holds only what it reads."""

    @property
    def dest(self) -> int:
        return self.plan.dest

    @property
    def keep(self) -> int:
        return self.plan.keep


class _Pool:
    """The pool's room as free slots' cells are given up (``KvSlots.make_room``'s rule)."""

    def __init__(self, slots: Sequence[Slot[S]], room: Room) -> None:
        self.free = room.free
        self.unified = room.unified
        self.held = [len(s.tokens) for s in slots]
        lru = sorted(slots, key=lambda s: (s.last_used, s.index))
        self.idle = [s.index for s in lru if not s.busy]
        self.evicted: list[int] = []

    def copy(self) -> _Pool:
        other = copy.copy(self)
        other.held, other.evicted = list(self.held), list(self.evicted)
        return other

    def make_room(self, cells: int, *, spare: Sequence[int]) -> bool:
        """Give up free slots' cells (not ``spare``'s), least recently used first,
        until ``cells`` are free; False if that is not enough."""
        if self.free >= cells:
            return True
        for index in self.idle:
            if index in spare or not self.held[index]:
                continue
            self.evicted.append(index)
            if self.unified:
                self.free += self.held[index]
            self.held[index] = 0
            if self.free >= cells:
                return True
        return False


def _copied(plan: Placement, restored: int = 0) -> tuple[Event, ...]:
    streams = restored + plan.copies
    return (KvCopied(streams),) if streams else ()


def place(
    slots: Sequence[Slot[S]],
    prompt: Sequence[int],
    *,
    room: Room,
    pending: int = 0,
    fills: bool = False,
    reuse: bool = True,
    tiers: bool = False,
    host: HostOffer | None = None,
    disk: DiskOffer | None = None,
) -> KvPlacement:
    """Place a request for ``prompt`` in a free slot of ``slots`` (see the module's
    docstring). ``pending`` and ``fills`` are :func:`~.slots.plan_placement`'s;
    ``reuse`` False: no cached prefix is reused (the prompt's own log probabilities
    are wanted, or a follower's prompt comes from its leader); ``tiers``: the host
    tier is on (what ``dest`` loses is parked there, not in another slot), and
    ``host`` and ``disk`` are what it and the disk tier offer (considered only with
    ``reuse``). Raises ``ValueError`` when no slot is free."""
    decision = _place(slots, prompt, room, pending, fills, reuse, tiers, host, disk)
    if not (tiers and room.unified):
        return decision
    fallback = decision.fallback
    if fallback is not None:
        fallback = replace(fallback, trim=_trim(fallback, slots, prompt))
    return replace(decision, trim=_trim(decision, slots, prompt), fallback=fallback)


def _trim(
    decision: KvPlacement, slots: Sequence[Slot[S]], prompt: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """The free slots a placement cuts, and to what, for a tight span (see the
    module's docstring): none unless it leaves ``SPAN_PREFILL_MIN`` prompt tokens to
    compute."""
    if len(prompt) - decision.keep < SPAN_PREFILL_MIN:
        return ()
    given_up = set(decision.evict)
    source = decision.plan.copy_from
    trim: list[tuple[int, int]] = []
    for slot in slots:
        if slot.busy or slot.index == decision.dest or slot.index in given_up:
            continue
        shared = decision.keep if slot.index == source else 0
        if len(slot.tokens) > shared:
            trim.append((slot.index, shared))
    return tuple(trim)


def _place(
    slots: Sequence[Slot[S]],
    prompt: Sequence[int],
    room: Room,
    pending: int,
    fills: bool,
    reuse: bool,
    tiers: bool,
    host: HostOffer | None,
    disk: DiskOffer | None,
) -> KvPlacement:
    plan = plan_placement(
        slots, prompt, pending=pending, fills=fills, reuse_prefix=reuse, park=not tiers
    )
    pool = _Pool(slots, room)
    if not (reuse and tiers):
        return _host_or_slots(plan, None, pool, slots, prompt, reuse)
    dest, held = plan.dest, len(slots[plan.dest].tokens)
    offered = plan.copy_tokens if plan.copy_from is not None else plan.keep
    if host is not None and (
        host.common < offered + KV_COPY_MIN_TOKENS
        # Restoring takes the entry's cells (dest's own are given back first).
        or not pool.make_room(host.length - held, spare=(dest,))
    ):
        host = None
    better = max(offered, 0 if host is None else host.common)
    if (
        disk is None
        or disk.common < better + KV_COPY_MIN_TOKENS
        or not pool.make_room(disk.length - held, spare=(dest,))
    ):
        return _host_or_slots(plan, host, pool, slots, prompt, reuse)
    fallback = _host_or_slots(plan, host, pool.copy(), slots, prompt, reuse, len(pool.evicted))
    keep = min(disk.common, len(prompt) - 1)
    restore = replace(plan, copy_from=None, copy_tokens=0, keep=keep)
    events: tuple[Event, ...] = (*_copied(restore, 1), DiskRestored(keep))
    return KvPlacement(restore, Source.DISK, tuple(pool.evicted), None, events, fallback)


def _host_or_slots(
    plan: Placement,
    host: HostOffer | None,
    pool: _Pool,
    slots: Sequence[Slot[S]],
    prompt: Sequence[int],
    reuse: bool,
    given_up: int = 0,
) -> KvPlacement:
    """The host entry's restore if ``host``, else ``plan`` as the pool's room allows;
    its ``evict`` the slots ``pool`` gave up beyond the first ``given_up``."""
    if host is not None:
        keep = min(host.common, len(prompt) - 1)
        restore = replace(plan, copy_from=None, copy_tokens=0, keep=keep)
        restored = HostRestored(host.key, keep, whole=keep >= host.length)
        events: tuple[Event, ...] = (*_copied(restore, 1), restored)
        evict = tuple(pool.evicted[given_up:])
        return KvPlacement(restore, Source.HOST, evict, host.key, events)
    dest, held = plan.dest, len(slots[plan.dest].tokens)
    if plan.copy_from is not None and (
        # Given up already (for a restore that then did not fit): its cells are gone.
        plan.copy_from in pool.evicted
        or not pool.make_room(pool.held[plan.copy_from] - held, spare=(dest, plan.copy_from))
    ):
        # No room for the copy: the prompt is computed after dest's own prefix.
        own = common_prefix(slots[dest].tokens, prompt) if reuse else 0
        plan = replace(plan, copy_from=None, copy_tokens=0, keep=min(own, plan.keep))
    # Parking copies dest's cells into park_to, over what it held.
    if plan.park_to is not None and not pool.make_room(
        held - pool.held[plan.park_to], spare=(dest, plan.park_to, plan.source)
    ):
        plan = replace(plan, park_to=None)
    source = Source.NONE if plan.copy_from is None else Source.SLOT
    return KvPlacement(plan, source, tuple(pool.evicted[given_up:]), None, _copied(plan))


def refused(placement: KvPlacement) -> KvPlacement:
    """``placement``, a restore, once llama.cpp refused the state: the slot holds
    nothing and no prompt token is reused; nothing restored is counted (its ``evict``
    were carried out already)."""
    plan = replace(placement.plan, keep=0)
    return KvPlacement(plan, Source.NONE, events=_copied(plan))
