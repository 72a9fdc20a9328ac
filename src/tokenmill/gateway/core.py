"""The gateway: from a validated request to a metered, cancellable stream of chunks.

:meth:`Gateway.open` does everything that can refuse a request *before* a byte of
the response is sent (unknown model, prompt too long, queue full, no credit), then
hands the request to its replica, and returns a :class:`RequestStream`: the replica
works on the prompt while the response head is written. The stream is the one place
where cancellation and the books meet: however it ends (finished, stop string, client
gone, replica crash), its ``aclose`` aborts the engine request, returns the replica's
slot and the admission permit, settles the hold exactly once, and writes one log line.
What it holds, and how each was taken and is given back, is the request's
:class:`~tokenmill.gateway.reservation.Reservation` (before it streams) and then its
:class:`~tokenmill.gateway.reservation.Books` (the stream's own). While it runs, it
counts the tokens it delivered, which the gateway's progress task
(:mod:`tokenmill.gateway.progress`) records with the meter about once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from tokenmill import stages
from tokenmill.config import Settings
from tokenmill.engines import Chunk, ChunkStream, GenerationRequest, Usage
from tokenmill.errors import (
    EngineError,
    ForbiddenError,
    ResourceNotFoundError,
    ServiceError,
    UnavailableError,
)
from tokenmill.gateway.deployment import Deployment
from tokenmill.gateway.progress import record_progress
from tokenmill.gateway.records import (
    Observer,
    RequestRecord,
    finished,
    new_request_id,
)
from tokenmill.gateway.reservation import Books, Reservation, shielded
from tokenmill.identity import ANONYMOUS, Caller
from tokenmill.metering import FreeMeter, Meter, Progress

log = logging.getLogger("tokenmill.requests")
__all__ = [
    "Gateway",
    "Observer",
    "OpenStreams",
    "RequestRecord",
    "RequestStream",
    "new_request_id",
]
# A cancelled request's final chunk (its exact token count) comes within a decode
# step, however slow the machine; a replica that dies or hangs ends the stream with
# an error (its host's probe kills a wedged one). So this is only a last resort:
# until then the bill waits for the replica's count, and nothing goes unbilled. (10 s
# was seen to run out on a machine at load 20, billing one token short.)
CANCEL_WAIT_S = 300.0


class RequestStream:
    """One admitted request. Iterate for chunks; ``aclose`` always runs the books."""

    def __init__(
        self,
        books: Books,
        request: GenerationRequest,
        record: RequestRecord,
        observers: Sequence[Observer],
        streams: OpenStreams,
    ) -> None:
        self._books = books
        self.deployment = books.deployment
        self._replica = books.replica
        self.request = request
        self.record = record
        self._observers = observers
        self._streams = streams
        self._engine_stream: ChunkStream | None = None
        self._closing: asyncio.Task[None] | None = None
        self.usage: Usage | None = None
        # Completion tokens counted toward the account's fair share so far.
        self._served = 0
        # Set by the drain before it aborts this stream: the client is told why.
        self.cut_at_shutdown = False
        # Tokens handed on to the client so far, and the count last recorded as the
        # hold's progress: what the hold is settled on if this gateway dies.
        self.delivered = 0
        self._recorded = 0
        # When the first and the latest output arrived: the replica's measured speeds.
        self._first_at: float | None = None
        self._last_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.record.prompt_tokens

    def progress(self) -> Progress | None:
        delivered = self.delivered
        if delivered == self._recorded:
            return None
        return self._books.progress(self.record.prompt_tokens, delivered)

    def recorded(self, progress: Progress) -> None:
        self._recorded = progress.completion_tokens

    def start(self) -> ChunkStream:
        """Hand the request to its replica (once): generation starts."""
        if self._engine_stream is None:
            # Before the frame leaves: the replica may take it up at once.
            self.record.marks["dispatched"] = time.monotonic()
            self._engine_stream = self._replica.host.generate(self.request)
        return self._engine_stream

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        rec = self.record
        observers = self._observers
        try:
            stream = self.start()
            async for chunk in stream:
                now = time.monotonic()
                output = bool(chunk.text or chunk.tool_calls)  # an upstream's calls too
                if rec.ttft_s is None and (output or chunk.finish_reason):
                    rec.ttft_s = now - rec.started
                    self._replica.first_tokens.add(now, rec.ttft_s)
                    if stream.marks is not None:  # the replica's own, and when read
                        rec.marks.update(stream.marks)
                    else:  # a replica on another clock sent none
                        rec.marks["received"] = now
                if chunk.tokens > rec.completion_tokens:
                    rec.completion_tokens = chunk.tokens
                if chunk.usage is not None:
                    self.usage = chunk.usage
                    rec.completion_tokens = chunk.usage.completion_tokens
                    rec.cached_tokens = chunk.usage.cached_tokens
                self._count_service()
                if chunk.finish_reason == "abort" and self.cut_at_shutdown:
                    break
                if chunk.finish_reason is not None:
                    rec.finish_reason = chunk.finish_reason
                if output:
                    if self._first_at is None:
                        self._first_at = now
                    self._last_at = now
                    for o in observers:
                        o.on_tokens(rec, now)
                yield chunk
                # The reader asks for more: the chunk went out.
                self.delivered = rec.completion_tokens
                if "written" not in rec.marks and rec.ttft_s is not None:
                    # The reader asks for more: the first token went out (to the socket).
                    rec.marks["written"] = time.monotonic()
                if chunk.finish_reason is not None:
                    return
            if self.cut_at_shutdown:
                raise UnavailableError(
                    "the gateway shut down before this generation finished; the tokens "
                    "sent were billed, retry for the rest",
                    code="shutting_down",
                )
            raise EngineError("the replica ended the stream without finishing it")
        except ServiceError as e:
            if not self.cut_at_shutdown:  # else the books say "abort", as _close set
                rec.status = "error"
                rec.error_code = e.code
                rec.finish_reason = "error"
            raise
        except asyncio.CancelledError:
            rec.finish_reason = "abort"
            rec.status = "cancelled"
            # A cancelled task cannot await its cleanup (anyio re-cancels every await),
            # so closing runs in its own task; whoever owns the stream awaits it.
            self._start_close()
            raise
        except GeneratorExit:
            rec.finish_reason = "abort"
            rec.status = "cancelled"
            raise
        except Exception as e:
            rec.status = "error"
            rec.error_code = "engine_error"
            rec.finish_reason = "error"
            log.exception("request %s failed in the engine", self.request_id)
            raise EngineError(f"the replica failed: {type(e).__name__}") from e
        finally:
            await self.aclose()

    def _count_service(self) -> None:
        """Charge the account's fair-share counter with the tokens produced since."""
        produced = self.record.completion_tokens - self._served
        if produced > 0:
            self._served += produced
            self.deployment.admission.serve(self.record.caller.account_id, 0, produced)

    def _start_close(self) -> asyncio.Task[None]:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        return self._closing

    async def aclose(self) -> None:
        """End the request: abort generation, free capacity, settle. Idempotent.

        Every caller awaits the same closing task, which a caller's cancellation
        cannot cut short: the tokens produced are learnt from the engine and settled.
        """
        await asyncio.shield(self._start_close())

    async def _close(self) -> None:
        rec = self.record
        stream = self._engine_stream
        if rec.finish_reason not in ("stop", "length") and rec.status == "ok":
            rec.finish_reason = "abort"
            rec.status = "cancelled"
        self._count_service()  # before its slots go to the next account
        # Capacity first: the slot and the permit return before any slow bookkeeping.
        self._books.release_capacity(rec)
        self._measure()
        try:
            if stream is not None:
                if not stream.ended:
                    # Stop generation and learn how many tokens were really produced:
                    # those are paid for, even if the client never saw them. The
                    # stream's final chunk (or the replica's death) says; a reader
                    # still on the stream gets it too.
                    stream.cancel()
                    if not await shielded(stream.wait_end(CANCEL_WAIT_S)):
                        log.error(
                            "request %s did not stop within %ss", self.request_id, CANCEL_WAIT_S
                        )
                rec.completion_tokens = max(rec.completion_tokens, stream.tokens)
                self._count_service()  # the last step's, if the account still runs
        finally:
            try:
                await self._books.settle(rec, dispatched=stream is not None)
            finally:
                finished(rec, self._observers)
                self._streams.discard(self)

    def _measure(self) -> None:
        """Feed the replica's speeds with this stream's, if it ran whole and alone
        (one choice: its tokens came one a step)."""
        rec, dispatched = self.record, self.record.marks.get("dispatched")
        if self.usage is None or dispatched is None or self._first_at is None:
            return
        if rec.finish_reason not in ("stop", "length") or self.request.choices != 1:
            return
        last = self._last_at or self._first_at
        picked, decoded = rec.marks.get("picked"), rec.marks.get("decoded")
        prefill_s = self._first_at - dispatched
        if picked is not None and decoded is not None:  # the replica's own (see .speed)
            prefill_s = decoded - picked
        self._replica.speed.observe(
            prefill_s=prefill_s,
            uncached_tokens=self.usage.prompt_tokens - self.usage.cached_tokens,
            decode_s=last - self._first_at,
            generated=self.usage.completion_tokens,
        )


