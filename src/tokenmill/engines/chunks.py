"""Reading one request's chunks from the queue its producer fills.

Engines hand chunks from elsewhere (a decode thread, an IPC reader) to the task
streaming the request through an ``asyncio.Queue``; an exception in the queue fails
the stream. :class:`ChunkReader` reads up to the chunk with a ``finish_reason`` and
remembers whether it got there, so the engine knows whether to abort on close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tokenmill.engines.base import Chunk

ChunkQueue = asyncio.Queue[Chunk | BaseException]


class ChunkReader:
    __slots__ = ("finished", "queue")

    def __init__(self, queue: ChunkQueue) -> None:
        self.queue = queue
        self.finished = False  # the last chunk (or an error) was read

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finish_reason is not None:
                self.finished = True
            yield item
            if self.finished:
                return
