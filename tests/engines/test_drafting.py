"""Which choices of a step draft, and how long (engines/llamacpp/drafting.py): the
measured costs decide, no constant cap; no model."""

from __future__ import annotations

from tokenmill.engines import GenerationRequest, SamplingParams
from tokenmill.engines.llamacpp.choices import Choice, build_group
from tokenmill.engines.llamacpp.drafting import plan_drafts
from tokenmill.engines.speculative import DraftLength, NgramIndex, Speculation, StepCosts

# A prompt that repeats a 100-token run: its tail drafts the run again.
RUN = list(range(500, 600))
PROMPT = [*RUN, *RUN[:4]]


def choice(key: str, slot: int, *, acceptance: float, max_tokens: int = 500) -> Choice:
    seq = build_group(
        GenerationRequest(key, SamplingParams(max_tokens=max_tokens), prompt_tokens=(1,)),
        [list(PROMPT)],
    ).members[0]
    seq.slot, seq.n_past, seq.last_token = slot, len(PROMPT), PROMPT[-1]
    seq.spec = Speculation(NgramIndex(PROMPT), DraftLength(acceptance))
    return seq


def costs(per_row: float) -> StepCosts:
    """A step of n rows: one pass (10 ms), then ``per_row`` of a pass for each row more."""
    measured = StepCosts(unified=True, n_ubatch=512)
    for n in (1, 2, 9, 17, 65, 129):
        measured.observe([(0, n)], 0.010 * (1 + per_row * (n - 1)))
    return measured


def test_a_copying_choice_drafts_long_where_rows_are_cheap() -> None:
    seq = choice("copy", 0, acceptance=0.995)
    plan_drafts([seq], costs(0.35), n_ctx=8192)
    assert len(seq.draft) >= 16 and seq.draft == RUN[4 : 4 + len(seq.draft)]
    # Rows as dear as a step: nothing pays, and it rests (its acceptance drifts back
    # toward the prior, to try again after a while).
    seq = choice("copy", 0, acceptance=0.995)
    plan_drafts([seq], costs(1.0), n_ctx=8192)
    assert seq.draft == [] and seq.spec is not None and seq.spec.length.acceptance < 0.995


def test_drafts_stop_at_max_tokens_and_the_context() -> None:
    seq = choice("copy", 0, acceptance=0.995, max_tokens=6)
    plan_drafts([seq], costs(0.35), n_ctx=8192)
    assert len(seq.draft) <= 5
    seq = choice("copy", 0, acceptance=0.995)
    plan_drafts([seq], costs(0.35), n_ctx=len(PROMPT) + 4)
    assert len(seq.draft) <= 3


def test_a_low_acceptance_rests_and_the_always_rule_drafts_what_it_finds() -> None:
    seq = choice("unsure", 0, acceptance=0.2)
    plan_drafts([seq], costs(0.35), n_ctx=8192)
    assert seq.draft == []
    assert seq.spec is not None and seq.spec.length.acceptance > 0.2  # resting: back up
    seq = choice("unsure", 0, acceptance=0.2, max_tokens=20)
    plan_drafts([seq], costs(0.35), n_ctx=8192, always=True)
    assert seq.draft == RUN[4:23]


def test_no_draft_while_a_prompt_is_read_and_beside_many_only_what_pays() -> None:
    seq = choice("copy", 0, acceptance=0.995)
    reading = choice("reading", 1, acceptance=0.8)
    reading.n_past = 10
    plan_drafts([seq, reading], costs(0.35), n_ctx=8192)
    assert seq.draft == []
    # Beside fifteen plain streams a middling acceptance's draft costs them all.
    middling = choice("middling", 0, acceptance=0.6)
    others = []
    for slot in range(1, 16):
        other = choice(f"o{slot}", slot, acceptance=0.0)
        other.spec = None
        others.append(other)
    plan_drafts([middling, *others], costs(0.35), n_ctx=8192)
    assert len(middling.draft) <= 2
