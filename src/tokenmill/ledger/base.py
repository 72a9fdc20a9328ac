"""The ledger's vocabulary: accounts, keys, holds and receipts.

Money is always an ``int`` of micro-units. API keys are high-entropy random strings;
only their SHA-256 is stored (a slow password hash buys nothing for 256 random bits),
so the plain text exists once, in the response that creates the key.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.identity import Priority

ANONYMOUS_ACCOUNT = "anonymous"
# A key's priority class: the caller's, as the fair queue ranks it.
KeyPriority = Priority
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
