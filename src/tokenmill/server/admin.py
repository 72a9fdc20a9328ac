"""The admin API (accounts, credits, keys, usage) and ``GET /v1/usage/{request_id}``.

Access is decided by :mod:`tokenmill.server.auth` before a route runs: ``/admin``
routes only ever see the admin (or everyone, when the gateway runs open).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.errors import NotFoundError
from tokenmill.identity import Caller
from tokenmill.ledger import KEEP, MAX_WEIGHT, KeyInfo, KeyPriority, Receipt, SqlLedger
from tokenmill.ledger import Account as LedgerAccount
from tokenmill.server.intake import parse_body
from tokenmill.server.openapi import errors, json_body, link
from tokenmill.server.protocol import Int

router = APIRouter()
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


class NewAccount(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=200)
    balance: Int = Field(default=0, ge=0, le=MAX_MICRO_UNITS, description="micro-units")
    weight: float = Weight
    max_concurrent: Int | None = MaxConcurrent


class AccountChange(BaseModel):
    """``PATCH /admin/accounts/{id}``: the fields given change, the rest stay."""

    model_config = _STRICT
    weight: float = Weight
    max_concurrent: Int | None = MaxConcurrent


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


class KeyChange(BaseModel):
    model_config = _STRICT
    priority: KeyPriority = Field(default="default", description=PRIORITY_HELP)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Account(_Response):
    id: str
    name: str
    balance: int = Field(description="micro-units")
    held: int = Field(description="micro-units held for requests still running")
    unlimited: bool
    created: float
    weight: float
    max_concurrent: int | None

    @classmethod
    def of(cls, acc: LedgerAccount) -> Account:
        return cls(
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

    @classmethod
    def of(cls, info: KeyInfo) -> ApiKey:
        return cls(
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


def ledger_of(request: Request) -> SqlLedger:
    ledger: SqlLedger = request.app.state.ledger
    return ledger


async def _account_or_404(ledger: SqlLedger, account_id: str) -> LedgerAccount:
    acc = await ledger.get_account(account_id)
    if acc is None:
        raise NotFoundError(f"no account {account_id!r}", code="account_not_found")
    return acc


# What can be done with an account once it exists.
_ACCOUNT = "$response.body#/id"
ACCOUNT_LINKS = {
    "get": link("get_account", account_id=_ACCOUNT),
    "credit": link("add_credits", account_id=_ACCOUNT),
    "usage": link("account_usage", account_id=_ACCOUNT),
    "new_key": {"operationId": "create_key", "requestBody": {"account": _ACCOUNT}},
}


@router.post(
    "/admin/accounts",
    openapi_extra=json_body(NewAccount),
    responses={200: {"links": ACCOUNT_LINKS}, **errors(400, 413)},
)
async def create_account(request: Request) -> Account:
    body = await parse_body(request, NewAccount)
    acc = await ledger_of(request).create_account(
        body.name, body.balance, weight=body.weight, max_concurrent=body.max_concurrent
    )
    return Account.of(acc)


@router.get("/admin/accounts/{account_id}", responses=errors(404))
async def get_account(request: Request, account_id: str) -> Account:
    return Account.of(await _account_or_404(ledger_of(request), account_id))


@router.patch(
    "/admin/accounts/{account_id}",
    openapi_extra=json_body(AccountChange),
    responses={200: {"links": ACCOUNT_LINKS}, **errors(400, 404, 413)},
)
async def update_account(request: Request, account_id: str) -> Account:
    body = await parse_body(request, AccountChange)
    given = body.model_fields_set
    acc = await ledger_of(request).update_account(
        account_id,
        weight=body.weight if "weight" in given else KEEP,
        max_concurrent=body.max_concurrent if "max_concurrent" in given else KEEP,
    )
    # This gateway's next request sees it; others' within the key cache's TTL.
    request.app.state.key_cache.forget_account(account_id)
    return Account.of(acc)


@router.post(
    "/admin/accounts/{account_id}/credits",
    openapi_extra=json_body(Credits),
    responses={200: {"links": ACCOUNT_LINKS}, **errors(400, 404, 413)},
)
async def add_credits(request: Request, account_id: str) -> Account:
    body = await parse_body(request, Credits)
    return Account.of(await ledger_of(request).add_credits(account_id, body.amount))


@router.get("/admin/accounts/{account_id}/usage", responses=errors(400, 404))
async def account_usage(request: Request, account_id: str, limit: int = 100) -> UsageRecordList:
    ledger = ledger_of(request)
    await _account_or_404(ledger, account_id)
    receipts = await ledger.usage(account_id, max(1, min(limit, MAX_USAGE_PAGE)))
    return UsageRecordList(object="list", data=[UsageRecord.of(r) for r in receipts])


@router.post(
    "/admin/keys",
    openapi_extra=json_body(NewKey),
    responses={
        200: {"links": {"revoke": link("revoke_key", key_id="$response.body#/id")}},
        **errors(400, 404, 413),
    },
)
async def create_key(request: Request) -> NewApiKey:
    body = await parse_body(request, NewKey)
    info, plaintext = await ledger_of(request).create_key(
        body.account, rpm=body.rpm, tpm=body.tpm, priority=body.priority
    )
    # The only time the key's plain text exists outside the caller's hands.
    return NewApiKey(**ApiKey.of(info).model_dump(), key=plaintext)


@router.delete("/admin/keys/{key_id}", responses=errors(404))
async def revoke_key(request: Request, key_id: str) -> ApiKey:
    info = await ledger_of(request).revoke_key(key_id)
    if info is None:
        raise NotFoundError(f"no key {key_id!r}", code="key_not_found")
    request.app.state.key_cache.forget(key_id)
    return ApiKey.of(info)


@router.patch(
    "/admin/keys/{key_id}", openapi_extra=json_body(KeyChange), responses=errors(400, 404, 413)
)
async def update_key(request: Request, key_id: str) -> ApiKey:
    body = await parse_body(request, KeyChange)
    info = await ledger_of(request).set_key_priority(key_id, body.priority)
    if info is None:
        raise NotFoundError(f"no key {key_id!r}", code="key_not_found")
    request.app.state.key_cache.forget(key_id)
    return ApiKey.of(info)


@router.get("/v1/usage/{request_id}", responses=errors(404))
async def usage(request: Request, request_id: str) -> UsageRecord:
    caller: Caller = request.state.caller
    receipt = await ledger_of(request).receipt(request_id)
    open_gateway = request.app.state.settings.admin_key is None
    # Someone else's request is indistinguishable from an unknown one.
    if receipt is None or not (
        open_gateway or caller.is_admin or (caller.key_id and receipt.key_id == caller.key_id)
    ):
        raise NotFoundError(
            f"no settled request {request_id!r} for this key "
            "(a request is listed once it has finished)",
            code="usage_not_found",
        )
    return UsageRecord.of(receipt)
