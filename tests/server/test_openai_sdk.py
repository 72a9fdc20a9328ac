"""The official openai package, unchanged, against a real gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import ServerProcess

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


def test_chat_non_streamed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8)
    assert r.object == "chat.completion"
    assert r.model == "smollm2"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes in (["stop"], ["length"])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and 0 < last.usage.completion_tokens <= 12
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage_has_none(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
        )
    )
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions_both_ways(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens <= 6
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2", prompt="The sky is", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["smollm2"]


async def test_async_chat_streamed_and_not(aclient: openai.AsyncOpenAI) -> None:
    r = await aclient.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
    )
    text = r.choices[0].message.content
    stream = await aclient.chat.completions.create(
        model="smollm2",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == text
    await aclient.close()


def test_errors_are_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=4)
    assert "nope" in nf.value.message
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4, n=999)
    assert br.value.body is not None and br.value.param == "n"
