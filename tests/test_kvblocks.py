"""Block-hash chains (kvblocks.py) and the gateway's prefix index (gateway/prefix.py),
checked against plain token lists: what a slot holds, what a prompt shares with it."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engines.llamacpp.slots import common_prefix
from tokenmill.gateway.prefix import PrefixIndex
from tokenmill.kvblocks import (
    BLOCK_TOKENS,
    ROOT,
    BlockSnapshot,
    BlockUpdate,
    CacheEvent,
    CachePublisher,
    SlotChains,
    chain,
    extend_chain,
)

B = BLOCK_TOKENS


def test_only_full_blocks_are_named() -> None:
    assert chain(list(range(B - 1))) == []
    assert len(chain(list(range(B)))) == 1
    assert len(chain(list(range(3 * B + 5)))) == 3


def test_a_name_stands_for_the_whole_prefix() -> None:
    a = list(range(4 * B))
    b = [*a[:B], 999, *a[B + 1 :]]  # differs in block 1 only
    ca, cb = chain(a), chain(b)
    assert ca[0] == cb[0]
    assert all(x != y for x, y in zip(ca[1:], cb[1:], strict=True))  # every later block


def test_extending_a_chain_equals_naming_the_whole() -> None:
    tokens = list(range(5 * B))
    head = chain(tokens[: 2 * B])
    assert head + extend_chain(head[-1], tokens[2 * B :]) == chain(tokens)
    assert extend_chain(ROOT, tokens) == chain(tokens)


def test_names_are_the_same_in_another_process() -> None:
    """Replicas and the gateway are different processes: no per-process salt."""
    code = "from tokenmill.kvblocks import chain; print(chain(list(range(40))))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(chain(list(range(40))))


# A slot's life: (kept as a fraction of what it holds, tokens added).
changes = st.lists(
    st.tuples(
        st.integers(0, 3),  # slot
        st.floats(0, 1),  # kept, as a fraction of the slot's length
        st.lists(st.integers(0, 3), max_size=3 * B),  # small vocabulary: shared prefixes
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(changes, st.lists(st.integers(0, 3), max_size=6 * B))
def test_slot_chains_and_index_follow_every_change(
    steps: list[tuple[int, float, list[int]]], prompt: list[int]
) -> None:
    slots = SlotChains(4)
    held: list[list[int]] = [[] for _ in range(4)]
    live = PrefixIndex()  # fed every update, as the gateway is
    live.reset(0, slots.snapshot().slots)
    for slot, fraction, added in steps:
        kept = int(len(held[slot]) * fraction)
        update = slots.change(slot, kept, added)
        held[slot] = held[slot][:kept] + added
        if update is not None:
            live.update(0, update)
        assert slots.tokens(slot) == tuple(held[slot])
    assert list(slots.snapshot().slots) == [tuple(chain(h)) for h in held]
    rebuilt = PrefixIndex()  # a gateway that connects now
    rebuilt.reset(0, slots.snapshot().slots)
    assert live.chains(0) == rebuilt.chains(0) == list(slots.snapshot().slots)
    longest = max((common_prefix(h, prompt) for h in held), default=0)
    expected = min(longest, len(prompt)) // B
    assert live.cached_blocks(chain(prompt)) == {0: expected}
    assert live.blocks(0) == sum(len(chain(h)) for h in held)


def test_a_decode_inside_a_block_publishes_nothing() -> None:
    slots = SlotChains(1)
    first = slots.change(0, 0, list(range(B + 3)))
    assert first is not None and first.kept == 0 and len(first.added) == 1
    assert slots.change(0, B + 3, [7]) is None
    filled = slots.change(0, B + 4, list(range(B - 4)))
    assert filled is not None and filled.kept == 1 and len(filled.added) == 1


def test_index_counts_replicas_and_forgets_the_dead() -> None:
    system = list(range(3 * B))
    chat = system + list(range(100, 100 + 2 * B))
    index = PrefixIndex()
    index.reset(0, [chain(chat), chain(system)])
    index.reset(1, [chain(system)])
    assert index.cached_blocks(chain([*chat, 1, 2, 3])) == {0: 5, 1: 3}
    assert index.cached_tokens(chain(chat)) == {0: 5 * B, 1: 3 * B}
    index.drop(0)
    assert index.cached_blocks(chain(chat)) == {1: 3}
    index.reset(0, [])  # restarted, empty
    assert index.cached_blocks(chain(chat)) == {0: 0, 1: 3}


def test_a_prompt_continues_a_slot_only_when_it_holds_the_whole_chain() -> None:
    system = list(range(3 * B))
    turn1 = system + list(range(100, 100 + 2 * B))  # a conversation's first exchange
    index = PrefixIndex()
    index.reset(0, [chain(turn1)])
    index.reset(1, [chain(system)])
    # The next turn: replica 0 holds its whole history, 1 the system prompt alone, which
    # is all it holds in that slot: both are "continued", 0 the longer.
    turn2 = chain([*turn1, *range(500, 500 + B + 3)])
    held = index.cached_blocks(turn2)
    assert held == {0: 5, 1: 3}
    assert index.continued(turn2, held) == {0, 1}
    # Another conversation: 0 holds the system prompt only as the start of a longer
    # sequence (another conversation's), 1 holds it whole.
    other = chain([*system, *range(900, 900 + 2 * B)])
    held = index.cached_blocks(other)
    assert held == {0: 3, 1: 3}
    assert index.continued(other, held) == {1}
    # Nothing held continues nothing.
    assert index.continued(chain(list(range(700, 700 + 2 * B))), {0: 0, 1: 0}) == set()


def test_a_slot_evicted_below_a_shared_block_keeps_the_other_slot() -> None:
    system = list(range(2 * B))
    index = PrefixIndex()
    slots = SlotChains(2)
    index.reset(0, slots.snapshot().slots)
    for slot in (0, 1):
        update = slots.change(slot, 0, system)
        assert update is not None
        index.update(0, update)
    evicted = slots.change(0, 0, [])
    assert evicted is not None
    index.update(0, evicted)
    assert index.cached_blocks(chain(system)) == {0: 2}  # slot 1 still holds it


def test_index_is_bounded_and_under_reports_past_the_bound() -> None:
    index = PrefixIndex(max_blocks_per_replica=4)
    long = list(range(10 * B))
    index.reset(0, [chain(long)])
    assert index.blocks(0) == 4
    assert index.cached_blocks(chain(long)) == {0: 4}
    slots = SlotChains(1)
    update = slots.change(0, 0, long)
    assert update is not None
    index.reset(0, [[]])
    index.update(0, update)
    grown = slots.change(0, len(long), list(range(B)))
    assert grown is not None and grown.kept == 10
    index.update(0, grown)  # its parent was never indexed: nor is it
    assert index.blocks(0) == 4


def test_updates_before_a_snapshot_are_ignored() -> None:
    index = PrefixIndex()
    slots = SlotChains(1)
    update = slots.change(0, 0, list(range(2 * B)))
    assert update is not None
    index.update(3, update)
    assert index.cached_blocks(chain(list(range(2 * B)))) == {}


def test_a_publisher_gives_a_snapshot_then_every_change_and_a_snapshot_on_restart() -> None:
    publisher = CachePublisher(2)
    publisher.change(0, 0, list(range(2 * B)))
    events: list[CacheEvent] = []
    publisher.subscribe(events.append)
    publisher.change(1, 0, list(range(B)))
    publisher.change(1, B, [1])  # inside a block: nothing
    index = PrefixIndex()
    for event in events:
        if isinstance(event, BlockSnapshot):
            index.reset(0, event.slots)
        else:
            index.update(0, event)
    assert index.chains(0) == list(publisher.snapshot().slots)
    assert len(events) == 2
    publisher.reset()
    assert events[-1] == BlockSnapshot(((), ()), n_slots=2)
    gone: list[CacheEvent] = []
    stop = publisher.subscribe(gone.append)
    stop()
    publisher.change(0, 0, list(range(B)))
    assert len(gone) == 1  # its snapshot only


def test_parked_sequences_are_published_as_lanes_after_the_slots() -> None:
    """The host tier's sequences: one lane each after the slots, freed lanes reused
    lowest first; a gateway's index says which tier holds a prompt's prefix."""
    publisher = CachePublisher(2)
    events: list[CacheEvent] = []
    publisher.subscribe(events.append)
    a, b, c = (list(range(k * 100, k * 100 + 3 * B)) for k in (1, 2, 3))
    publisher.change(0, 0, a)
    publisher.park(7, b)  # lane 2
    publisher.park(8, c)  # lane 3
    publisher.unpark(7)  # lane 2 free
    publisher.park(9, b)  # lane 2 again
    publisher.unpark(42)  # never parked: nothing
    snapshot = publisher.snapshot()
    assert snapshot == BlockSnapshot((tuple(chain(a)), (), tuple(chain(b)), tuple(chain(c))), 2)

    index = PrefixIndex()
    for event in events:
        if isinstance(event, BlockSnapshot):
            index.reset(0, event.slots, event.n_slots)
        else:
            index.update(0, event)
    assert index.chains(0) == list(snapshot.slots)
    for tokens, tier in ((a, "slot"), (b, "host"), (c, "host")):
        names = chain([*tokens, *range(900, 900 + B)])  # the next turn
        held = index.cached_blocks(names)
        assert held == {0: 3}
        assert index.continued(names, held) == {0}  # a parked sequence, continued whole
        assert index.tiers(names, held) == {0: tier}
    assert index.tiers(chain(list(range(5000, 5000 + B))), {0: 0}) == {}

    # A prefix held both in a slot and parked is in the slot; the rest only parked.
    publisher.change(1, 0, c[: 2 * B])
    update = events[-1]
    assert isinstance(update, BlockUpdate)
    index.update(0, update)
    names = chain(c)
    held = index.cached_blocks(names)
    assert held == {0: 3} and index.tiers(names, held) == {0: "host"}
    assert index.tiers(names[:2], {0: 2}) == {0: "slot"}

    publisher.reset()  # the engine restarted: slots and tier empty, lanes too
    assert events[-1] == BlockSnapshot(((), ()), 2)
    publisher.park(1, a)
    assert publisher.snapshot().slots[2] == tuple(chain(a))


def test_disk_tier_files_are_lanes_the_index_calls_disk() -> None:
    """A disk tier file is published as a lane like a parked sequence, marked as on
    disk: the index says ``disk`` only where no slot or host lane holds the prefix,
    and a freed lane reused by host memory is ``host`` again."""
    publisher = CachePublisher(1)
    events: list[CacheEvent] = []
    a, b = (list(range(k * 100, k * 100 + 3 * B)) for k in (1, 2))
    publisher.park(("disk", "f1"), a, disk=True)  # lane 1: announced at start
    publisher.subscribe(events.append)  # a gateway connects: the snapshot says so
    publisher.park(("disk", "f2"), b, disk=True)  # lane 2
    publisher.park(("host", 1), b)  # lane 3: the same sequence, also in memory
    assert events[0] == BlockSnapshot(((), tuple(chain(a))), 1, disk=(1,))
    assert publisher.snapshot().disk == (1, 2)

    index = PrefixIndex()
    for event in events:
        if isinstance(event, BlockSnapshot):
            index.reset(0, event.slots, event.n_slots, event.disk)
        else:
            index.update(0, event)
    for tokens, tier in ((a, "disk"), (b, "host")):
        names = chain(tokens)
        assert index.tiers(names, index.cached_blocks(names)) == {0: tier}
    publisher.unpark(("disk", "f1"))  # deleted: lane 1 free
    publisher.park(("host", 2), a)  # lane 1 again, in host memory now
    for event in events[-2:]:
        assert isinstance(event, BlockUpdate)
        index.update(0, event)
    names = chain(a)
    assert index.tiers(names, index.cached_blocks(names)) == {0: "host"}
    assert publisher.snapshot().disk == (2,)


def test_a_snapshot_without_n_slots_is_all_slots() -> None:
    """A replica of an older version sends no ``n_slots``: every chain is a slot's."""
    index = PrefixIndex()
    tokens = list(range(2 * B))
    index.reset(0, [[], chain(tokens)])
    names = chain(tokens)
    assert index.tiers(names, index.cached_blocks(names)) == {0: "slot"}
