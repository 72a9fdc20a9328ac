"""Gateway processes sharing one PostgreSQL ledger: they cannot jointly overdraw, and
one that is killed mid-stream is settled by another on the tokens it delivered."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import (
    CONFIG,
    ENV,
    PRICE,
    account,
    admin,
    chat,
    expected_charge,
    new_account,
    new_key,
    receipt,
    recorded_progress,
)
from tests.sse import events, text
from tests.waiting import HANG_S, wait_until

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


def test_a_killed_gateways_streamed_tokens_are_charged(
    start_server: Callable[..., ServerProcess], driver: EngineDriver, pg_url: str
) -> None:
    # The engine runs inside the gateway: SIGKILL takes both, as a crashed host would.
    config = scripted_deployment(driver, placement="local") + (
        f"[deployments.price]\nprompt_per_mtok = {PRICE.prompt_per_mtok}\n"
        f"completion_per_mtok = {PRICE.completion_per_mtok}\n"
    )
    doomed = start_server(config=config, env=ENV, args=["--ledger", pg_url])
    survivor = start_server(config=config, env=ENV, args=["--ledger", pg_url])
    credit = 10**6
    with admin(survivor.url) as adm:
        acc = new_account(adm, "killed", credit)
        _, key = new_key(adm, acc)
    rid = "killed-mid-stream"
    headers = {"authorization": f"Bearer {key}", "x-request-id": rid}
    request = {"model": "scripted", "prompt": "a b c d", "max_tokens": 50, "stream": True}
    recorded, sent_after = 6, 3
    received: list[str] = []
    with httpx.Client(base_url=doomed.url, timeout=HANG_S) as client:
        with client.stream("POST", "/v1/completions", json=request, headers=headers) as r:
            assert r.status_code == 200, r.read()
            stream = events(r)
            driver.emit(rid, recorded)
            received += [text(next(stream)) for _ in range(recorded)]
            # The gateway writes its progress within a second; the test waits for it.
            wait_until(
                lambda: recorded_progress(pg_url, rid) == recorded,
                f"the ledger to record {recorded} streamed tokens",
            )
            # More tokens reach the client; the gateway dies before or after it
            # records them: the bill may miss these, never count more.
            driver.emit(rid, sent_after)
            received += [text(next(stream)) for _ in range(sent_after)]
            doomed.proc.kill()
            doomed.proc.wait()
    assert received == [f" w{i}" for i in range(1, recorded + sent_after + 1)]
    # The survivor's sweeper settles the hold once the dead gateway's heartbeat is stale.
    with admin(survivor.url) as adm:
        swept = receipt(adm, rid)
        state = account(adm, acc)
    assert swept["finish_reason"] == "expired", swept
    assert recorded <= swept["completion_tokens"] <= len(received), swept
    assert swept["prompt_tokens"] == 4 and swept["charged"] == expected_charge(swept), swept
    assert state["held"] == 0 and state["balance"] == credit - swept["charged"]
