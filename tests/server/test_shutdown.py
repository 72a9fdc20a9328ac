"""SIGTERM under load: refuse new work, drain open streams, settle, exit 0.

A scripted deployment holds each stream open until the test finishes it, so what
happens after the signal is ordered by the test: the gateway says ``draining``, a
new request gets 503, an open stream finished by the driver reaches its end, a
stream nobody finishes is aborted at the drain deadline, and the books (read from
the SQLite ledger once the process is gone) hold nothing and bill what was produced.
"""

from __future__ import annotations

import signal
import sqlite3
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.sse import DONE, Event, events, text
from tests.waiting import HANG_S, wait_until
from tokenmill.config import Price

ADMIN_KEY = "admin-key-for-the-shutdown-tests"
PRICE = Price(prompt_per_mtok=1_000_000, completion_per_mtok=2_000_000)
BALANCE = 10**9
PROMPT = "tell me a story"  # 3 words: 3 prompt tokens, plus the role ("user:")


def start(
    start_server: Callable[..., ServerProcess], driver: EngineDriver, drain_s: float
) -> tuple[ServerProcess, str, str]:
    """A priced scripted gateway, one funded account and its key."""
    config = scripted_deployment(driver, max_num_seqs=4, max_queue=0)
    config += f"[deployments.price]\nprompt_per_mtok = {PRICE.prompt_per_mtok}\n"
    config += f"completion_per_mtok = {PRICE.completion_per_mtok}\n"
    env = {"TOKENMILL_ADMIN_KEY": ADMIN_KEY, "TOKENMILL_DRAIN_S": str(drain_s)}
    srv = start_server(config=config, env=env)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=srv.url, headers=admin, timeout=60) as client:
        account = client.post("/admin/accounts", json={"name": "a", "balance": BALANCE}).json()
        key = client.post("/admin/keys", json={"account": account["id"]}).json()["key"]
    return srv, account["id"], key


def open_stream(stack: ExitStack, client: httpx.Client, key: str) -> tuple[str, Any]:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {key}"}
    resp = stack.enter_context(
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers)
    )
    assert resp.status_code == 200
    return resp.headers["x-request-id"], events(resp)


def take(stream: Any, n: int) -> list[Event]:
    return [next(stream) for _ in range(n)]


def books(data_dir: Path) -> tuple[dict[str, tuple[int, int]], dict[str, dict[str, Any]], int]:
    """From the ledger file: per account (balance, held); receipts; open holds."""
    with sqlite3.connect(data_dir / "ledger.sqlite3") as db:
        db.row_factory = sqlite3.Row
        accounts = {
            r["id"]: (r["balance"], r["held"]) for r in db.execute("SELECT * FROM accounts")
        }
        receipts = {r["request_id"]: dict(r) for r in db.execute("SELECT * FROM receipts")}
        holds = db.execute("SELECT count(*) FROM holds").fetchone()[0]
    return accounts, receipts, holds


def health(srv: ServerProcess) -> tuple[int, str]:
    resp = httpx.get(f"{srv.url}/health", timeout=HANG_S)
    return resp.status_code, resp.json()["status"]


def test_sigterm_refuses_new_requests_and_lets_open_streams_finish(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    srv, account, key = start(start_server, driver, drain_s=HANG_S)
    with ExitStack() as stack, httpx.Client(base_url=srv.url, timeout=HANG_S) as client:
        first, a = open_stream(stack, client, key)
        second, b = open_stream(stack, client, key)
        driver.emit(first, 2)
        driver.emit(second, 1)
        assert [text(e) for e in take(a, 3)] == ["", " w1", " w2"]
        assert [text(e) for e in take(b, 2)] == ["", " w1"]

        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: health(srv) == (503, "draining"), "/health to say draining")
        # New work is refused while the open streams run on.
        resp = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"authorization": f"Bearer {key}"},
        )
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "shutting_down"
        assert resp.headers["retry-after"] == "1"
        assert srv.proc.poll() is None

        # Both streams finish after the signal, as they would have without it.
        driver.emit(first, 1)
        driver.finish(first)
        rest_a = list(a)
        assert [text(e) for e in rest_a] == [" w3", "", "", ""] and rest_a[-1] == DONE
        assert isinstance(rest_a[1], dict) and rest_a[1]["choices"][0]["finish_reason"] == "stop"
        assert srv.proc.poll() is None  # one stream is still open: still draining
        driver.finish(second, "length")
        rest_b = list(b)
        assert rest_b[-1] == DONE
        usage = [e for e in rest_b if isinstance(e, dict) and e.get("usage")]
        assert usage[0]["usage"]["completion_tokens"] == 1

    assert srv.proc.wait(HANG_S) == 0
    assert driver.seen("aborted") == 0
    accounts, receipts, holds = books(srv.data_dir)
    assert holds == 0 and accounts[account][1] == 0
    assert {receipts[first]["completion_tokens"], receipts[second]["completion_tokens"]} == {3, 1}
    charged = sum(r["charged"] for r in receipts.values())
    # 1 a prompt token, 2 a completion token (PRICE): whole micro-units, no rounding.
    assert charged == sum(
        r["prompt_tokens"] + 2 * r["completion_tokens"] for r in receipts.values()
    )
    assert accounts[account][0] == BALANCE - charged
    assert "aborting" not in srv.log()


def test_streams_still_open_at_the_drain_deadline_are_aborted_and_settled(
    start_server: Callable[..., ServerProcess], driver: EngineDriver
) -> None:
    # Nobody finishes the stream, so only the deadline can end it: its length does not
    # matter, only that it is short enough for the test to wait for.
    srv, account, key = start(start_server, driver, drain_s=0.5)
    with ExitStack() as stack, httpx.Client(base_url=srv.url, timeout=HANG_S) as client:
        rid, stream = open_stream(stack, client, key)
        driver.emit(rid, 2)
        take(stream, 3)
        srv.proc.send_signal(signal.SIGTERM)
        # The client is told, in-band, that its stream was cut, and the stream ends.
        rest = list(stream)
        assert rest[-1] == DONE, rest
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert errors and errors[0]["error"]["code"] == "shutting_down", rest

    assert driver.wait("aborted", rid)["tokens"] == 2
    assert srv.proc.wait(HANG_S) == 0
    accounts, receipts, holds = books(srv.data_dir)
    assert holds == 0 and accounts[account][1] == 0
    got = receipts[rid]
    assert got["completion_tokens"] == 2 and got["finish_reason"] == "abort", got
    assert got["charged"] == got["prompt_tokens"] + 2 * 2  # 1 a prompt token, 2 a completion token
    assert accounts[account][0] == BALANCE - got["charged"]
    assert f"aborting {rid} at shutdown" in srv.log()