class OpenStreams:
    """The streams open on a gateway, each from its start until it is settled: what a
    drain waits for, and what the progress task records."""

    def __init__(self) -> None:
        self._streams: set[RequestStream] = set()

    def add(self, stream: RequestStream) -> None:
        self._streams.add(stream)

    def discard(self, stream: RequestStream) -> None:
        self._streams.discard(stream)

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[RequestStream]:
        return iter(self._streams)

    def __contains__(self, stream: object) -> bool:
        return stream in self._streams


class Gateway:
    def __init__(self, settings: Settings, meter: Meter | None = None) -> None:
        self.settings = settings
        self.deployments: dict[str, Deployment] = {
            d.id: Deployment(settings.with_data_dir(d), ray_address=settings.ray_address)
            for d in settings.deployments
        }
        self.meter: Meter = meter or FreeMeter()
        self.observers: list[Observer] = []
        self.ready = False
        # Set at shutdown: no request is admitted any more (503), open ones may finish.
        self.draining = False
        self._drain_deadline: float | None = None
        self.streams = OpenStreams()
        self._progress: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._progress is None:
            self._progress = asyncio.create_task(
                record_progress(self.meter, self.streams), name="progress"
            )
        await asyncio.gather(*(d.start() for d in self.deployments.values()))
        self.ready = True

    async def drain(self, drain_s: float) -> None:
        """Stop admitting, let open streams finish up to ``drain_s``, abort the rest.

        Each stream is settled by its own ``aclose``; when this returns none is open.
        """
        self.draining = True
        deadline = time.monotonic() + drain_s
        if self._drain_deadline is not None:  # a second drain never extends the first
            deadline = min(deadline, self._drain_deadline)
        self._drain_deadline = deadline
        # _drain_deadline is re-read: end_drain() may cut it short.
        while self.streams and time.monotonic() < self._drain_deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        left = list(self.streams)
        if left:
            log.warning("aborting %d open request(s) after the %gs drain", len(left), drain_s)
        for stream in left:
            log.warning("aborting %s at shutdown", stream.request_id)
            stream.cut_at_shutdown = True
        await asyncio.gather(*(stream.aclose() for stream in left))

    def end_drain(self) -> None:
        """Cut a running drain short: what is still open is aborted now."""
        self.draining = True
        self._drain_deadline = time.monotonic()

    async def close(self, drain_s: float = 5.0) -> None:
        """Drain (see :meth:`drain`), then close the engines."""
        await self.drain(drain_s)
        self.ready = False
        if self._progress is not None:  # every stream is settled: nothing left to record
            self._progress.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._progress
            self._progress = None
        await asyncio.gather(
            *(d.close() for d in self.deployments.values()), return_exceptions=True
        )

    def deployment(self, model: str | None) -> Deployment:
        if model is None:
            if len(self.deployments) == 1:
                return next(iter(self.deployments.values()))
            raise ResourceNotFoundError(
                "'model' is required: name one of GET /v1/models", param="model"
            )
        try:
            return self.deployments[model]
        except KeyError:
            known = ", ".join(sorted(self.deployments)) or "none"
            raise ResourceNotFoundError(
                f"The model {model!r} does not exist. Available models: {known}.",
                param="model",
                code="model_not_found",
            ) from None

    async def open(
        self,
        deployment: Deployment,
        request: GenerationRequest,
        caller: Caller = ANONYMOUS,
        *,
        session: str | None = None,
        up_to_window: bool = False,
    ) -> RequestStream:
        """Admit, count the prompt, route it, hold credit. Raises before streaming.

        The prompt is prepared (rendered, tokenized, checked) once, on any serving
        replica; the routing policy then chooses the replica with its token ids in
        hand, and one other than the preparer is handed the ids with the request.
        ``session`` (the ``user`` field or ``x-session-id``) is an affinity hint.
        ``up_to_window``: a ``max_tokens`` past what the context leaves is served up
        to the window (the stream's ``request`` then carries the smaller one) instead
        of refused.
        """
        if caller.priority == "batch" and not request.background:
            # Background work yields the decode steps that prefill others' prompts.
            request = dataclasses.replace(request, background=True)
        record = RequestRecord(request.request_id, deployment.id, caller)
        marks = stages.current()
        if marks is not None:  # the HTTP request's, with its marks so far
            record.marks = marks
        reservation = Reservation(
            deployment, request, record, self.meter, up_to_window=up_to_window
        )
        try:
            self.check_admits(caller, "generate")
            await reservation.admit()
            info = await reservation.prepare()
            await reservation.place(info, session)
            await reservation.hold(info)
        except BaseException as e:
            try:
                await reservation.release()
            finally:
                self.refused(record, e)
            raise
        books = reservation.books()
        stream = RequestStream(books, reservation.request, record, self.observers, self.streams)
        self.streams.add(stream)
        for o in self.observers:
            o.on_start(record)
        try:
            # Now, not when the response's body is first read: the replica works on the
            # prompt while the response head goes out.
            stream.start()
        except BaseException as e:
            record.status = "error"
            record.error_code = getattr(e, "code", None)
            record.finish_reason = "error"
            await stream.aclose()
            raise
        return stream

    def check_admits(self, caller: Caller, verb: str) -> None:
        """Raise unless a billed request may start now: not while shutting down (503),
        never on the admin key, which bills no account (it would be free: 403)."""
        if self.draining:
            raise UnavailableError(
                "the gateway is shutting down and admits no new request; retry shortly "
                "(another instance, or this one once restarted)",
                retry_after=1.0,
                code="shutting_down",
            )
        if caller.is_admin:
            raise ForbiddenError(
                f"the admin key manages accounts and bills none: {verb} with an "
                "account's API key (POST /admin/keys)"
            )

    def refused(self, record: RequestRecord, e: BaseException) -> None:
        """Record a request refused before it streamed (it was never started)."""
        record.status = "rejected"
        record.error_code = getattr(e, "code", None)
        # Refusals (429, no credit) are what error metrics are for: observers see
        # them via on_finish with status "rejected" (on_start was never called).
        finished(record, self.observers)

    def stats(self) -> dict[str, Any]:
        return {d.id: d.describe() for d in self.deployments.values()}
