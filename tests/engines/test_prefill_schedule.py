"""How much prompt a step reads, and whose (engines/llamacpp/prefill.py): no model.

The rule is driven with a made-up cost of steps, as the loop drives it with the
measured one: every step is planned by ``plan_batch`` with the chunk ``RowCost`` gives,
"decoded" at the cost model's price, and the choices advance as the loop advances them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tokenmill.engines import GenerationRequest, SamplingParams
from tokenmill.engines.llamacpp.batch import plan_batch
from tokenmill.engines.llamacpp.choices import Choice, build_group
from tokenmill.engines.llamacpp.prefill import (
    FIXED_SHARE,
    LARGE_ROWS,
    LONG_STEP_BUDGET_S,
    MIN_CHUNK,
    STEP_BUDGET_S,
    Pending,
    RowCost,
    grant_prefills,
)

CAPACITY = 528  # the engine's batch at 16 slots: 512 prompt tokens and a row a slot
MAX_CHUNK = 512


def cost(rows: int) -> float:
    """A step of SmolLM2-135M's Q8_0 on 2 cores, roughly: a pass over the weights,
    then ~2 ms a row."""
    return 0.008 + 0.002 * rows


def test_the_shortest_prompt_goes_first_and_the_oldest_always_gets_a_share() -> None:
    long, short, mid = Pending("long", 2000), Pending("short", 20), Pending("mid", 60)
    # 100 rows: the oldest its quarter, then shortest first, then the rest to the oldest.
    assert grant_prefills([long, short, mid], 100) == {"long": 25, "short": 20, "mid": 55}
    assert grant_prefills([long, short, mid], 200) == {"long": 120, "short": 20, "mid": 60}
    # Alone, a prompt takes what there is.
    assert grant_prefills([long], 100) == {"long": 100}
    # Equal lengths: arrival order.
    assert grant_prefills([Pending("a", 9), Pending("b", 50), Pending("c", 50)], 40) == {
        "a": 9,
        "b": 31,
    }
    # The oldest's share is no more than it has left; nothing for no rows.
    assert grant_prefills([Pending("a", 3), Pending("b", 500)], 100) == {"a": 3, "b": 97}
    assert grant_prefills([long, short], 0) == {}


def test_row_cost_sizes_a_step_to_the_budget_and_follows_the_machine() -> None:
    rc = RowCost()
    # Nothing measured: the whole batch (as before the budget).
    assert rc.chunk(3, capacity=CAPACITY) == CAPACITY - 3
    for _ in range(30):
        rc.observe(1, cost(1))
    # Only decode steps measured: a prior that errs on the short side.
    first = rc.chunk(1, capacity=CAPACITY)
    assert MIN_CHUNK <= first <= (STEP_BUDGET_S - 0.008) / 0.002
    for rows in (first, 100, 60, 1, 45):
        rc.observe(rows, cost(rows))
    for _ in range(30):
        rc.observe(1, cost(1))
        rc.observe(50, cost(50))
    within = rc.rows_within(STEP_BUDGET_S)
    assert within is not None and abs(within - 46) <= 1  # (0.1 - 0.008) / 0.002
    assert abs(rc.chunk(16, capacity=CAPACITY) - 30) <= 1
    # Decoding streams beyond the budget: a prompt still progresses.
    assert rc.chunk(200, capacity=CAPACITY + 200) == MIN_CHUNK
    # ... and never past the batch.
    assert rc.chunk(CAPACITY - 5, capacity=CAPACITY) == 5
    # The machine gets twice as slow (another process): steps shrink to fit.
    for _ in range(30):
        rc.observe(1, 2 * cost(1))
        rc.observe(LARGE_ROWS + 10, 2 * cost(LARGE_ROWS + 10))
    within = rc.rows_within(STEP_BUDGET_S)
    assert within is not None and abs(within - 21) <= 1  # (0.1 - 0.016) / 0.004
    # ... but never below what keeps a step's pass over the weights a tenth of it: 36
    # rows (0.016 s x 0.9 / (0.1 x 0.004 s a row)), or prompts would be read slower
    # still.
    least = rc.rows_for_share(FIXED_SHARE)
    assert abs(least - 36) <= 1
    assert rc.chunk(0, capacity=CAPACITY) == least
    assert rc.chunk(10, capacity=CAPACITY) == least - 10
    assert rc.chunk(30, capacity=CAPACITY) == MIN_CHUNK
    # Cheap rows (a fast machine): the whole batch.
    fast = RowCost()
    for _ in range(10):
        fast.observe(1, 0.001)
        fast.observe(400, 0.001 + 400 * 0.00005)
    assert fast.chunk(2, capacity=CAPACITY) == CAPACITY - 2


def test_chunks_grow_back_after_a_slow_spell_from_steps_of_any_size() -> None:
    # A first step measured at the worst moment (another process had the cores), then
    # only steps of a minimum chunk beside two streams: each measures a row's cost, so
    # the chunk grows back to the budget instead of staying at the minimum.
    rc = RowCost()
    rc.observe(1, 0.45)
    chunks = []
    for _ in range(40):
        chunk = rc.chunk(2, capacity=CAPACITY, shortest=400)
        chunks.append(chunk)
        rc.observe(2 + chunk, cost(2 + chunk))
        rc.observe(2, cost(2))
    assert chunks[0] == MIN_CHUNK
    assert abs(chunks[-1] - ((LONG_STEP_BUDGET_S - 0.008) / 0.002 - 2)) <= 2


@dataclass
class Sim:
    """The loop's prefill, stepped: ``admit`` a choice, ``step`` one decode."""

    rc: RowCost = field(default_factory=RowCost)
    running: list[Choice] = field(default_factory=list)
    now: float = 0.0
    steps: list[float] = field(default_factory=list)  # each step's seconds
    first_token: dict[str, float] = field(default_factory=dict)

    def admit(self, key: str, prompt: int, slot: int) -> Choice:
        seq = build_group(
            GenerationRequest(key, SamplingParams(max_tokens=10_000), prompt_tokens=(1,)),
            [list(range(1000, 1000 + prompt))],
        ).members[0]
        seq.slot = slot
        self.running.append(seq)
        return seq

    def step(self) -> None:
        decoding = sum(1 for s in self.running if s.prefilled)
        lefts = [len(s.prompt) - s.n_past for s in self.running if not s.prefilled]
        chunk = self.rc.chunk(
            decoding,
            capacity=min(CAPACITY, MAX_CHUNK + decoding),
            shortest=min(lefts) if lefts else None,
        )
        plan = plan_batch(self.running, prefill_chunk=chunk, capacity=CAPACITY)
        seconds = cost(len(plan.rows))
        self.rc.observe(len(plan.rows), seconds)
        self.now += seconds
        self.steps.append(seconds)
        for seq, end in plan.prefills:
            seq.n_past = end
        for seq, _ in plan.outputs:
            self.first_token.setdefault(seq.key, self.now)
            seq.n_past += 1
            seq.last_token = 7


