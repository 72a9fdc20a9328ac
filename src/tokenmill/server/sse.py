"""Server-sent events, and the race between a response and its client leaving.

:class:`EventStreamResponse` sends each event the moment the generator yields it and
watches the connection: when the client disconnects, the generator is cancelled and
``on_close`` runs (shielded), which aborts generation and settles the request.
:func:`run_until_disconnect` gives non-streamed responses the same guarantee, and
:func:`respond` is every generation route's answer, streamed or whole.

Keep-alive (``stream_keepalive_s``; docs/api.md#streaming): every streamed generation
goes through :func:`stream_generation`, which opens it and answers with its events.

* Opened within one interval (the usual case), or refused within one (bad input,
  unknown model, queue full, no credit): exactly as without keep-alive, a refusal is
  its HTTP status.
* Still opening after one interval (waiting in the admission queue, a replica
  loading): the head goes out with a ping, and the opening goes on behind it. What it
  ends in after that (a queue timeout, no credit once admitted) can only be said in
  band: the API's error event (OpenAI's ``data: {"error": ...}`` then
  ``data: [DONE]``). A client that leaves meanwhile cancels the opening: its place in
  the queue, or its slots, go back at once, and nothing is billed.
* Whenever an open stream has sent nothing for one interval (a long prefill, text held
  back), a ping goes out. Never after the last event.
* Agent CLIs count no ping as activity (Claude Code skips ``ping`` events, Codex's SSE
  reader skips comments) and give up on a stream quiet for 5 minutes: a long prefill
  on a small CPU takes longer. Their APIs' adapters read the generation through
  :func:`with_ticks` (``stream_activity_s``) and, on each tick, send an event their
  client counts (the encoders' ``activity()``).

Each API says what its ping and its in-band error are (:class:`InBand`); OpenAI's
ping is the SSE comment ``: ping``, which SSE readers skip. Off (0), nothing changes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill.errors import ServiceError

T = TypeVar("T")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"connection", b"keep-alive"),
]
DONE = b"data: [DONE]\n\n"
# An SSE comment: every reader skips it (the WHATWG event-stream format), proxies see bytes.
PING = b": ping\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def encode_typed_event(payload: dict[str, Any]) -> bytes:
    """An event named by its payload's ``type`` (``event: <type>`` then its ``data``),
    as the Responses and Messages APIs send them."""
    return f"event: {payload['type']}\n".encode() + encode_event(payload)


def openai_error(error: ServiceError) -> bytes:
    """OpenAI's in-band error: the error body as an event, then the end of the stream."""
    return encode_event(error.to_openai_body()) + DONE


@dataclass(frozen=True)
class InBand:
    """What an API's stream says by itself: its keep-alive ping, and the error that
    ends a stream whose head already went out (the frames, the stream's end included)."""

    ping: bytes = PING
    error: Callable[[ServiceError], bytes] = openai_error


OPENAI = InBand()


class EventSource(Protocol):
    """An opened generation, as an API adapter shapes it."""

    def events(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Answer(EventSource, Protocol):
    """An opened generation that can also be answered whole, as one JSON body."""

    async def collect(self) -> dict[str, Any]: ...


async def respond(
    request: Request,
    opening: Coroutine[Any, Any, Answer],
    stream: bool,
    in_band: InBand = OPENAI,
) -> Response:
    """A generation route's response: with ``stream`` its events (opened behind
    keep-alive pings where it waits, :func:`stream_generation`), else its whole
    answer, collected unless the client leaves first (then 499, which nobody reads)."""
    headers = {"x-request-id": request.state.request_id}
    if stream:
        return await stream_generation(request, opening, headers, in_band)
    answer = await opening
    body = await run_until_disconnect(request.receive, answer.collect, answer.aclose)
    if body is None:
        return Response(status_code=499)
    return JSONResponse(body, headers=headers)


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _aclose(frames: AsyncIterator[Any]) -> None:
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        await aclose()


async def with_ticks(source: AsyncIterator[T], every_s: float | None) -> AsyncIterator[T | None]:
    """``source``'s items, and None whenever it has given nothing for ``every_s`` (a
    long prefill): the adapter then sends what its client counts as activity. Without
    ``every_s``, ``source`` as it is. Each next item is awaited in a task of its own,
    asked for only when the reader asks for more; a reader that leaves cancels it."""
    if not every_s:
        async for item in source:
            yield item
        return
    source_iter = aiter(source)
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source_iter))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            ready, pending = pending, None
            try:
                item = ready.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is None:
            await _aclose(source_iter)
        else:  # the reader left while the source was quiet: cancelled, it ends itself
            pending.cancel()
            pending.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Read a task's end, so that none is reported as never retrieved."""
    if not task.cancelled():
        task.exception()


