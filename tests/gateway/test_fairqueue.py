"""The queue discipline alone: which waiting request gets the next slots, and why.

Pure calls on :class:`FairQueue` with the time given by the test; no event loop.
"""

from __future__ import annotations

import pytest

from tokenmill.errors import InvalidRequestError
from tokenmill.gateway.fairqueue import FairQueue, requested_priority
from tokenmill.identity import Priority, Tenant, capped

A = Tenant("a")
B = Tenant("b")


def drain(q: FairQueue[str], free: int = 1, now: float = 0.0) -> list[str]:
    """Grant one request at a time (each finishing before the next) until none waits."""
    order: list[str] = []
    while (entry := q.pop_next(free, now)) is not None:
        order.append(entry.item)
        q.finish(entry.tenant.account)
    return order


def test_one_accounts_requests_keep_their_order_and_accounts_alternate() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push(f"a{i}", A, 1, now=0.0)
    for i in range(3):
        q.push(f"b{i}", B, 1, now=0.0)
    order: list[str] = []
    while (entry := q.pop_next(1, 0.0)) is not None:
        order.append(entry.item)
        q.serve(entry.tenant.account, completion_tokens=10)
        q.finish(entry.tenant.account)
    # Equal service each turn: the less-served account goes next, each in its own order.
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_light_tenant_goes_ahead_of_a_floods_queue() -> None:
    q: FairQueue[str] = FairQueue()
    flood, light = Tenant("flood"), Tenant("light")
    for _ in range(4):  # four running, twelve queued
        q.start(flood)
    for i in range(12):
        q.push(f"f{i}", flood, 1, now=float(i))
    q.serve("flood", prompt_tokens=40, completion_tokens=200)
    q.push("l0", light, 1, now=20.0)  # arrives last
    entry = q.pop_next(1, 20.0)
    assert entry is not None and entry.item == "l0"


def test_a_returning_idle_account_is_caught_up_and_banks_no_credit() -> None:
    q: FairQueue[str] = FairQueue()
    q.start(A)
    q.start(B)
    q.serve("a", completion_tokens=1000)
    q.serve("b", completion_tokens=1500)
    # c was never seen (or idle all along): it starts at the least-served active one.
    q.push("c0", Tenant("c"), 1, now=0.0)
    assert q.counter("c") == 1000
    # b goes idle with more than a; when it comes back it keeps its own counter.
    q.finish("b")
    q.push("b1", B, 1, now=1.0)
    assert q.counter("b") == 1500
    # When every account is idle, nobody is owed anything: counters start afresh.
    for entry in list(q):
        q.remove(entry)
    q.finish("a")
    assert q.counter("a") == q.counter("b") == q.counter("c") == 0


def test_an_account_that_served_less_is_not_lifted_above_what_it_had() -> None:
    q: FairQueue[str] = FairQueue()
    q.start(A)
    q.start(B)
    q.serve("a", completion_tokens=100)
    q.serve("b", completion_tokens=300)
    q.finish("b")
    # b idled with more than a: its record stays (it would gain by being forgotten).
    q.push("b1", B, 1, now=0.0)
    assert q.counter("b") == 300


@pytest.mark.parametrize("weights", [(1.0, 1.0, 2.0), (1.0, 3.0, 4.0)])
def test_backlogged_accounts_share_tokens_by_weight(weights: tuple[float, ...]) -> None:
    q: FairQueue[str] = FairQueue()
    tenants = [Tenant(f"t{i}", weight=w) for i, w in enumerate(weights)]
    served = dict.fromkeys((t.account for t in tenants), 0)
    for t in tenants:
        for i in range(200):
            q.push(f"{t.account}-{i}", t, 1, now=0.0)
    for _ in range(300):  # all stay backlogged throughout
        entry = q.pop_next(1, 0.0)
        assert entry is not None
        tokens = 7 + (len(entry.item) % 5)  # uneven request sizes
        q.serve(entry.tenant.account, completion_tokens=tokens)
        served[entry.tenant.account] += tokens
        q.finish(entry.tenant.account)
    total = sum(served.values())
    for t in tenants:
        owed = t.weight / sum(weights)
        # VTC's bound: within one request's tokens of the fair share, per account.
        assert abs(served[t.account] - owed * total) <= 12 * max(weights) / min(weights)


def test_a_higher_class_goes_first_and_a_waiting_lower_class_is_promoted() -> None:
    q: FairQueue[str] = FairQueue(promote_after_s=10.0)
    batch = Tenant("b", priority="batch")
    interactive = Tenant("i", priority="interactive")
    q.push("batch", batch, 1, now=0.0)
    q.push("early", interactive, 1, now=0.0)
    q.serve("b", completion_tokens=0)
    q.serve("i", completion_tokens=500)  # served far more, still first: class wins
    entry = q.pop_next(1, 5.0)
    assert entry is not None and entry.item == "early"
    q.finish("i")
    q.push("late", interactive, 1, now=19.0)
    # At 19 s the batch request counts as default (one promotion): interactive first.
    entry = q.pop_next(1, 19.0)
    assert entry is not None and entry.item == "late"
    q.finish("i")
    q.push("later", interactive, 1, now=21.0)
    # At 21 s it has waited two periods: interactive too, and less served.
    entry = q.pop_next(1, 21.0)
    assert entry is not None and entry.item == "batch"


