"""Carrying out routing's moves (tokenmill.gateway.moves) with hosts a test scripts:
whatever goes wrong, the outcome says so and nothing is raised (the target then
computes the prompt); only a completed move counts bytes and measures its cost."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

import pytest

from tests.waiting import wait_until_async
from tokenmill.config import LlamaCppDeployment
from tokenmill.engines import EngineHealth, KvState
from tokenmill.gateway.deployment import Deployment
from tokenmill.gateway.moves import KvMoves
from tokenmill.gateway.routing import Decision, ReplicaView, RouteQuery, RoutingName
from tokenmill.replicas import ReplicaHost
from tokenmill.replicas.host import KvLink, KvParcel

STATE = KvState(tuple(range(200)), b"\x01" * 4000, "fp")


class Host:
    """The two calls a move makes, scripted."""

    def __init__(
        self,
        export: Any = STATE,
        take: bool = True,
        delay: float = 0.0,
        link: KvLink | None = None,
    ) -> None:
        self.export, self.take, self.delay, self.link = export, take, delay, link
        self.imported: list[KvState] = []
        self.asked: list[tuple[tuple[int, ...], int]] = []

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
        self.asked.append((tuple(tokens), min_tokens))
        if self.delay:
            await asyncio.sleep(self.delay)
        if isinstance(self.export, Exception):
            raise self.export
        return cast(KvState | None, self.export)

    async def import_kv(self, state: KvState) -> bool:
        self.imported.append(state)
        return self.take

    def kv_link(self) -> KvLink | None:
        return self.link


class Link:
    """A KvLink scripted: a store of parcels by handle, as Ray's object store."""

    def __init__(self, kind: str, store: dict[int, bytes], export: KvState | None = STATE):
        self.kind, self.store, self.export = kind, store, export
        self.imported: list[KvState] = []

    async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvParcel | None:
        if self.export is None:
            return None
        handle = len(self.store)
        self.store[handle] = self.export.state
        s = self.export
        return KvParcel(s.tokens, len(s.state), s.fingerprint, self.kind, handle)

    async def import_kv(self, parcel: KvParcel) -> bool:
        assert parcel.kind == self.kind
        blob = self.store[cast(int, parcel.handle)]
        self.imported.append(KvState(parcel.tokens, blob, parcel.fingerprint))
        return True


def host(h: Host) -> ReplicaHost:
    return cast(ReplicaHost, h)


async def test_a_move_hands_the_donors_state_to_the_target() -> None:
    moves, donor, target = KvMoves(), Host(), Host()
    prompt = list(range(250))
    assert (
        await moves.move(host(donor), host(target), prompt, min_tokens=128, budget_s=5) == "moved"
    )
    assert donor.asked == [(tuple(prompt), 128)] and target.imported == [STATE]
    assert (moves.outcomes["moved"], moves.bytes_moved, moves.tokens_moved) == (1, 4000, 200)
    assert moves.move_s is not None and moves.move_s > 0
    assert moves.describe()["bytes"] == 4000


async def test_state_goes_by_the_replicas_own_link_when_both_have_one_of_a_kind() -> None:
    """Two replicas with links of one kind (Ray actors: the object store) move state
    through it, and the gateway only hands a reference on: neither host's own
    export or import is called. Links of other kinds, or only one replica with a
    link, go through the gateway."""
    store: dict[int, bytes] = {}
    donor = Host(link=Link("store", store))
    taker = Link("store", store)
    target = Host(link=taker)
    moves = KvMoves()
    got = await moves.move(host(donor), host(target), list(range(250)), min_tokens=128, budget_s=5)
    assert got == "moved" and taker.imported == [STATE]
    assert donor.asked == [] and target.imported == []  # the gateway's path unused
    assert moves.via == {"store": 1} and moves.bytes_moved == 4000
    # Missing on the donor's side: said so, as through the gateway.
    empty = Host(link=Link("store", store, export=None))
    assert await moves.move(host(empty), host(target), [1], min_tokens=1, budget_s=5) == "missing"
    # One link only, on either side: through the gateway.
    for a, b in ((Host(link=Link("store", store)), Host()), (Host(), Host(link=taker))):
        assert await moves.move(host(a), host(b), [1], min_tokens=1, budget_s=5) == "moved"
        assert b.imported == [STATE]
    other = Host(link=Link("elsewhere", {}))
    assert await moves.move(host(other), host(target), [1], min_tokens=1, budget_s=5) == "moved"
    assert target.imported == [STATE]  # by the gateway: the kinds differ
    assert moves.via == {"store": 1, "gateway": 3}
    assert moves.describe()["via"] == {"store": 1, "gateway": 3}


