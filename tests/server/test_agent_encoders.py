"""The Responses and Messages event encoders, fed neutral events, checked against the
official SDKs' own event and object types (no model, no server)."""

from __future__ import annotations

from typing import Any, get_args

import anthropic.types
import openai.types.responses
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from pydantic import BaseModel

from tests.server.core_events import ARGS, CALL, CUT, NOTHING, TEXT, TEXT_THEN_CALL, USAGE
from tokenmill.chat import (
    ChoiceEnd,
    Event,
    Finished,
    TextDelta,
)
from tokenmill.errors import EngineError
from tokenmill.server.messages.events import MessageEncoder
from tokenmill.server.responses.events import ResponseEncoder


def by_type(union: Any) -> dict[str, type[BaseModel]]:
    """The members of an SDK's union of events, by their ``type``."""
    (members, *_) = get_args(union)
    return {get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(members)}


OPENAI_EVENTS = by_type(openai.types.responses.ResponseStreamEvent)
ANTHROPIC_EVENTS = by_type(anthropic.types.RawMessageStreamEvent)


def check(events: dict[str, type[BaseModel]], event: dict[str, Any]) -> None:
    """``event`` is valid as the SDK's own model of its type."""
    events[event["type"]].model_validate(event)


PARIS = {"city": "Paris"}


def response_skeleton() -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "in_progress",
        "model": "smollm2",
        "output": [],
        "usage": None,
        "incomplete_details": None,
        "error": None,
        "instructions": None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def encode_response(events: list[Event]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    encoder = ResponseEncoder(response_skeleton())
    out = encoder.start()
    for e in events:
        out += encoder.feed(e)
    return out, encoder.response


def message_skeleton() -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "smollm2",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 0},
    }


