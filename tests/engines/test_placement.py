"""Where a request's KV cells come from (engines/llamacpp/placement.py): the one pure
decision over slots, copies, the host and disk tiers and the pool's room, no model."""

from __future__ import annotations

import pytest

from tests.engines.test_slots import PROMPT, make, other
from tokenmill.engines.llamacpp.placement import (
    SPAN_PREFILL_MIN,
    DiskOffer,
    DiskRestored,
    HostOffer,
    HostRestored,
    KvCopied,
    KvPlacement,
    Room,
    Source,
    place,
    refused,
)
from tokenmill.engines.llamacpp.slots import Slot

ROOMY = Room(10_000)


def copyable(extra: dict[int, list[int]] | None = None, busy_tail: int = 0) -> list[Slot[str]]:
    """Slot 1 runs, holding PROMPT's first 8 tokens (then ``busy_tail`` others): a
    request for PROMPT takes slot 0 and copies them. Slots 2, 3 free (``extra``)."""
    tokens = {1: PROMPT[:8] + other(busy_tail, 900), **(extra or {})}
    return make(4, busy=[1], tokens=tokens, used={2: 1.0, 3: 2.0})


# -- within the slots (no tier) ----------------------------------------------------


def test_a_slot_keeps_its_own_prefix() -> None:
    slots = make(2, tokens={0: PROMPT[:10]})
    got = place(slots, PROMPT, room=ROOMY)
    assert (got.dest, got.keep, got.source) == (0, 10, Source.NONE)
    assert got.plan.copy_from is None and got.plan.park_to is None
    assert (got.evict, got.events, got.fallback) == ((), (), None)


def test_another_slots_prefix_is_copied() -> None:
    got = place(copyable(), PROMPT, room=ROOMY)
    assert (got.dest, got.keep, got.source) == (0, 8, Source.SLOT)
    assert (got.plan.copy_from, got.plan.copy_tokens) == (1, 8)
    assert got.events == (KvCopied(1),)
    assert got.evict == ()


def test_a_copy_gives_up_free_slots_cells_for_room_least_recently_used_first() -> None:
    slots = copyable({2: other(3), 3: other(30, 700)}, busy_tail=20)  # the copy takes 28
    got = place(slots, PROMPT, room=Room(10))
    assert got.evict == (2, 3)  # 10 + 3 is not enough
    assert (got.source, got.keep, got.events) == (Source.SLOT, 8, (KvCopied(1),))


def test_a_copy_without_room_computes_the_prompt_after_dests_own_prefix() -> None:
    # dest (slot 0) shares 2 tokens itself; the copy needs 2 more cells than it holds.
    slots = copyable({0: PROMPT[:2] + other(2), 3: other(1, 700)}, busy_tail=2)
    slots[0].last_used = 0.5
    got = place(slots, PROMPT, room=Room(1))
    assert got.dest == 0
    assert got.plan.copy_from is None and got.plan.copy_tokens == 0
    assert (got.source, got.keep, got.events) == (Source.NONE, 2, ())
    # What was given up for the copy stays given up: the check failed after it.
    assert got.evict == (3,)


def test_in_a_stream_per_slot_giving_up_cells_frees_none() -> None:
    slots = copyable({3: other(40, 700)})
    got = place(slots, PROMPT, room=Room(0, unified=False))
    assert got.evict == (3,)
    assert (got.source, got.keep) == (Source.NONE, 0)
    assert place(slots, PROMPT, room=Room(8, unified=False)) == place(slots, PROMPT, room=ROOMY)


def parking() -> list[Slot[str]]:
    """Slot 0 shares 2 tokens and holds 8 others: it takes the request, copies slot 1's
    12 tokens, and parks its own 10 in slot 2 (free, empty) first."""
    tokens = {0: PROMPT[:2] + other(8), 1: PROMPT[:12]}
    return make(4, busy=[1], tokens=tokens)


def test_what_dest_held_is_parked_in_another_slot_when_it_fits() -> None:
    got = place(parking(), PROMPT, room=Room(12))  # the copy takes 2 cells, parking 10
    assert (got.dest, got.plan.copy_from, got.plan.park_to) == (0, 1, 2)
    assert (got.source, got.keep, got.events) == (Source.SLOT, 12, (KvCopied(2),))


def test_parking_is_dropped_without_room() -> None:
    got = place(parking(), PROMPT, room=Room(5))
    assert (got.plan.copy_from, got.plan.park_to) == (1, None)
    assert (got.keep, got.events, got.evict) == (12, (KvCopied(1),), ())


def test_parking_does_not_give_up_the_copy_source_or_the_park_slot() -> None:
    slots = parking()
    slots[3].tokens = other(4, 700)
    got = place(slots, PROMPT, room=Room(5))
    assert got.evict == (3,)  # 5 + 4 < 10: parking is still dropped
    assert got.plan.park_to is None


# -- without reuse -----------------------------------------------------------------