@pytest.mark.parametrize(
    ("donor", "target", "outcome"),
    [
        (Host(export=None), Host(), "missing"),  # the donor no longer holds it
        (Host(), Host(take=False), "refused"),  # no room, or another model
        (Host(export=ConnectionError("replica gone")), Host(), "failed"),
    ],
)
async def test_a_move_that_does_not_happen_says_why(
    donor: Host, target: Host, outcome: str
) -> None:
    moves = KvMoves()
    got = await moves.move(host(donor), host(target), [1, 2, 3], min_tokens=1, budget_s=5)
    assert got == outcome
    assert moves.outcomes[outcome] == 1 and moves.bytes_moved == 0 and moves.move_s is None


async def test_a_move_slower_than_computing_is_given_up() -> None:
    # The budget is what computing the moved tokens would take (at least 0.5 s): a
    # donor that has not answered by then loses to computing. (Its answer never
    # comes: this is ordered by the event, not timed against the machine.)
    never = asyncio.Event()

    class Stuck(Host):
        async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
            await never.wait()
            return STATE

    moves, target = KvMoves(), Host()
    got = await moves.move(host(Stuck()), host(target), [1], min_tokens=1, budget_s=0.0)
    assert got == "failed" and target.imported == []


class Hosted(Host):
    """A ready replica as a Deployment drives it: enough of ReplicaHost for place()."""

    kind = "local"
    state = "ready"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.cancelled: list[str] = []

    def on_change(self, callback: Any) -> None: ...

    def on_cache(self, callback: Any) -> None: ...

    def on_status(self, callback: Any) -> None: ...

    async def reserve(self, request_id: str, weight: int) -> None: ...

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def health(self) -> EngineHealth:
        return EngineHealth(ready=True, slots=1, running=0, moves_kv=True)


class MoveFrom0:
    """A routing policy that always sends to replica 1 with replica 0's ``cached``
    tokens (the move's budget: what computing them would take)."""

    name: RoutingName = "cache_aware"

    def __init__(self, cached: int) -> None:
        self.cached = cached

    def choose(self, replicas: Sequence[ReplicaView], query: RouteQuery) -> Decision:
        return Decision(1, "cache", self.cached, 0.1, True, "host", move_from=0)


def deployment(donor: Hosted, target: Hosted, cached: int = 256) -> Deployment:
    config = LlamaCppDeployment(id="d", replicas=2, max_num_seqs=1)
    dep = Deployment(config, [host(donor), host(target)])
    dep.routing = MoveFrom0(cached)
    return dep


async def test_the_deployment_moves_before_it_returns_the_replica() -> None:
    donor, target = Hosted(), Hosted()
    dep = deployment(donor, target)
    replica, decision = await dep.place("r1", RouteQuery(300), list(range(300)))
    assert (replica.index, decision.move_from, decision.moved) == (1, 0, "moved")
    assert target.imported == [STATE] and replica.in_flight == 1
    assert dep.moves.describe()["moved"] == 1


async def test_a_request_given_up_during_its_move_holds_nothing() -> None:
    never = asyncio.Event()

    class Slow(Hosted):
        async def export_kv(self, tokens: Sequence[int], min_tokens: int) -> KvState | None:
            self.asked.append((tuple(tokens), min_tokens))
            await never.wait()
            return STATE

    donor, target = Slow(), Hosted()
    # 10M tokens to move: a budget of hours, so only the cancel ends the move.
    dep = deployment(donor, target, cached=10_000_000)
    placing = asyncio.create_task(dep.place("r1", RouteQuery(300), list(range(300))))
    await wait_until_async(lambda: donor.asked or None, "the move to start")
    placing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await placing
    # Its slot is free again, and the replica told to forget the request.
    assert [r.in_flight for r in dep.replicas] == [0, 0]
    assert target.cancelled == ["r1"]
