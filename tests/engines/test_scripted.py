"""The scripted engine keeps the engine contract, in the test's own event loop.

The driver blocks while it waits for an event, so here it waits in a thread
(``asyncio.to_thread``) while the engine runs on the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from tests.driver import EngineDriver
from tokenmill.engines import Chunk, ChunkStream, Engine, GenerationRequest, SamplingParams, Usage
from tokenmill.engines.scripted import ScriptedEngine
from tokenmill.errors import ContextLengthError, EngineError


@pytest.fixture
async def driven() -> AsyncIterator[tuple[EngineDriver, ScriptedEngine]]:
    driver = EngineDriver()
    engine = ScriptedEngine(str(driver.path), max_num_seqs=2, n_ctx=64)
    await engine.start()
    try:
        yield driver, engine
    finally:
        await engine.close()
        driver.close()


def request(rid: str, max_tokens: int, prompt: str = "one two three") -> GenerationRequest:
    return GenerationRequest(rid, SamplingParams(max_tokens=max_tokens), prompt=prompt)


async def started(driver: EngineDriver, stream: ChunkStream, rid: str) -> asyncio.Future[Chunk]:
    """Start ``stream`` (its first chunk, pending) and wait until the engine saw it."""
    first = asyncio.ensure_future(anext(stream))
    await asyncio.to_thread(driver.wait, "started", rid)
    return first


def test_it_is_an_engine() -> None:
    assert isinstance(ScriptedEngine("/nonexistent"), Engine)


async def test_tokens_usage_and_max_tokens(driven: tuple[EngineDriver, ScriptedEngine]) -> None:
    driver, engine = driven
    req = request("a", max_tokens=3)
    info = await engine.prepare(req)
    assert (info.prompt_tokens, info.context_length) == (3, 64)
    stream = engine.generate(req)
    assert isinstance(stream, ChunkStream)
    first = await started(driver, stream, "a")
    assert driver.wait("started", "a")["max_tokens"] == 3
    driver.emit("a", 10)  # more than max_tokens: the engine stops at 3
    chunks = [await first] + [c async for c in stream]
    assert [c.text for c in chunks] == [" w1", " w2", " w3", ""]
    assert [c.tokens for c in chunks] == [1, 2, 3, 3]
    assert [c.finish_reason for c in chunks] == [None, None, None, "length"]
    assert [c.usage for c in chunks] == [None, None, None, Usage(3, 3)]
    ended = await asyncio.to_thread(driver.wait, "ended", "a")
    assert (ended["reason"], ended["tokens"]) == ("length", 3)
    assert engine.health().tokens_generated == 3 and engine.health().running == 0


async def test_finish_with_stop(driven: tuple[EngineDriver, ScriptedEngine]) -> None:
    driver, engine = driven
    stream = engine.generate(request("s", max_tokens=10))
    assert isinstance(stream, ChunkStream)
    first = await started(driver, stream, "s")
    driver.emit("s", 2)
    driver.finish("s", "stop")
    chunks = [await first] + [c async for c in stream]
    assert chunks[-1] == Chunk("", "stop", Usage(3, 2), 2)


async def test_finish_on_a_stop_string(driven: tuple[EngineDriver, ScriptedEngine]) -> None:
    driver, engine = driven
    sampling = SamplingParams(max_tokens=10, stop=("END", "\n"))
    for rid, said, matched in (("t", "END", "END"), ("u", "other", None)):
        stream = engine.generate(GenerationRequest(rid, sampling, prompt="one two"))
        first = await started(driver, stream, rid)
        driver.emit(rid, 1)
        driver.finish(rid, stop=said)  # a string the request did not ask for: not named
        chunks = [await first] + [c async for c in stream]
        assert chunks[-1] == Chunk("", "stop", Usage(2, 1), 1, stop_sequence=matched)


async def test_an_end_of_sequence_token_is_counted(
    driven: tuple[EngineDriver, ScriptedEngine],
) -> None:
    # As the llama.cpp engine counts it: a completion token with no text.
    driver, engine = driven
    stream = engine.generate(request("e", max_tokens=10))
    assert isinstance(stream, ChunkStream)
    first = await started(driver, stream, "e")
    driver.emit("e", 2)
    driver.eos("e")
    chunks = [await first] + [c async for c in stream]
    assert chunks[-1] == Chunk("", "stop", Usage(3, 3), 3)
    ended = await asyncio.to_thread(driver.wait, "ended", "e")
    assert (ended["reason"], ended["tokens"]) == ("stop", 3)
    assert engine.health().tokens_generated == 3


async def test_cancel_ends_the_stream_with_the_tokens_produced(
    driven: tuple[EngineDriver, ScriptedEngine],
) -> None:
    driver, engine = driven
    stream = engine.generate(request("open", max_tokens=10))
    first = await started(driver, stream, "open")
    driver.emit("open", 2)
    assert (await first).text == " w1" and (await anext(stream)).text == " w2"
    assert engine.health().running == 1
    engine.cancel("open")
    # The one final chunk: the tokens really produced, which the caller pays for.
    assert [c async for c in stream] == [Chunk("", "abort", Usage(3, 2), 2)]
    assert stream.finished and (stream.tokens, stream.usage) == (2, Usage(3, 2))
    aborted = await asyncio.to_thread(driver.wait, "aborted", "open")
    assert aborted["tokens"] == 2
    assert engine.health().running == 0
    driver.emit("open", 1)  # nothing runs it any more
    assert (await asyncio.to_thread(driver.wait, "ignored", "open"))["op"] == "emit"
    engine.cancel("open")  # a finished request: ignored
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_a_cancelled_read_loses_nothing(
    driven: tuple[EngineDriver, ScriptedEngine],
) -> None:
    driver, engine = driven
    stream = engine.generate(request("cut", max_tokens=10))
    reader = await started(driver, stream, "cut")
    driver.emit("cut", 1)
    assert (await reader).tokens == 1
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # one step of the task: it waits for the next chunk
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert engine.health().running == 1  # a reader leaving stops nothing: cancel() does
    driver.emit("cut", 1)
    assert (await anext(stream)).text == " w2"
    await stream.aclose()  # closing an unfinished stream is its cancel()
    assert (await anext(stream)) == Chunk("", "abort", Usage(3, 2), 2)
    assert (await asyncio.to_thread(driver.wait, "aborted", "cut"))["tokens"] == 2


async def test_fail_and_context_errors(driven: tuple[EngineDriver, ScriptedEngine]) -> None:
    driver, engine = driven
    with pytest.raises(ContextLengthError, match="maximum context length is 64"):
        await engine.prepare(request("big", max_tokens=62))
    stream = engine.generate(request("f", max_tokens=10))
    assert isinstance(stream, ChunkStream)
    first = await started(driver, stream, "f")
    driver.emit("f", 1)
    assert (await first).tokens == 1
    driver.fail("f", "boom")
    with pytest.raises(EngineError, match="boom"):
        await anext(stream)
    ended = await asyncio.to_thread(driver.wait, "ended", "f")
    assert (ended["reason"], ended["tokens"]) == ("error", 1)


async def test_requests_fail_when_the_driver_goes_away() -> None:
    driver = EngineDriver()
    engine = ScriptedEngine(str(driver.path))
    await engine.start()
    try:
        stream = engine.generate(request("orphan", max_tokens=5))
        assert isinstance(stream, ChunkStream)
        first = await started(driver, stream, "orphan")
        await asyncio.to_thread(driver.close)
        with pytest.raises(EngineError, match="driver went away"):
            await first
    finally:
        await engine.close()


async def test_start_without_a_driver_says_so() -> None:
    engine = ScriptedEngine("/nonexistent/control.sock")
    with pytest.raises(EngineError, match="cannot reach its driver"):
        await engine.start()


async def test_a_held_start_waits_for_the_drivers_go(
    driven: tuple[EngineDriver, ScriptedEngine],
) -> None:
    driver, _ = driven
    driver.hold_starts()
    held = ScriptedEngine(str(driver.path))
    starting = asyncio.ensure_future(held.start())
    try:
        pid = (await asyncio.to_thread(driver.wait, "hello", count=2))["pid"]
        # Connected and announced, but start() cannot return before go: not ready.
        assert not starting.done() and not held.health().ready
        driver.release_starts()
        await starting
        assert held.health().ready and pid == os.getpid()
    finally:
        starting.cancel()
        await held.close()


async def test_a_start_fails_when_the_driver_goes_before_go() -> None:
    driver = EngineDriver()
    driver.hold_starts()
    engine = ScriptedEngine(str(driver.path))
    starting = asyncio.ensure_future(engine.start())
    await asyncio.to_thread(driver.wait, "hello")
    await asyncio.to_thread(driver.close)
    with pytest.raises(EngineError, match="went away before it said go"):
        await starting
    assert not engine.health().ready


async def test_kv_cache_usage_counts_the_running_requests_tokens(
    driven: tuple[EngineDriver, ScriptedEngine],
) -> None:
    driver, engine = driven
    stream = engine.generate(request("kv", max_tokens=10))  # 3 prompt words
    assert isinstance(stream, ChunkStream)
    first = await started(driver, stream, "kv")
    assert engine.health().kv_cache_usage == 3 / 64
    driver.emit("kv", 5)
    assert (await first).tokens == 1
    for _ in range(4):
        await anext(stream)
    assert engine.health().kv_cache_usage == (3 + 5) / 64
    driver.finish("kv")
    assert [c.finish_reason async for c in stream] == ["stop"]
    assert engine.health().kv_cache_usage == 0.0
