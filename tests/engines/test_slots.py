"""KV-slot placement (engines/llamacpp/slots.py): pure decisions over slot bookkeeping, no model."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tokenmill.engines.llamacpp.slots import (
    KV_COPY_MIN_TOKENS,
    Placement,
    Slot,
    apply_placement,
    common_prefix,
    plan_placement,
)

PROMPT = list(range(100, 120))  # 20 tokens


def make(
    n: int,
    busy: Sequence[int] = (),
    tokens: dict[int, list[int]] | None = None,
    used: dict[int, float] | None = None,
) -> list[Slot[str]]:
    slots: list[Slot[str]] = [Slot(i) for i in range(n)]
    for i in busy:
        slots[i].seq = f"running-{i}"
    for i, held in (tokens or {}).items():
        slots[i].tokens = list(held)
    for i, when in (used or {}).items():
        slots[i].last_used = when
    return slots


def other(n: int, start: int = 500) -> list[int]:
    """Tokens sharing nothing with PROMPT."""
    return list(range(start, start + n))


def test_common_prefix() -> None:
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix((5,), [6]) == 0


def test_first_request_takes_slot_0() -> None:
    slots = make(4)
    plan = plan_placement(slots, PROMPT)
    assert plan == Placement(dest=0, keep=0, source=0)
    assert plan.copies == 0
    apply_placement(slots, plan, "req", now=7.0)
    assert slots[0].seq == "req" and slots[0].tokens == [] and slots[0].last_used == 7.0


def test_a_free_slot_caching_the_prefix_is_reused() -> None:
    slots = make(4, tokens={2: [*PROMPT[:12], 1, 2, 3]})
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.keep, plan.copy_from) == (2, 12, None)
    # What the prompt overwrites (3 tokens) is not worth parking.
    assert plan.park_to is None
    apply_placement(slots, plan, "req", now=1.0)
    assert slots[2].tokens == PROMPT[:12]


def runs_added(busy: Sequence[bool], i: int) -> int:
    def runs(b: Sequence[bool]) -> int:
        return sum(1 for j, x in enumerate(b) if x and (j == 0 or not b[j - 1]))

    after = list(busy)
    after[i] = True
    return runs(after) - runs(busy)


@pytest.mark.parametrize(
    ("busy", "expected"),
    [
        ([0], 1),  # [T,F,F,F]: slot 1 extends the run, 2 and 3 would open one
        ([0, 3], 1),  # [T,F,F,T]: slot 1 or 2 extends a run; the lowest wins the tie
        ([0, 2], 1),  # [T,F,T,F]: slot 1 joins two runs into one
        ([3], 2),  # [F,F,F,T]
        ([1, 3], 2),  # [F,T,F,T]: slot 2 joins
    ],
)
def test_the_slot_adding_fewest_runs_wins(busy: list[int], expected: int) -> None:
    slots = make(4, busy=busy)
    flags = [s.busy for s in slots]
    plan = plan_placement(slots, PROMPT)
    assert plan.dest == expected
    best = min(runs_added(flags, i) for i in range(4) if not flags[i])
    assert runs_added(flags, plan.dest) == best


def test_among_adjacent_slots_the_cached_prefix_decides() -> None:
    # [T,F,F,T]: slots 1 and 2 both extend a run; slot 2 caches part of the prompt.
    slots = make(4, busy=[0, 3], tokens={2: PROMPT[:3]})
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.keep) == (2, 3)


def test_fewer_runs_beat_a_cached_prefix_which_is_then_copied() -> None:
    # [T,F,F,F]: slot 1 extends the run; slot 3 would open a second one.
    slots = make(4, busy=[0], tokens={3: PROMPT[:10]})
    plan = plan_placement(slots, PROMPT)
    assert plan.dest == 1
    assert (plan.copy_from, plan.copy_tokens, plan.keep) == (3, 10, 10)


def test_fills_ignores_runs() -> None:
    slots = make(4, busy=[0], tokens={3: PROMPT[:10]})
    plan = plan_placement(slots, PROMPT, fills=True)
    assert (plan.dest, plan.copy_from, plan.keep) == (3, None, 10)
    # With nothing cached anywhere, fills leaves only the lowest index.
    assert plan_placement(make(4, busy=[0]), PROMPT, fills=True).dest == 1
    assert plan_placement(make(4, busy=[1]), PROMPT, fills=True).dest == 0
    assert plan_placement(make(4, busy=[1]), PROMPT).dest == 0  # also adjacent


def test_among_equal_prefixes_the_least_recently_used_slot_is_taken() -> None:
    # One stream: every slot caches a conversation after the same system prompt.
    system = PROMPT[:8]
    held = {i: [*system, *other(30, 500 + 100 * i)] for i in range(4)}
    slots = make(4, tokens=held, used={0: 4.0, 1: 2.0, 2: 1.0, 3: 3.0})
    prompt = [*system, *other(12, 900)]
    plan = plan_placement(slots, prompt)
    # Slot 2's conversation is the oldest: the prompt takes its slot, and no other
    # conversation is moved (no KV stream copied on the way to the first token).
    assert plan == Placement(dest=2, keep=8, source=0)
    assert plan.copies == 0


def test_a_longer_prefix_still_beats_an_older_slot() -> None:
    slots = make(4, tokens={0: PROMPT[:4], 1: PROMPT[:12]}, used={0: 1.0, 1: 9.0})
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.keep) == (1, 12)


def test_a_running_slots_prefix_is_copied() -> None:
    slots = make(4, busy=[0], tokens={0: [*PROMPT[:10], 7, 7]})
    plan = plan_placement(slots, PROMPT)
    assert plan == Placement(dest=1, keep=10, source=0, copy_from=0, copy_tokens=10)
    assert plan.copies == 1
    apply_placement(slots, plan, "req", now=5.0)
    assert slots[1].tokens == PROMPT[:10]
    assert slots[0].tokens == [*PROMPT[:10], 7, 7]  # the source is untouched
    assert slots[0].last_used == slots[1].last_used == 5.0


def test_copy_only_for_at_least_kv_copy_min_tokens_more() -> None:
    dest_has = 5
    below = make(3, busy=[0], tokens={0: PROMPT[: dest_has + KV_COPY_MIN_TOKENS - 1]})
    below[1].tokens = PROMPT[:dest_has]
    plan = plan_placement(below, PROMPT)
    assert (plan.dest, plan.copy_from, plan.keep) == (1, None, dest_has)

    at = make(3, busy=[0], tokens={0: PROMPT[: dest_has + KV_COPY_MIN_TOKENS]})
    at[1].tokens = PROMPT[:dest_has]
    plan = plan_placement(at, PROMPT)
    assert (plan.dest, plan.copy_from, plan.keep) == (1, 0, dest_has + KV_COPY_MIN_TOKENS)


def test_what_dest_held_is_parked_in_the_lru_free_slot() -> None:
    held = other(10)
    slots = make(
        5,
        busy=[0],
        tokens={1: held, 2: other(6, 700), 3: other(6, 800), 4: other(6, 900)},
        used={1: 10.0, 2: 4.0, 3: 2.0, 4: 3.0},
    )
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.park_to, plan.keep) == (1, 3, 0)
    apply_placement(slots, plan, "req", now=20.0)
    assert slots[3].tokens == held and slots[3].last_used == 10.0
    assert slots[1].tokens == [] and slots[1].last_used == 20.0


def test_an_empty_free_slot_always_takes_the_park() -> None:
    slots = make(3, busy=[0], tokens={1: other(10)}, used={1: 1.0, 2: 5.0})
    assert plan_placement(slots, PROMPT).park_to == 2


def test_the_park_is_taken_before_the_copy_overwrites_dest() -> None:
    held = other(10)
    slots = make(4, busy=[0], tokens={0: PROMPT[:15], 1: held}, used={1: 3.0})
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.copy_from, plan.park_to) == (1, 0, 2)
    assert plan.copies == 2
    apply_placement(slots, plan, "req", now=9.0)
    assert slots[2].tokens == held  # what dest held, not what was copied into it
    assert slots[1].tokens == PROMPT[:15]


def test_no_park_when_dest_loses_too_little() -> None:
    slots = make(3, busy=[0], tokens={1: [*PROMPT[:10], *other(KV_COPY_MIN_TOKENS - 1)]})
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.park_to, plan.keep) == (1, None, 10)


def test_no_park_when_it_is_cached_elsewhere() -> None:
    held = other(12)
    # Slot 2 (busy) holds all but KV_COPY_MIN_TOKENS of it: close enough.
    elsewhere = held[: len(held) - KV_COPY_MIN_TOKENS]
    slots = make(4, busy=[0, 2], tokens={1: held, 2: elsewhere})
    assert plan_placement(slots, PROMPT).park_to is None
    # One token fewer and it is parked.
    slots = make(4, busy=[0, 2], tokens={1: held, 2: elsewhere[:-1]}, used={1: 1.0})
    assert plan_placement(slots, PROMPT).park_to == 3


def test_no_park_when_pending_requests_need_the_free_slots() -> None:
    slots = make(4, busy=[0], tokens={1: other(10)}, used={1: 1.0})
    # Free besides dest (slot 1): slots 2 and 3.
    assert plan_placement(slots, PROMPT, pending=1).park_to == 2
    assert plan_placement(slots, PROMPT, pending=2).park_to is None


def test_the_copy_source_is_never_a_park_slot() -> None:
    # Slot 3 is free, caches the prompt's prefix, and is the least recently used.
    slots = make(4, busy=[0], tokens={1: other(10), 3: PROMPT[:8]}, used={1: 5.0, 2: 1.0})
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.copy_from, plan.park_to) == (1, 3, 2)
    # Without slot 2 to take it, nothing is parked.
    slots[2].seq = "running-2"
    plan = plan_placement(slots, PROMPT)
    assert (plan.dest, plan.copy_from, plan.park_to) == (1, 3, None)


def test_no_park_into_a_slot_used_no_earlier() -> None:
    slots = make(3, busy=[0], tokens={1: other(10), 2: other(5, 700)}, used={1: 3.0, 2: 3.0})
    assert plan_placement(slots, PROMPT).park_to is None
    slots[2].last_used = 2.9
    assert plan_placement(slots, PROMPT).park_to == 2


def test_at_least_one_prompt_token_is_decoded() -> None:
    slots = make(2, tokens={0: [*PROMPT, 1, 2]})
    plan = plan_placement(slots, PROMPT)
    assert plan.keep == len(PROMPT) - 1
    apply_placement(slots, plan, "req", now=1.0)
    assert slots[0].tokens == PROMPT[:-1]
    one = plan_placement(make(2, tokens={0: [5, 6]}), [5])
    assert one.keep == 0


def test_a_copied_prompt_still_decodes_its_last_token() -> None:
    slots = make(2, busy=[0], tokens={0: PROMPT})
    plan = plan_placement(slots, PROMPT)
    assert (plan.copy_from, plan.copy_tokens, plan.keep) == (0, len(PROMPT), len(PROMPT) - 1)


def test_without_prefix_reuse_nothing_is_kept_or_copied() -> None:
    slots = make(4, busy=[0], tokens={1: other(2), 2: PROMPT, 3: PROMPT[:10]})
    plan = plan_placement(slots, PROMPT, reuse_prefix=False)
    assert (plan.dest, plan.keep, plan.copy_from, plan.copy_tokens) == (1, 0, None, 0)
    # Even a slot caching the prompt and adding no run is left for the lowest index.
    slots = make(4, busy=[0, 3], tokens={2: PROMPT})
    plan = plan_placement(slots, PROMPT, reuse_prefix=False)
    assert (plan.dest, plan.keep, plan.copy_from) == (1, 0, None)


def test_the_engine_clearing_the_slot_keeps_nothing() -> None:
    slots = make(2, tokens={0: PROMPT[:10]})
    plan = plan_placement(slots, PROMPT)
    assert plan.keep == 10
    apply_placement(slots, plan, "req", now=1.0, keep=0)
    assert slots[0].tokens == []


def test_no_free_slot_is_an_error() -> None:
    with pytest.raises(ValueError, match="no free slot"):
        plan_placement(make(2, busy=[0, 1]), PROMPT)


# -- random cases ------------------------------------------------------------------------


def random_case(rng: random.Random) -> tuple[list[Slot[str]], list[int], int, bool, bool]:
    n = rng.randint(1, 6)
    bases = [[rng.randint(0, 3) for _ in range(12)] for _ in range(3)]

    def tokens(length_max: int) -> list[int]:
        base = rng.choice(bases)
        cut = rng.randint(0, min(length_max, len(base)))
        tail = [rng.randint(0, 3) for _ in range(rng.randint(0, 4))]
        return base[:cut] + tail

    slots: list[Slot[str]] = []
    for i in range(n):
        slot: Slot[str] = Slot(i, tokens(12), last_used=float(rng.randint(0, 5)))
        if rng.random() < 0.4:
            slot.seq = f"running-{i}"
        slots.append(slot)
    if all(s.busy for s in slots):
        rng.choice(slots).seq = None
    prompt = tokens(12) or [1]
    free = sum(not s.busy for s in slots)
    pending = rng.randint(0, free - 1)
    return slots, prompt, pending, rng.random() < 0.3, rng.random() < 0.8


def test_invariants_over_random_cases() -> None:
    rng = random.Random(20240601)
    for _ in range(3000):
        slots, prompt, pending, fills, reuse = random_case(rng)
        before = [list(s.tokens) for s in slots]
        plan = plan_placement(slots, prompt, pending=pending, fills=fills, reuse_prefix=reuse)
        assert not slots[plan.dest].busy
        assert plan.copy_from != plan.dest
        assert 0 <= plan.keep < len(prompt)
        if plan.park_to is not None:
            assert not slots[plan.park_to].busy
            assert plan.park_to not in (plan.dest, plan.copy_from, plan.source)
        if not reuse:
            assert plan.keep == 0 and plan.copy_from is None
        if plan.copy_from is not None:
            assert plan.copy_from == plan.source
            assert plan.copy_tokens >= KV_COPY_MIN_TOKENS
        apply_placement(slots, plan, "req", now=99.0)
        dest = slots[plan.dest]
        assert dest.seq == "req" and dest.last_used == 99.0
        assert len(dest.tokens) == plan.keep
        assert plan.keep <= common_prefix(dest.tokens, prompt)
        if plan.park_to is not None:
            assert slots[plan.park_to].tokens == before[plan.dest]
        for i, s in enumerate(slots):
            if i not in (plan.dest, plan.park_to):
                assert s.tokens == before[i]


# The engine's placement as it was written inline (LlamaCppEngine._assign and _park, with
# llama.cpp calls recorded), before it moved to slots.py: the plan must do the same.


def reference(
    slots: list[Slot[str]],
    prompt: list[int],
    pending: int,
    fills: bool,
    reuse: bool,
    now: float,
    calls: list[tuple[str, int, int]],
) -> int:
    copies = 0

    def park_(slot: Slot[str], avoid: Slot[str]) -> None:
        nonlocal copies
        others = [s for s in slots if s is not slot]
        held = len(slot.tokens) - KV_COPY_MIN_TOKENS
        if any(common_prefix(s.tokens, slot.tokens) >= held for s in others):
            return
        spare = [s for s in others if s.seq is None and s is not avoid]
        if len(spare) <= pending:
            return
        park = min(spare, key=lambda s: (s.last_used, s.index))
        if park.tokens and park.last_used >= slot.last_used:
            return
        calls.append(("cp", slot.index, park.index))
        park.tokens = list(slot.tokens)
        park.last_used = slot.last_used
        copies += 1

    busy = [slot.seq is not None for slot in slots]
    shared = [common_prefix(slot.tokens, prompt) for slot in slots]
    if not reuse:
        shared = [0] * len(shared)
    n = len(busy)

    def placement(i: int) -> tuple[int, int, float, int]:
        left = i > 0 and busy[i - 1]
        right = i + 1 < n and busy[i + 1]
        runs_added = 0 if fills else 1 - left - right
        # (Since #16: the least recently used among equally good slots, then the index.)
        return (runs_added, -shared[i], slots[i].last_used, i)

    dest = slots[min((i for i in range(n) if not busy[i]), key=placement)]
    common = shared[dest.index]
    source = slots[max(range(n), key=shared.__getitem__)]
    source_common = shared[source.index]
    copy = source is not dest and source_common >= common + KV_COPY_MIN_TOKENS
    if len(dest.tokens) - common >= KV_COPY_MIN_TOKENS:
        park_(dest, avoid=source)
    if copy:
        calls.append(("cp", source.index, dest.index))
        dest.tokens = source.tokens[:source_common]
        common = source_common
        copies += 1
    keep = min(common, len(prompt) - 1)
    calls.append(("rm", dest.index, keep))
    del dest.tokens[keep:]
    dest.seq = "req"
    dest.last_used = source.last_used = now
    return copies


def test_same_decisions_as_the_inline_engine_code() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        slots, prompt, pending, fills, reuse = random_case(rng)
        twin = [Slot(s.index, list(s.tokens), s.seq, s.last_used) for s in slots]
        expected: list[tuple[str, int, int]] = []
        copies = reference(twin, prompt, pending, fills, reuse, 42.0, expected)

        plan = plan_placement(slots, prompt, pending=pending, fills=fills, reuse_prefix=reuse)
        calls: list[tuple[str, int, int]] = []  # issued as the engine does
        if plan.park_to is not None:
            calls.append(("cp", plan.dest, plan.park_to))
        if plan.copy_from is not None:
            calls.append(("cp", plan.copy_from, plan.dest))
        calls.append(("rm", plan.dest, plan.keep))
        apply_placement(slots, plan, "req", now=42.0)

        assert calls == expected
        assert plan.copies == copies
        assert slots == twin
