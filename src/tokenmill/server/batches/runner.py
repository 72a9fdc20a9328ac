"""Runs the lines of Batch API batches on a gateway's idle capacity.

Every gateway on a ledger runs one :class:`BatchRunner`. It claims pending lines for
each deployment it serves as far as that deployment has room for them
(:meth:`~tokenmill.gateway.Deployment.batch_room`: nobody waiting, a few slots kept
for interactive requests), and runs each line as the request it is: its stored body
read into its route's wire model and served by its route's serving function (the
route's :class:`~tokenmill.server.endpoint.Endpoint`, :data:`~tokenmill.server.
batches.lines.ENDPOINTS`), as the batch's owner, in the ``batch`` class and at the
batch discount (:meth:`~tokenmill.identity.Caller.for_batch`), so a line is admitted,
routed (cache locality included), held, metered and settled like any request, and
answers what the route would answer: its collected body, or its error's status and
body. Its outcome is written only if this gateway still holds the line
(:mod:`tokenmill.ledger.batches`).

What a line's answer means for it:

- 2xx: completed, into the output file;
- 402 (the account's credit is held by its other running lines, or gone): back to
  pending while other lines of its batch run (their settlements free credit); when
  none does, the line and every line not yet started fail ``insufficient_quota``:
  nothing is overdrawn and nothing more runs;
- 429 and 503 (full, rate-limited, loading, shutting down): back to pending, not
  counted, and the deployment is left alone for a moment;
- another 5xx: once more, then failed; any other 4xx: failed, into the error file.

The runner also does the batches' housekeeping: lines of gateways that died are
taken back, batches past their window expire, ended batches are finalized.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import anyio

from tokenmill.errors import ServiceError, UnauthenticatedError
from tokenmill.gateway import Gateway
from tokenmill.identity import Caller
from tokenmill.ledger import ResponseStore, SqlLedger
from tokenmill.ledger.batches import MAX_ATTEMPTS, BatchStore, Claimed, output_line
from tokenmill.server.auth import caller_of
from tokenmill.server.batches.lines import ENDPOINTS
from tokenmill.server.endpoint import Call
from tokenmill.server.intake import parse_json

log = logging.getLogger("tokenmill.batches")

POLL_S = 1.0  # the longest the runner sleeps without being woken
HOUSEKEEPING_S = 1.0
# How long a deployment that answered 429 or 503 is left alone (at most).
HOLD_OFF_S = 2.0
# How long a batch waits for its running lines to free credit after a 402.
CREDIT_WAIT_S = 0.5
_KEY_TTL_S = 2.0


async def serve_line(call: Call, url: str, body: str) -> tuple[int, Any, dict[str, str]]:
    """Serve a line's request (``body``, JSON) as its route does, whole: the status,
    the body (OpenAI's error body for an error) and the headers the route would answer.
    Never disconnects; cancel it to abort (the generation then settles what it made)."""
    endpoint = ENDPOINTS[url]
    try:
        answer = await endpoint.serve(call, parse_json(body, endpoint.model, endpoint.tags))
        try:
            return 200, await answer.collect(), {}
        finally:
            with anyio.CancelScope(shield=True):
                await answer.aclose()
    except ServiceError as e:
        return e.status, e.to_openai_body(), e.headers()
    except Exception:  # as the app's handler of the unexpected answers it
        log.exception("batch line %s failed unexpectedly", call.request_id)
        error = ServiceError("internal error; the request was not processed")
        return error.status, error.to_openai_body(), {}


class BatchRunner:
    def __init__(
        self,
        gateway: Gateway,
        store: BatchStore,
        ledger: SqlLedger,
        responses: ResponseStore,
        *,
        stale_s: float,
        poll_s: float = POLL_S,
    ) -> None:
        self.gateway = gateway
        self.store = store
        self.ledger = ledger
        self.responses = responses  # where a /v1/responses line stores what it answers
        self.stale_s = stale_s
        self.poll_s = poll_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lines: set[asyncio.Task[None]] = set()
        self._own: dict[str, int] = {}  # lines running, by deployment
        self._held_off: dict[str, float] = {}  # deployment -> until (monotonic)
        self._paused: dict[str, float] = {}  # batch -> until (monotonic)
        self._keys: dict[str, tuple[float, Caller | None]] = {}
        self._deployments: list[str] = []
        self._next_housekeeping = 0.0
        self._claiming = True

    @property
    def running(self) -> int:
        return len(self._lines)

    def wake(self) -> None:
        """Look again now: a batch was created or cancelled, or a line ended."""
        self._next_housekeeping = 0.0
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-runner")

    def stop_claiming(self) -> None:
        """Shutting down: start no more lines (those running finish or are cut by the
        gateway's drain, and go back to pending)."""
        self._claiming = False

    async def close(self) -> None:
        self._claiming = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._lines):
            task.cancel()
        if self._lines:
            await asyncio.gather(*self._lines, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._step()
            except Exception:
                log.exception("batch runner: a step failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def _step(self) -> None:
        now = time.monotonic()
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + HOUSEKEEPING_S
            await self._housekeeping()
        if not (self._claiming and self.gateway.ready):
            return
        paused = [b for b, until in self._paused.items() if until > now]
        for dep_id in self._deployments:
            deployment = self.gateway.deployments.get(dep_id)
            if deployment is None or self._held_off.get(dep_id, 0.0) > now:
                continue  # another gateway's deployment, or left alone a moment
            own = self._own.get(dep_id, 0)
            room = deployment.batch_room(own)
            if room <= 0:
                continue
            claimed = await self.store.claim(self.ledger.gateway_id, dep_id, room, paused)
            for line in claimed:
                self._own[dep_id] = self._own.get(dep_id, 0) + 1
                task = asyncio.create_task(self._line(line), name=f"batch-line-{line.request_id}")
                self._lines.add(task)
                task.add_done_callback(self._lines.discard)

    async def _housekeeping(self) -> None:
        taken = await self.store.take_back(self.ledger.gateway_id, self.stale_s)
        if taken:
            log.warning("batches: took back %d lines of gateways that stopped", taken)
        expired = await self.store.expire()
        for batch_id in expired:
            log.info("batch %s: its window closed; lines not started expire", batch_id)
        for final in await self.store.finalize():
            log.info("batch %s %s: %s", final.batch_id, final.status, final.lines)
        self._deployments = await self.store.active_deployments()

    async def _caller(self, line: Claimed) -> Caller | None:
        """Whom a line runs for: the key that created its batch (None: revoked)."""
        if line.key_id is None:
            return Caller(account_id=line.account_id).for_batch(line.batch_id)
        now = time.monotonic()
        hit = self._keys.get(line.key_id)
        if hit is None or hit[0] < now:
            info = await self.ledger.key_by_id(line.key_id)
            caller = None if info is None or info.revoked is not None else caller_of(info)
            hit = self._keys[line.key_id] = (now + _KEY_TTL_S, caller)
        return None if hit[1] is None else hit[1].for_batch(line.batch_id)

    async def _line(self, line: Claimed) -> None:
        gateway_id = self.ledger.gateway_id
        try:
            caller = await self._caller(line)
            if caller is None:
                revoked = UnauthenticatedError("the key that created this batch was revoked")
                body = revoked.to_openai_body()
                result = output_line(line.custom_id, line.request_id, revoked.status, body)
                await self.store.finish(line, gateway_id, "failed", result)
                return
            call = Call(self.gateway, caller, line.request_id, self.responses)
            status, body, headers = await serve_line(call, line.url, line.body)
            await self._outcome(line, status, body, headers)
        except asyncio.CancelledError:
            # Shut down mid-line: its stream settled what it produced; it runs again.
            await asyncio.shield(self.store.unclaim(line, gateway_id))
            raise
        except Exception:
            log.exception("batch %s line %d failed in the runner", line.batch_id, line.line)
            await self.store.unclaim(line, gateway_id, counted=True)
        finally:
            self._own[line.deployment] -= 1
            if not any(self._own.values()):
                self._next_housekeeping = 0.0  # perhaps its batch's last: finalize it now
            self._wake.set()

    async def _outcome(
        self, line: Claimed, status: int, body: Any, headers: dict[str, str]
    ) -> None:
        gateway_id = self.ledger.gateway_id
        result = output_line(line.custom_id, line.request_id, status, body)
        if 200 <= status < 300:
            await self.store.finish(line, gateway_id, "completed", result)
        elif status == 402:
            if await self.store.running(line.batch_id) > 1:
                # Its other lines hold the credit; what they leave pays for this one.
                await self.store.unclaim(line, gateway_id)
                self._paused[line.batch_id] = time.monotonic() + CREDIT_WAIT_S
                return
            await self.store.finish(line, gateway_id, "failed", result)
            ended = await self.store.end_pending(
                line.batch_id,
                "insufficient_quota",
                "the account ran out of credit before this request ran",
            )
            log.warning("batch %s: out of credit, %d lines not run", line.batch_id, ended)
        elif status in (429, 503):
            await self.store.unclaim(line, gateway_id)
            wait = _retry_after(headers)
            self._held_off[line.deployment] = time.monotonic() + min(wait, HOLD_OFF_S)
        elif status >= 500 and line.attempts < MAX_ATTEMPTS:
            await self.store.unclaim(line, gateway_id, counted=True)
        else:
            await self.store.finish(line, gateway_id, "failed", result)


def _retry_after(headers: dict[str, str]) -> float:
    try:
        return max(0.1, float(headers.get("Retry-After", HOLD_OFF_S)))
    except ValueError:
        return HOLD_OFF_S
