"""Requests admitted whole, first come first served (engines/llamacpp/admission.py)."""

from __future__ import annotations

from tokenmill.engines import GenerationRequest, SamplingParams
from tokenmill.engines.llamacpp.admission import RequestQueue
from tokenmill.engines.llamacpp.choices import Group, build_group


def group(rid: str, n: int) -> Group:
    request = GenerationRequest(rid, SamplingParams(max_tokens=4), prompt_tokens=(1,), n=n)
    return build_group(request, [[1, 2]])


def test_a_request_waits_for_all_its_slots_and_is_not_overtaken() -> None:
    queue = RequestQueue()
    big, small = group("big", 3), group("small", 1)
    queue.push(big)
    queue.push(small)
    assert queue.admit(2, now=1.0) == []  # big needs 3: small waits behind it
    assert queue.waiting == 2
    admitted = queue.admit(4, now=2.0)
    assert admitted == [*big.members, *small.members]
    assert big.marks == [2.0] and queue.waiting == 0
    assert queue.running("big") is big and queue.running("small") is small
    queue.finished("big")
    assert queue.running("big") is None


def test_a_queued_request_is_withdrawn_whole() -> None:
    queue = RequestQueue()
    first, second = group("a", 2), group("b", 1)
    queue.push(first)
    queue.push(second)
    assert queue.withdraw("b") is second
    assert second.open == 0 and all(seq.done for seq in second.members)
    assert queue.withdraw("b") is None and queue.withdraw("unknown") is None
    assert queue.waiting == 1


def test_pending_names_one_choice_of_each_open_request() -> None:
    queue = RequestQueue()
    running, queued, done = group("r", 2), group("q", 3), group("d", 1)
    for g in (running, done, queued):
        queue.push(g)
    queue.admit(3, now=0.0)  # r and d run, q waits
    done.open = 0
    assert queue.pending() == [running.members[0], queued.members[0]]
    queue.clear_queued()
    assert queue.pending() == [running.members[0]]
    queue.clear()
    assert queue.pending() == [] and queue.waiting == 0
