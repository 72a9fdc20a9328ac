"""Keep-alive of streamed responses (``stream_keepalive_s``), ordered by events.

A scripted deployment of one slot: the test holds the slot with one stream, so a
second one waits in the admission queue for exactly as long as the test wants, and
its engine produces a token only when the test says so. Pings are read as they come
(the interval is tiny); nothing here asserts a duration.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.driver import EngineDriver, scripted_deployment
from tests.ledger.helpers import receipt
from tests.sse import DONE, PING, events, lines, text
from tests.waiting import HANG_S, wait_until

# Far below anything the test waits for: a waiting stream pings many times.
KEEPALIVE_S = 0.05
# Ten intervals: the head (after one interval in the queue) always goes out first.
QUEUE_TIMEOUT_S = 0.5
PROMPT = "Tell a long story."  # 4 words: 4 prompt tokens for the scripted engine


def serve(
    start_server: Callable[..., ServerProcess],
    driver: EngineDriver,
    keepalive_s: float = KEEPALIVE_S,
    **keys: object,
) -> ServerProcess:
    keys.setdefault("queue_timeout_s", HANG_S)
    deployment = scripted_deployment(driver, "scripted", max_num_seqs=1, **keys)
    config = f"stream_keepalive_s = {keepalive_s}\n" + deployment
    return start_server(config=config)


def completion(rid: str, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": "scripted", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    return {"url": "/v1/completions", "json": body, "headers": {"x-request-id": rid}}


def chat(rid: str, max_tokens: int = 8) -> dict[str, Any]:
    body = {
        "model": "scripted",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    return {"url": "/v1/chat/completions", "json": body, "headers": {"x-request-id": rid}}


@contextmanager
def slot_held(c: httpx.Client, driver: EngineDriver) -> Iterator[Iterator[Any]]:
    """The deployment's one slot, taken by a stream (``holder``) once its engine has
    started it: what comes next waits in the queue. Yields the stream's events."""
    with c.stream("POST", **completion("holder")) as held:
        holder = events(held)
        driver.started("holder")
        yield holder


def queued(c: httpx.Client) -> int:
    return int(c.get("/v1/deployments/scripted").json()["queued"])


def pings_then_data(stream: Iterator[str]) -> tuple[int, dict[str, Any] | str]:
    """Read to the next ``data:`` line: how many pings came first, and its event."""
    pings = 0
    for line in stream:
        if line == PING:
            pings += 1
            continue
        data = line.removeprefix("data: ")
        return pings, DONE if data == DONE else json.loads(data)
    raise AssertionError("the stream ended without another data line")


def next_ping(stream: Iterator[str]) -> None:
    line = next(stream)
    assert line == PING, f"a data line where only a ping could come: {line!r}"


def test_a_queued_stream_gets_its_head_then_pings_until_its_first_token(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with slot_held(c, driver) as holder:
            with c.stream("POST", **chat("waiter")) as r:
                # The head came while the request waits: the slot is still the holder's.
                assert r.status_code == 200, r.read()
                assert r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-request-id"] == "waiter"
                waiter = lines(r)
                for _ in range(3):  # not one ping: a ping every interval while it waits
                    next_ping(waiter)
                assert queued(c) == 1
                assert driver.seen("started", "waiter") == 0
                driver.finish("holder")
                assert list(holder)[-1] == DONE
                # Admitted: the chat's role delta, then pings while the prompt is worked
                # on (the engine produces nothing until told), then the first token.
                _, first = pings_then_data(waiter)
                assert isinstance(first, dict)
                assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                driver.started("waiter")
                next_ping(waiter)
                driver.emit("waiter", 2)
                _, token = pings_then_data(waiter)
                assert text(token) == " w1"
                driver.finish("waiter")
                rest = [line for line in waiter if line != PING]
        assert rest[-1] == f"data: {DONE}"
        # Settled once, on what was produced, like any stream.
        got = receipt(c, "waiter")
        assert (got["prompt_tokens"], got["completion_tokens"]) == (5, 2)
        assert got["finish_reason"] == "stop"
        assert receipt(c, "holder")["finish_reason"] == "stop"


def test_a_queue_timeout_after_the_head_ends_the_stream_in_band(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver, queue_timeout_s=QUEUE_TIMEOUT_S)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with slot_held(c, driver) as holder:
            with c.stream("POST", **completion("waiter")) as r:
                assert r.status_code == 200, r.read()
                waiter = lines(r)
                pings, error = pings_then_data(waiter)
                rest = list(waiter)
            assert pings >= 1
            assert isinstance(error, dict), error
            assert error["error"]["type"] == "rate_limit_error"
            assert error["error"]["code"] == "queue_timeout"
            assert rest == [f"data: {DONE}"]  # the stream's end, nothing after it
            assert queued(c) == 0  # it left the queue
            driver.finish("holder")
            assert list(holder)[-1] == DONE
        # It never reached the engine and held nothing: there is nothing to bill.
        assert driver.seen("started", "waiter") == 0
        assert c.get("/v1/usage/waiter").status_code == 404
        assert receipt(c, "holder")["finish_reason"] == "stop"


def test_a_client_leaving_a_queued_stream_gives_its_place_back(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver, max_queue=1)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with slot_held(c, driver) as holder:
            with c.stream("POST", **completion("leaver")) as r:
                leaver = lines(r)  # referenced: a dropped reader closes the connection
                next_ping(leaver)
                assert queued(c) == 1
            # Gone while it waited: its place in the queue (of one) is free again.
            wait_until(lambda: queued(c) == 0, "the queued request to leave the queue")
            with c.stream("POST", **completion("next")) as nxt:
                assert nxt.status_code == 200, nxt.read()  # queued, not refused
                following = events(nxt)
                driver.finish("holder")
                assert list(holder)[-1] == DONE
                driver.emit("next", 1)
                assert text(next(following)) == " w1"
                driver.finish("next")
                assert list(following)[-1] == DONE
        assert driver.seen("started", "leaver") == 0
        assert c.get("/v1/usage/leaver").status_code == 404


def test_refusals_known_before_waiting_keep_their_status(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver, max_queue=0)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with slot_held(c, driver) as holder:
            full = c.post(**completion("refused"))
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "overloaded"
            request = chat("unknown")
            unknown = c.post(request["url"], json=request["json"] | {"model": "nope"})
            assert unknown.status_code == 404, unknown.text
            assert unknown.json()["error"]["code"] == "model_not_found"
            driver.finish("holder")
            assert list(holder)[-1] == DONE


def test_off_nothing_is_sent_while_a_stream_waits(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    # No head while it waits: the queue timeout is still an HTTP status, as it always was.
    srv = serve(start_server, driver, keepalive_s=0, queue_timeout_s=QUEUE_TIMEOUT_S)
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", **completion("holder")) as held:
            holder = lines(held)
            driver.started("holder")
            waited = c.post(**completion("waiter"))
            assert waited.status_code == 429, waited.text
            assert waited.json()["error"]["code"] == "queue_timeout"
            driver.emit("holder", 1)
            driver.finish("holder")
            got = list(holder)
        assert got[-1] == f"data: {DONE}"
        assert PING not in got


def test_the_openai_sdk_reads_a_stream_that_pinged(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver)
    with (
        httpx.Client(base_url=srv.url, timeout=HANG_S) as c,
        openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0) as client,
        slot_held(c, driver) as holder,
    ):
        stream = client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=3,
            stream=True,
            extra_headers={"x-request-id": "waiter"},
        )
        # The SDK has the head (and the pings behind it) while the request still waits.
        assert queued(c) == 1
        driver.finish("holder")
        assert list(holder)[-1] == DONE
        driver.emit("waiter", 3)
        chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == (
        " w1 w2 w3"
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_openai_sdk_raises_the_in_band_queue_timeout(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver, queue_timeout_s=QUEUE_TIMEOUT_S)
    with (
        httpx.Client(base_url=srv.url, timeout=HANG_S) as c,
        openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0) as client,
        slot_held(c, driver) as holder,
    ):
        stream = client.completions.create(
            model="scripted", prompt=PROMPT, max_tokens=3, stream=True
        )
        with pytest.raises(openai.APIError, match=r"waited 0\.5s in the queue"):
            list(stream)
        driver.finish("holder")
        assert list(holder)[-1] == DONE


