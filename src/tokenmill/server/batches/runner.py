"""Runs the lines of Batch API batches on a gateway's idle capacity.

Every gateway on a ledger runs one :class:`BatchRunner`. It claims pending lines for
each deployment it serves as far as that deployment has room for them
(:meth:`~tokenmill.gateway.Deployment.batch_room`: nobody waiting, a few slots kept
for interactive requests), and runs each line as the request it is: through this
app, as the batch's owner, in the ``batch`` class and at the batch discount
(:meth:`~tokenmill.identity.Caller.for_batch`), so a line is admitted, routed (cache
locality included), held, metered and settled like any request, and answers what
the route would answer. Its outcome is written only if this gateway still holds
the line (:mod:`tokenmill.ledger.batches`).

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
import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message

from tokenmill.gateway import Gateway
from tokenmill.identity import Caller
from tokenmill.ledger import SqlLedger
from tokenmill.ledger.batches import MAX_ATTEMPTS, BatchStore, Claimed, output_line
from tokenmill.server.auth import INTERNAL_CALLER, caller_of

log = logging.getLogger("tokenmill.batches")

POLL_S = 1.0  # the longest the runner sleeps without being woken
HOUSEKEEPING_S = 1.0
# How long a deployment that answered 429 or 503 is left alone (at most).
HOLD_OFF_S = 2.0
# How long a batch waits for its running lines to free credit after a 402.
CREDIT_WAIT_S = 0.5
_KEY_TTL_S = 2.0


async def call_app(
    app: ASGIApp, path: str, body: dict[str, Any], caller: Caller, request_id: str
) -> tuple[int, bytes, dict[str, str]]:
    """POST ``body`` to ``path`` of ``app`` as ``caller``, in process: the status,
    body and headers it answers. The call never disconnects; cancel it to abort."""
    payload = json.dumps(body).encode()
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"x-request-id", request_id.encode()),
        ],
        "client": ("batch", 0),
        "server": ("tokenmill", 0),
        INTERNAL_CALLER: caller,
    }
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the caller never leaves
        raise AssertionError("unreachable")

    status = 500
    headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers.update(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
            )
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks), headers


class BatchRunner:
    def __init__(
        self,
        app: ASGIApp,
        gateway: Gateway,
        store: BatchStore,
        ledger: SqlLedger,
        *,
        stale_s: float,
        poll_s: float = POLL_S,
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.store = store
        self.ledger = ledger
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
                body = {"error": {"message": "the key that created this batch was revoked",
                                  "type": "authentication_error", "param": None,
                                  "code": "invalid_api_key"}}  # fmt: skip
                result = output_line(line.custom_id, line.request_id, 401, body)
                await self.store.finish(line, gateway_id, "failed", result)
                return
            status, raw, headers = await call_app(
                self.app, line.url, line.body, caller, line.request_id
            )
            await self._outcome(line, status, raw, headers)
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
        self, line: Claimed, status: int, raw: bytes, headers: dict[str, str]
    ) -> None:
        gateway_id = self.ledger.gateway_id
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
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
        return max(0.1, float(headers.get("retry-after", HOLD_OFF_S)))
    except ValueError:
        return HOLD_OFF_S
