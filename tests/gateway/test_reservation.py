"""A request's reservation gives back exactly what its steps took, whichever step fails
and wherever its caller gives up (:mod:`tokenmill.gateway.reservation`).

An in-process gateway serves a scripted deployment (its engine in this process, the
test's driver stepping it) and meters with :class:`SteppedMeter`, a meter this test
steps the same way: a hold waits until the test lets it be written, or is refused.
Every assertion is about what is held once a step ended (admission permits, replica
slots, requests preparing, credit holds), never about time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from tests.driver import EngineDriver
from tokenmill.config import Price, ScriptedDeployment, Settings
from tokenmill.engines import GenerationRequest, SamplingParams
from tokenmill.errors import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    PaymentRequiredError,
)
from tokenmill.gateway import Gateway, RequestRecord
from tokenmill.gateway.reservation import Reservation
from tokenmill.identity import Caller
from tokenmill.metering import HoldRequest, Progress, Settlement, cost

PRICE = Price(prompt_per_mtok=2_000_000, completion_per_mtok=5_000_000)
N_CTX = 64
PROMPT = "Tell a long story."  # 4 words: 4 prompt tokens for the scripted engine
ALICE = Caller(account_id="alice", key_id="k1")


class SteppedMeter:
    """A :class:`~tokenmill.metering.Meter` the test steps: it keeps the holds open
    now, every settlement, and can refuse holds or make them wait for :meth:`let_through`."""

    def __init__(self) -> None:
        self.open: dict[str, HoldRequest] = {}
        self.settled: dict[str, Settlement] = {}
        self.refuse = False
        self.holding = asyncio.Event()  # a hold is being written
        self._gate: asyncio.Event | None = None

    def hold_back(self) -> None:
        self._gate = asyncio.Event()

    def let_through(self) -> None:
        assert self._gate is not None
        self._gate.set()

    async def hold(self, hold: HoldRequest) -> None:
        self.holding.set()
        if self._gate is not None:
            await self._gate.wait()
        if self.refuse:
            raise PaymentRequiredError("no credit left: top the account up")
        self.open[hold.request_id] = hold

    async def settle(self, hold: HoldRequest, settlement: Settlement) -> None:
        assert settlement.request_id not in self.settled, "settled twice"
        del self.open[hold.request_id]
        self.settled[settlement.request_id] = settlement

    async def record_progress(self, progress: Sequence[Progress]) -> None:
        return None


class Watcher:
    """An observer: the records that started and those that ended."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ended: list[RequestRecord] = []

    def on_start(self, record: RequestRecord) -> None:
        self.started.append(record.request_id)

    def on_tokens(self, record: RequestRecord, now: float) -> None:
        return None

    def on_finish(self, record: RequestRecord) -> None:
        self.ended.append(record)


def request(rid: str, prompt: str = PROMPT, max_tokens: int = 8, n: int = 1) -> GenerationRequest:
    return GenerationRequest(rid, SamplingParams(max_tokens=max_tokens), prompt=prompt, n=n)


@pytest.fixture
async def gateway(driver: EngineDriver) -> AsyncIterator[tuple[Gateway, SteppedMeter, Watcher]]:
    config = ScriptedDeployment(
        id="scripted",
        control=driver.path,
        placement="local",
        max_num_seqs=1,
        n_ctx=N_CTX,
        price=PRICE,
    )
    meter = SteppedMeter()
    gw = Gateway(Settings(deployments=[config]), meter)
    watcher = Watcher()
    gw.observers.append(watcher)
    await gw.start()
    yield gw, meter, watcher
    await gw.close(drain_s=0)


def held(gw: Gateway, meter: SteppedMeter) -> dict[str, object]:
    """Everything a request may hold, across the gateway."""
    dep = gw.deployment("scripted")
    return {
        "permits": dep.admission.active,
        "queued": dep.admission.waiting,
        "slots": sum(r.in_flight for r in dep.replicas),
        "preparing": dep.preparing,
        "holds": sorted(meter.open),
        "streams": len(gw.streams),
    }


NOTHING = {"permits": 0, "queued": 0, "slots": 0, "preparing": 0, "holds": [], "streams": 0}


async def test_a_request_refused_at_admission_takes_nothing(
    gateway: tuple[Gateway, SteppedMeter, Watcher],
) -> None:
    gw, meter, watcher = gateway
    with pytest.raises(InvalidRequestError) as refused:  # 2 choices, 1 slot a replica
        await gw.open(gw.deployment("scripted"), request("r1", n=2), ALICE)
    assert refused.value.param == "n"
    assert held(gw, meter) == NOTHING
    assert [(r.request_id, r.status) for r in watcher.ended] == [("r1", "rejected")]
    assert watcher.started == []


async def test_a_prompt_refused_by_prepare_gives_back_its_permit(
    gateway: tuple[Gateway, SteppedMeter, Watcher],
) -> None:
    gw, meter, watcher = gateway
    too_long = " ".join(["word"] * N_CTX)
    with pytest.raises(ContextLengthError):
        await gw.open(gw.deployment("scripted"), request("r1", too_long), ALICE)
    assert held(gw, meter) == NOTHING
    (record,) = watcher.ended
    assert (record.status, record.error_code) == ("rejected", "context_length_exceeded")
    assert meter.settled == {}