def test_a_heavy_request_holds_free_slots_until_it_fits_and_is_never_overtaken() -> None:
    q: FairQueue[str] = FairQueue()
    q.start(B)
    q.start(B)
    q.serve("b", completion_tokens=50)
    q.push("heavy", A, 4, now=0.0)  # a is the least served: next
    q.push("a-light", A, 1, now=1.0)  # behind it in its own line
    q.push("b-light", B, 1, now=2.0)
    # Two slots free: the heavy request does not fit, and nobody passes it.
    assert q.pop_next(2, 3.0) is None
    entry = q.pop_next(4, 3.0)
    assert entry is not None and entry.item == "heavy"


def test_a_heavy_head_of_a_more_served_account_lets_the_less_served_through() -> None:
    q: FairQueue[str] = FairQueue()
    q.start(A)
    q.serve("a", completion_tokens=500)
    q.push("heavy", A, 4, now=0.0)
    q.push("light", B, 1, now=1.0)
    entry = q.pop_next(1, 1.0)
    assert entry is not None and entry.item == "light"
    # Once b has been served more, the heavy request is next and gets its slots.
    q.serve("b", completion_tokens=600)
    q.finish("b")
    q.push("light2", B, 1, now=2.0)
    assert q.pop_next(3, 2.0) is None
    entry = q.pop_next(4, 2.0)
    assert entry is not None and entry.item == "heavy"


def test_an_account_at_its_cap_waits_and_others_go() -> None:
    q: FairQueue[str] = FairQueue()
    capped_a = Tenant("a", max_concurrent=1)
    q.start(capped_a)
    q.push("a1", capped_a, 1, now=0.0)
    q.push("b1", B, 1, now=1.0)
    q.serve("b", completion_tokens=1000)  # b served more, yet a is capped
    entry = q.pop_next(4, 1.0)
    assert entry is not None and entry.item == "b1"
    assert q.pop_next(4, 1.0) is None  # a1 waits for a's running request
    q.finish("a")
    entry = q.pop_next(4, 1.0)
    assert entry is not None and entry.item == "a1"


def test_a_request_cancelled_while_queued_leaves_no_trace() -> None:
    q: FairQueue[str] = FairQueue()
    heavy = q.push("heavy", A, 4, now=0.0)
    q.push("light", B, 1, now=1.0)
    q.serve("b", completion_tokens=5)
    assert q.pop_next(1, 1.0) is None  # the heavy head holds the slot
    assert q.remove(heavy) and not q.remove(heavy)
    assert (len(q), q.queued("a")) == (1, 0)
    entry = q.pop_next(1, 1.0)
    assert entry is not None and entry.item == "light"


def test_fifo_serves_in_arrival_order_whoever_asks() -> None:
    q: FairQueue[str] = FairQueue(fair=False)
    q.push("a0", A, 1, now=0.0)
    q.push("a1", A, 1, now=1.0)
    q.push("b0", Tenant("b", priority="interactive"), 1, now=2.0)
    q.serve("a", completion_tokens=10_000)
    assert drain(q) == ["a0", "a1", "b0"]


def test_the_deployments_view_lists_waiting_accounts_and_their_shares() -> None:
    q: FairQueue[str] = FairQueue()
    heavy = Tenant("h", weight=3.0)
    q.start(heavy)
    q.push("h1", heavy, 1, now=0.0)
    q.push("l1", Tenant("l", priority="batch"), 1, now=0.0)
    q.push("l2", Tenant("l"), 1, now=0.0)
    views = {v.account: v for v in q.accounts()}
    assert views["l"].queued == {"batch": 1, "default": 1}
    assert (views["h"].running, views["h"].queued) == (1, {"default": 1})
    assert (views["h"].share, views["l"].share) == (0.75, 0.25)


@pytest.mark.parametrize(
    ("priority", "tier", "expected"),
    [
        ("interactive", None, "interactive"),
        ("batch", "priority", "batch"),  # priority decides
        (-1, None, "interactive"),
        (0, None, "default"),
        (5, None, "batch"),
        (None, "flex", "batch"),
        (None, "priority", "interactive"),
        (None, "scale", "interactive"),
        (None, "auto", None),
        (None, "default", None),
        (None, None, None),
    ],
)
def test_requested_priority_maps_vllm_and_openai_values(
    priority: int | str | None, tier: str | None, expected: Priority | None
) -> None:
    assert requested_priority(priority, tier) == expected


@pytest.mark.parametrize(
    ("priority", "tier", "field"), [("urgent", None, "priority"), (None, "gold", "service_tier")]
)
def test_an_unknown_class_is_a_400_naming_its_field(
    priority: str | None, tier: str | None, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        requested_priority(priority, tier)
    assert caught.value.param == field


def test_a_keys_class_caps_what_its_requests_ask_for() -> None:
    assert capped("interactive", "default", "default") == "default"
    assert capped("batch", "default", "default") == "batch"
    assert capped(None, "batch", "batch") == "batch"
    assert capped("interactive", "default", "interactive") == "interactive"
