"""The host tier's policy (engines/llamacpp/hosttier.py): pure, no model.

Placement against parked entries, what is worth parking, eviction order, the byte
bound, and swapped-out (pinned) sequences.
"""

from __future__ import annotations

import random

from tokenmill.engines.llamacpp.hosttier import HostTier, Match
from tokenmill.engines.llamacpp.slots import KV_COPY_MIN_TOKENS, common_prefix

A = list(range(100, 140))  # 40 tokens
B = list(range(500, 530))


def tier(capacity: int = 1000) -> HostTier[str]:
    return HostTier(capacity)


def test_off_parks_nothing() -> None:
    t = tier(0)
    assert not t.enabled and not t.worth_parking(A, [])
    assert t.park(A, "a", 10, now=1.0) is None and t.used == 0


def test_match_picks_the_longest_prefix_and_beats_a_slot_only_by_enough() -> None:
    t = tier()
    ka = t.park(A, "a", 10, now=1.0)
    t.park(B, "b", 10, now=2.0)
    prompt = [*A[:30], 1, 2, 3]
    assert t.match(prompt) == Match(ka, 30)  # type: ignore[arg-type]
    # A slot offering nearly as much wins: restoring costs about a copy.
    assert t.match(prompt, better_than=30 - KV_COPY_MIN_TOKENS + 1) is None
    assert t.match(prompt, better_than=30 - KV_COPY_MIN_TOKENS) is not None
    assert t.match([7, 8, 9]) is None


def test_restoring_a_continued_entry_moves_it_else_it_stays() -> None:
    t = tier()
    k = t.park(A, "a", 10, now=1.0)
    assert k is not None
    t.restored(k, reused=20, now=2.0, whole=False)
    assert k in t.entries and t.entries[k].last_used == 2.0
    t.restored(k, reused=40, now=3.0, whole=True)
    assert k not in t.entries and t.used == 0
    assert (t.stats.hits, t.stats.restores, t.stats.restored_tokens) == (2, 2, 60)


def test_nothing_held_twice() -> None:
    t = tier()
    # A prefix of what a slot still holds, or of a parked entry: not worth parking.
    assert not t.worth_parking(A[:30], [A])
    assert t.worth_parking(A[:30], [B])
    t.park(A, "a", 10, now=1.0)
    assert not t.worth_parking(A[:20], [])
    # A sequence continuing a parked one replaces it.
    longer = [*A, 1, 2, 3, 4, 5, 6]
    t.park(longer, "longer", 12, now=2.0)
    assert [e.tokens for e in t.entries.values()] == [tuple(longer)]
    assert t.used == 12 and t.stats.subsumed == 1
    # Too short to matter.
    assert not t.worth_parking([1, 2], [])


def test_least_recently_used_goes_first_within_the_byte_bound() -> None:
    t = tier(30)
    keys = [t.park([i] * 10 + list(range(i * 50, i * 50 + 5)), str(i), 10, now=i) for i in range(3)]
    assert t.used == 30
    assert keys[0] is not None
    t.restored(keys[0], reused=5, now=9.0, whole=False)  # used again: now the newest
    t.park(list(range(900, 920)), "new", 10, now=10.0)
    assert keys[1] not in t.entries and keys[0] in t.entries
    assert t.used == 30 and t.stats.evictions == 1
    # One that can never fit is not parked, and evicts nothing.
    assert not t.fits(31)
    assert t.park(list(range(2000, 2050)), "huge", 31, now=11.0) is None
    assert t.used == 30 and len(t.entries) == 3


def test_swapped_sequences_are_never_evicted_and_evict_cached_ones() -> None:
    t = tier(30)
    cached = t.park(A, "a", 20, now=1.0)
    swapped = t.park(B, "b", 25, now=2.0, pinned=True)
    assert cached not in t.entries and swapped in t.entries
    assert t.cached_entries() == 0 and t.stats.swaps == 1
    # Held beyond the bound when nothing cached is left to evict.
    other = t.park(list(range(3000, 3010)), "c", 25, now=3.0, pinned=True)
    assert t.used == 50 and other in t.entries
    # Swapped entries are not offered to prompts, and room is not offered past them.
    assert t.match(B) is None and not t.fits(6)
    assert swapped is not None
    assert t.unpin(swapped).state == "b" and t.used == 25


def test_replay_keeps_bytes_bounded_and_entries_distinct() -> None:
    rng = random.Random(7)
    t = tier(200)
    for step in range(500):
        base = rng.randrange(5)
        tokens = [base] * 8 + [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        if t.worth_parking(tokens, []):
            t.park(tokens, "x", len(tokens), now=float(step))
        prompt = [base] * 8 + [rng.randrange(3) for _ in range(20)]
        match = t.match(prompt)
        if match is not None:
            best = max(common_prefix(e.tokens, prompt) for e in t.entries.values())
            assert match.common == best
            t.restored(match.key, reused=match.common, now=float(step), whole=rng.random() < 0.3)
        assert t.used == sum(e.nbytes for e in t.entries.values()) <= 200
        held = [e.tokens for e in t.entries.values()]
        for i, a in enumerate(held):
            for j, b in enumerate(held):
                # No entry is (all but a few tokens of) a prefix of another.
                if i != j:
                    assert common_prefix(a, b) < len(a) - KV_COPY_MIN_TOKENS + 1


def test_the_listener_hears_exactly_what_the_tier_holds_as_a_cache() -> None:
    """Parks, restores, evictions, subsumed entries and a clear, replayed at random:
    what the listener was told is always the tier's cached entries (swapped-out
    sequences are live requests, never published)."""
    rng = random.Random(11)
    heard: dict[int, tuple[int, ...]] = {}

    def listener(key: int, tokens: tuple[int, ...] | None) -> None:
        if tokens is None:
            del heard[key]  # only what was heard of leaves
        else:
            assert key not in heard
            heard[key] = tokens

    t: HostTier[str] = HostTier(200, listener=listener)
    pinned: list[int] = []
    for step in range(500):
        base = rng.randrange(5)
        tokens = [base] * 8 + [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        if rng.random() < 0.05:
            key = t.park(tokens, "swap", len(tokens), now=float(step), pinned=True)
            assert key is not None
            pinned.append(key)
        elif pinned and rng.random() < 0.05:
            t.unpin(pinned.pop())
        elif t.worth_parking(tokens, []):
            t.park(tokens, "x", len(tokens), now=float(step))
        match = t.match([base] * 8 + [rng.randrange(3) for _ in range(20)])
        if match is not None:
            t.restored(match.key, reused=match.common, now=float(step), whole=rng.random() < 0.3)
        cached = {k: e.tokens for k, e in t.entries.items() if not e.pinned}
        assert heard == cached
    t.clear()
    assert heard == {} and t.used == 0 and t.entries == {}
