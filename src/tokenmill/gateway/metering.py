"""The interface between a stream and the books.

The gateway calls :meth:`Meter.hold` once before any token is generated (priced on
the prompt plus ``max_tokens``) and :meth:`Meter.settle` exactly once when the stream
ends for any reason, with the tokens actually produced. Meanwhile it reports each
open stream's progress (:meth:`Meter.record_progress`, about once a second), so that
if the gateway dies the tokens already delivered are still billed. The ledger package
provides the real implementation; :class:`FreeMeter` is used when metering is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from tokenmill.config import Price
from tokenmill.gateway.fairqueue import DEFAULT_PRIORITY, Priority, Tenant, capped


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: resolved by the server's auth from the API key.

    The scheduling fields come from the ledger (docs/fairness.md): the account's
    ``weight`` and ``max_concurrent``, and the key's class, which is both the class of
    its requests (``priority``, until a request asks for another) and the highest
    one they may ask for (``max_priority``).
    """

    account_id: str
    key_id: str | None = None
    is_admin: bool = False
    weight: float = 1.0
    max_concurrent: int | None = None
    priority: Priority = DEFAULT_PRIORITY
    max_priority: Priority = "interactive"

    def asking(self, priority: Priority | None) -> Caller:
        """This caller for a request that asks for ``priority`` (None: the key's own)."""
        return replace(self, priority=capped(priority, self.priority, self.max_priority))

    def tenant(self) -> Tenant:
        """Whom admission serves this request for."""
        return Tenant(self.account_id, self.weight, self.priority, self.max_concurrent)


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


@dataclass(frozen=True, slots=True)
class Progress:
    """How far an open stream got: the tokens delivered so far and what they cost."""

    request_id: str
    completion_tokens: int
    charged: int  # the prompt and these tokens, <= the hold


class Meter(Protocol):
    async def hold(self, hold: HoldRequest) -> None:
        """Reserve credit; raise InsufficientCreditError or OverloadedError (rate limit)."""

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
