"""The contract between a stream and the books.

The gateway calls :meth:`Meter.hold` once before any token is generated (priced on
the prompt plus ``max_tokens``) and :meth:`Meter.settle` exactly once when the stream
ends for any reason, with the tokens actually produced. Meanwhile it reports each
open stream's progress (:meth:`Meter.record_progress`, about once a second), so that
if the gateway dies the tokens already delivered are still billed. The ledger package
provides the real implementation (:class:`tokenmill.ledger.meter.LedgerMeter`);
:class:`FreeMeter` is used when metering is off.

It stands below the gateway and the ledger, which both implement or call it: it must
import neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenmill.config import DeploymentCommon, Price
from tokenmill.identity import Caller


def cost(
    price: Price | None, prompt_tokens: int, completion_tokens: int, discount: float = 0.0
) -> int:
    """Micro-units for a request, rounded up: no fraction of a token goes unbilled.
    ``discount``: the share of the price spared (a batch line's), exact to 1e-6."""
    if price is None:
        return 0
    total = prompt_tokens * price.prompt_per_mtok + completion_tokens * price.completion_per_mtok
    if discount:
        paid = 1_000_000 - round(discount * 1_000_000)
        return -(-total * paid // 1_000_000_000_000)
    return -(-total // 1_000_000)


def discount_for(config: DeploymentCommon, caller: Caller) -> float:
    """The share of ``config``'s price spared for ``caller``: its batch discount for a
    line of a Batch API batch, else none."""
    return config.batch_discount if caller.batch is not None else 0.0


@dataclass(frozen=True, slots=True)
class HoldRequest:
    request_id: str
    caller: Caller
    deployment: str
    prompt_tokens: int
    max_tokens: int
    amount: int  # micro-units held
    discount: float = 0.0  # the share of the price spared (metering.discount_for)


@dataclass(frozen=True, slots=True)
class Settlement:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    charged: int


@dataclass(frozen=True, slots=True)
class Progress:
    """How far an open stream got: the tokens delivered so far and what they cost."""

    request_id: str
    completion_tokens: int
    charged: int  # the prompt and these tokens, <= the hold


class Meter(Protocol):
    async def hold(self, hold: HoldRequest) -> None:
        """Reserve credit; raise PaymentRequiredError or OverloadedError (rate limit)."""

    async def settle(self, hold: HoldRequest, settlement: Settlement) -> None:
        """Charge ``settlement.charged`` (<= the hold) and release the rest. Exactly once."""

    async def record_progress(self, progress: Sequence[Progress]) -> None:
        """Remember how far open holds got (those that changed since the last call), in
        one write: a hold whose gateway dies is settled on its last progress."""


class FreeMeter:
    """Metering off: nothing is held or charged."""

    async def hold(self, hold: HoldRequest) -> None:
        return None

    async def settle(self, hold: HoldRequest, settlement: Settlement) -> None:
        return None

    async def record_progress(self, progress: Sequence[Progress]) -> None:
        return None
