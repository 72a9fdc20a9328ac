"""The chat completion and completion encoders, fed neutral events, checked against the
official ``openai`` SDK's own types (and tokenmill's served schema, which forbids any
field it does not declare: the SDK's models accept extra ones). No model, no server."""

from __future__ import annotations

from typing import Any, Literal

import openai.types
import openai.types.chat
import pytest
from pydantic import BaseModel

from tests.server.core_events import ARGS, CALL, CUT, NOTHING, TEXT, TEXT_THEN_CALL, USAGE
from tokenmill.chat import (
    ChoiceEnd,
    ChoiceResult,
    Event,
    Finished,
    Result,
    TextDelta,
)
from tokenmill.engines import TokenLogprob, ToolCall
from tokenmill.engines.results import TopLogprob
from tokenmill.errors import EngineError
from tokenmill.server.openai import replies
from tokenmill.server.openai.events import ChatEncoder, CompletionEncoder
from tokenmill.server.protocol import ErrorBody


class StreamedCompletionChoice(openai.types.CompletionChoice):
    """The SDK's choice as a stream sends it: ``finish_reason`` is null until the
    choice ends (as OpenAI's own API streams it; the SDK's stream reads it unchecked)."""

    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class StreamedCompletion(openai.types.Completion):
    choices: list[StreamedCompletionChoice]  # type: ignore[assignment]


def check(chunk: dict[str, Any], *models: type[BaseModel]) -> None:
    for model in models:
        model.model_validate(chunk)


# Two choices, interleaved as the core gives them.
TWO: list[Event] = [
    TextDelta(1, "B"),
    TextDelta(0, "A"),
    TextDelta(1, "b"),
    ChoiceEnd(1, "length"),
    TextDelta(0, "a"),
    ChoiceEnd(0, "stop"),
    Finished(USAGE),
]

HELLO = TokenLogprob(b"Hello", -0.25, 0, (TopLogprob(b"Hello", -0.25), TopLogprob(b"Hi", -1.5)))
# A token that ends halfway through a character: its text is a replacement character,
# its bytes what it holds.
HALF = TokenLogprob(b"\xe2\x82", -0.5, 5, (TopLogprob(b"\xe2\x82", -0.5),))
LOGPROBS: list[Event] = [
    TextDelta(0, "Hello", (HELLO,)),
    TextDelta(0, "", (HALF,)),
    ChoiceEnd(0, "length"),
    Finished(USAGE),
]

CHAT_STREAM = (openai.types.chat.ChatCompletionChunk, replies.ChatCompletionChunk)
CHAT_BODY = (openai.types.chat.ChatCompletion, replies.ChatCompletion)
COMPLETION_STREAM = (StreamedCompletion, replies.CompletionChunk)
COMPLETION_BODY = (openai.types.Completion, replies.Completion)


def chat(**options: Any) -> ChatEncoder:
    return ChatEncoder("req-abc", "smollm2", 1700000000, **options)


def completion(**options: Any) -> CompletionEncoder:
    return CompletionEncoder("req-abc", "smollm2", 1700000000, **options)


def encode(encoder: ChatEncoder | CompletionEncoder, events: list[Event]) -> list[dict[str, Any]]:
    out = encoder.start()
    for e in events:
        out += encoder.feed(e)
    return out


