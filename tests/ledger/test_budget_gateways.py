"""Budgets through two real gateways sharing one PostgreSQL ledger: 64 concurrent
requests never spend more than the window allows, the ones refused get the API's own
429 (Retry-After: the window's reset) with nothing held or billed, and the next window
starts from 0, exactly. The window's remaining budget is in ``GET /v1/keys/{id}``, the
admin API and the metrics.

The gateways' ledger reads a clock the test sets (tests/clockfile.py); every request
is held open on the scripted engine until all 64 were answered, so how many fit is
decided by the budget alone, not by how fast requests end.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.clockfile import ClockFile
from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import ADMIN_KEY, ENV, PRICE, account, admin, new_account, receipt
from tests.waiting import wait_until

NOW = datetime(2026, 3, 4, 10, 0, 15, tzinfo=UTC).timestamp()
HOUR_END = datetime(2026, 3, 4, 11, tzinfo=UTC).timestamp()
PROMPT = "a b c d"  # four tokens: the scripted engine counts words
MAX_TOKENS = 10
GENERATED = 3
HOLD = math.ceil((4 * PRICE.prompt_per_mtok + MAX_TOKENS * PRICE.completion_per_mtok) / 1e6)
CHARGE = math.ceil((4 * PRICE.prompt_per_mtok + GENERATED * PRICE.completion_per_mtok) / 1e6)
FITS = 10
BUDGET = FITS * HOLD + HOLD // 2  # room for FITS holds at once, not one more
REQUESTS = 64


@dataclass
class Round:
    """One burst of requests: each answer's status and head, as it arrives."""

    answered: dict[str, tuple[int, httpx.Headers, bytes]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admitted(self) -> list[str]:
        with self.lock:
            return [rid for rid, (code, _, _) in self.answered.items() if code == 200]

    def refused(self) -> list[tuple[httpx.Headers, bytes]]:
        with self.lock:
            return [(h, body) for code, h, body in self.answered.values() if code != 200]


@pytest.fixture
def clock(tmp_path: Path) -> ClockFile:
    return ClockFile(tmp_path / "clock", NOW)


@pytest.fixture
def gateways(
    start_server: Callable[..., ServerProcess],
    driver: EngineDriver,
    pg_url: str,
    clock: ClockFile,
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    config = scripted_deployment(driver, max_num_seqs=REQUESTS) + (
        f"max_queue = {REQUESTS}\n[deployments.price]\n"
        f"prompt_per_mtok = {PRICE.prompt_per_mtok}\n"
        f"completion_per_mtok = {PRICE.completion_per_mtok}\n"
    )
    env = {**ENV, **clock.env}
    a = start_server(config=config, env=env, args=["--ledger", pg_url])
    b = start_server(config=config, env=env, args=["--ledger", pg_url])
    yield a, b


def burst(
    gateways: tuple[ServerProcess, ServerProcess], driver: EngineDriver, key: str, name: str
) -> Round:
    """REQUESTS streamed completions at once, half on each gateway; once every one has
    its answer's head, the admitted ones generate GENERATED tokens and end."""
    state = Round()
    release = threading.Event()
    clients = [
        httpx.Client(
            base_url=g.url,
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
            limits=httpx.Limits(max_connections=REQUESTS),
        )
        for g in gateways
    ]

    def one(i: int) -> None:
        rid = f"{name}-{i}"
        body = {"model": "scripted", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
        with clients[i % 2].stream(
            "POST", "/v1/completions", json=body, headers={"x-request-id": rid}
        ) as r:
            content = b"" if r.status_code == 200 else r.read()
            with state.lock:
                state.answered[rid] = (r.status_code, r.headers, content)
            if r.status_code == 200:
                release.wait()
                r.read()

    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(one, i) for i in range(REQUESTS)]
            wait_until(lambda: len(state.answered) == REQUESTS, "every request's answer head")
            for rid in state.admitted():
                driver.emit(rid, GENERATED)
                driver.finish(rid, "stop")
            release.set()
            for f in futures:
                f.result()
    finally:
        release.set()
        for c in clients:
            c.close()
    return state


def own_budget(gateway: ServerProcess, key: str, key_id: str) -> dict[str, Any]:
    r = httpx.get(f"{gateway.base_url}/keys/{key_id}", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    [window] = r.json()["budget"]
    return dict(window)


def budget_gauges(gateway: ServerProcess, labels: dict[str, str]) -> dict[str, float]:
    """The budget gauges of one window, as the gateway's /metrics shows them."""
    text = httpx.get(f"{gateway.url}/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("tokenmill_budget_") and sample.labels == labels
    }


def gateways_beat_since(pg_url: str, since: float) -> bool:
    with psycopg.connect(pg_url) as conn:
        beats = [float(r[0]) for r in conn.execute("SELECT heartbeat FROM gateways")]
    return len(beats) == 2 and min(beats) >= since


def test_64_requests_from_two_gateways_never_exceed_the_window_and_reset_exactly(
    gateways: tuple[ServerProcess, ServerProcess],
    driver: EngineDriver,
    clock: ClockFile,
    pg_url: str,
) -> None:
    a, b = gateways
    credit = 10**6
    with admin(a.url) as adm:
        acc = new_account(adm, "budgeted", credit)
        created = adm.post(
            "/admin/keys",
            json={"account": acc, "rpm": 1000, "budget": [{"amount": BUDGET, "duration": "1h"}]},
        )
        assert created.status_code == 200, created.text
        key_id, key = created.json()["id"], created.json()["key"]
        assert created.json()["budget"] == [
            {
                "amount": BUDGET, "duration": "1h", "timezone": "UTC", "spent": 0,
                "remaining": BUDGET, "window_start": HOUR_END - 3600, "resets_at": HOUR_END,
            }
        ]  # fmt: skip

    first = burst(gateways, driver, key, "one")
    assert len(first.admitted()) == FITS
    for headers, body in first.refused():
        error = httpx.Response(429, content=body).json()["error"]
        assert error["code"] == "budget_exceeded" and error["type"] == "rate_limit_error"
        assert headers["retry-after"] == str(math.ceil(HOUR_END - NOW))
        assert headers["x-ratelimit-limit-requests"] == "1000"
    assert len(first.refused()) == REQUESTS - FITS

    with admin(b.url) as adm:
        for rid in first.admitted():
            assert receipt(adm, rid)["charged"] == CHARGE
        for headers, _ in first.refused():
            refused_id = headers["x-request-id"]
            assert adm.get(f"/v1/usage/{refused_id}").status_code == 404  # never held
        state = account(adm, acc)
        assert (state["held"], state["balance"]) == (0, credit - FITS * CHARGE)
        by_admin = adm.get(f"/admin/keys/{key_id}").json()["budget"][0]
    window = own_budget(a, key, key_id)
    assert window == by_admin
    assert (window["spent"], window["remaining"]) == (FITS * CHARGE, BUDGET - FITS * CHARGE)
    labels = {"owner_type": "key", "owner": key_id, "duration": "1h"}
    assert budget_gauges(b, labels) == {
        "tokenmill_budget_remaining_micro_units": BUDGET - FITS * CHARGE,
        "tokenmill_budget_spent_micro_units": FITS * CHARGE,
    }

    # The next hour: nothing spent, and again exactly FITS of 64 fit.
    clock.set(HOUR_END + 1)
    wait_until(
        lambda: gateways_beat_since(pg_url, HOUR_END + 1),
        "both gateways to beat at the new time (none mistaken for dead)",
    )
    window = own_budget(b, key, key_id)
    assert (window["spent"], window["remaining"]) == (0, BUDGET)
    assert (window["window_start"], window["resets_at"]) == (HOUR_END, HOUR_END + 3600)
    second = burst(gateways, driver, key, "two")
    assert len(second.admitted()) == FITS
    with admin(a.url) as adm:
        for rid in second.admitted():
            assert receipt(adm, rid)["charged"] == CHARGE
    window = own_budget(a, key, key_id)
    assert window["spent"] == FITS * CHARGE


def test_budgets_over_the_admin_api_are_audited_and_private(
    gateways: tuple[ServerProcess, ServerProcess],
) -> None:
    a, _ = gateways
    with admin(a.url) as adm:
        acc = new_account(adm, "owner", 10**6)
        mine = adm.post("/admin/keys", json={"account": acc}).json()
        other = adm.post("/admin/keys", json={"account": acc}).json()
        week = {"amount": 5000, "duration": "7d", "timezone": "Europe/Paris"}
        changed = adm.patch(f"/admin/keys/{mine['id']}", json={"budget": [week]})
        assert changed.status_code == 200, changed.text
        assert changed.json()["priority"] == "default"  # a field not given stays
        [status] = changed.json()["budget"]
        assert status["remaining"] == 5000 and status["timezone"] == "Europe/Paris"
        bad = adm.patch(
            f"/admin/keys/{mine['id']}", json={"budget": [{"amount": 1, "duration": "2w"}]}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "budget.0"
        acc_change = adm.patch(
            f"/admin/accounts/{acc}", json={"budget": [{"amount": 9, "duration": "1mo"}]}
        )
        assert acc_change.json()["budget"][0]["amount"] == 9
        [entry] = adm.get(
            "/admin/audit", params={"target": mine["id"], "action": "key.updated"}
        ).json()["data"]
        assert entry["before"]["budget"] == [] and entry["after"]["budget"] == [week]
    with httpx.Client(
        base_url=a.base_url, headers={"authorization": f"Bearer {mine['key']}"}
    ) as user:
        assert user.get(f"/keys/{mine['id']}").json()["budget"][0]["amount"] == 5000
        assert user.get(f"/keys/{other['id']}").status_code == 404  # another key's
    by_admin = httpx.get(
        f"{a.base_url}/keys/{other['id']}", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert by_admin.status_code == 200

    # The same from the shell.
    def cli(*args: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "tokenmill", *args, "--url", a.url],
            capture_output=True,
            text=True,
            env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY, "PATH": "/usr/bin:/bin"},
            check=True,
        )
        data: dict[str, Any] = json.loads(out.stdout)
        return data

    cli("keys", "set", other["id"], "--budget", "100/1d@Asia/Tokyo", "--budget", "900/1mo")
    shown = cli("keys", "show", other["id"])
    assert [(w["amount"], w["duration"], w["timezone"]) for w in shown["budget"]] == [
        (100, "1d", "Asia/Tokyo"),
        (900, "1mo", "UTC"),
    ]
    assert cli("keys", "set", other["id"], "--no-budget")["budget"] == []
