"""The admin API (accounts, credits, keys, budgets, usage, the audit log), and what a
key may read of its own: ``GET /v1/usage/{request_id}`` and ``GET /v1/keys/{key_id}``.
Its wire models are :mod:`tokenmill.server.admin_protocol`'s.

Access is decided by :mod:`tokenmill.server.auth` before a route runs: ``/admin``
routes only ever see the admin (or everyone, when the gateway runs open). Every
change is audited by the ledger, in its own transaction, naming the actor
(:func:`~tokenmill.server.auth.actor_of`) and the request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from tokenmill.errors import ResourceNotFoundError
from tokenmill.identity import Caller
from tokenmill.ledger import KEEP, Actor, AuditLog, AuditQuery, KeyInfo, SqlLedger
from tokenmill.ledger import Account as LedgerAccount
from tokenmill.ledger.audit import MAX_PAGE as MAX_AUDIT_PAGE
from tokenmill.server.admin_protocol import (
    MAX_USAGE_PAGE,
    Account,
    AccountChange,
    ApiKey,
    AuditRecord,
    AuditRecordList,
    Credits,
    KeyChange,
    NewAccount,
    NewApiKey,
    NewKey,
    UsageRecord,
    UsageRecordList,
    windows,
)
from tokenmill.server.auth import actor_of
from tokenmill.server.intake import parse_body
from tokenmill.server.openapi import errors, json_body, link

router = APIRouter()
# An audit entry's id is a 64-bit integer in the ledger.
MAX_ID = 2**63 - 1
# Times are seconds since the epoch: this is the year 33658, far past any entry.
MAX_TIME = 1e12


def ledger_of(request: Request) -> SqlLedger:
    ledger: SqlLedger = request.app.state.ledger
    return ledger


def change_actor(request: Request) -> Actor:
    """Whom the audit log names for this request's change."""
    caller: Caller = request.state.caller
    return actor_of(caller, request.state.request_id)


async def _account_or_404(ledger: SqlLedger, account_id: str) -> LedgerAccount:
    acc = await ledger.get_account(account_id)
    if acc is None:
        raise ResourceNotFoundError(f"no account {account_id!r}", code="account_not_found")
    return acc


async def _account(ledger: SqlLedger, acc: LedgerAccount) -> Account:
    """The account as the API shows it, with its budget windows as they stand."""
    return Account.of(acc, await ledger.budget_states("account", acc.id))


async def _key(ledger: SqlLedger, info: KeyInfo | None, key_id: str) -> ApiKey:
    """The key as the API shows it (404 if there is none), with its budget windows."""
    if info is None:
        raise ResourceNotFoundError(f"no key {key_id!r}", code="key_not_found")
    return ApiKey.of(info, await ledger.budget_states("key", info.id))


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
    ledger = ledger_of(request)
    acc = await ledger.create_account(
        body.name,
        body.balance,
        weight=body.weight,
        max_concurrent=body.max_concurrent,
        budget=windows(body.budget),
        actor=change_actor(request),
    )
    return await _account(ledger, acc)


@router.get("/admin/accounts/{account_id}", responses=errors(404))
async def get_account(request: Request, account_id: str) -> Account:
    ledger = ledger_of(request)
    return await _account(ledger, await _account_or_404(ledger, account_id))


@router.patch(
    "/admin/accounts/{account_id}",
    openapi_extra=json_body(AccountChange),
    responses={200: {"links": ACCOUNT_LINKS}, **errors(400, 404, 413)},
)
async def update_account(request: Request, account_id: str) -> Account:
    body = await parse_body(request, AccountChange)
    given = body.model_fields_set
    ledger = ledger_of(request)
    acc = await ledger.update_account(
        account_id,
        weight=body.weight if "weight" in given else KEEP,
        max_concurrent=body.max_concurrent if "max_concurrent" in given else KEEP,
        budget=windows(body.budget) if "budget" in given else KEEP,
        actor=change_actor(request),
    )
    # This gateway's next request sees it; others' within the key cache's TTL.
    request.app.state.key_cache.forget_account(account_id)
    return await _account(ledger, acc)