def fold_chat(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """What a client reading the stream ends up with, per choice."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            choice = choices.setdefault(c["index"], {"content": "", "calls": {}, "reason": None})
            delta = c["delta"]
            choice["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                into = choice["calls"].setdefault(call["index"], {"arguments": ""})
                into.update({k: v for k, v in call.items() if k in ("id", "type")})
                into.setdefault("name", call["function"].get("name"))
                into["arguments"] += call["function"]["arguments"]
            choice["reason"] = c["finish_reason"] or choice["reason"]
    return choices


@pytest.mark.parametrize("events", [TEXT, CALL, TEXT_THEN_CALL, CUT, NOTHING, LOGPROBS, TWO])
@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks_are_the_sdks(events: list[Event], include_usage: bool) -> None:
    encoder = chat(choices=2 if events is TWO else 1, include_usage=include_usage, logprobs=True)
    out = encode(encoder, events)
    for chunk in out:
        check(chunk, *CHAT_STREAM)
        assert chunk["id"] == "chatcmpl-abc"
        assert chunk["object"] == "chat.completion.chunk"
    # Each choice opens with its role, and ends exactly once.
    opening = [c for chunk in out[: encoder.choices] for c in chunk["choices"]]
    assert [c["delta"] for c in opening] == [{"role": "assistant", "content": ""}] * encoder.choices
    ends = [c["index"] for chunk in out for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(ends) == list(range(encoder.choices))
    if include_usage:
        assert out[-1]["choices"] == []
        assert out[-1]["usage"] == {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
    else:
        assert all("usage" not in chunk for chunk in out)


def test_chat_tool_call_stream() -> None:
    out = encode(chat(), TEXT_THEN_CALL)
    (choice,) = fold_chat(out).values()
    assert choice["content"] == "Let me look."
    assert choice["calls"] == {
        0: {"id": "call_1", "type": "function", "name": "weather", "arguments": ARGS}
    }
    assert choice["reason"] == "tool_calls"
    # The call opens whole-named with empty arguments, and each later piece has no id.
    deltas = [c["choices"][0]["delta"] for c in out]
    opened, *pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert opened["function"] == {"name": "weather", "arguments": ""}
    assert all(set(p) == {"index", "function"} for p in pieces)


def test_chat_logprobs() -> None:
    out = encode(chat(logprobs=True), LOGPROBS)
    hello, half = (c["choices"][0]["logprobs"]["content"] for c in out[1:3])
    assert hello == [
        {
            "token": "Hello",
            "logprob": -0.25,
            "bytes": list(b"Hello"),
            "top_logprobs": [
                {"token": "Hello", "logprob": -0.25, "bytes": list(b"Hello")},
                {"token": "Hi", "logprob": -1.5, "bytes": list(b"Hi")},
            ],
        }
    ]
    assert half[0]["token"] == "\ufffd" and half[0]["bytes"] == [0xE2, 0x82]
    # Not asked for (or the answer read for tool calls): never reported.
    assert all(
        c["logprobs"] is None for chunk in encode(chat(), LOGPROBS) for c in chunk["choices"]
    )


def test_chat_body_matches_the_stream() -> None:
    result = Result(
        (
            ChoiceResult("Aa", (), (), "stop"),
            ChoiceResult("Bb", (), (), "length"),
        ),
        USAGE,
    )
    encoder = chat(choices=2)
    body = encoder.body(result)
    check(body, *CHAT_BODY)
    assert (body["id"], body["object"], body["created"]) == (
        "chatcmpl-abc",
        "chat.completion",
        1700000000,
    )
    streamed = fold_chat(encode(encoder, TWO))
    for choice in body["choices"]:
        assert choice["message"]["content"] == streamed[choice["index"]]["content"]
        assert choice["finish_reason"] == streamed[choice["index"]]["reason"]
    assert body["usage"]["total_tokens"] == 10


@pytest.mark.parametrize("text", ["", "Let me look."])
def test_chat_body_with_tool_calls(text: str) -> None:
    call = ToolCall("call_1", "weather", ARGS)
    body = chat().body(Result((ChoiceResult(text, (call,), (), "tool_calls"),), USAGE))
    check(body, *CHAT_BODY)
    (choice,) = body["choices"]
    # No text beside the calls is null content, as OpenAI's.
    assert choice["message"] == {
        "role": "assistant",
        "content": text or None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ARGS}}
        ],
    }
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("events", [TEXT, CUT, NOTHING, LOGPROBS, TWO])
@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_chunks_are_the_sdks(events: list[Event], include_usage: bool) -> None:
    encoder = completion(include_usage=include_usage, logprobs=True)
    out = encode(encoder, events)
    assert encoder.start() == []  # no role to announce
    for chunk in out:
        check(chunk, *COMPLETION_STREAM)
        assert (chunk["id"], chunk["object"]) == ("cmpl-abc", "text_completion")
    texts: dict[int, str] = {}
    for chunk in out:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    ends = [c for chunk in out for c in chunk["choices"] if c["finish_reason"]]
    assert all(c["text"] == "" for c in ends)
    if events is TWO:
        assert texts == {0: "Aa", 1: "Bb"}
    assert ("usage" in out[-1]) == include_usage


def test_completion_logprobs() -> None:
    out = encode(completion(logprobs=True), LOGPROBS)
    first, second = (c["choices"][0]["logprobs"] for c in out[:2])
    # The sampled token is always among the alternatives.
    assert first == {
        "tokens": ["Hello"],
        "token_logprobs": [-0.25],
        "top_logprobs": [{"Hello": -0.25, "Hi": -1.5}],
        "text_offset": [0],
    }
    assert second["text_offset"] == [5]


def test_completion_echoed_prompt_logprobs() -> None:
    """An echoed prompt's first token has no log probability: null, as OpenAI's (which
    the SDK's types do not allow for, so only the served schema checks it)."""
    first = TokenLogprob(b"Say", None, 0)
    then = TokenLogprob(b" hi", -2.0, 3, (TopLogprob(b" hello", -1.0),))
    events: list[Event] = [TextDelta(0, "Say hi", (first, then), prompt=True)]
    (chunk,) = completion(logprobs=True).feed(events[0])
    replies.CompletionChunk.model_validate(chunk)
    assert chunk["choices"][0]["logprobs"] == {
        "tokens": ["Say", " hi"],
        "token_logprobs": [None, -2.0],
        "top_logprobs": [None, {" hello": -1.0, " hi": -2.0}],
        "text_offset": [0, 3],
    }


def test_completion_body() -> None:
    result = Result(
        (ChoiceResult("Hello", (), (HELLO,), "stop"), ChoiceResult("", (), (), "length")),
        USAGE,
    )
    body = completion(logprobs=True).body(result)
    check(body, *COMPLETION_BODY)
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["Hello", ""]
    assert body["choices"][0]["logprobs"]["tokens"] == ["Hello"]
    assert body["choices"][1]["logprobs"] == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    assert completion().body(result)["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("encoder", [chat(), completion()])
def test_failure_mid_stream_is_the_error_body(encoder: ChatEncoder | CompletionEncoder) -> None:
    (error,) = encoder.fail(EngineError("the replica failed: OSError"))
    ErrorBody.model_validate(error)
    assert error["error"]["message"] == "the replica failed: OSError"
