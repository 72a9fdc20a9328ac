"""The interface between a stream and the books.

The gateway calls :meth:`Meter.hold` once before any token is generated (priced on
the prompt plus ``max_tokens``) and :meth:`Meter.settle` exactly once when the stream
ends for any reason, with the tokens actually produced. The ledger package provides
the real implementation; :class:`FreeMeter` is used when metering is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenmill.config import Price


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: resolved by the server's auth from the API key."""

    account_id: str
    key_id: str | None = None
    is_admin: bool = False


ANONYMOUS = Caller(account_id="anonymous")


def cost(price: Price | None, prompt_tokens: int, completion_tokens: int) -> int:
    """Micro-units for a request, rounded up: no fraction of a token goes unbilled."""
    if price is None:
        return 0
    total = prompt_tokens * price.prompt_per_mtok + completion_tokens * price.completion_per_mtok
    return -(-total // 1_000_000)


@dataclass(frozen=True, slots=True)
class HoldRequest:
    request_id: str
    caller: Caller
    deployment: str
    prompt_tokens: int
    max_tokens: int
    amount: int  # micro-units held


@dataclass(frozen=True, slots=True)
class Settlement:
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    charged: int


class Meter(Protocol):
    async def hold(self, hold: HoldRequest) -> None:
        """Reserve credit; raise InsufficientCreditError or OverloadedError (rate limit)."""

    async def settle(self, hold: HoldRequest, settlement: Settlement) -> None:
        """Charge ``settlement.charged`` (<= the hold) and release the rest. Exactly once."""


class FreeMeter:
    """Metering off: nothing is held or charged."""

    async def hold(self, hold: HoldRequest) -> None:
        return None

    async def settle(self, hold: HoldRequest, settlement: Settlement) -> None:
        return None