TIERS = {"tiers": True, "host": HostOffer(7, 15, 15), "disk": DiskOffer(19, 30)}


@pytest.mark.parametrize("why", ["prompt_logprobs", "follower"])
def test_without_reuse_nothing_is_kept_copied_or_restored(why: str) -> None:
    # Prompt log probabilities need every prompt row's logits; a follower's prompt
    # comes from its leader, whole: KvSlots passes reuse=False for either.
    slots = make(3, busy=[1], tokens={0: PROMPT[:10], 1: PROMPT})
    got = place(slots, PROMPT, room=ROOMY, reuse=False, **TIERS)  # type: ignore[arg-type]
    assert (got.source, got.keep, got.events, got.evict) == (Source.NONE, 0, (), ())
    assert got.plan.copy_from is None and got.plan.park_to is None


def test_without_reuse_what_dest_held_may_still_be_parked() -> None:
    slots = make(3, busy=[1], tokens={0: PROMPT[:10]}, used={0: 1.0})
    got = place(slots, PROMPT, room=ROOMY, reuse=False)
    assert (got.dest, got.keep, got.plan.park_to) == (2, 0, None)  # the emptier slot
    slots = make(3, busy=[1], tokens={0: PROMPT[:10], 2: other(6)}, used={0: 1.0, 2: 2.0})
    got = place(slots, PROMPT, room=ROOMY, reuse=False)
    assert (got.dest, got.keep, got.plan.park_to) == (0, 0, None)  # slot 2 is newer
    slots[2].tokens = []
    got = place(slots, PROMPT, room=ROOMY, reuse=False)
    assert (got.dest, got.plan.park_to, got.events) == (0, 2, (KvCopied(1),))


# -- the host tier -----------------------------------------------------------------


def test_a_host_entry_is_restored_when_it_offers_enough_more() -> None:
    slots = copyable()  # the copy offers 8
    got = place(slots, PROMPT, room=ROOMY, tiers=True, host=HostOffer(5, 12, 14))
    assert (got.source, got.host_key, got.dest, got.keep) == (Source.HOST, 5, 0, 12)
    assert got.plan.copy_from is None and got.plan.copy_tokens == 0
    assert got.events == (KvCopied(1), HostRestored(5, reused=12, whole=False))
    # Restoring costs about what a copy does: 3 more tokens are not worth it.
    got = place(slots, PROMPT, room=ROOMY, tiers=True, host=HostOffer(5, 11, 14))
    assert (got.source, got.keep) == (Source.SLOT, 8)


def test_a_host_entry_kept_whole_leaves_the_tier() -> None:
    got = place(copyable(), PROMPT, room=ROOMY, tiers=True, host=HostOffer(5, 15, 15))
    assert got.events == (KvCopied(1), HostRestored(5, reused=15, whole=True))
    # At least one prompt token is computed: a whole prompt's entry is cut before it.
    got = place(copyable(), PROMPT, room=ROOMY, tiers=True, host=HostOffer(5, 20, 20))
    assert got.events == (KvCopied(1), HostRestored(5, reused=19, whole=False))


def test_with_the_host_tier_nothing_is_parked_in_another_slot() -> None:
    got = place(parking(), PROMPT, room=ROOMY, tiers=True)
    assert (got.source, got.plan.copy_from, got.plan.park_to) == (Source.SLOT, 1, None)


def test_a_host_entry_without_room_is_not_restored() -> None:
    slots = copyable({2: other(3)})
    got = place(slots, PROMPT, room=Room(10), tiers=True, host=HostOffer(5, 12, 14))
    assert got.evict == (2,)  # given up for it, and still not enough
    assert (got.source, got.keep) == (Source.SLOT, 8)
    # Dest's own cells are given back before the restore: they count as room.
    slots = copyable({0: other(4)})
    got = place(slots, PROMPT, room=Room(10), tiers=True, host=HostOffer(5, 12, 14))
    assert (got.source, got.evict) == (Source.HOST, ())


# -- the disk tier -----------------------------------------------------------------


def test_a_disk_file_wins_over_the_host_entry_when_it_offers_enough_more() -> None:
    host = HostOffer(5, 12, 14)
    got = place(copyable(), PROMPT, room=ROOMY, tiers=True, host=host, disk=DiskOffer(16, 18))
    assert (got.source, got.host_key, got.keep) == (Source.DISK, None, 16)
    assert got.events == (KvCopied(1), DiskRestored(16))
    # A file that does not read back: the host entry, as if there were no file.
    assert got.fallback == place(copyable(), PROMPT, room=ROOMY, tiers=True, host=host)
    got = place(copyable(), PROMPT, room=ROOMY, tiers=True, host=host, disk=DiskOffer(15, 18))
    assert (got.source, got.keep) == (Source.HOST, 12)


