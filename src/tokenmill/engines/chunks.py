"""One request's chunks, from the engine that produces them to whoever streams them.

An engine's ``generate()`` returns a :class:`ChunkStream` at once; the engine fills it
from wherever its tokens come from (a decode thread, an IPC reader, an HTTP response)
and the request's task reads it. A stream ends with exactly one final item: a chunk
with a ``finish_reason`` (and its usage), or an exception. Whatever the producer puts
after that is dropped, so "finished" has one meaning in every layer.

Stopping a request early is ``engine.cancel(request_id)`` and nothing else: the
engine ends the stream with a final ``abort`` chunk carrying the tokens it really
produced. :meth:`ChunkStream.wait_end` lets the party that cancelled (the gateway,
settling the bill) learn that usage without reading the stream, so the task still
reading it (a response being written) gets every chunk, the final one included.

A read cut short by cancellation loses nothing: the stream is a plain iterator over a
queue, not a generator, so the next read carries on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tokenmill.engines.results import Chunk, Usage

__all__ = ["ChunkStream"]


class ChunkStream:
    """The chunks of one request, ending with exactly one final chunk or an error."""

    __slots__ = (
        "_cancel",
        "_ended",
        "_queue",
        "_read_final",
        "error",
        "marks",
        "request_id",
        "tokens",
        "usage",
    )

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._queue: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        self._ended = asyncio.Event()
        self._read_final = False
        # What the producer has reported so far, for whoever settles the request.
        self.tokens = 0  # completion tokens produced (the highest ``Chunk.tokens`` seen)
        self.usage: Usage | None = None  # the final chunk's usage
        self.error: BaseException | None = None  # the final item, when it is an error
        # The producer's marks of the first token's way (see tokenmill.stages), if any.
        self.marks: dict[str, float] | None = None

    # -- producer side (on the event loop) ------------------------------------------

    @property
    def ended(self) -> bool:
        """The final item has been put (the reader may not have taken it yet)."""
        return self._ended.is_set()

    def put(self, item: Chunk | BaseException) -> None:
        if self._ended.is_set():
            return
        if isinstance(item, Chunk):
            if item.tokens > self.tokens:
                self.tokens = item.tokens
            if item.finish_reason is not None:
                if item.usage is not None:
                    self.usage = item.usage
                    self.tokens = max(self.tokens, item.usage.completion_tokens)
                self._ended.set()
        else:
            self.error = item
            self._ended.set()
        self._queue.put_nowait(item)

    # -- consumer side ----------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The reader has taken the final item."""
        return self._read_final

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._read_final:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._read_final = True
            raise item
        if item.finish_reason is not None:
            self._read_final = True
        return item

    def cancel(self) -> None:
        """Ask the engine to stop this request (no-op once it ended)."""
        if not self._ended.is_set():
            self._cancel(self.request_id)

    async def wait_end(self, within_s: float) -> bool:
        """Wait for the final item to be put; False if it did not come ``within_s``."""
        try:
            await asyncio.wait_for(self._ended.wait(), within_s)
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        """Cancel the request unless it ended (``contextlib.aclosing`` friendly)."""
        self.cancel()
