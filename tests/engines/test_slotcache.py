"""The record of what every KV slot holds (engines/llamacpp/slotcache.py): no model.

Its listeners are how the cache's contents will be published (cache-aware routing):
replaying every reported change onto a copy must give exactly what the cache says
each slot holds, whatever the engine did to the slots.
"""

from __future__ import annotations

import random
import sys

import pytest

from tokenmill.engines.llamacpp.slotcache import SlotCache, SlotChange, WarmUp
from tokenmill.engines.llamacpp.slots import plan_placement


class Mirror:
    """Every slot's tokens, rebuilt from the reported changes alone."""

    def __init__(self, n: int) -> None:
        self.slots: list[tuple[int, ...]] = [() for _ in range(n)]
        self.changes: list[SlotChange] = []

    def __call__(self, change: SlotChange) -> None:
        old = self.slots[change.slot]
        assert change.kept <= len(old)
        self.slots[change.slot] = old[: change.kept] + change.added
        assert len(self.slots[change.slot]) == change.length
        self.changes.append(change)


def test_importing_the_pure_parts_loads_no_llama_cpp() -> None:
    import subprocess

    probe = (
        "import sys, tokenmill.engines.llamacpp.slotcache, tokenmill.engines.llamacpp.batch,"
        " tokenmill.engines.llamacpp.choices, tokenmill.engines.llamacpp.admission;"
        " print('llama_cpp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_each_kind_of_change_is_reported_once() -> None:
    cache: SlotCache[str] = SlotCache(3, n_ctx=100)
    mirror = Mirror(3)
    cache.subscribe(mirror)
    plan = plan_placement(cache.slots, [1, 2, 3, 4])
    cache.place(plan, "a", now=1.0, keep=plan.keep)
    assert mirror.changes == []  # an empty slot placed with nothing kept: no change
    cache.extend(0, [1, 2, 3])
    cache.append(0, 4)
    assert mirror.changes == [SlotChange(0, 0, (1, 2, 3)), SlotChange(0, 3, (4,))]
    cache.copy(0, 2)
    assert mirror.changes[-1] == SlotChange(2, 0, (1, 2, 3, 4))
    cache.truncate(2, 1)
    assert mirror.changes[-1] == SlotChange(2, 1, ())
    count = len(mirror.changes)
    cache.truncate(2, 5)  # longer than it is: nothing to evict
    cache.extend(1, [])
    cache.release(0, now=2.0)  # the cells stay: the tokens did not change
    assert len(mirror.changes) == count
    assert cache.tokens(0) == (1, 2, 3, 4) and cache.tokens(2) == (1,)
    assert cache.contents() == mirror.slots == [(1, 2, 3, 4), (), (1,)]
    assert cache.used_tokens() == 5
    assert cache.free_slots() == 3


def test_a_placement_reports_the_parked_slot_and_the_destination() -> None:
    cache: SlotCache[str] = SlotCache(4, n_ctx=100)
    mirror = Mirror(4)
    cache.subscribe(mirror)
    system = list(range(10, 30))
    for i, start in enumerate((100, 200, 300, 400)):
        plan = plan_placement(cache.slots, [*system, start])
        cache.place(plan, f"r{i}", now=float(i), keep=plan.keep)
        cache.extend(plan.dest, [*system, start, start + 1][plan.keep :])
        cache.release(plan.dest, now=float(i))
    assert cache.contents() == mirror.slots
    # Every slot shares the system prompt: a new conversation reuses it, by copy or
    # in place, and what it overwrites may be parked first.
    plan = plan_placement(cache.slots, [*system, 999])
    cache.place(plan, "new", now=9.0, keep=plan.keep)
    assert cache.contents() == mirror.slots
    assert cache.tokens(plan.dest) == tuple(system[: plan.keep])


@pytest.mark.parametrize("seed", range(20))
def test_replayed_changes_always_equal_the_record(seed: int) -> None:
    rng = random.Random(seed)
    n = 4
    cache: SlotCache[int] = SlotCache(n, n_ctx=200)
    mirror = Mirror(n)
    cache.subscribe(mirror)
    bases = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    for step in range(200):
        op = rng.randrange(5)
        busy = [s.index for s in cache.slots if s.seq is not None]
        if op == 0 and cache.free_slots():
            prompt = rng.choice(bases) + [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            plan = plan_placement(
                cache.slots, prompt, pending=rng.randrange(2), fills=rng.random() < 0.2
            )
            keep = plan.keep if rng.random() < 0.9 else 0  # 0: llama.cpp could not cut
            cache.place(plan, step, now=float(step), keep=keep)
            cache.extend(plan.dest, prompt[keep:])
        elif op == 1 and busy:
            cache.append(rng.choice(busy), rng.randrange(5))
        elif op == 2 and busy:
            cache.release(rng.choice(busy), now=float(step))
        elif op == 3:
            cache.truncate(rng.randrange(n), rng.randrange(40))
        elif op == 4:
            cache.copy(rng.randrange(n), rng.randrange(n))
        assert mirror.slots == cache.contents(), step


def test_a_warm_up_is_planned_only_with_room_left() -> None:
    cache: SlotCache[str] = SlotCache(2, n_ctx=10)
    cache.extend(0, [1, 2, 3, 4, 5])
    cache.plan_warm_up(0, (6, 7, 8, 9, 10))  # would fill the context: no room left
    assert cache.warm_up is None
    cache.plan_warm_up(0, (6, 7, 8, 9))
    assert cache.warm_up == WarmUp(0, 5, (6, 7, 8, 9))


def test_a_slot_that_moved_on_is_not_warmed() -> None:
    cache: SlotCache[str] = SlotCache(2, n_ctx=100)
    cache.extend(0, [1, 2, 3])
    cache.plan_warm_up(0, (4, 5))
    warm = cache.warm_up
    assert warm is not None and cache.still_warmable(warm)
    cache.append(0, 9)  # another request extended it meanwhile
    assert not cache.still_warmable(warm)
    cache.truncate(0, 3)
    plan = plan_placement(cache.slots, [1, 2, 3, 7])
    cache.place(plan, "next", now=1.0, keep=plan.keep)
    assert plan.dest == 0 and cache.tokens(0) == (1, 2, 3)
    assert not cache.still_warmable(warm)  # the same length, but a request runs there