# -- the agent APIs: their own ping and error events ------------------------------------


def test_a_messages_stream_pings_anthropics_way_and_ends_with_its_error_event(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver, queue_timeout_s=QUEUE_TIMEOUT_S)
    body = {
        "model": "scripted",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
    }
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with slot_held(c, driver) as holder:
            with c.stream("POST", "/v1/messages", json=body) as r:
                assert r.status_code == 200, r.read()
                got = [line for line in r.iter_lines() if line]
            driver.finish("holder")
            assert list(holder)[-1] == DONE
    # Anthropic's ping events while it waited, then its error event, and nothing after.
    error = got.index("event: error")
    assert error >= 2 and got[:error] == ["event: ping", 'data: {"type":"ping"}'] * (error // 2)
    assert got[error + 2 :] == []
    event = json.loads(got[error + 1].removeprefix("data: "))
    assert event["type"] == "error" and event["error"]["type"] == "rate_limit_error"
    assert "waited 0.5s in the queue" in event["error"]["message"]


def test_the_agent_sdks_read_streams_that_pinged(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver)
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": PROMPT}]
    with (
        httpx.Client(base_url=srv.url, timeout=HANG_S) as c,
        openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0) as oai,
        anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0) as claude,
        slot_held(c, driver) as holder,
    ):
        # Each SDK has its stream's head while the request still waits in the queue.
        message = claude.messages.create(
            model="scripted",
            max_tokens=2,
            messages=messages,
            stream=True,
            extra_headers={"x-request-id": "message"},
        )
        response = oai.responses.create(
            model="scripted",
            input=PROMPT,
            max_output_tokens=2,
            stream=True,
            extra_headers={"x-request-id": "response"},
        )
        assert queued(c) == 2
        driver.finish("holder")
        assert list(holder)[-1] == DONE
        driver.emit("message", 2)
        deltas = [
            e.delta.text
            for e in message
            if e.type == "content_block_delta" and e.delta.type == "text_delta"
        ]
        assert "".join(deltas) == " w1 w2"
        driver.emit("response", 2)
        last = list(response)[-1]
        assert last.type == "response.incomplete"  # max_output_tokens reached
        assert last.response.output_text == " w1 w2"


def test_a_responses_stream_refused_after_its_head_ends_with_its_error_event(
    driver: EngineDriver, start_server: Callable[..., ServerProcess]
) -> None:
    srv = serve(start_server, driver, queue_timeout_s=QUEUE_TIMEOUT_S)
    with (
        httpx.Client(base_url=srv.url, timeout=HANG_S) as c,
        openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0) as oai,
        slot_held(c, driver) as holder,
    ):
        got = list(oai.responses.create(model="scripted", input=PROMPT, stream=True))
        driver.finish("holder")
        assert list(holder)[-1] == DONE
    assert [e.type for e in got] == ["error"]
    error = got[0]
    assert error.type == "error"  # for the type checker
    assert error.code == "queue_timeout" and "waited 0.5s in the queue" in error.message
