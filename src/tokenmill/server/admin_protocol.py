"""The admin API's wire models: what its routes take and answer
(:mod:`tokenmill.server.admin`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.ledger import (
    MAX_WEIGHT,
    AuditEntry,
    BudgetState,
    BudgetWindow,
    KeyInfo,
    KeyPriority,
    Receipt,
)
from tokenmill.ledger import Account as LedgerAccount
from tokenmill.ledger.budgets import MAX_WINDOWS
from tokenmill.ledger.windows import DURATION_HELP
from tokenmill.server.protocol import Int

# The most receipts one usage page lists.
MAX_USAGE_PAGE = 1000
# One balance or credit of at most a billion currency units: more is a client's bug,
# and sums stay far inside the ledger's 64-bit integer columns.
MAX_MICRO_UNITS = 10**15
# A per-minute limit above this limits nothing (leave it out); it also stays in 64 bits.
MAX_PER_MINUTE = 10**12
# Streams one account may run at once: far beyond any deployment's slots.
MAX_CONCURRENT = 10**6


# As strict as the generation bodies: 5.0 is 5, but "5" and true are not numbers.
_STRICT = ConfigDict(extra="forbid", strict=True)


Weight = Field(
    default=1.0,
    gt=0,
    le=MAX_WEIGHT,
    allow_inf_nan=False,
    description="its share of a busy deployment against other accounts (docs/fairness.md)",
)
MaxConcurrent = Field(
    default=None,
    ge=1,
    le=MAX_CONCURRENT,
    description="streams it may run at once on one deployment; null: no cap",
)
PRIORITY_HELP = "the class of the key's requests and the highest they may ask for"
BUDGET_HELP = (
    "spend windows that reset on calendar boundaries (docs/metering.md#budgets); [] or null: none"
)


class Budget(BaseModel):
    """One window of a spend budget: at most ``amount`` each ``duration``."""

    model_config = _STRICT
    amount: Int = Field(ge=0, le=MAX_MICRO_UNITS, description="micro-units a window")
    duration: str = Field(min_length=2, max_length=8, description=DURATION_HELP)
    timezone: str = Field(
        default="UTC", min_length=1, max_length=64, description="IANA zone of the boundaries"
    )

    def window(self) -> BudgetWindow:
        return BudgetWindow(self.amount, self.duration, self.timezone)


Budgets: Any = Field(default_factory=list, max_length=MAX_WINDOWS, description=BUDGET_HELP)


def windows(budget: list[Budget] | None) -> list[BudgetWindow]:
    return [b.window() for b in budget or ()]


class NewAccount(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=200)
    balance: Int = Field(default=0, ge=0, le=MAX_MICRO_UNITS, description="micro-units")
    weight: float = Weight
    max_concurrent: Int | None = MaxConcurrent
    budget: list[Budget] | None = Budgets


class AccountChange(BaseModel):
    """``PATCH /admin/accounts/{id}``: the fields given change, the rest stay."""

    model_config = _STRICT
    weight: float = Weight
    max_concurrent: Int | None = MaxConcurrent
    budget: list[Budget] | None = Budgets


class Credits(BaseModel):
    model_config = _STRICT
    amount: Int = Field(
        ge=-MAX_MICRO_UNITS,
        le=MAX_MICRO_UNITS,
        description="micro-units; negative to remove credit",
    )


class NewKey(BaseModel):
    model_config = _STRICT
    account: str = Field(min_length=1)
    rpm: Int | None = Field(default=None, ge=1, le=MAX_PER_MINUTE)
    tpm: Int | None = Field(default=None, ge=1, le=MAX_PER_MINUTE)
    priority: KeyPriority = Field(default="default", description=PRIORITY_HELP)
    budget: list[Budget] | None = Budgets


class KeyChange(BaseModel):
    """``PATCH /admin/keys/{id}``: the fields given change, the rest stay."""

    model_config = _STRICT
    priority: KeyPriority = Field(default="default", description=PRIORITY_HELP)
    budget: list[Budget] | None = Budgets


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BudgetStatus(_Response):
    amount: int = Field(description="micro-units a window")
    duration: str
    timezone: str
    spent: int = Field(description="charged, and held for requests running, this window")
    remaining: int
    window_start: float = Field(description="seconds since the epoch")
    resets_at: float = Field(description="when this window ends, seconds since the epoch")

    @classmethod
    def of(cls, state: BudgetState) -> BudgetStatus:
        return cls.model_validate(state.to_json())


def statuses(states: list[BudgetState]) -> list[BudgetStatus]:
    return [BudgetStatus.of(s) for s in states]


class Account(_Response):
    id: str
    name: str
    balance: int = Field(description="micro-units")
    held: int = Field(description="micro-units held for requests still running")
    unlimited: bool
    created: float
    weight: float
    max_concurrent: int | None
    budget: list[BudgetStatus]

    @classmethod
    def of(cls, acc: LedgerAccount, budget: list[BudgetState]) -> Account:
        return cls(
            budget=statuses(budget),
            id=acc.id,
            name=acc.name,
            balance=acc.balance,
            held=acc.held,
            unlimited=acc.unlimited,
            created=acc.created,
            weight=acc.weight,
            max_concurrent=acc.max_concurrent,
        )


class ApiKey(_Response):
    id: str
    account: str
    rpm: int | None
    tpm: int | None
    created: float
    revoked: float | None
    priority: KeyPriority
    budget: list[BudgetStatus]

    @classmethod
    def of(cls, info: KeyInfo, budget: list[BudgetState]) -> ApiKey:
        return cls(
            budget=statuses(budget),
            id=info.id,
            account=info.account_id,
            rpm=info.rpm,
            tpm=info.tpm,
            created=info.created,
            revoked=info.revoked,
            priority=info.priority,
        )


class NewApiKey(ApiKey):
    key: str = Field(description="the key itself; it is never shown again")


class UsageRecord(_Response):
    request_id: str
    account: str
    key: str | None
    deployment: str
    prompt_tokens: int
    completion_tokens: int
    held: int
    charged: int = Field(description="micro-units")
    finish_reason: str
    created: float
    settled: float

    @classmethod
    def of(cls, r: Receipt) -> UsageRecord:
        return cls(
            request_id=r.request_id,
            account=r.account_id,
            key=r.key_id,
            deployment=r.deployment,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            held=r.held,
            charged=r.charged,
            finish_reason=r.finish_reason,
            created=r.created,
            settled=r.settled,
        )


class UsageRecordList(_Response):
    object: Literal["list"]
    data: list[UsageRecord]


class AuditRecord(_Response):
    id: int = Field(description="increasing: a later change has a higher id")
    at: float = Field(description="when the change was made, seconds since the epoch")
    actor: str = Field(description="admin, key:<id> (an API key), or system")
    action: str = Field(description="account.created, key.revoked, batch.cancelled, ...")
    target_type: str = Field(description="account, key or batch")
    target_id: str
    before: dict[str, Any] | None = Field(description="the target before; null: it was new")
    after: dict[str, Any] | None
    request_id: str | None = Field(description="the x-request-id of the change's request")
    gateway_id: str

    @classmethod
    def of(cls, e: AuditEntry) -> AuditRecord:
        return cls.model_validate(e.to_json())


class AuditRecordList(_Response):
    object: Literal["list"]
    data: list[AuditRecord]
    has_more: bool
    first_id: int | None
    last_id: int | None = Field(description="pass as ?after= for the next page")
