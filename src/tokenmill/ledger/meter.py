"""The gateway's :class:`~tokenmill.metering.Meter`, backed by the ledger.

Besides holding and settling, it records how far open streams got, keeps this
gateway alive in the ledger (a heartbeat) and sweeps the holds of gateways that
stopped beating: a gateway killed mid-stream never settles, so another one settles
for it, on the dead gateway's last recorded progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence

from tokenmill.config import Price
from tokenmill.ledger.base import HoldProgress, HoldSpec
from tokenmill.ledger.sql import SqlLedger
from tokenmill.metering import HoldRequest, Progress, Settlement, cost

log = logging.getLogger("tokenmill.ledger")

HEARTBEAT_S = 5.0
# A gateway silent this long is dead: several missed heartbeats, never a slow one.
STALE_S = 30.0


class LedgerMeter:
    def __init__(
        self,
        ledger: SqlLedger,
        prices: Mapping[str, Price | None] | None = None,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_s: float = STALE_S,
    ) -> None:
        self.ledger = ledger
        self.prices = dict(prices or {})
        self.heartbeat_s = heartbeat_s
        self.stale_s = stale_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Sweep once now (a restart finds its predecessor's holds), then keep beating."""
        await self._sweep()
        self._task = asyncio.create_task(self._beat(), name="ledger-heartbeat")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sweep(self) -> None:
        try:
            await self.ledger.sweep(self.stale_s)
        except Exception:
            log.exception("ledger sweep failed; retrying at the next heartbeat")

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.ledger.heartbeat()
            except Exception:
                log.exception("ledger heartbeat failed")
                continue
            await self._sweep()

    async def hold(self, hold: HoldRequest) -> None:
        await self.ledger.hold(
            HoldSpec(
                request_id=hold.request_id,
                account_id=hold.caller.account_id,
                key_id=hold.caller.key_id,
                deployment=hold.deployment,
                prompt_tokens=hold.prompt_tokens,
                max_tokens=hold.max_tokens,
                amount=hold.amount,
                min_charge=cost(
                    self.prices.get(hold.deployment), hold.prompt_tokens, 0, hold.discount
                ),
            )
        )

    async def settle(self, hold: HoldRequest, settlement: Settlement) -> None:
        await self.ledger.settle(
            settlement.request_id,
            prompt_tokens=settlement.prompt_tokens,
            completion_tokens=settlement.completion_tokens,
            finish_reason=settlement.finish_reason,
            charged=settlement.charged,
        )

    async def record_progress(self, progress: Sequence[Progress]) -> None:
        await self.ledger.record_progress(
            [HoldProgress(p.request_id, p.completion_tokens, p.charged) for p in progress]
        )