async def test_a_hold_refused_gives_back_the_replica_and_the_permit(
    gateway: tuple[Gateway, SteppedMeter, Watcher], driver: EngineDriver
) -> None:
    gw, meter, watcher = gateway
    meter.refuse = True
    with pytest.raises(PaymentRequiredError):
        await gw.open(gw.deployment("scripted"), request("r1"), ALICE)
    assert held(gw, meter) == NOTHING
    (record,) = watcher.ended
    assert (record.status, record.error_code) == ("rejected", "insufficient_credit")
    assert record.prompt_tokens == 4 and record.route is not None  # it got that far
    assert meter.settled == {}  # nothing was held: nothing to settle
    assert driver.seen("started", "r1") == 0  # the engine never saw it


async def test_a_caller_gone_while_its_hold_is_written_leaves_it_written_and_unbilled(
    gateway: tuple[Gateway, SteppedMeter, Watcher],
) -> None:
    gw, meter, watcher = gateway
    meter.hold_back()
    opening = asyncio.create_task(gw.open(gw.deployment("scripted"), request("r1"), ALICE))
    await meter.holding.wait()
    opening.cancel()
    await asyncio.sleep(0)  # the cancellation reaches open(), which waits for the hold
    assert not opening.done()
    meter.let_through()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert held(gw, meter) == NOTHING
    assert meter.settled == {"r1": Settlement("r1", 4, 0, "abort", 0)}
    (record,) = watcher.ended
    assert record.status == "rejected"


async def test_a_caller_gone_while_queued_takes_no_permit(
    gateway: tuple[Gateway, SteppedMeter, Watcher], driver: EngineDriver
) -> None:
    gw, meter, watcher = gateway
    dep = gw.deployment("scripted")
    first = await gw.open(dep, request("r1", max_tokens=2), ALICE)
    waiting = asyncio.create_task(gw.open(dep, request("r2"), ALICE))
    while dep.admission.waiting == 0:  # noqa: ASYNC110 - no event says "queued"
        await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert held(gw, meter) == {**NOTHING, "permits": 1, "slots": 1, "holds": ["r1"], "streams": 1}
    # The first runs to its end: its books are settled once, on the tokens produced.
    await asyncio.to_thread(driver.emit, "r1", 2)
    chunks = [chunk async for chunk in first]
    assert chunks[-1].finish_reason == "length"
    assert held(gw, meter) == NOTHING
    assert meter.settled["r1"] == Settlement("r1", 4, 2, "length", cost(PRICE, 4, 2))
    assert [r.request_id for r in watcher.ended] == ["r2", "r1"]
    assert watcher.started == ["r1"]


@pytest.mark.parametrize("step", ["prepare", "place"])
async def test_a_caller_gone_while_its_replica_loads_gives_back_the_permit(
    gateway: tuple[Gateway, SteppedMeter, Watcher], driver: EngineDriver, step: str
) -> None:
    gw, meter, _ = gateway
    dep = gw.deployment("scripted")
    record = RequestRecord("r1", dep.id, ALICE)
    reservation = Reservation(dep, request("r1"), record, meter)
    await reservation.admit()
    info = await reservation.prepare() if step == "place" else None
    # The replica unloads; the step loads it again, and the driver holds its start.
    await dep.replicas[0].host.close()
    driver.hold_starts()
    hellos = driver.seen("hello")
    task: asyncio.Task[object]
    if step == "prepare":
        task = asyncio.create_task(reservation.prepare())
    else:
        assert info is not None
        task = asyncio.create_task(reservation.place(info))
    await asyncio.to_thread(driver.wait, "hello", None, hellos + 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert held(gw, meter)["permits"] == 1
    await reservation.release()
    assert held(gw, meter) == NOTHING
    await reservation.release()  # nothing twice
    assert held(gw, meter) == NOTHING
    driver.release_starts()


async def test_a_request_its_replica_could_not_take_is_settled_unbilled(
    gateway: tuple[Gateway, SteppedMeter, Watcher],
    driver: EngineDriver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held, then its replica dies as the request is handed over: the caller gets the
    error (a 502, before any byte of a response), and the hold is settled for nothing,
    as no engine read its prompt (seen in CI: a prompt billed on a refused request)."""
    gw, meter, watcher = gateway
    host = gw.deployment("scripted").replicas[0].host

    def dead(req: GenerationRequest) -> object:
        raise EngineError("the replica is not running")

    monkeypatch.setattr(host, "generate", dead)
    with pytest.raises(EngineError):
        await gw.open(gw.deployment("scripted"), request("r1"), ALICE)
    assert held(gw, meter) == NOTHING
    assert meter.settled == {"r1": Settlement("r1", 4, 0, "error", 0)}
    (record,) = watcher.ended
    assert (record.status, record.charged) == ("error", 0)
    assert driver.seen("started", "r1") == 0
