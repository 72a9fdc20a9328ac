"""A shared replica's slot book (replicas/slotbook.py): pure decisions, no replica."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.replicas.slotbook import SlotBook

A, B = 1, 2  # two gateways' connections


def test_reservations_of_two_owners_fill_the_slots_and_no_more() -> None:
    book = SlotBook(3)
    assert book.reserve(A, "a1", 1, now=0) == "ok"
    assert book.reserve(B, "b1", 2, now=0) == "ok"
    assert book.taken == 3
    assert book.reserve(A, "a2", 1, now=0) == "full"
    assert book.taken == 3 and "a2" not in book
    assert book.end("b1") == B
    assert book.reserve(A, "a2", 2, now=0) == "ok" and book.taken == 3


def test_an_id_held_here_is_refused_not_shared() -> None:
    book = SlotBook(4)
    assert book.reserve(A, "same", 1, now=0) == "ok"
    assert book.reserve(B, "same", 1, now=0) == "duplicate"
    # Another owner cannot start it either; its own owner can, once.
    assert book.start(B, "same", 1, now=0) == "duplicate"
    assert book.start(A, "same", 1, now=0) == "ok" and book.running("same")
    assert book.start(A, "same", 1, now=0) == "duplicate"
    assert book.owner("same") == A and book.taken == 1


def test_a_start_without_a_reservation_takes_free_slots_or_is_full() -> None:
    book = SlotBook(1)
    assert book.start(A, "a", 1, now=0) == "ok" and book.running("a")
    assert book.start(B, "b", 1, now=0) == "full"
    assert book.end("a") == A and book.end("a") is None
    assert book.taken == 0


def test_a_lost_reservation_expires_only_when_its_slots_are_wanted() -> None:
    book = SlotBook(2, hold_s=10)
    book.reserve(A, "lost", 1, now=0)
    book.reserve(A, "running", 1, now=0)
    book.start(A, "running", 1, now=0)
    assert book.reserve(B, "b", 1, now=5) == "full"  # not old enough
    assert book.reserve(B, "b", 1, now=11) == "ok"  # the lost one makes room
    assert "lost" not in book and book.running("running")
    assert book.expire(now=100) == ["b"]  # b never started; a running request stays
    assert book.running("running") and book.taken == 1


def test_what_an_owner_holds_splits_into_reserved_and_running() -> None:
    book = SlotBook(4)
    for rid in ("r1", "r2"):
        book.reserve(A, rid, 1, now=0)
    book.start(A, "r2", 1, now=0)
    book.reserve(B, "other", 1, now=0)
    assert book.held_by(A) == (["r1"], ["r2"])
    assert book.held_by(B) == (["other"], [])
    assert book.held_by(3) == ([], [])


ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "start", "end", "expire"]),
        st.integers(1, 2),  # owner
        st.integers(0, 5),  # request
        st.integers(1, 3),  # weight
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(1, 4), script=ops)
def test_the_slots_taken_never_exceed_the_slots_and_always_add_up(
    slots: int, script: list[tuple[str, int, int, int]]
) -> None:
    book = SlotBook(slots, hold_s=3)
    held: dict[str, int] = {}  # reference: id -> weight
    for now, (op, owner, n, weight) in enumerate(script):
        rid = f"r{n}"
        if op == "reserve":
            if book.reserve(owner, rid, weight, now) == "ok":
                held[rid] = weight
        elif op == "start":
            if book.start(owner, rid, weight, now) == "ok":
                held.setdefault(rid, weight)
        elif op == "end":
            book.end(rid)
            held.pop(rid, None)
        else:
            book.expire(now)
        for gone in [r for r in held if r not in book]:  # expired along the way
            del held[gone]
        assert book.taken == sum(held.values()) <= slots