def test_a_disk_file_is_measured_against_the_slots_when_the_host_entry_has_no_room() -> None:
    host, disk = HostOffer(5, 16, 40), DiskOffer(12, 12)
    got = place(copyable(), PROMPT, room=Room(20), tiers=True, host=host, disk=disk)
    assert (got.source, got.keep) == (Source.DISK, 12)
    fallback = got.fallback
    assert fallback is not None
    assert (fallback.source, fallback.keep, fallback.events) == (Source.SLOT, 8, (KvCopied(1),))


def test_a_disk_file_without_room_is_not_restored() -> None:
    host, disk = HostOffer(5, 12, 14), DiskOffer(16, 30)
    got = place(copyable(), PROMPT, room=Room(20), tiers=True, host=host, disk=disk)
    assert (got.source, got.keep, got.fallback) == (Source.HOST, 12, None)


def test_a_disk_fallbacks_evictions_are_those_beyond_the_files() -> None:
    # The file takes 14 cells (slot 2 given up); the copy, should the file not read
    # back, 40 (slot 3 too).
    slots = copyable({2: other(6), 3: other(25, 700)}, busy_tail=32)
    got = place(slots, PROMPT, room=Room(10), tiers=True, disk=DiskOffer(14, 14))
    assert (got.source, got.evict) == (Source.DISK, (2,))
    fallback = got.fallback
    assert isinstance(fallback, KvPlacement)
    assert (fallback.source, fallback.evict, fallback.keep) == (Source.SLOT, (3,), 8)


def test_a_refused_restore_reuses_nothing_and_counts_nothing() -> None:
    got = place(copyable(), PROMPT, room=ROOMY, tiers=True, host=HostOffer(5, 12, 14))
    back = refused(got)
    assert (back.dest, back.keep, back.source, back.events, back.evict) == (
        0,
        0,
        Source.NONE,
        (),
        (),
    )
    assert back.plan.copy_from is None and back.plan.park_to is None


# -- a tight span for a long prefill -----------------------------------------------

LONG = list(range(100, 100 + SPAN_PREFILL_MIN + 400))


def spread() -> list[Slot[str]]:
    """Slot 0 runs; slot 1 is free and empty (it joins slot 0's run: the
    destination); slot 2, free, holds LONG's first 100 tokens and a tail of its own
    (the copy's source); slot 3, free, holds another conversation."""
    tokens = {0: other(5), 2: LONG[:100] + other(50, 900), 3: other(30, 700)}
    return make(4, busy=[0], tokens=tokens, used={2: 1.0, 3: 2.0})


def test_a_long_prefill_cuts_the_free_slots_to_what_they_share_with_it() -> None:
    got = place(spread(), LONG, room=ROOMY, tiers=True)
    assert (got.dest, got.plan.copy_from, got.keep) == (1, 2, 100)
    # The source keeps the prefix the destination shares (those cells stay anyway),
    # the other free slot gives up all it holds; the running slot is not touched.
    assert got.trim == ((2, 100), (3, 0))
    # The same from a restored host entry: nothing is shared with any slot.
    got = place(spread(), LONG, room=ROOMY, tiers=True, host=HostOffer(5, 300, 300))
    assert (got.source, got.trim) == (Source.HOST, ((2, 0), (3, 0)))


def test_a_short_prefill_or_no_host_tier_or_a_stream_per_slot_cuts_nothing() -> None:
    # Fewer than SPAN_PREFILL_MIN tokens left to compute: the span costs less than
    # parking would.
    mostly_cached = LONG[: SPAN_PREFILL_MIN + 99]
    assert place(spread(), mostly_cached, room=ROOMY, tiers=True).trim == ()
    # Without the host tier what is cut would be lost, not parked.
    assert place(spread(), LONG, room=ROOMY).trim == ()
    # Every slot attends to a stream of its own.
    assert place(spread(), LONG, room=Room(10_000, unified=False), tiers=True).trim == ()


def test_slots_given_up_for_room_are_not_cut_again() -> None:
    slots = spread()
    slots[3].last_used = 0.5  # given up first
    got = place(slots, LONG, room=Room(280), tiers=True, host=HostOffer(5, 300, 300))
    assert (got.source, got.evict, got.trim) == (Source.HOST, (3,), ((2, 0),))


def test_a_copy_source_given_up_for_a_restore_that_still_does_not_fit_is_not_copied() -> None:
    # The host entry needs 300 cells: giving up slots 2 (the copy's source) and 3 frees
    # 180. Slot 2's cells are gone, so nothing can be copied from it: the prompt is
    # computed after the destination's own prefix (none), never after cells that are
    # not there.
    got = place(spread(), LONG, room=Room(0), tiers=True, host=HostOffer(5, 300, 300))
    assert got.evict == (2, 3)
    assert (got.source, got.plan.copy_from, got.keep, got.events) == (Source.NONE, None, 0, ())


def test_no_free_slot_raises() -> None:
    with pytest.raises(ValueError):
        place(make(2, busy=[0, 1]), PROMPT, room=ROOMY)
