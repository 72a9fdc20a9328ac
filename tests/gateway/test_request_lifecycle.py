"""Admission, queueing, cancellation, failures and replica crashes, ordered by events.

Each gateway here serves a scripted deployment (:mod:`tokenmill.engines.scripted`)
in replica processes: a request produces tokens only when the test says so, so a
slot stays busy exactly as long as the test needs, and every assertion is about the
order of events (request started, tokens emitted, stream ended), never about how
fast the machine is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import receipt
from tests.sse import DONE, Event, events, text
from tests.waiting import HANG_S, wait_until
from tokenmill.config import Price

PRICE = Price(prompt_per_mtok=2_000_000, completion_per_mtok=5_000_000)
PRICED = f"""
[deployments.price]
prompt_per_mtok = {PRICE.prompt_per_mtok}
completion_per_mtok = {PRICE.completion_per_mtok}
"""
PROMPT = "Tell a long story."  # 4 words: 4 prompt tokens for the scripted engine


def body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": "scripted", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


def named(rid: str) -> dict[str, str]:
    """Headers giving the request its id: the id the engine (and the driver) sees."""
    return {"x-request-id": rid}


def deployment(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/v1/deployments/scripted")
    assert r.status_code == 200, r.text
    return dict(r.json())


def texts(stream: Iterator[Event], n: int) -> list[str]:
    """The next ``n`` texts of a stream (skipping events without text)."""
    out: list[str] = []
    while len(out) < n:
        event = next(stream)
        assert isinstance(event, dict) and "error" not in event, event
        if text(event):
            out.append(text(event))
    return out


def test_full_queue_answers_429_with_retry_after(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=scripted_deployment(driver, max_num_seqs=1, max_queue=1))
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(400), headers=named("running")) as r:
            running = events(r)
            driver.emit("running", 1)
            assert texts(running, 1) == [" w1"]
            with ThreadPoolExecutor(1) as pool:
                queued = pool.submit(
                    httpx.post,
                    srv.url + "/v1/completions",
                    json=body(2, stream=False),
                    headers=named("queued"),
                    timeout=HANG_S,
                )
                wait_until(lambda: deployment(c)["queued"] == 1, "the second request to queue")
                refused = c.post("/v1/completions", json=body(2), headers=named("refused"))
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["retry-after"]) >= 1
                error = refused.json()["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
                # The queued request gets the slot when the running one ends, not before.
                driver.finish("running")
                assert list(running)[-1] == DONE
                driver.emit("queued", 2)
                answer = queued.result(timeout=HANG_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == " w1 w2"
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert answer.json()["usage"]["completion_tokens"] == 2
    assert driver.index("ended", "running") < driver.index("started", "queued")
    assert driver.seen("started", "refused") == 0


def test_a_burst_past_slots_and_queue_refuses_exactly_the_excess(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    # Two slots and a queue of one, all held until the test lets go: of six requests
    # sent at once, whatever order they arrive in, three get in and three are refused.
    slots, queue, burst = 2, 1, 6
    config = scripted_deployment(
        driver, max_num_seqs=slots, max_queue=queue, queue_timeout_s=HANG_S
    )
    srv = start_server(config=config)
    ids = [f"burst-{i}" for i in range(burst)]

    def send(rid: str) -> httpx.Response:
        return httpx.post(
            srv.url + "/v1/completions",
            json=body(2, stream=False),
            headers=named(rid),
            timeout=HANG_S,
        )

    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c, ThreadPoolExecutor(burst) as pool:
        sent = {rid: pool.submit(send, rid) for rid in ids}
        refused_count = burst - slots - queue
        # Nothing admitted can answer before the test emits a token: whatever answered
        # by now was refused at the door.
        wait_until(
            lambda: sum(f.done() for f in sent.values()) == refused_count,
            f"{refused_count} requests to be refused",
        )
        refused = {rid: f.result() for rid, f in sent.items() if f.done()}
        running = [driver.wait("started", count=i + 1)["id"] for i in range(slots)]
        assert deployment(c)["queued"] == queue
        for rid in running:
            driver.emit(rid, 2)
        waiting = driver.wait("started", count=slots + 1)["id"]
        driver.emit(waiting, 2)
        served = {rid: sent[rid].result(timeout=HANG_S) for rid in [*running, waiting]}
    assert sorted([*refused, *served]) == ids
    for r in refused.values():
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
    for r in served.values():
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    # The refused never reached the engine; the queued one started after a slot freed.
    assert all(driver.seen("started", rid) == 0 for rid in refused)
    first_end = min(driver.index("ended", rid) for rid in running)
    assert first_end < driver.index("started", waiting)


def test_queue_timeout_answers_429_queue_timeout(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    # The slot stays taken until the test releases it, after the queued request's
    # answer: its timeout fires however slow the machine is.
    config = scripted_deployment(driver, max_num_seqs=1, max_queue=4, queue_timeout_s=0.5)
    srv = start_server(config=config)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(8), headers=named("holder")) as r:
            holder = events(r)
            driver.started("holder")
            waited = c.post("/v1/completions", json=body(2), headers=named("waiter"))
            assert waited.status_code == 429, waited.text
            assert int(waited.headers["retry-after"]) >= 1
            error = waited.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_timeout"
            assert "waited 0.5s in the queue" in error["message"]
            assert deployment(c)["queued"] == 0  # it left the queue
            driver.finish("holder")
            assert list(holder)[-1] == DONE
        # It never reached the engine, so nothing was billed for it.
        assert driver.seen("started", "waiter") == 0
        assert c.get("/v1/usage/waiter").status_code == 404
        assert receipt(c, "holder")["finish_reason"] == "stop"


def test_cancellation_frees_the_slot_and_settles_the_tokens_emitted(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    # No queue: a request is refused unless the cancelled stream's slot came back.
    config = scripted_deployment(driver, max_num_seqs=1, max_queue=0) + PRICED
    srv = start_server(config=config)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(50), headers=named("left")) as r:
            left = events(r)
            driver.emit("left", 3)
            assert texts(left, 3) == [" w1", " w2", " w3"]
            assert deployment(c)["in_flight"] == 1
        # The client is gone: the engine is told to stop, and reports what it produced.
        aborted = driver.wait("aborted", "left")
        assert aborted["tokens"] == 3
        driver.emit("left", 1)  # generation really stopped: nobody runs it any more
        assert driver.wait("ignored", "left")["op"] == "emit"
        got = receipt(c, "left")
        assert (got["prompt_tokens"], got["completion_tokens"]) == (4, 3)
        assert got["finish_reason"] == "abort"
        assert got["charged"] == 23  # 4 prompt tokens x 2 + 3 completion tokens x 5
        assert deployment(c)["in_flight"] == 0
        # The slot is free: with no queue, the next request is admitted, not refused.
        with ThreadPoolExecutor(1) as pool:
            nxt = pool.submit(c.post, "/v1/completions", json=body(2, stream=False))
            driver.emit(driver.wait("started", count=2)["id"], 2)
            answer = nxt.result(timeout=HANG_S)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2


def test_a_failure_mid_stream_ends_it_with_an_error_event(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=scripted_deployment(driver, max_num_seqs=1) + PRICED)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(50), headers=named("doomed")) as r:
            stream = events(r)
            driver.emit("doomed", 2)
            assert texts(stream, 2) == [" w1", " w2"]
            driver.fail("doomed", "the model fell over")
            tail = list(stream)
        assert tail[-1] == DONE
        errors = [e for e in tail if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail
        assert "the model fell over" in errors[0]["error"]["message"]
        got = receipt(c, "doomed")
        assert (got["completion_tokens"], got["finish_reason"]) == (2, "error")
        assert got["charged"] == 18  # 4 x 2 + 2 x 5
        assert deployment(c)["in_flight"] == 0


def test_max_tokens_is_a_hard_limit(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=scripted_deployment(driver, max_num_seqs=1))
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(3), headers=named("capped")) as r:
            stream = events(r)
            driver.emit("capped", 10)  # asks for more than max_tokens
            got = list(stream)
    finals = [e for e in got if isinstance(e, dict) and e["choices"][0]["finish_reason"]]
    assert "".join(text(e) for e in got) == " w1 w2 w3"
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert got[-1] == DONE
    assert driver.wait("ended", "capped") == {
        "event": "ended",
        "id": "capped",
        "reason": "length",
        "tokens": 3,
    }


def replica(c: httpx.Client) -> dict[str, Any]:
    return dict(deployment(c)["replicas"][0])


def test_a_crashed_replica_ends_its_streams_and_restarts(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=scripted_deployment(driver, max_num_seqs=2) + PRICED)
    first_pid = driver.wait("hello")["pid"]
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        before = replica(c)
        assert before["pid"] == first_pid and before["restarts"] == 0
        with (
            c.stream("POST", "/v1/completions", json=body(50), headers=named("a")) as ra,
            c.stream("POST", "/v1/completions", json=body(50), headers=named("b")) as rb,
        ):
            a, b = events(ra), events(rb)
            driver.emit("a", 1)
            driver.emit("b", 2)
            assert texts(a, 1) == [" w1"] and texts(b, 2) == [" w1", " w2"]
            driver.crash("a")  # the one process serves both
            tails = [list(a), list(b)]
        for tail in tails:
            assert tail[-1] == DONE, tail
            errors = [e for e in tail if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail
        # Billed what the client was sent: the replica's own count died with it.
        # 4 prompt tokens x 2 + 1 or 2 completion tokens x 5
        for rid, tokens, charged in (("a", 1, 13), ("b", 2, 18)):
            got = receipt(c, rid)
            assert (got["completion_tokens"], got["finish_reason"]) == (tokens, "error")
            assert got["charged"] == charged

        # The supervisor starts a new process, which connects to the driver again.
        second_pid = driver.wait("hello", count=2)["pid"]
        assert second_pid != first_pid
        after = wait_until(
            lambda: (rep := replica(c))["state"] == "ready" and rep, "the replica to be back"
        )
        assert after["pid"] == second_pid and after["restarts"] == 1
        assert deployment(c)["in_flight"] == 0
        with ThreadPoolExecutor(1) as pool:
            again = pool.submit(
                c.post, "/v1/completions", json=body(2, stream=False), headers=named("again")
            )
            driver.emit("again", 2)
            answer = again.result(timeout=HANG_S)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2


def test_a_crash_during_a_non_streamed_request_is_a_502(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = start_server(config=scripted_deployment(driver, max_num_seqs=1))
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            c.post, "/v1/completions", json=body(50, stream=False), headers=named("whole")
        )
        driver.emit("whole", 2)
        driver.crash("whole")
        r = pending.result(timeout=HANG_S)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["code"] == "engine_error"


def test_a_stalled_replica_is_killed_by_the_health_probe(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    config = scripted_deployment(
        driver, max_num_seqs=1, health_check_interval_s=0.25, health_check_timeout_s=1.5
    )
    srv = start_server(config=config)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json=body(50), headers=named("stuck")) as r:
            stream = events(r)
            driver.emit("stuck", 1)
            assert texts(stream, 1) == [" w1"]
            driver.stall("stuck")  # alive, answering nothing: a hung native call
            tail = list(stream)
        assert tail[-1] == DONE
        errors = [e for e in tail if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error", tail
        driver.wait("hello", count=2)
        wait_until(lambda: replica(c)["state"] == "ready", "the replica to be back")
        assert replica(c)["restarts"] == 1
    assert "is wedged" in srv.log()
