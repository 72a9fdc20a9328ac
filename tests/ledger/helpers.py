"""Shared by the HTTP ledger tests: a priced config and small admin/usage helpers."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tokenmill.config import Price
from tokenmill.gateway.metering import cost

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


def receipt(client: httpx.Client, request_id: str, timeout: float = 90.0) -> dict[str, Any]:
    """The usage record, waiting for it: a disconnected stream settles just after."""
    deadline = time.monotonic() + timeout
    while True:
        resp = client.get(f"/v1/usage/{request_id}")
        if resp.status_code == 200:
            data: dict[str, Any] = resp.json()
            return data
        assert resp.status_code == 404, resp.text
        if time.monotonic() > deadline:
            raise AssertionError(f"no receipt for {request_id}")
        time.sleep(0.05)


def expected_charge(r: dict[str, Any]) -> int:
    return cost(PRICE, r["prompt_tokens"], r["completion_tokens"])


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
