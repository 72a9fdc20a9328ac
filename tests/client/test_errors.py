"""Each error type from a real server response; retries; a stream broken midway."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.client.conftest import LONG_PROMPT, dead_upstream_config, in_flight
from tests.conftest import ServerProcess, free_port
from tests.driver import EngineDriver, scripted_deployment
from tests.waiting import HANG_S, wait_until
from tokenmill import (
    APIConnectionError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    InsufficientCreditError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServerError,
    StreamError,
    TokenmillError,
)
from tokenmill.client.errors import status_error

Start = Callable[..., ServerProcess]


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tokenmill.client"]


class _BeforeRetry(logging.Handler):
    """Holds the client's retry until the test has done what must come first.

    The client logs once per retry, in its own thread, just before it waits out the
    delay and sends again: ``emit`` reports the refusal and blocks until ``go`` is set.
    """

    def __init__(self, refused: threading.Event, go: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.refused = refused
        self.go = go

    def emit(self, record: logging.LogRecord) -> None:
        self.refused.set()
        self.go.wait(HANG_S)


def test_not_found_is_typed_and_not_retried(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.client")
    with Client(server.url, max_retries=3) as client:
        with pytest.raises(NotFoundError) as ei:
            client.chat("Hi", model="nope", max_tokens=2)
        e = ei.value
        assert e.status == 404
        assert "nope" in e.message
        assert e.request_id is not None and e.request_id.startswith("req-")
        assert e.type == "invalid_request_error" and e.code
        assert e.request_id in str(e)
        with pytest.raises(NotFoundError):
            client.complete("Hi", model="nope", stream=True, max_tokens=2)
        with pytest.raises(NotFoundError) as ei:
            client.predict("nope", prompt="Hi", max_tokens=2)
        assert ei.value.code == "deployment_not_found"
    assert _retries(caplog) == []


async def test_bad_request_names_the_parameter(server: ServerProcess) -> None:
    async with AsyncClient(server.url, max_retries=3) as client:
        with pytest.raises(BadRequestError) as ei:
            await client.chat("Hi", temperature=5, max_tokens=2)
        assert ei.value.status == 400
        assert ei.value.param == "temperature"
        with pytest.raises(BadRequestError) as ei:
            await client.complete("Hi", stream=True, max_tokens=0)
        assert ei.value.param == "max_tokens"
        assert isinstance(ei.value, TokenmillError)


def test_body_too_large_is_a_bad_request(start_server: Start) -> None:
    srv = start_server(env={"TOKENMILL_MAX_BODY_BYTES": "1024"})
    with Client(srv.url, max_retries=2) as client:
        with pytest.raises(BadRequestError) as ei:
            client.complete("x" * 4000, max_tokens=2)
        assert ei.value.status == 413
        assert "1024" in ei.value.message


def test_429_then_retry_succeeds(
    overload_server: ServerProcess, driver: EngineDriver, caplog: pytest.LogCaptureFixture
) -> None:
    # The one slot is held by a scripted stream until the test frees it: the refusal,
    # the freed slot and the retry come in that order, whatever the machine.
    srv = overload_server
    caplog.set_level(logging.INFO, logger="tokenmill.client")
    client_log = logging.getLogger("tokenmill.client")
    with Client(srv.url, max_retries=0) as holder:
        hold = holder.chat(LONG_PROMPT, model="scripted", stream=True, max_tokens=50)
        assert hold.request_id is not None
        driver.emit(hold.request_id, 1)
        assert next(hold).text == " w1"  # the only slot is now taken
        with pytest.raises(RateLimitError) as ei:
            holder.complete("Hi", model="scripted", max_tokens=2)
        assert ei.value.status == 429
        assert ei.value.retry_after is not None and ei.value.retry_after >= 1
        assert _retries(caplog) == []  # max_retries=0: refused at once

        refused, freed = threading.Event(), threading.Event()

        def free_slot_then_serve(rid: str) -> str:
            """Once the retrying client was refused: free the slot before it retries,
            then produce its answer."""
            try:
                assert refused.wait(HANG_S), "the retrying client was never refused"
                hold.close()
                assert driver.wait("aborted", rid)["tokens"] == 1
                wait_until(lambda: in_flight(srv) == 0, "the holder's slot to be free")
            finally:
                freed.set()
            retried = str(driver.wait("started", count=2)["id"])
            driver.emit(retried, 4)
            return retried

        watcher = _BeforeRetry(refused, freed)
        client_log.addHandler(watcher)
        try:
            with ThreadPoolExecutor(1) as pool:
                served = pool.submit(free_slot_then_serve, hold.request_id)
                try:
                    with Client(srv.url, max_retries=3) as client:
                        response = client.complete("Hi", model="scripted", max_tokens=4)
                finally:
                    freed.set()  # never leave the client blocked in its log call
                retried = served.result(timeout=HANG_S)
        finally:
            client_log.removeHandler(watcher)
    assert response.text == " w1 w2 w3 w4" and response.usage is not None
    assert response.request_id == retried
    # Refused once, retried once into the freed slot.
    retries = _retries(caplog)
    assert len(retries) == 1 and "429" in retries[0], retries
    assert driver.seen("started") == 2  # the holder and the retry: no refusal ran


def test_5xx_and_connect_errors_are_retried_until_the_server_is_up(
    start_server: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.client")
    srv = start_server(wait=False)
    with ThreadPoolExecutor(1) as pool:
        # A patient client sent before the server listens (its retries wait at least
        # 4 s each after the first few: 40 outlast any machine's start-up)...
        def patient() -> str:
            with Client(srv.url, max_retries=40) as client:
                return client.complete("Hi", max_tokens=2).text

        result = pool.submit(patient)
        # ...while an impatient one sees what it is waiting through.
        seen: set[str] = set()
        with Client(srv.url, max_retries=0) as client:

            def served() -> bool:
                try:
                    client.complete("Hi", max_tokens=2)
                except APIConnectionError:
                    seen.add("connect")
                except ServerError as e:
                    assert e.status == 503 and e.code == "unavailable"
                    seen.add("503")
                else:
                    return True
                return False

            wait_until(served, "the server to serve")
        assert result.result(timeout=HANG_S)
    assert seen == {"connect", "503"}
    retries = _retries(caplog)
    assert any("cannot reach" in m for m in retries)


def test_connection_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.client")
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, max_retries=1) as client, pytest.raises(APIConnectionError) as ei:
        client.models()
    assert ei.value.status is None
    assert len(_retries(caplog)) == 1


def test_engine_failure_is_a_server_error_or_in_band_stream_error(start_server: Start) -> None:
    srv = start_server(config=dead_upstream_config())
    with Client(srv.url, max_retries=0) as client:
        with pytest.raises(ServerError) as ei:
            client.chat("Hi", model="dead", max_tokens=2)
        assert ei.value.status == 502 and "unreachable" in ei.value.message
        # Streamed, the failure comes after the 200 as an in-band error event.
        stream = client.chat("Hi", model="dead", stream=True, max_tokens=2)
        with pytest.raises(StreamError) as se:
            list(stream)
        assert se.value.code == "engine_error" and "unreachable" in se.value.message
        assert se.value.text == ""
        assert se.value.request_id == stream.request_id


async def test_broken_stream_raises_with_the_text_so_far(
    driver: EngineDriver, start_server: Start, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.client")
    # Three tokens and no end: the kill lands mid-stream however fast the machine.
    srv = start_server(config=scripted_deployment(driver, max_num_seqs=1))
    received: list[str] = []
    async with AsyncClient(srv.url, max_retries=5) as client:
        stream = await client.chat(LONG_PROMPT, model="scripted", stream=True, max_tokens=1000)
        assert stream.request_id is not None
        await asyncio.to_thread(driver.emit, stream.request_id, 3)
        with pytest.raises(StreamError) as ei:
            async for chunk in stream:
                received.append(chunk.text)
                if len(received) == 3:
                    srv.proc.kill()  # SIGKILL: the connection drops mid-stream
    e = ei.value
    assert received == [" w1", " w2", " w3"]
    assert e.text == "".join(received)  # everything delivered, nothing twice
    assert "not re-sent" in e.message
    assert e.request_id == stream.request_id
    assert _retries(caplog) == []  # a begun stream is never re-sent


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, BadRequestError),
        (401, AuthenticationError),
        (402, InsufficientCreditError),
        (403, PermissionDeniedError),
        (404, NotFoundError),
        (409, BadRequestError),
        (413, BadRequestError),
        (422, BadRequestError),
        (429, RateLimitError),
        (500, ServerError),
        (502, ServerError),
        (503, ServerError),
    ],
)
def test_status_mapping_from_openai_error_body(status: int, cls: type[TokenmillError]) -> None:
    body = {"error": {"message": "why", "type": "t", "param": "p", "code": "c"}}
    e = status_error(status, json.dumps(body).encode(), request_id="req-1", retry_after="3")
    assert type(e) is cls
    assert (e.message, e.type, e.param, e.code) == ("why", "t", "p", "c")
    assert (e.status, e.request_id, e.body) == (status, "req-1", body)
    if isinstance(e, RateLimitError):
        assert e.retry_after == 3.0


def test_status_mapping_without_an_openai_body() -> None:
    e = status_error(502, b"<html>Bad Gateway</html>")
    assert isinstance(e, ServerError) and e.message == "<html>Bad Gateway</html>"
    e = status_error(401, b"")
    assert isinstance(e, AuthenticationError) and e.message == "HTTP 401"
    before = time.time()
    due = int(before + 30)  # an HTTP date has whole seconds
    e = status_error(429, b"{}", retry_after=email.utils.formatdate(due, usegmt=True))
    after = time.time()
    assert isinstance(e, RateLimitError)
    # What was left until the date when it was parsed, however long that took.
    assert e.retry_after is not None and due - after <= e.retry_after <= due - before