@router.post(
    "/admin/accounts/{account_id}/credits",
    openapi_extra=json_body(Credits),
    responses={200: {"links": ACCOUNT_LINKS}, **errors(400, 404, 413)},
)
async def add_credits(request: Request, account_id: str) -> Account:
    body = await parse_body(request, Credits)
    ledger = ledger_of(request)
    acc = await ledger.add_credits(account_id, body.amount, actor=change_actor(request))
    return await _account(ledger, acc)


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
    ledger = ledger_of(request)
    info, plaintext = await ledger.create_key(
        body.account,
        rpm=body.rpm,
        tpm=body.tpm,
        priority=body.priority,
        budget=windows(body.budget),
        actor=change_actor(request),
    )
    # The only time the key's plain text exists outside the caller's hands.
    key = await _key(ledger, info, info.id)
    return NewApiKey(**key.model_dump(), key=plaintext)


@router.get("/admin/keys/{key_id}", responses=errors(404))
async def get_key(request: Request, key_id: str) -> ApiKey:
    ledger = ledger_of(request)
    return await _key(ledger, await ledger.key_by_id(key_id), key_id)


@router.delete("/admin/keys/{key_id}", responses=errors(404))
async def revoke_key(request: Request, key_id: str) -> ApiKey:
    ledger = ledger_of(request)
    info = await ledger.revoke_key(key_id, actor=change_actor(request))
    request.app.state.key_cache.forget(key_id)
    return await _key(ledger, info, key_id)


@router.patch(
    "/admin/keys/{key_id}", openapi_extra=json_body(KeyChange), responses=errors(400, 404, 413)
)
async def update_key(request: Request, key_id: str) -> ApiKey:
    body = await parse_body(request, KeyChange)
    given = body.model_fields_set
    ledger = ledger_of(request)
    info = await ledger.update_key(
        key_id,
        priority=body.priority if "priority" in given else KEEP,
        budget=windows(body.budget) if "budget" in given else KEEP,
        actor=change_actor(request),
    )
    request.app.state.key_cache.forget(key_id)
    return await _key(ledger, info, key_id)


@router.get("/admin/audit", responses=errors(400))
async def audit_log(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_AUDIT_PAGE)] = 100,
    after: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="the last id of the previous page")
    ] = None,
    actor: str | None = None,
    action: str | None = None,
    target_type: str | None = None,
    target: Annotated[str | None, Query(description="the target's id")] = None,
    since: Annotated[float | None, Query(ge=0, le=MAX_TIME, description="at or after")] = None,
    until: Annotated[float | None, Query(ge=0, le=MAX_TIME, description="before")] = None,
) -> AuditRecordList:
    """The audit log, newest first, each filter given narrowing it."""
    query = AuditQuery(
        actor=actor, action=action, target_type=target_type, target_id=target,
        since=since, until=until, after=after, limit=limit,
    )  # fmt: skip
    page = await AuditLog(ledger_of(request)).page(query)
    data = [AuditRecord.of(e) for e in page.data]
    return AuditRecordList(
        object="list",
        data=data,
        has_more=page.has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/v1/keys/{key_id}", responses=errors(404))
async def own_key(request: Request, key_id: str) -> ApiKey:
    """A key's limits and budget windows as they stand: an API key reads its own (any
    other is a 404, as an unknown one), the admin any."""
    caller: Caller = request.state.caller
    open_gateway = request.app.state.settings.admin_key is None
    ledger = ledger_of(request)
    info = await ledger.key_by_id(key_id)
    if info is not None and not (open_gateway or caller.is_admin or caller.key_id == key_id):
        info = None
    return await _key(ledger, info, key_id)


@router.get("/v1/usage/{request_id}", responses=errors(404))
async def usage(request: Request, request_id: str) -> UsageRecord:
    caller: Caller = request.state.caller
    receipt = await ledger_of(request).receipt(request_id)
    open_gateway = request.app.state.settings.admin_key is None
    # Someone else's request is indistinguishable from an unknown one.
    if receipt is None or not (
        open_gateway or caller.is_admin or (caller.key_id and receipt.key_id == caller.key_id)
    ):
        raise ResourceNotFoundError(
            f"no settled request {request_id!r} for this key "
            "(a request is listed once it has finished)",
            code="usage_not_found",
        )
    return UsageRecord.of(receipt)
