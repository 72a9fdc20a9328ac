"""Every replica host keeps one contract, whatever carries its engine.

The same scripted engine runs in the test's own process (``local``), in a child
process (``process``) and in a Ray actor on a real Ray cluster (``ray``); the
gateway drives all of them through :class:`~tokenmill.replicas.host.ReplicaHost`
and nothing else. Every step is ordered by the driver's events, never by time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.conftest import RayCluster
from tests.driver import EngineDriver
from tests.waiting import wait_until_async
from tokenmill.config import ScriptedDeployment
from tokenmill.engines import Chunk, GenerationRequest, SamplingParams, Usage
from tokenmill.errors import EngineError
from tokenmill.replicas import ReplicaHost, ReplicaState, build_host


def state_of(host: ReplicaHost) -> ReplicaState:
    return host.state  # a call: mypy does not narrow it from one assert to the next


def request(rid: str, max_tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(rid, SamplingParams(max_tokens=max_tokens), prompt="one two three")


@pytest.fixture(params=["local", "process", "ray"])
async def hosted(request: pytest.FixtureRequest) -> AsyncIterator[tuple[EngineDriver, ReplicaHost]]:
    driver = EngineDriver()
    config = ScriptedDeployment(
        id="s", control=driver.path, max_num_seqs=2, n_ctx=64, placement=request.param
    )
    address = None
    if request.param == "ray":
        cluster: RayCluster = request.getfixturevalue("ray_cluster")
        address = cluster.address
    host = build_host(config, ray_address=address)
    assert host.kind == request.param and host.state == "unloaded"
    await host.start()
    try:
        yield driver, host
    finally:
        await host.close()
        await asyncio.to_thread(driver.close)


async def test_start_generate_finish(hosted: tuple[EngineDriver, ReplicaHost]) -> None:
    driver, host = hosted
    assert host.state == "ready" and host.restarts == 0
    info = await host.prepare(request("a", 2))
    assert (info.prompt_tokens, info.context_length) == (3, 64)
    stream = host.generate(request("a", 2))
    await asyncio.to_thread(driver.wait, "started", "a")
    driver.emit("a", 5)  # past max_tokens: the engine stops at 2
    chunks = [c async for c in stream]
    assert [c.text for c in chunks] == [" w1", " w2", ""]
    assert chunks[-1] == Chunk("", "length", Usage(3, 2), 2)


async def test_cancel_ends_the_stream_with_the_tokens_produced(
    hosted: tuple[EngineDriver, ReplicaHost],
) -> None:
    driver, host = hosted
    stream = host.generate(request("c"))
    await asyncio.to_thread(driver.wait, "started", "c")
    driver.emit("c", 3)
    assert [(await anext(stream)).tokens for _ in range(3)] == [1, 2, 3]
    host.cancel("c")
    host.cancel("c")  # fire-and-forget: a repeat changes nothing
    assert await stream.wait_end(60)
    assert await anext(stream) == Chunk("", "abort", Usage(3, 3), 3)
    assert (await asyncio.to_thread(driver.wait, "aborted", "c"))["tokens"] == 3
    host.cancel("c")  # ended: ignored
    assert await wait_until_async(lambda: host.health().running == 0, "the slot to be free")


async def test_an_engine_error_is_the_streams_end(hosted: tuple[EngineDriver, ReplicaHost]) -> None:
    driver, host = hosted
    stream = host.generate(request("f"))
    await asyncio.to_thread(driver.wait, "started", "f")
    driver.emit("f", 1)
    assert (await anext(stream)).tokens == 1
    driver.fail("f", "boom")
    with pytest.raises(EngineError, match="boom"):
        await anext(stream)
    assert stream.tokens == 1  # what it produced before failing is known, for the bill


async def test_close_ends_open_streams(hosted: tuple[EngineDriver, ReplicaHost]) -> None:
    driver, host = hosted
    stream = host.generate(request("open"))
    await asyncio.to_thread(driver.wait, "started", "open")
    await host.close()
    assert state_of(host) == "unloaded"
    with pytest.raises(EngineError):
        await anext(stream)
    await host.start()  # and it comes back
    assert state_of(host) == "ready"


@pytest.fixture
async def process_host() -> AsyncIterator[tuple[EngineDriver, ReplicaHost]]:
    driver = EngineDriver()
    config = ScriptedDeployment(id="s", control=driver.path, max_num_seqs=2, n_ctx=64)
    host = build_host(config)
    changes: list[str] = []
    host.on_change(lambda: changes.append(host.state))
    await host.start()
    assert changes == ["loading", "ready"]
    try:
        yield driver, host
    finally:
        await host.close()
        await asyncio.to_thread(driver.close)


async def test_a_dead_replica_fails_its_streams_and_comes_back(
    process_host: tuple[EngineDriver, ReplicaHost],
) -> None:
    driver, host = process_host
    first_pid = host.location().pid
    assert isinstance(first_pid, int)
    stream = host.generate(request("d"))
    await asyncio.to_thread(driver.wait, "started", "d")
    driver.emit("d", 2)
    assert [(await anext(stream)).tokens for _ in range(2)] == [1, 2]
    driver.hold_starts()
    driver.crash("d")
    with pytest.raises(EngineError, match="died"):
        async for _ in stream:
            pass
    assert stream.tokens == 2
    # Held: the new replica said hello and waits for go; it is not serving meanwhile.
    await asyncio.to_thread(driver.wait, "hello", None, 2)
    assert host.state == "restarting"
    with pytest.raises(EngineError, match="restarting"):
        host.generate(request("early"))
    driver.release_starts()
    await wait_until_async(lambda: host.state == "ready", "the replica to be back")
    assert host.restarts == 1 and host.location().pid not in (None, first_pid)
