"""Shared by the HTTP ledger tests: a priced config and small admin/usage helpers."""

from __future__ import annotations

from typing import Any

import httpx
import psycopg

from tests.waiting import HANG_S, wait_until
from tokenmill.config import Price

ADMIN_KEY = "admin-secret-for-tests"
PRICE = Price(prompt_per_mtok=1_500_000, completion_per_mtok=3_000_000)
CONFIG = f"""
[[deployments]]
id = "smollm2"
max_queue = 512

[deployments.price]
prompt_per_mtok = {PRICE.prompt_per_mtok}
completion_per_mtok = {PRICE.completion_per_mtok}
"""
ENV = {"TOKENMILL_ADMIN_KEY": ADMIN_KEY}


def admin(base_url: str) -> httpx.Client:
    return httpx.Client(
        base_url=base_url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60.0
    )


def user(base_url: str, key: str) -> httpx.Client:
    """A client calling with an account's API key."""
    return httpx.Client(
        base_url=base_url, headers={"authorization": f"Bearer {key}"}, timeout=120.0
    )


def new_account(client: httpx.Client, name: str, balance: int) -> str:
    resp = client.post("/admin/accounts", json={"name": name, "balance": balance})
    assert resp.status_code == 200, resp.text
    account_id: str = resp.json()["id"]
    return account_id


def new_key(client: httpx.Client, account: str, **limits: int) -> tuple[str, str]:
    resp = client.post("/admin/keys", json={"account": account, **limits})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["id"], body["key"]


def account(client: httpx.Client, account_id: str) -> dict[str, Any]:
    resp = client.get(f"/admin/accounts/{account_id}")
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def receipt(client: httpx.Client, request_id: str, timeout: float = HANG_S) -> dict[str, Any]:
    """The usage record, waiting for it: a disconnected stream settles just after."""

    def settled() -> dict[str, Any] | None:
        resp = client.get(f"/v1/usage/{request_id}")
        assert resp.status_code in (200, 404), resp.text
        return dict(resp.json()) if resp.status_code == 200 else None

    return wait_until(settled, f"the receipt of {request_id}", timeout=timeout)


def charge_for(prompt_tokens: int, completion_tokens: int) -> int:
    """What PRICE charges, written out here rather than computed by tokenmill's cost()
    (tests/ledger/test_price.py pins that down): 1.5 micro-units a prompt token and 3 a
    completion token, the sum rounded up; the completion's part is whole, so only the
    prompt's half rounds: ceil(3 * prompt / 2)."""
    return (3 * prompt_tokens + 1) // 2 + 3 * completion_tokens


def expected_charge(r: dict[str, Any]) -> int:
    return charge_for(r["prompt_tokens"], r["completion_tokens"])


def chat(max_tokens: int, stream: bool = False, text: str = "Count to twenty.") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def recorded_progress(pg_url: str, request_id: str) -> int | None:
    """The streamed count the ledger holds for an open hold (None once it is settled)."""
    with psycopg.connect(pg_url) as conn:
        row = conn.execute(
            "SELECT streamed FROM holds WHERE request_id = %s", (request_id,)
        ).fetchone()
    return None if row is None else int(row[0])
