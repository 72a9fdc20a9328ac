"""401 and 402 as the client sees them from a gateway with API keys and prices."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.conftest import ServerProcess
from tokenmill import AsyncClient, AuthenticationError, Client, InsufficientCreditError

ADMIN_KEY = "admin-key-for-client-tests"
PRICED = """
[[deployments]]
id = "smollm2"

[deployments.price]
prompt_per_mtok = 1000000
completion_per_mtok = 1000000
"""


def _key(srv: ServerProcess, balance: int) -> str:
    """A new account with ``balance`` credits, and an API key for it."""
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as admin:
        resp = admin.post("/admin/accounts", json={"name": f"acct-{balance}", "balance": balance})
        assert resp.status_code == 200, resp.text
        resp = admin.post("/admin/keys", json={"account": resp.json()["id"]})
        assert resp.status_code == 200, resp.text
        key: str = resp.json()["key"]
        return key


async def test_keys_and_credit(
    start_server: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = start_server(config=PRICED, env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY})
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)

    with Client(srv.url, max_retries=2) as client, pytest.raises(AuthenticationError) as ei:
        client.chat("Hi", max_tokens=2)  # no key at all
    assert ei.value.status == 401 and ei.value.request_id

    async with AsyncClient(srv.url, api_key="tm-not-a-real-key", max_retries=2) as aclient:
        with pytest.raises(AuthenticationError):
            await aclient.complete("Hi", stream=True, max_tokens=2)

    broke = _key(srv, balance=0)
    with Client(srv.url, api_key=broke, max_retries=2) as client:
        with pytest.raises(InsufficientCreditError) as credit:
            client.chat("Hi", max_tokens=2)
        assert credit.value.status == 402 and credit.value.message

    monkeypatch.setenv("TOKENMILL_API_KEY", _key(srv, balance=10**9))
    with Client(srv.url) as client:  # the key from the environment
        assert client.chat("Hi", max_tokens=2).usage is not None
