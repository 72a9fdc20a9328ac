"""Two gateway processes sharing one PostgreSQL ledger cannot jointly overdraw."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import ServerProcess
from tests.ledger.helpers import (
    CONFIG,
    ENV,
    account,
    admin,
    chat,
    expected_charge,
    new_account,
    new_key,
)

MAX_TOKENS = 32


def test_two_gateways_cannot_overdraw(
    start_server: Callable[..., ServerProcess], pg_url: str
) -> None:
    a = start_server(config=CONFIG, env=ENV, args=["--ledger", pg_url])
    b = start_server(config=CONFIG, env=ENV, args=["--ledger", pg_url])
    with admin(a.url) as adm:
        # Enough credit for about three concurrent holds of MAX_TOKENS.
        probe = new_account(adm, "probe", 10**6)
        _, probe_key = new_key(adm, probe)
        headers = {"authorization": f"Bearer {probe_key}"}
        r = httpx.post(f"{a.url}/v1/chat/completions", json=chat(1), headers=headers, timeout=60)
        assert r.status_code == 200
        prompt = r.json()["usage"]["prompt_tokens"]
        hold = -(-(prompt * 1_500_000 + MAX_TOKENS * 3_000_000) // 1_000_000)
        credit = 3 * hold + hold // 2
        acc = new_account(adm, "shared", credit)
        _, key = new_key(adm, acc)
    headers = {"authorization": f"Bearer {key}"}

    def one(i: int) -> tuple[int, str]:
        url = (a, b)[i % 2].url
        resp = httpx.post(
            f"{url}/v1/chat/completions", json=chat(MAX_TOKENS), headers=headers, timeout=240
        )
        return resp.status_code, resp.headers["x-request-id"]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 402}, codes
    assert codes.count(402) > 0 and codes.count(200) >= 3
    with admin(b.url) as adm:
        state = account(adm, acc)
        receipts = adm.get(f"/admin/accounts/{acc}/usage").json()["data"]
    assert state["held"] == 0 and state["balance"] >= 0
    assert len(receipts) == codes.count(200)
    assert sum(r["charged"] for r in receipts) == credit - state["balance"]
    for r in receipts:
        assert r["charged"] == expected_charge(r)
    assert {r["request_id"] for r in receipts} == {rid for c, rid in results if c == 200}
