"""The replica frames carry tool calling whole: a request's tools and tool turns, and
the chunks' tool-call pieces, decode to what was encoded."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.engines import (
    ChatMessage,
    Chunk,
    GenerationRequest,
    SamplingParams,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from tokenmill.replicas.wire import chunk_row, decode_chunk_row, decode_request, encode_request


def roundtrip_request(request: GenerationRequest) -> GenerationRequest:
    # Through JSON, as a frame travels.
    return decode_request(json.loads(json.dumps(encode_request(request))))


def test_tools_and_tool_turns_survive_the_wire() -> None:
    messages = (
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "18 C", tool_call_id="call_1"),
    )
    spec = ToolSpec(
        tools='[{"type": "function", "function": {"name": "get_weather"}}]',
        choice='"auto"',
        parallel=False,
    )
    request = GenerationRequest("r1", SamplingParams(max_tokens=8), messages=messages, tools=spec)
    assert roundtrip_request(request) == request
    plain = GenerationRequest("r2", SamplingParams(max_tokens=8), messages=messages[:1])
    assert roundtrip_request(plain) == plain


def test_tool_call_pieces_survive_the_wire() -> None:
    chunks = [
        Chunk("", tool_calls=(ToolCallDelta(0, "call_1", "get_weather", ""),)),
        Chunk(
            "", tool_calls=(ToolCallDelta(0, arguments='{"city": '), ToolCallDelta(1, "c2", "f"))
        ),
        Chunk("", "stop", Usage(10, 4)),
        Chunk("text", index=1),
    ]
    for chunk in chunks:
        row = json.loads(json.dumps(chunk_row("r1", chunk)))
        assert decode_chunk_row(row) == ("r1", chunk)


def test_a_matched_stop_string_survives_the_wire() -> None:
    chunks = [
        Chunk("", "stop", Usage(10, 4), 4, stop_sequence="END"),
        Chunk("last", tokens=3, index=1, choice_finish="stop", stop_sequence="\n"),
        Chunk("", tool_calls=(ToolCallDelta(0, "c1", "f"),), stop_sequence="x"),
    ]
    for chunk in chunks:
        row = json.loads(json.dumps(chunk_row("r1", chunk)))
        assert decode_chunk_row(row) == ("r1", chunk)
    # Rows without it (as an older replica sends them) still decode, to None.
    assert chunk_row("r1", Chunk("", "stop", Usage(1, 1))) == ["r1", "", "stop", [1, 1, 0], 0, None]
    old_rows: list[list[Any]] = [
        ["r1", "", "stop", [1, 1, 0], 1, None],
        ["r1", "a", None, None, 1, None, 1, "stop"],
        ["r1", "", None, None, 1, None, 0, None, [[0, "c1", "f", ""]]],
    ]
    for old in old_rows:
        assert decode_chunk_row(old)[1].stop_sequence is None