class EventStreamResponse(Response):
    """An ASGI response streaming ``events`` (already-encoded SSE frames); with
    ``keepalive_s``, ``ping`` whenever nothing was sent for that long."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
        *,
        keepalive_s: float | None = None,
        ping: bytes = PING,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.on_close = on_close
        self.keepalive_s = keepalive_s
        self.ping = ping
        self.raw_headers = list(SSE_HEADERS) + [
            (k.lower().encode(), v.encode()) for k, v in (headers or {}).items()
        ]
        self._sent_at = 0.0
        # asyncio's, not anyio's: taking it free does not yield to the loop (per frame).
        self._sending = asyncio.Lock()

    async def _write(self, send: Send, frame: bytes) -> None:
        # One writer at a time: a ping never lands inside an event.
        async with self._sending:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            self._sent_at = time.monotonic()

    async def _keep_alive(self, send: Send, every_s: float) -> None:
        while True:
            quiet_s = time.monotonic() - self._sent_at
            if quiet_s < every_s:
                await anyio.sleep(every_s - quiet_s)
            else:
                await self._write(send, self.ping)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, tg.cancel_scope)
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                self._sent_at = time.monotonic()
                async with anyio.create_task_group() as pings:
                    if self.keepalive_s:
                        pings.start_soon(self._keep_alive, send, self.keepalive_s)
                    async for frame in self.events:
                        await self._write(send, frame)
                    pings.cancel_scope.cancel()  # the stream ended: nothing after it
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self.events)
                await self.on_close()


class _Opening:
    """A generation still opening (queued) when its response head went out."""

    def __init__(self, task: asyncio.Task[EventSource], in_band: InBand) -> None:
        self._task = task
        self._in_band = in_band

    async def events(self) -> AsyncIterator[bytes]:
        yield self._in_band.ping  # the head goes out now, with a sign of life
        try:
            # Cancelled (the client left), this cancels the opening too: the request
            # leaves the queue and takes no slot.
            source = await self._task
        except ServiceError as e:
            yield self._in_band.error(e)
            return
        frames = source.events()
        try:
            async for frame in frames:
                yield frame
        finally:
            await _aclose(frames)

    async def aclose(self) -> None:
        """Cancel the opening if it still runs; close the generation if it opened."""
        self._task.cancel()
        try:
            source = await self._task
        except (asyncio.CancelledError, Exception):
            return  # never opened; a failure was the stream's to tell
        await source.aclose()


async def stream_generation(
    request: Request,
    opening: Coroutine[Any, Any, EventSource],
    headers: dict[str, str],
    in_band: InBand = OPENAI,
) -> EventStreamResponse:
    """The streamed response of the generation ``opening`` opens (see the module's
    docstring); raises what ``opening`` raises before the response head."""
    keepalive_s: float | None = request.app.state.settings.stream_keepalive_s
    if not keepalive_s:  # off: open first, then the head, as it always was
        source = await opening
        return EventStreamResponse(source.events(), source.aclose, headers)
    task = asyncio.ensure_future(opening)
    opened = _Opening(task, in_band)
    try:
        await asyncio.wait([task], timeout=keepalive_s)
    except BaseException:  # this handler cancelled: the opening must not outlive it
        await asyncio.shield(opened.aclose())
        raise
    if task.done():
        source = task.result()  # a refusal raises here: its HTTP status
        return EventStreamResponse(
            source.events(), source.aclose, headers, keepalive_s=keepalive_s, ping=in_band.ping
        )
    return EventStreamResponse(
        opened.events(), opened.aclose, headers, keepalive_s=keepalive_s, ping=in_band.ping
    )


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
