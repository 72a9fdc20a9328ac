"""How a batch's lines run, on a deployment whose engine the test drives: interactive
requests keep a slot of their own, cancel and expiry end the lines not started (never
run nor billed), and a gateway killed mid-batch leaves its line to another gateway on
the same PostgreSQL ledger, every line in the output once."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any, Literal

import httpx
import openai

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import ENV, PRICE, account, admin, new_account, new_key
from tests.waiting import HANG_S, wait_until

TEXT: Literal["/v1/completions"] = "/v1/completions"


def priced(config: str) -> str:
    return config + (
        f"[deployments.price]\nprompt_per_mtok = {PRICE.prompt_per_mtok}\n"
        f"completion_per_mtok = {PRICE.completion_per_mtok}\n"
    )


def lines(n: int) -> bytes:
    body = {"model": "scripted", "prompt": "a b c d", "max_tokens": 20}
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": TEXT, "body": body} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def tenant(srv: ServerProcess) -> tuple[str, str, openai.OpenAI]:
    with admin(srv.url) as adm:
        acct = new_account(adm, "batcher", 10**6)
        _, key = new_key(adm, acct)
    return acct, key, client_of(srv, key)


def client_of(srv: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)


def create(client: openai.OpenAI, n: int, window: str = "24h") -> Any:
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(n))), purpose="batch")
    return client.batches.create(
        input_file_id=f.id,
        endpoint=TEXT,
        completion_window=window,  # type: ignore[arg-type]
    )


def status(client: openai.OpenAI, batch_id: str, *wanted: str) -> Any:
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in wanted and b,
        f"batch {batch_id} to be {' or '.join(wanted)}",
    )


def outputs(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def usage(srv: ServerProcess, acct: str) -> list[dict[str, Any]]:
    with admin(srv.url) as adm:
        data: list[dict[str, Any]] = adm.get(f"/admin/accounts/{acct}/usage").json()["data"]
    return data


def test_an_interactive_request_finds_a_slot_while_a_batch_runs(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    # Two slots: the batch may take one, the other stays for interactive requests.
    srv = start_server(config=scripted_deployment(driver, max_num_seqs=2), env=ENV)
    _, key, client = tenant(srv)
    batch = create(client, 3)
    first = driver.wait("started")["id"]
    rid = "interactive-1"
    headers = {"authorization": f"Bearer {key}", "x-request-id": rid}
    request = {"model": "scripted", "prompt": "hello", "max_tokens": 5, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as http:
        with http.stream("POST", TEXT, json=request, headers=headers) as r:
            assert r.status_code == 200
            driver.started(rid)  # admitted at once, beside the running line
            assert driver.seen("started") == 2  # and no second line took its slot
            driver.finish(rid)
            r.read()
    for n in range(1, 4):
        rid_n = first if n == 1 else driver.wait("started", count=n + 1)["id"]
        driver.emit(rid_n, 2)
        driver.finish(rid_n)
    done = status(client, batch.id, "completed")
    assert done.request_counts.completed == 3
    prios = [
        srv.request_line(o["response"]["request_id"]) for o in outputs(client, done.output_file_id)
    ]
    assert [p and p["priority"] for p in prios] == ["batch"] * 3
    assert (srv.request_line(rid) or {}).get("priority") == "default"


def test_cancel_runs_and_bills_no_line_not_yet_started(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    srv = start_server(config=priced(scripted_deployment(driver, max_num_seqs=1)), env=ENV)
    acct, _, client = tenant(srv)
    batch = create(client, 3)
    rid = driver.wait("started")["id"]
    driver.emit(rid, 3)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    driver.finish(rid)  # the running line finishes and is kept
    done = status(client, batch.id, "cancelled")
    assert driver.seen("started") == 1
    (out,) = outputs(client, done.output_file_id)
    assert out["custom_id"] == "c0" and out["response"]["request_id"] == rid
    errs = outputs(client, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errs] == [
        ("c1", "batch_cancelled"),
        ("c2", "batch_cancelled"),
    ]
    receipts = usage(srv, acct)
    assert [r["request_id"] for r in receipts] == [rid]
    with admin(srv.url) as adm:
        assert account(adm, acct)["held"] == 0
    assert client.batches.cancel(batch.id).status == "cancelled"  # ended: as it is


def test_an_expired_batch_keeps_what_completed_and_bills_nothing_more(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    srv = start_server(config=priced(scripted_deployment(driver, max_num_seqs=1)), env=ENV)
    acct, _, client = tenant(srv)
    batch = create(client, 3, window="5s")
    rid = driver.wait("started")["id"]
    # The window closes while the first line runs: the others will never start.
    wait_until(
        lambda: client.batches.retrieve(batch.id).expired_at is not None,
        "the batch's window to close",
    )
    driver.emit(rid, 2)
    driver.finish(rid)
    done = status(client, batch.id, "expired")
    assert driver.seen("started") == 1
    assert [o["custom_id"] for o in outputs(client, done.output_file_id)] == ["c0"]
    errs = outputs(client, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errs] == [
        ("c1", "batch_expired"),
        ("c2", "batch_expired"),
    ]
    assert [r["request_id"] for r in usage(srv, acct)] == [rid]


def test_a_killed_gateways_line_is_finished_by_another_once(
    start_server: Callable[..., ServerProcess], driver: EngineDriver, pg_url: str
) -> None:
    # One slot each; the engine runs inside its gateway: SIGKILL takes both.
    config = priced(scripted_deployment(driver, placement="local", max_num_seqs=1))
    doomed = start_server(config=config, env=ENV, args=["--ledger", pg_url])
    acct, key, client = tenant(doomed)
    batch = create(client, 3)
    lost = driver.wait("started")["id"]
    driver.emit(lost, 2)
    survivor = start_server(config=config, env=ENV, args=["--ledger", pg_url])
    ran = []
    for n in (2, 3):  # the survivor takes the other lines as its slot frees
        rid = driver.wait("started", count=n)["id"]
        driver.emit(rid, 1)
        driver.finish(rid)
        ran.append(rid)
    doomed.proc.kill()
    doomed.proc.wait()
    # Once the dead gateway's heartbeat is stale, its line runs again on the survivor.
    again = driver.wait("started", count=4)["id"]
    driver.finish(again)
    other = client_of(survivor, key)
    done = status(other, batch.id, "completed")
    out = outputs(other, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == ["c0", "c1", "c2"]
    assert {o["response"]["request_id"] for o in out} == {*ran, again}
    receipts = {r["request_id"]: r for r in usage(survivor, acct)}
    # The cut run is settled by the sweeper on what it streamed; nothing else is billed.
    wait_until(lambda: lost in {r["request_id"] for r in usage(survivor, acct)}, "the sweep")
    receipts = {r["request_id"]: r for r in usage(survivor, acct)}
    assert set(receipts) == {lost, *ran, again}
    assert receipts[lost]["finish_reason"] == "expired"
    with admin(survivor.url) as adm:
        state = account(adm, acct)
    assert state["held"] == 0
    assert state["balance"] == 10**6 - sum(r["charged"] for r in receipts.values())
