"""The clients people already use work against tokenmill unchanged: the official
openai SDK, langchain-openai's ChatOpenAI, and curl reading raw server-sent events."""

from __future__ import annotations

import json
import subprocess

import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI

from tests.conftest import ServerProcess

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Name a colour."}
]


def test_openai_sync(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == ["smollm2"]

        chat = client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8

        text = client.completions.create(
            model="smollm2", prompt="The sky is", max_tokens=8, temperature=0
        )
        assert text.choices[0].text and text.usage is not None

        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=MESSAGES, max_tokens=2
        )
        assert raw.headers["x-request-id"].startswith("req-")

        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(
                model="smollm2", messages=MESSAGES, max_tokens=2, temperature=7
            )
        assert ei.value.param == "temperature"


def test_openai_sync_streaming_with_usage(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        full = client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0
        )
        stream = client.chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        # The last chunk has no choices and carries the usage, as OpenAI sends it.
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

        no_usage = list(
            client.completions.create(
                model="smollm2", prompt="The sky is", max_tokens=4, stream=True
            )
        )
        assert all(c.usage is None for c in no_usage)
        assert no_usage[-1].choices[0].finish_reason in ("stop", "length")


async def test_openai_async_and_streaming(server: ServerProcess) -> None:
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0
    ) as client:
        chat = await client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content
        stream = await client.completions.create(
            model="smollm2",
            prompt="The sky is",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        usage = None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        full = await client.completions.create(
            model="smollm2", prompt="The sky is", max_tokens=8, temperature=0
        )
        assert "".join(parts) == full.choices[0].text
        assert usage is not None and full.usage is not None
        assert usage.completion_tokens == full.usage.completion_tokens


def test_langchain_chat_openai_invoke_and_stream(server: ServerProcess) -> None:
    llm = ChatOpenAI(
        base_url=server.base_url,
        api_key="unused",  # type: ignore[arg-type]
        model="smollm2",
        max_tokens=8,  # type: ignore[call-arg]
        temperature=0,
        max_retries=0,
        stream_usage=True,
    )
    answer = llm.invoke("Name a colour.")
    assert isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata is not None
    assert 0 < answer.usage_metadata["output_tokens"] <= 8

    total: AIMessageChunk | None = None
    for chunk in llm.stream("Name a colour."):
        total = chunk if total is None else total + chunk
    assert total is not None
    assert total.content == answer.content
    assert total.usage_metadata is not None
    assert total.usage_metadata["output_tokens"] == answer.usage_metadata["output_tokens"]


def _curl(url: str, body: dict[str, object]) -> tuple[str, bytes]:
    """Headers and raw body bytes, exactly as curl received them."""
    proc = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            "-D",
            "-",
            "--max-time",
            "120",
            url,
            "-H",
            "content-type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        check=True,
        timeout=150,
    )
    head, _, payload = proc.stdout.partition(b"\r\n\r\n")
    return head.decode("latin-1").lower(), payload


def test_curl_raw_sse_framing(server: ServerProcess) -> None:
    head, payload = _curl(
        f"{server.base_url}/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert head.startswith("http/1.1 200")
    assert "content-type: text/event-stream" in head
    assert "x-request-id: req-" in head
    # Every event is one `data: ` line followed by a blank line; the last is [DONE].
    assert payload.endswith(b"data: [DONE]\n\n")
    events = payload.split(b"\n\n")
    assert events[-1] == b""
    events = events[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    bodies = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert all(b["object"] == "chat.completion.chunk" for b in bodies)
    assert len({b["id"] for b in bodies}) == 1
    assert bodies[0]["choices"][0]["delta"]["role"] == "assistant"
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] > 0

    head, payload = _curl(
        f"{server.url}/v1/deployments/smollm2/predictWithResponseStream",
        {"prompt": "The sky is", "endpoint_type": "completion", "max_tokens": 4},
    )
    assert "content-type: text/event-stream" in head
    events = payload.split(b"\n\n")[:-1]
    assert events[-1] == b"data: [DONE]"
    texts = [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts)


def test_curl_error_body(server: ServerProcess) -> None:
    proc = subprocess.run(
        [
            "curl",
            "-sS",
            "-w",
            "\n%{http_code}",
            f"{server.base_url}/completions",
            "-H",
            "content-type: application/json",
            "-d",
            '{"prompt": "x", "model": "nope"}',
        ],
        capture_output=True,
        check=True,
        timeout=60,
    )
    body, _, status = proc.stdout.rpartition(b"\n")
    assert status == b"404"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
