"""Server-sent events, and the race between a response and its client leaving.

:class:`EventStreamResponse` sends each event the moment the generator yields it and
watches the connection: when the client disconnects, the generator is cancelled and
``on_close`` runs (shielded), which aborts generation and settles the request.
:func:`run_until_disconnect` gives non-streamed responses the same guarantee.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"connection", b"keep-alive"),
]
DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def encode_typed_event(payload: dict[str, Any]) -> bytes:
    """An event named by its payload's ``type`` (``event: <type>`` then its ``data``),
    as the Responses and Messages APIs send them."""
    return f"event: {payload['type']}\n".encode() + encode_event(payload)


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class EventStreamResponse(Response):
    """An ASGI response streaming ``events`` (already-encoded SSE frames)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.on_close = on_close
        self.raw_headers = list(SSE_HEADERS) + [
            (k.lower().encode(), v.encode()) for k, v in (headers or {}).items()
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                async for frame in self.events:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self.on_close()


async def run_until_disconnect(
    receive: Receive, work: Callable[[], Awaitable[T]], on_close: Callable[[], Awaitable[None]]
) -> T | None:
    """Run ``work``; if the client leaves first, cancel it. ``on_close`` always runs."""
    result: list[T] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
            result.append(await work())
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # anyio wraps the work's exception (a replica died: EngineError) in a group;
        # the error handlers map the bare exception to its status (502), not a 500.
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        raise inner from None
    finally:
        with anyio.CancelScope(shield=True):
            await on_close()
    return result[0] if result else None
