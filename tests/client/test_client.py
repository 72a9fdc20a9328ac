"""Client and AsyncClient against the real gateway: every call kind, streamed and not."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.client.conftest import LONG_PROMPT, in_flight
from tests.conftest import ServerProcess
from tests.driver import EngineDriver
from tests.waiting import HANG_S, wait_until
from tokenmill import AsyncClient, Client, RateLimitError
from tokenmill.client import AsyncStream, Chunk, Response, Stream

GREEDY: dict[str, Any] = {"temperature": 0.0, "seed": 1}


def _check_chunks(chunks: list[Chunk], max_tokens: int) -> None:
    """Only the last chunk ends the stream, and it carries the usage."""
    assert chunks, "the stream yielded nothing"
    *body, last = chunks
    assert all(c.finish_reason is None and c.usage is None for c in body)
    assert all(c.text for c in body)
    assert last.finish_reason in ("stop", "length")
    assert last.usage is not None
    assert 0 < last.usage.completion_tokens <= max_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert len({c.request_id for c in chunks}) == 1


def _check_response(r: Response, obj: str, max_tokens: int) -> None:
    assert r.text
    assert r.finish_reason in ("stop", "length")
    assert r.usage is not None and 0 < r.usage.completion_tokens <= max_tokens
    assert r.request_id is not None and r.request_id.startswith("req-")
    assert r.raw["object"] == obj
    assert r.model == "smollm2"


def test_sync_calls_streamed_equal_unstreamed(server: ServerProcess) -> None:
    with Client(server.url, max_retries=0) as client:
        assert [m.id for m in client.models()] == ["smollm2"]

        chat = client.chat("Name a colour.", max_tokens=12, **GREEDY)
        _check_response(chat, "chat.completion", 12)
        stream = client.chat("Name a colour.", stream=True, max_tokens=12, **GREEDY)
        assert isinstance(stream, Stream)
        chunks = list(stream)
        _check_chunks(chunks, 12)
        assert "".join(c.text for c in chunks) == chat.text == stream.text
        assert chunks[-1].usage is not None and chat.usage is not None
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens

        text = client.complete("The sky is", max_tokens=10, **GREEDY)
        _check_response(text, "text_completion", 10)
        chunks = list(client.complete("The sky is", stream=True, max_tokens=10, **GREEDY))
        _check_chunks(chunks, 10)
        assert "".join(c.text for c in chunks) == text.text

        pred = client.predict("smollm2", prompt="Name a colour.", max_tokens=12, **GREEDY)
        # A deployment's default endpoint type is chat: same answer as /v1/chat/completions.
        assert pred.text == chat.text
        pred_text = client.predict(
            "smollm2", prompt="The sky is", endpoint_type="completion", max_tokens=10, **GREEDY
        )
        assert pred_text.text == text.text
        msgs = [{"role": "user", "content": "Name a colour."}]
        chunks = list(
            client.predict("smollm2", messages=msgs, stream=True, max_tokens=12, **GREEDY)
        )
        _check_chunks(chunks, 12)
        assert "".join(c.text for c in chunks) == chat.text


async def test_async_calls_streamed_equal_unstreamed(server: ServerProcess) -> None:
    # The OpenAI-style base URL (…/v1) is accepted as well as the server root.
    async with AsyncClient(server.base_url, max_retries=0) as client:
        assert [m.id for m in await client.models()] == ["smollm2"]
        chat = await client.chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            max_tokens=10,
            **GREEDY,
        )
        _check_response(chat, "chat.completion", 10)
        stream = await client.chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            stream=True,
            max_tokens=10,
            **GREEDY,
        )
        assert isinstance(stream, AsyncStream)
        chunks = [c async for c in stream]
        _check_chunks(chunks, 10)
        assert "".join(c.text for c in chunks) == chat.text

        text = await client.complete("Once upon a time", max_tokens=8, **GREEDY)
        _check_response(text, "text_completion", 8)
        async with await client.complete(
            "Once upon a time", stream=True, max_tokens=8, **GREEDY
        ) as s:
            chunks = [c async for c in s]
        _check_chunks(chunks, 8)
        assert "".join(c.text for c in chunks) == text.text

        pred = await client.predict("smollm2", messages="Hi", max_tokens=8, **GREEDY)
        _check_response(pred, "chat.completion", 8)
        ps = await client.predict(
            "smollm2",
            prompt="Once upon a time",
            endpoint_type="completion",
            stream=True,
            max_tokens=8,
            **GREEDY,
        )
        chunks = [c async for c in ps]
        _check_chunks(chunks, 8)
        assert "".join(c.text for c in chunks) == text.text


def test_url_and_key_from_environment(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENMILL_URL", server.url + "/")
    monkeypatch.setenv("TOKENMILL_API_KEY", "tm-from-env")
    with Client() as client:
        assert client.base_url == server.url
        assert client.api_key == "tm-from-env"
        assert client.complete("Hi", max_tokens=2).usage is not None


def test_predict_needs_prompt_or_messages(server: ServerProcess) -> None:
    with Client(server.url) as client, pytest.raises(ValueError, match="exactly one"):
        client.predict("smollm2", max_tokens=2)


def test_closing_a_stream_early_stops_generation(
    overload_server: ServerProcess, driver: EngineDriver
) -> None:
    """With one slot, a new request is admitted only once the closed stream is aborted."""
    with Client(overload_server.url, max_retries=0) as client:
        stream = client.chat(LONG_PROMPT, model="scripted", stream=True, max_tokens=1000)
        rid = stream.request_id
        assert rid is not None
        driver.emit(rid, 1)
        first = next(stream)
        assert first.text == " w1"
        with pytest.raises(RateLimitError):  # the slot is held while the stream is open
            client.complete("Hi", model="scripted", max_tokens=2)
        stream.close()
        # The server noticed the closed connection and stopped the generation there.
        assert driver.wait("aborted", rid)["tokens"] == 1
        wait_until(lambda: in_flight(overload_server) == 0, "the closed stream's slot back")
        with ThreadPoolExecutor(1) as pool:
            admitted = pool.submit(client.complete, "Hi", model="scripted", max_tokens=2)
            after = str(driver.wait("started", count=2)["id"])
            driver.emit(after, 2)
            assert admitted.result(timeout=HANG_S).text == " w1 w2"
        assert stream.text == first.text
    assert driver.index("aborted", rid) < driver.index("started", after)
    usage = httpx.get(f"{overload_server.url}/v1/usage/{rid}").json()
    assert (usage["finish_reason"], usage["completion_tokens"]) == ("abort", 1), usage
