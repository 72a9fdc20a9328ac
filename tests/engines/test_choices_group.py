"""A request laid out as choices (engines/llamacpp/choices.py): no model."""

from __future__ import annotations

import pytest

from tokenmill.engines import Constraint, GenerationRequest, SamplingParams
from tokenmill.engines.llamacpp.choices import build_group


def test_n_choices_per_prompt_led_by_the_first() -> None:
    sampling = SamplingParams(max_tokens=8, seed=10)
    request = GenerationRequest("r", sampling, prompts=("a", "b"), n=3)
    group = build_group(request, [[1, 2], [3, 4, 5]], next_turn=(9,))
    members = group.members
    assert [m.key for m in members] == ["r", "r#1", "r#2", "r#3", "r#4", "r#5"]
    assert [m.index for m in members] == list(range(6))
    assert [m.sampling.seed for m in members] == [10, 11, 12, 10, 11, 12]
    assert members[0].followers == members[1:3] and members[3].followers == members[4:]
    first, second = members[0], members[3]
    assert [m.leader for m in members] == [None, first, first, None, second, second]
    assert all(m.group is group and m.next_turn == (9,) for m in members)
    assert group.open == 6 and group.prompt_tokens == 5
    assert group.usage().prompt_tokens == 5 and group.usage().completion_tokens == 0


def test_echoed_logprobs_are_collected_by_leaders_only() -> None:
    sampling = SamplingParams(max_tokens=8, echo=True, logprobs=1)
    request = GenerationRequest("r", sampling, prompt_tokens=(1, 2), n=2)
    leader, follower = build_group(request, [[1, 2]]).members
    assert leader.prompt_logprobs == [] and follower.prompt_logprobs is None
    assert leader.aligner is not None and follower.aligner is not None
    assert leader.echo_pending and follower.echo_pending
    plain = build_group(GenerationRequest("p", SamplingParams(max_tokens=8), prompt="x"), [[1]])
    seq = plain.members[0]
    assert seq.prompt_logprobs is None and seq.aligner is None and not seq.echo_pending


def test_a_constraint_needs_its_grammar_starter() -> None:
    sampling = SamplingParams(max_tokens=8, constraint=Constraint("json_object", ""))
    request = GenerationRequest("r", sampling, prompt="x")
    with pytest.raises(ValueError, match="start_grammar"):
        build_group(request, [[1]])
