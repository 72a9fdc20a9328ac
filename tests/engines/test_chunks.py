"""A request's chunk stream: exactly one final item, one way to stop, nothing lost."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.engines import Chunk, ChunkStream, TokenLogprob, ToolCallDelta, Usage
from tokenmill.errors import EngineError


def make() -> tuple[ChunkStream, list[str]]:
    cancelled: list[str] = []
    return ChunkStream("r1", cancelled.append), cancelled


async def test_the_final_chunk_ends_it_and_later_items_are_dropped() -> None:
    stream, _ = make()
    stream.put(Chunk(" a", tokens=1))
    stream.put(Chunk(" b", tokens=2))
    stream.put(Chunk("", "stop", Usage(3, 2), 2))
    assert stream.ended and not stream.finished
    stream.put(Chunk(" late", tokens=3))  # a producer's stray item after the end
    stream.put(EngineError("late"))
    assert [c.text async for c in stream] == [" a", " b", ""]
    assert stream.finished and stream.error is None
    assert (stream.tokens, stream.usage) == (2, Usage(3, 2))
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_an_error_is_the_final_item() -> None:
    stream, cancelled = make()
    stream.put(Chunk(" a", tokens=1))
    stream.put(EngineError("the replica died"))
    assert (await anext(stream)).text == " a"
    with pytest.raises(EngineError, match="died"):
        await anext(stream)
    assert stream.finished and isinstance(stream.error, EngineError)
    assert stream.tokens == 1 and stream.usage is None
    stream.cancel()  # ended: nothing to stop
    assert cancelled == []


async def test_cancel_goes_to_the_engine_until_the_stream_ends() -> None:
    stream, cancelled = make()
    stream.cancel()
    await stream.aclose()
    assert cancelled == ["r1", "r1"]  # fire-and-forget: the engine ignores repeats
    stream.put(Chunk("", "abort", Usage(3, 0), 0))
    stream.cancel()
    assert cancelled == ["r1", "r1"]


async def test_the_canceller_learns_the_end_while_a_reader_gets_every_chunk() -> None:
    stream, _ = make()
    reader = asyncio.ensure_future(anext(stream))
    waiter = asyncio.ensure_future(stream.wait_end(60))
    await asyncio.sleep(0)
    assert not reader.done() and not waiter.done()
    stream.put(Chunk("", "abort", Usage(3, 4), 4))
    assert await waiter is True
    assert (await reader).finish_reason == "abort"  # the reader still gets the final chunk
    assert stream.tokens == 4


async def test_wait_end_says_when_the_end_did_not_come() -> None:
    stream, _ = make()
    assert await stream.wait_end(0) is False


async def test_a_cancelled_read_loses_no_chunk() -> None:
    stream, _ = make()
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    stream.put(Chunk(" a", tokens=1))
    assert (await anext(stream)).text == " a"


def test_a_chunk_then_a_later_one_is_one_delta_unless_the_first_ends_something() -> None:
    a = TokenLogprob(b" a", -0.1, 0)
    b = TokenLogprob(b" b", -0.2, 2)
    joined = Chunk(" a", tokens=1, logprobs=(a,)).then(
        Chunk(" b", "length", Usage(3, 2), 2, (b,), stop_sequence=None)
    )
    assert joined == Chunk(" a b", "length", Usage(3, 2), 2, (a, b))
    # Nothing follows an end, another choice is another delta, tool pieces stay apart.
    assert Chunk(" a", "stop", Usage(3, 1), 1).then(Chunk(" b", tokens=2)) is None
    assert Chunk(" a", tokens=1, choice_finish="stop").then(Chunk(" b", tokens=2)) is None
    assert Chunk(" a", tokens=1).then(Chunk(" b", tokens=2, index=1)) is None
    call = ToolCallDelta(0, "c1", "f")
    assert Chunk("", tokens=1, tool_calls=(call,)).then(Chunk(" b", tokens=2)) is None
