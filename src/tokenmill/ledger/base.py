"""The ledger's vocabulary: accounts, keys, holds and receipts, and the async interface.

Money is always an ``int`` of micro-units. API keys are high-entropy random strings;
only their SHA-256 is stored (a slow password hash buys nothing for 256 random bits),
so the plain text exists once, in the response that creates the key.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

ANONYMOUS_ACCOUNT = "anonymous"
# A key's priority class (tokenmill.gateway.fairqueue.Priority; the ledger stands
# below the gateway and names them itself).
KeyPriority = Literal["batch", "default", "interactive"]
# The largest weight an account may have: a thousand times another's share is already
# all of it in practice, and a bound keeps the counters' arithmetic tame.
MAX_WEIGHT = 1000.0


class Keep(enum.Enum):
    """An update's "leave this as it is" (where None is a value: no cap)."""

    KEEP = "keep"


KEEP = Keep.KEEP
KEY_PREFIX = "tm-"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True, slots=True)
class Account:
    id: str
    name: str
    balance: int
    held: int
    unlimited: bool
    created: float
    # Its share of a busy deployment against other accounts (docs/fairness.md).
    weight: float = 1.0
    # Streams it may run at once on one deployment; None: no cap.
    max_concurrent: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: str
    account_id: str
    rpm: int | None
    tpm: int | None
    created: float
    revoked: float | None
    # The class of the key's requests and the highest they may ask for.
    priority: KeyPriority = "default"
    # Its account's scheduling, read with the key (one query on the hot path).
    weight: float = 1.0
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class HoldSpec:
    """One hold as the ledger stores it (the meter builds it from a HoldRequest)."""

    request_id: str
    account_id: str
    key_id: str | None
    deployment: str
    prompt_tokens: int
    max_tokens: int
    amount: int
    # What a hold is settled for when its gateway died before recording any progress:
    # the prompt was processed for sure, so at least the prompt is charged.
    min_charge: int


@dataclass(frozen=True, slots=True)
class HoldProgress:
    """How far an open hold's stream got, recorded by its gateway while it runs.

    If that gateway dies, the sweeper settles the hold on this: ``completion_tokens``
    delivered, charged ``charge`` (the prompt and those tokens, priced by the gateway).
    """

    request_id: str
    completion_tokens: int
    charge: int


@dataclass(frozen=True, slots=True)
class Receipt:
    request_id: str
    account_id: str
    key_id: str | None
    deployment: str
    prompt_tokens: int
    completion_tokens: int
    held: int
    charged: int
    finish_reason: str
    created: float
    settled: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Ledger(Protocol):
    """Every method is a short transaction; all are safe across processes."""

    gateway_id: str

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def create_account(
        self,
        name: str,
        balance: int = 0,
        *,
        account_id: str | None = None,
        weight: float = 1.0,
        max_concurrent: int | None = None,
    ) -> Account: ...
    async def get_account(self, account_id: str) -> Account | None: ...
    async def add_credits(self, account_id: str, amount: int) -> Account: ...
    async def update_account(
        self,
        account_id: str,
        *,
        weight: float | Keep = KEEP,
        max_concurrent: int | Keep | None = KEEP,
    ) -> Account: ...

    async def create_key(
        self,
        account_id: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        priority: KeyPriority = "default",
    ) -> tuple[KeyInfo, str]: ...
    async def resolve_key(self, plaintext: str) -> KeyInfo | None: ...
    async def revoke_key(self, key_id: str) -> KeyInfo | None: ...
    async def set_key_priority(self, key_id: str, priority: KeyPriority) -> KeyInfo | None: ...

    async def hold(self, spec: HoldSpec) -> None: ...
    async def record_progress(self, progress: Sequence[HoldProgress]) -> None: ...
    async def settle(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        charged: int,
    ) -> Receipt | None: ...
    async def receipt(self, request_id: str) -> Receipt | None: ...
    async def usage(self, account_id: str, limit: int = 100) -> list[Receipt]: ...
    async def open_holds(self, account_id: str | None = None) -> int: ...

    async def heartbeat(self) -> None: ...
    async def sweep(self, stale_s: float) -> int: ...
