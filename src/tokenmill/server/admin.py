"""The admin API (accounts, credits, keys, usage) and ``GET /v1/usage/{request_id}``.

Access is decided by :mod:`tokenmill.server.auth` before a route runs: ``/admin``
routes only ever see the admin (or everyone, when the gateway runs open).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.errors import NotFoundError
from tokenmill.gateway.metering import Caller
from tokenmill.ledger.base import KeyInfo, Receipt
from tokenmill.ledger.sql import SqlLedger
from tokenmill.server.routes import parse

router = APIRouter()


class NewAccount(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    balance: int = Field(default=0, ge=0)


class Credits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    amount: int = Field(description="micro-units; negative to remove credit")


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    account: str = Field(min_length=1)
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)


def ledger_of(request: Request) -> SqlLedger:
    ledger: SqlLedger = request.app.state.ledger
    return ledger


def _key_json(info: KeyInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "account": info.account_id,
        "rpm": info.rpm,
        "tpm": info.tpm,
        "created": info.created,
        "revoked": info.revoked,
    }


def usage_json(r: Receipt) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "account": r.account_id,
        "key": r.key_id,
        "deployment": r.deployment,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "held": r.held,
        "charged": r.charged,
        "finish_reason": r.finish_reason,
        "created": r.created,
        "settled": r.settled,
    }


async def _account_or_404(ledger: SqlLedger, account_id: str) -> dict[str, Any]:
    acc = await ledger.get_account(account_id)
    if acc is None:
        raise NotFoundError(f"no account {account_id!r}", code="account_not_found")
    return acc.to_json()


@router.post("/admin/accounts")
async def create_account(request: Request) -> dict[str, Any]:
    body = await parse(request, NewAccount)
    acc = await ledger_of(request).create_account(body.name, body.balance)
    return acc.to_json()


@router.get("/admin/accounts/{account_id}")
async def get_account(request: Request, account_id: str) -> dict[str, Any]:
    return await _account_or_404(ledger_of(request), account_id)


@router.post("/admin/accounts/{account_id}/credits")
async def add_credits(request: Request, account_id: str) -> dict[str, Any]:
    body = await parse(request, Credits)
    acc = await ledger_of(request).add_credits(account_id, body.amount)
    return acc.to_json()


@router.get("/admin/accounts/{account_id}/usage")
async def account_usage(request: Request, account_id: str, limit: int = 100) -> dict[str, Any]:
    ledger = ledger_of(request)
    await _account_or_404(ledger, account_id)
    receipts = await ledger.usage(account_id, max(1, min(limit, 1000)))
    return {"object": "list", "data": [usage_json(r) for r in receipts]}


@router.post("/admin/keys")
async def create_key(request: Request) -> dict[str, Any]:
    body = await parse(request, NewKey)
    info, plaintext = await ledger_of(request).create_key(body.account, rpm=body.rpm, tpm=body.tpm)
    # The only time the key's plain text exists outside the caller's hands.
    return {**_key_json(info), "key": plaintext}


@router.delete("/admin/keys/{key_id}")
async def revoke_key(request: Request, key_id: str) -> dict[str, Any]:
    info = await ledger_of(request).revoke_key(key_id)
    if info is None:
        raise NotFoundError(f"no key {key_id!r}", code="key_not_found")
    request.app.state.key_cache.forget(key_id)
    return _key_json(info)


@router.get("/v1/usage/{request_id}")
async def usage(request: Request, request_id: str) -> dict[str, Any]:
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
    return usage_json(receipt)
