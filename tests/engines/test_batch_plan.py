"""Which tokens a decode step computes (engines/llamacpp/batch.py): no model."""

from __future__ import annotations

from tokenmill.engines import GenerationRequest, SamplingParams
from tokenmill.engines.llamacpp.batch import plan_batch
from tokenmill.engines.llamacpp.choices import Choice, build_group


def choice(key: str, slot: int, prompt: int, n_past: int = 0, last: int = -1) -> Choice:
    """A choice in ``slot`` with a ``prompt``-token prompt, ``n_past`` of it decoded."""
    seq = build_group(
        GenerationRequest(key, SamplingParams(max_tokens=8), prompt_tokens=(1,)),
        [list(range(1000, 1000 + prompt))],
    ).members[0]
    seq.slot, seq.n_past, seq.last_token = slot, n_past, last
    return seq


def test_decoding_choices_get_a_row_each_in_slot_order() -> None:
    late = choice("late", slot=0, prompt=3, n_past=5, last=42)
    early = choice("early", slot=2, prompt=3, n_past=3, last=41)
    plan = plan_batch([early, late], prefill_chunk=512, capacity=600)
    assert plan.rows == [(42, 5, 0, True), (41, 3, 2, True)]
    assert plan.outputs == [(late, 0), (early, 1)]
    assert plan.prompt_rows == [] and plan.prefills == []


def test_the_prompt_budget_goes_shortest_first_with_the_oldests_share() -> None:
    decoding = choice("d", slot=1, prompt=2, n_past=4, last=7)
    first = choice("first", slot=3, prompt=200)
    second = choice("second", slot=0, prompt=300, n_past=100)
    third = choice("third", slot=2, prompt=50)
    # capacity 251: 1 row for the decoding choice, 250 prompt tokens (prefill.py's
    # rule): first, the oldest, its quarter (63); then shortest left first: all of
    # third's 50, the rest of first's; none left for second (as long as first, later).
    plan = plan_batch([decoding, first, second, third], prefill_chunk=512, capacity=251)
    assert [(seq.key, end) for seq, end in plan.prefills] == [("third", 50), ("first", 200)]
    # The rows in slot order: decoding (1), third (2), first (3).
    assert [row[2] for row in plan.rows] == [1] + [2] * 50 + [3] * 200
    assert plan.rows[0] == (7, 4, 1, True) and plan.rows[1] == (1000, 0, 2, False)
    # Both prompts are in: their last rows give their first tokens.
    assert plan.outputs == [(decoding, 0), (third, 50), (first, 250)]
    # A smaller chunk bounds the prompt tokens whatever the capacity: the oldest's
    # share (30 of 120), then the shortest, then the oldest again.
    plan = plan_batch([decoding, first, second, third], prefill_chunk=120, capacity=600)
    assert [(seq.key, end) for seq, end in plan.prefills] == [("third", 50), ("first", 70)]


def test_a_prompts_last_token_is_an_output_and_the_chunk_bounds_the_prefill() -> None:
    seq = choice("p", slot=0, prompt=5, n_past=2)
    plan = plan_batch([seq], prefill_chunk=512, capacity=600)
    assert plan.rows == [(1002, 2, 0, False), (1003, 3, 0, False), (1004, 4, 0, True)]
    assert plan.outputs == [(seq, 2)] and plan.prefills == [(seq, 5)]
    long = choice("long", slot=1, prompt=2000)
    plan = plan_batch([long], prefill_chunk=512, capacity=600)
    assert len(plan.rows) == 512 and plan.prefills == [(long, 512)] and plan.outputs == []


def test_followers_neither_decode_nor_prefill() -> None:
    request = GenerationRequest("r", SamplingParams(max_tokens=8), prompt_tokens=(1,), n=3)
    leader, *followers = build_group(request, [[5, 6, 7]]).members
    for slot, seq in enumerate((leader, *followers)):
        seq.slot = slot
    plan = plan_batch([leader, *followers], prefill_chunk=512, capacity=600)
    assert plan.rows == [(5, 0, 0, False), (6, 1, 0, False), (7, 2, 0, True)]
    assert plan.outputs == [(leader, 2)]


def test_echoed_logprobs_want_every_prompt_row() -> None:
    sampling = SamplingParams(max_tokens=8, echo=True, logprobs=2)
    request = GenerationRequest("e", sampling, prompt_tokens=(1,))
    seq = build_group(request, [[5, 6, 7, 8]]).members[0]
    seq.slot = 0
    plan = plan_batch([seq], prefill_chunk=2, capacity=600)
    assert plan.rows == [(5, 0, 0, True), (6, 1, 0, True)]
    assert plan.prompt_rows == [(seq, 0), (seq, 1)] and plan.outputs == []
    seq.n_past = 2
    plan = plan_batch([seq], prefill_chunk=2, capacity=600)
    assert plan.prompt_rows == [(seq, 0)] and plan.outputs == [(seq, 1)]


def test_background_choices_sit_out_a_step_that_prefills_a_foreground_prompt() -> None:
    line = choice("line", slot=0, prompt=3, n_past=6, last=40)
    line.background = True
    other = choice("other", slot=1, prompt=3, n_past=4, last=41)
    fresh = choice("fresh", slot=2, prompt=4)
    # A foreground prompt to prefill: the background line neither decodes nor prefills.
    plan = plan_batch([line, other, fresh], prefill_chunk=512, capacity=600)
    assert [row[2] for row in plan.rows] == [1, 2, 2, 2, 2]
    assert [seq.key for seq, _ in plan.outputs] == ["other", "fresh"]
    # Once it is in, everyone decodes together again.
    fresh.n_past, fresh.last_token = 4, 43
    plan = plan_batch([line, other, fresh], prefill_chunk=512, capacity=600)
    assert [seq.key for seq, _ in plan.outputs] == ["line", "other", "fresh"]
    # A background prompt waits for nobody, and holds nobody back.
    queued = choice("queued", slot=3, prompt=2)
    queued.background = True
    plan = plan_batch([line, other, fresh, queued], prefill_chunk=512, capacity=600)
    assert [seq.key for seq, _ in plan.outputs] == ["line", "other", "fresh", "queued"]


def test_a_draft_is_verified_right_after_its_choices_row_with_what_prompts_leave() -> None:
    a = choice("a", slot=0, prompt=3, n_past=5, last=42)
    b = choice("b", slot=1, prompt=3, n_past=9, last=43)
    a.draft, b.draft = [7, 8, 9], [5, 6]
    plan = plan_batch([a, b], prefill_chunk=512, capacity=600)
    # Each draft token at the positions after the choice's next one, logits wanted.
    assert plan.rows == [
        (42, 5, 0, True),
        (7, 6, 0, True),
        (8, 7, 0, True),
        (9, 8, 0, True),
        (43, 9, 1, True),
        (5, 10, 1, True),
        (6, 11, 1, True),
    ]
    assert plan.outputs == [(a, 0), (b, 4)]
    assert plan.drafts == {"a": [1, 2, 3], "b": [5, 6]}
    # A prompt to prefill goes first; the drafts get what is left, in slot order.
    a.draft, b.draft = [7, 8, 9], [5, 6]
    new = choice("new", slot=2, prompt=3)
    plan = plan_batch([a, b, new], prefill_chunk=512, capacity=8)
    assert [(seq.key, end) for seq, end in plan.prefills] == [("new", 3)]
    assert plan.drafts == {"a": [1, 2, 3]} and a.draft == [7, 8, 9] and b.draft == []
    assert len(plan.rows) == 8