def test_a_continuation_gets_its_first_token_before_a_long_prompt_is_read() -> None:
    sim = Sim()
    for _ in range(20):  # a stream decoding: the engine has measured its steps
        sim.rc.observe(1, cost(1))
    sim.admit("stream", 10, slot=0).n_past = 10
    long = sim.admit("long", 2000, slot=1)
    sim.step()
    sim.step()
    cont = sim.admit("continuation", 20, slot=2)
    asked = sim.now
    while not long.prefilled:
        sim.step()
    assert cont.prefilled
    assert sim.first_token["continuation"] < sim.first_token["long"]
    # Its first token came with the next step, a short one: not after the long prompt.
    assert sim.first_token["continuation"] - asked <= STEP_BUDGET_S * 1.1
    # Once measured, no step ran much past the long budget (the first ones size the
    # rows), and the long prompt was read in such steps, not starved, at most a tenth
    # slower than in 512-row steps.
    assert max(sim.steps[3:]) <= LONG_STEP_BUDGET_S * 1.1
    assert sim.first_token["long"] <= 1.1 * 4 * cost(512)


def test_a_long_prompt_is_never_starved_by_short_ones() -> None:
    sim = Sim()
    long = sim.admit("long", 1000, slot=0)
    n = 0
    while not long.prefilled:
        assert len(sim.steps) < 200
        # A new short prompt every step, each with a slot of its own.
        if not any(not s.prefilled for s in sim.running if s is not long):
            n += 1
            sim.admit(f"short-{n}", 30, slot=n)
        sim.step()
        sim.running = [s for s in sim.running if s is long or not s.prefilled]
    assert n > 5  # the short ones went meanwhile


def test_a_step_is_short_when_a_first_token_waits_on_it_and_longer_otherwise() -> None:
    rc = RowCost()
    for _ in range(10):
        rc.observe(1, cost(1))
        rc.observe(100, cost(100))
    short = rc.chunk(4, capacity=CAPACITY, shortest=20)
    assert abs(short - ((STEP_BUDGET_S - 0.008) / 0.002 - 4)) <= 1
    assert rc.chunk(4, capacity=CAPACITY, shortest=None) == short
    # Every prompt left is longer than a short step reads: a long step, read sooner.
    long = rc.chunk(4, capacity=CAPACITY, shortest=short + 1)
    assert abs(long - ((LONG_STEP_BUDGET_S - 0.008) / 0.002 - 4)) <= 1


def test_a_long_prompt_with_nothing_decoding_is_read_in_whole_chunks() -> None:
    # However dear a row has been measured (deep in a long prompt every row is), a step
    # that only reads long prompts, with nothing decoding beside it, takes the whole room:
    # nobody waits on it, and small pieces deep in a prompt read it many times slower.
    rc = RowCost()
    for _ in range(10):
        rc.observe(1, cost(1))
        rc.observe(100, 100 * 0.1)  # 100 ms a row
    assert rc.chunk(0, capacity=CAPACITY, shortest=5000) == CAPACITY
    # Beside decoding streams the long budget still bounds the step.
    assert rc.chunk(4, capacity=CAPACITY, shortest=5000) < CAPACITY - 4
    # A prompt a short step finishes is still read in a short one.
    short = rc.within_budget(0, capacity=CAPACITY, budget_s=STEP_BUDGET_S)
    assert short < CAPACITY and rc.chunk(0, capacity=CAPACITY, shortest=short) == short


@pytest.mark.parametrize("decoding", [0, 4, 16])
def test_before_any_step_is_measured_the_whole_chunk_goes(decoding: int) -> None:
    sim = Sim()
    for i in range(decoding):
        sim.admit(f"d{i}", 5, slot=i).n_past = 5
    sim.admit("p", 2000, slot=decoding)
    sim.step()
    assert sim.steps[0] == pytest.approx(cost(MAX_CHUNK + decoding))
    sim.step()  # measured: the next is sized to the (long) budget
    assert sim.steps[1] <= LONG_STEP_BUDGET_S * 1.1