def encode_message(events: list[Event]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    encoder = MessageEncoder(message_skeleton())
    out = encoder.start()
    for e in events:
        out += encoder.feed(e)
    return out, encoder.message


@pytest.mark.parametrize("events", [TEXT, CALL, TEXT_THEN_CALL, CUT, NOTHING])
def test_responses_events_are_the_sdks_and_numbered(events: list[Event]) -> None:
    out, response = encode_response(events)
    for e in out:
        check(OPENAI_EVENTS, e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    openai.types.responses.Response.model_validate(response)
    # The last event carries the response as it ended.
    assert out[-1]["response"] == response


def test_responses_text_stream() -> None:
    out, response = encode_response(TEXT)
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert out[0]["response"]["output"] == []
    assert out[0]["response"]["status"] == "in_progress"
    (message,) = response["output"]
    assert message["content"][0]["text"] == "Hello"
    assert message["status"] == "completed"
    assert response["status"] == "completed"
    assert response["usage"]["input_tokens"] == 7
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 4
    assert response["usage"]["output_tokens"] == 3


def test_responses_function_call() -> None:
    out, response = encode_response(TEXT_THEN_CALL)
    types = [e["type"] for e in out]
    assert types.index("response.output_item.done") < types.index(
        "response.function_call_arguments.delta"
    )
    deltas = [e["delta"] for e in out if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == ARGS
    message, call = response["output"]
    assert message["content"][0]["text"] == "Let me look."
    assert call["type"] == "function_call"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "weather", ARGS)
    assert call["status"] == "completed"
    assert call["id"].startswith("fc_") and message["id"].startswith("msg_")


def test_responses_cut_by_max_output_tokens() -> None:
    out, response = encode_response(CUT)
    assert out[-1]["type"] == "response.incomplete"
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_responses_nothing_generated_is_an_empty_message() -> None:
    _, response = encode_response(NOTHING)
    (message,) = response["output"]
    assert message["content"][0]["text"] == ""


def test_responses_failure_mid_stream() -> None:
    encoder = ResponseEncoder(response_skeleton())
    out = encoder.start() + encoder.feed(TextDelta(0, "Hi"))
    out += encoder.fail(EngineError("the replica failed: OSError"))
    for e in out:
        check(OPENAI_EVENTS, e)
    assert [e["type"] for e in out[-2:]] == ["error", "response.failed"]
    assert encoder.response["status"] == "failed"
    assert encoder.response["error"]["message"] == "the replica failed: OSError"


@pytest.mark.parametrize("events", [TEXT, CALL, TEXT_THEN_CALL, CUT, NOTHING])
def test_messages_events_are_the_sdks(events: list[Event]) -> None:
    out, message = encode_message(events)
    for e in out:
        if e["type"] != "ping":  # not in the SDK's union: its stream skips pings
            check(ANTHROPIC_EVENTS, e)
    anthropic.types.Message.model_validate(message)
    assert [e["type"] for e in out[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in out[-2:]] == ["message_delta", "message_stop"]
    # Every block that starts stops, in order, before the next starts.
    opened = [e["index"] for e in out if e["type"] == "content_block_start"]
    closed = [e["index"] for e in out if e["type"] == "content_block_stop"]
    assert opened == closed == list(range(len(message["content"])))


def test_messages_text_then_tool_use() -> None:
    out, message = encode_message(TEXT_THEN_CALL)
    text, call = message["content"]
    assert text == {"type": "text", "text": "Let me look."}
    assert call == {
        "type": "tool_use",
        "id": "call_1",
        "name": "weather",
        "input": {"city": "Paris"},
    }
    partial = [
        e["delta"]["partial_json"]
        for e in out
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert "".join(partial) == ARGS
    assert message["stop_reason"] == "tool_use"
    assert out[-2]["delta"]["stop_reason"] == "tool_use"
    # Anthropic's input_tokens are those not read from the cache.
    assert message["usage"] == {
        "input_tokens": 3,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }


@pytest.mark.parametrize(
    ("events", "reason"), [(TEXT, "end_turn"), (CUT, "max_tokens"), (NOTHING, "end_turn")]
)
def test_messages_stop_reasons(events: list[Event], reason: str) -> None:
    out, message = encode_message(events)
    assert message["stop_reason"] == reason
    assert out[-2]["delta"] == {"stop_reason": reason, "stop_sequence": None}


def test_messages_stop_sequence() -> None:
    stopped: list[Event] = [TextDelta(0, "Hello"), ChoiceEnd(0, "stop", "\n\n"), Finished(USAGE)]
    out, message = encode_message(stopped)
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "\n\n")
    assert out[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}


def test_messages_failure_mid_stream() -> None:
    encoder = MessageEncoder(message_skeleton())
    out = encoder.start() + encoder.feed(TextDelta(0, "Hi"))
    out += encoder.fail(EngineError("the replica failed: OSError"))
    assert out[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "the replica failed: OSError"},
    }


# A tick: the stream was quiet a long while (a long prefill); the encoder's activity().
TICK = None


def with_activity(encoder: Any, events: list[Event | None]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = encoder.start()
    for e in events:
        out += encoder.activity() if e is None else encoder.feed(e)
    return out


@pytest.mark.parametrize("events", [TEXT, CALL, TEXT_THEN_CALL, CUT, NOTHING])
def test_responses_activity_is_in_progress_again_and_changes_nothing(events: list[Event]) -> None:
    _, plain = encode_response(events)
    encoder = ResponseEncoder(response_skeleton())
    out = with_activity(encoder, [TICK, TICK, events[0], TICK, *events[1:]])
    for e in out:
        check(OPENAI_EVENTS, e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out[2:4]] == ["response.in_progress"] * 2
    ids = {"id": None}  # item ids are new each time
    assert [{**i, **ids} for i in encoder.response["output"]] == [
        {**i, **ids} for i in plain["output"]
    ]


def accumulated(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The message the Anthropic SDK's own stream accumulator makes of ``out``."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for e in out:
        if e["type"] == "ping":
            continue
        event = ANTHROPIC_EVENTS[e["type"]].model_validate(e)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    return snapshot.model_dump(exclude_none=True)


def test_messages_activity_opens_a_text_block_that_the_answer_continues() -> None:
    # Claude Code counts no ping: a long prefill sends an empty text block, then empty
    # deltas; the answer's text goes on in that block.
    encoder = MessageEncoder(message_skeleton())
    out = with_activity(encoder, [TICK, TICK, TICK, *TEXT])
    assert [e["type"] for e in out[2:5]] == ["content_block_start", *["content_block_delta"] * 2]
    assert out[2]["content_block"] == {"type": "text", "text": ""}
    assert encoder.message["content"] == [{"type": "text", "text": "Hello"}]
    assert accumulated(out)["content"] == encoder.message["content"]


def test_messages_activity_before_a_call_leaves_an_empty_text_block_first() -> None:
    encoder = MessageEncoder(message_skeleton())
    out = with_activity(encoder, [TICK, TICK, *CALL[:2], TICK, *CALL[2:]])
    text, call = encoder.message["content"]
    assert text == {"type": "text", "text": ""}
    assert call["type"] == "tool_use" and call["input"] == PARIS
    opened = [e["index"] for e in out if e["type"] == "content_block_start"]
    closed = [e["index"] for e in out if e["type"] == "content_block_stop"]
    assert opened == closed == [0, 1]
    # Inside the call's block a tick adds nothing (the pings go on).
    assert accumulated(out)["content"][1]["input"] == PARIS
    anthropic.types.Message.model_validate(encoder.message)
