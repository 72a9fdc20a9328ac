"""A replica shared by several gateways (replicas/shared.py), without Ray.

Two gateways' connections (socket pairs speaking the frames of replicas/wire.py) to one
:class:`SharedReplica` whose scripted engine the driver runs: the replica keeps its
own slot count across both, sends each gateway its own requests' frames and every
gateway its status, and outlives a gateway that leaves.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from tests.driver import EngineDriver
from tests.waiting import HANG_S
from tokenmill.engines import GenerationRequest, SamplingParams
from tokenmill.replicas.shared import SharedReplica
from tokenmill.replicas.wire import encode_frame, encode_request, read_frame


class Gateway:
    """One gateway's end of a connection to the replica."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.seen: list[dict[str, Any]] = []  # every frame received, in order

    def send(self, message: dict[str, Any]) -> None:
        self.writer.write(encode_frame(message))

    def reserve(self, rid: str, weight: int = 1) -> None:
        self.send({"op": "reserve", "id": rid, "w": weight})

    def request(self, op: str, rid: str, n: int = 1) -> None:
        req = GenerationRequest(rid, SamplingParams(max_tokens=5), prompt="one two three", n=n)
        self.send({"op": op, "req": encode_request(req)})

    async def until(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The next frame that ``match``es (the ones before it are kept in ``seen``)."""
        async with asyncio.timeout(HANG_S):
            while True:
                msg = await read_frame(self.reader)
                assert msg is not None, "the replica closed the connection"
                self.seen.append(msg)
                if match(msg):
                    return msg


def answer_to(rid: str) -> Callable[[dict[str, Any]], bool]:
    return lambda m: m.get("id") == rid and m["op"] in ("prepared", "reserved", "full", "error")


def chunk_rows(frames: list[dict[str, Any]]) -> list[list[Any]]:
    return [row for f in frames if f["op"] == "chunks" for row in f["c"]]


async def attach(replica: SharedReplica) -> tuple[Gateway, asyncio.Task[None]]:
    ours, theirs = socket.socketpair()
    r_reader, r_writer = await asyncio.open_unix_connection(sock=theirs)
    served = asyncio.create_task(replica.serve(r_reader, r_writer))
    gateway = Gateway(*await asyncio.open_unix_connection(sock=ours))
    ready = await gateway.until(lambda m: m["op"] in ("ready", "fatal"))
    assert ready["op"] == "ready" and ready["shared"] is True, ready
    return gateway, served


def test_two_gateways_share_one_engine_and_never_overcommit_its_slot(
    driver: EngineDriver,
) -> None:
    section = {"id": "s", "engine": "scripted", "control": str(driver.path), "max_num_seqs": 1}

    async def scenario() -> None:
        replica = SharedReplica(section)
        a, served_a = await attach(replica)
        b, served_b = await attach(replica)
        assert driver.seen("hello") == 1  # one engine for both

        a.reserve("a1")
        assert (await a.until(answer_to("a1")))["op"] == "reserved"
        # The one slot is a1's: b may prepare (that holds nothing), but its reserve is
        # refused at once, with the count.
        b.request("prepare", "b1")
        assert (await b.until(answer_to("b1")))["op"] == "prepared"
        b.reserve("b1")
        full = await b.until(answer_to("b1"))
        assert full["op"] == "full" and full["status"]["running"] == 1
        a.request("generate", "a1")
        # The engine runs on this loop: the driver (which blocks) is called off it.
        await asyncio.to_thread(driver.emit, "a1", 2)
        await asyncio.to_thread(driver.finish, "a1")
        final = await a.until(lambda m: any(row[2] == "stop" for row in chunk_rows([m])))
        assert [row[0] for row in chunk_rows(a.seen)] == ["a1", "a1", "a1"]
        # b was told "full": it hears at once that the slot is free, and takes it.
        freed = await b.until(lambda m: m["op"] == "status" and m["status"]["running"] == 0)
        assert freed and final
        b.reserve("b1")
        assert (await b.until(answer_to("b1")))["op"] == "reserved"
        b.request("generate", "b1")
        await asyncio.to_thread(driver.started, "b1")
        # An id running here for b is not a's to reuse: refused, naming the field.
        a.reserve("b1")
        dup = await a.until(answer_to("b1"))
        assert dup["op"] == "error" and dup["error"]["param"] == "x-request-id", dup
        assert not chunk_rows(b.seen) and all(m["op"] != "chunks" for m in b.seen)

        # b leaves (its connection closes): its request is cancelled, its slot freed,
        # and the engine goes on serving a.
        b.writer.close()
        await served_b
        assert (await asyncio.to_thread(driver.wait, "aborted", "b1"))["tokens"] == 0
        a.reserve("a2")
        assert (await a.until(answer_to("a2")))["op"] == "reserved"
        # A reservation a drops (its request refused after all) frees the slot too.
        a.send({"op": "abort", "id": "a2"})
        a.reserve("a3")
        assert (await a.until(answer_to("a3")))["op"] == "reserved"
        a.send({"op": "close"})
        await served_a
        a.writer.close()
        assert driver.seen("hello") == 1
        await replica.close()

    asyncio.run(scenario())


def test_a_request_of_several_choices_takes_as_many_slots(driver: EngineDriver) -> None:
    section = {"id": "s", "engine": "scripted", "control": str(driver.path), "max_num_seqs": 3}

    async def scenario() -> None:
        replica = SharedReplica(section)
        a, served = await attach(replica)
        a.reserve("three", 3)
        a.reserve("one", 1)
        answers = [(await a.until(answer_to(r)))["op"] for r in ("three", "one")]
        assert answers == ["reserved", "full"]
        a.send({"op": "abort", "id": "three"})  # dropped: its three slots return
        for rid, weight in (("two", 2), ("one", 1), ("more", 1)):
            a.reserve(rid, weight)
        answers = [(await a.until(answer_to(r)))["op"] for r in ("two", "one", "more")]
        assert answers == ["reserved", "reserved", "full"]
        a.send({"op": "close"})
        await served
        a.writer.close()
        await replica.close()

    asyncio.run(scenario())
