"""Fair share and priority classes end to end: real gateways, real ledger, real HTTP.

Each gateway serves a scripted deployment (:mod:`tokenmill.engines.scripted`): a
request holds its slot until the test finishes it, so who is admitted next is read
from the order of the engine's "started" events, never from timing. The policy itself
is tested in ``test_fairqueue``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.waiting import HANG_S, wait_until

ADMIN_KEY = "admin-key-for-the-fairness-tests"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
DEP = "scripted"


def gateway(
    start: Callable[..., ServerProcess], driver: EngineDriver, **keys: object
) -> ServerProcess:
    config = scripted_deployment(driver, id=DEP, queue_timeout_s=HANG_S, **keys)
    return start(config=config, env={"TOKENMILL_ADMIN_KEY": ADMIN_KEY})


def tenant(c: httpx.Client, name: str, priority: str = "default", **account: Any) -> str:
    """A new account with one key of class ``priority``: the key."""
    r = c.post("/admin/accounts", json={"name": name, **account}, headers=ADMIN)
    assert r.status_code == 200, r.text
    r = c.post("/admin/keys", json={"account": r.json()["id"], "priority": priority}, headers=ADMIN)
    assert r.status_code == 200, r.text
    key: str = r.json()["key"]
    return key


def send(c: httpx.Client, key: str, rid: str, **extra: Any) -> httpx.Response:
    body = {"model": DEP, "prompt": "Hello there", "max_tokens": 4, **extra}
    return c.post(
        "/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", "x-request-id": rid},
    )


def view(c: httpx.Client) -> dict[str, Any]:
    r = c.get(f"/v1/deployments/{DEP}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return dict(r.json())


def queued(c: httpx.Client, n: int) -> dict[str, Any]:
    return wait_until(lambda: (v := view(c))["queued"] == n and v, f"{n} request(s) queued")


def finish(driver: EngineDriver, *rids: str) -> None:
    for rid in rids:
        driver.finish(rid)


def srv_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


@pytest.mark.parametrize(("admission", "light_first"), [("fair", True), ("fifo", False)])
def test_a_light_tenant_is_admitted_ahead_of_a_floods_queue(
    start_server: Callable[..., ServerProcess],
    driver: EngineDriver,
    admission: str,
    light_first: bool,
) -> None:
    srv = gateway(start_server, driver, max_num_seqs=2, max_queue=16, admission=admission)
    flood_ids = [f"flood-{i}" for i in range(6)]
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c, ThreadPoolExecutor(8) as pool:
        flood, light = tenant(c, "flood"), tenant(c, "light")
        answers: list[Future[httpx.Response]] = []
        for i, rid in enumerate(flood_ids):  # two run, four queue, in this order
            answers.append(pool.submit(send, c, flood, rid))
            if i < 2:
                driver.started(rid)
            else:
                shown = queued(c, i - 1)
        driver.emit(flood_ids[0], 2)
        assert shown["admission"] == admission
        if admission == "fair":
            (row,) = shown["accounts"]
            assert (row["running"], row["queued"], row["share"]) == (2, {"default": 4}, 1.0)
        answers.append(pool.submit(send, c, light, "light"))
        shown = queued(c, 5)
        if admission == "fair":
            rows = {r["queued"].get("default"): r for r in shown["accounts"]}
            assert (rows[4]["share"], rows[1]["share"], rows[1]["running"]) == (0.5, 0.5, 0)
        finish(driver, flood_ids[0])  # one slot frees
        if light_first:
            driver.started("light")
            assert driver.seen("started", flood_ids[2]) == 0
            finish(driver, "light")
            driver.started(flood_ids[2])
        else:
            driver.started(flood_ids[2])
            assert driver.seen("started", "light") == 0
        for rid in flood_ids[1:]:
            finish(driver, rid)
        if not light_first:
            finish(driver, "light")
        assert all(a.result(timeout=HANG_S).status_code == 200 for a in answers)
    line = wait_until(lambda: srv.request_line("light"), "the light request's log line")
    assert line["priority"] == "default" and line["queue_ms"] > 0


def test_classes_caps_and_what_is_refused(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    srv = gateway(start_server, driver, max_num_seqs=1, max_queue=16)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c, ThreadPoolExecutor(8) as pool:
        holder = tenant(c, "holder")
        plain = tenant(c, "plain")
        batchy = tenant(c, "batchy", priority="batch")
        vip = tenant(c, "vip", priority="interactive")
        capped = tenant(c, "capped", max_concurrent=1)

        # Unknown classes: 400s naming the field, before anything queues.
        error = error_of(send(c, plain, "bad-1", priority="urgent"), 400)
        assert (error["param"], error["code"]) == ("priority", "invalid_priority")
        error = error_of(send(c, plain, "bad-2", service_tier="gold"), 400)
        assert (error["param"], error["code"]) == ("service_tier", "invalid_service_tier")
        assert error_of(send(c, plain, "bad-3", priority=True), 400)["param"] == "priority"

        held = pool.submit(send, c, holder, "held")
        driver.started("held")
        answers = [
            pool.submit(send, c, plain, "plain"),  # default
            pool.submit(send, c, batchy, "batchy", priority="interactive"),  # capped: batch
            pool.submit(send, c, vip, "vip", priority=-1),  # vLLM's integer: interactive
        ]
        queued(c, 3)
        finish(driver, "held")
        driver.started("vip")  # interactive first...
        finish(driver, "vip")
        driver.started("plain")  # ...then default...
        finish(driver, "plain")
        driver.started("batchy")  # ...then batch
        assert driver.index("started", "vip") < driver.index("started", "plain")
        assert driver.index("started", "plain") < driver.index("started", "batchy")

        # max_concurrent 1 allows two open (one running, one waiting); the slot is
        # busy, so both wait, and a third is refused.
        answers.append(pool.submit(send, c, capped, "capped-1"))
        queued(c, 1)
        answers.append(pool.submit(send, c, capped, "capped-2"))
        queued(c, 2)
        r = send(c, capped, "capped-3")
        error = error_of(r, 429)
        assert error["code"] == "account_concurrency_exceeded"
        assert int(r.headers["retry-after"]) >= 1
        finish(driver, "batchy")
        for rid in ("capped-1", "capped-2"):
            finish(driver, rid)
        assert held.result(timeout=HANG_S).status_code == 200
        assert all(a.result(timeout=HANG_S).status_code == 200 for a in answers)
        metrics = c.get("/metrics").text
    assert srv.request_line("batchy") is not None
    classes = {rid: (srv.request_line(rid) or {}).get("priority") for rid in ("vip", "batchy")}
    assert classes == {"vip": "interactive", "batchy": "batch"}
    assert (
        'tokenmill_queue_time_by_priority_seconds_count{deployment="scripted",priority="batch"}'
        in metrics
    )
    assert 'tokenmill_served_tokens_total{deployment="scripted",priority="interactive"}' in metrics
    assert "tokenmill_account_served_tokens" not in metrics  # opt-in only


def test_weights_classes_and_caps_are_set_through_the_admin_api_and_the_cli(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    srv = gateway(start_server, driver)

    def cli(*args: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "tokenmill", *args, "--url", srv.url],
            capture_output=True,
            text=True,
            # The environment the gateway got (its source path), with the admin key.
            env={**srv_env(), "TOKENMILL_ADMIN_KEY": ADMIN_KEY},
            check=True,
            timeout=HANG_S,
        )
        data: dict[str, Any] = json.loads(out.stdout)
        return data

    acc = cli("accounts", "create", "cli-tenant", "--weight", "2", "--max-concurrent", "3")
    assert (acc["weight"], acc["max_concurrent"]) == (2.0, 3)
    acc = cli("accounts", "set", acc["id"], "--no-max-concurrent")
    assert (acc["weight"], acc["max_concurrent"]) == (2.0, None)
    key = cli("keys", "create", acc["id"], "--priority", "batch")
    assert key["priority"] == "batch"
    assert cli("keys", "set", key["id"], "--priority", "interactive")["priority"] == "interactive"

    with httpx.Client(base_url=srv.url, timeout=HANG_S, headers=ADMIN) as c:
        r = c.patch(f"/admin/accounts/{acc['id']}", json={"weight": 0.5, "max_concurrent": 2})
        assert (r.json()["weight"], r.json()["max_concurrent"]) == (0.5, 2)
        got = c.get(f"/admin/accounts/{acc['id']}").json()
        assert (got["weight"], got["max_concurrent"]) == (0.5, 2)
        for body, field in [
            ({"weight": 0}, "weight"),
            ({"weight": "2"}, "weight"),
            ({"max_concurrent": 0}, "max_concurrent"),
            ({"colour": "red"}, "colour"),
        ]:
            assert (
                error_of(c.patch(f"/admin/accounts/{acc['id']}", json=body), 400)["param"] == field
            )
        r = c.patch(f"/admin/keys/{key['id']}", json={"priority": "urgent"})
        assert error_of(r, 400)["param"] == "priority"
        r = c.post("/admin/keys", json={"account": acc["id"], "priority": 2})
        assert error_of(r, 400)["param"] == "priority"
        assert error_of(c.patch("/admin/keys/key_missing", json={"priority": "batch"}), 404)
        assert error_of(c.patch("/admin/accounts/acct_missing", json={"weight": 2}), 404)
