"""The generation core's answers: chunks in, the neutral events every API adapter reads
out (the order the contract in ``tokenmill.chat.events`` promises), without a model."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.chat import (
    ChoiceEnd,
    Event,
    Finished,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from tokenmill.chat.answers import Answer, CallingAnswer, TextAnswer
from tokenmill.engines import Chunk, TokenLogprob, ToolCallDelta

CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
    {"name": "convert", "arguments": {"amount": 3.5, "to": "EUR"}},
]


def run(answer: Answer, chunks: list[Chunk], reason: str = "stop") -> list[Event]:
    events: list[Event] = []
    for chunk in chunks:
        events += answer.take(chunk)[0]
    return events + answer.end(reason)


def pieces(text: str, cuts: list[int]) -> list[str]:
    at = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *at, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if text[a:b]]


def check_order(events: list[Event]) -> None:
    """Each call starts, gets its arguments, ends, before anything else; one ChoiceEnd, last."""
    open_call: int | None = None
    for e in events[:-1]:
        assert not isinstance(e, ChoiceEnd)
        if isinstance(e, ToolCallStart):
            assert open_call is None
            open_call = e.call
        elif isinstance(e, ToolCallArguments):
            assert e.call == open_call
        elif isinstance(e, ToolCallEnd):
            assert e.call == open_call
            open_call = None
        else:
            assert open_call is None
    assert open_call is None
    assert isinstance(events[-1], ChoiceEnd)


@given(st.lists(st.integers(min_value=0), max_size=12))
def test_generic_calls_come_out_whole_in_order(cuts: list[int]) -> None:
    text = json.dumps({"tool_calls": CALLS})
    answer = CallingAnswer.reading(0, "generic")
    events = run(answer, [Chunk(p) for p in pieces(text, cuts)])
    check_order(events)
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [e.name for e in ends] == [c["name"] for c in CALLS]
    assert [json.loads(e.arguments) for e in ends] == [c["arguments"] for c in CALLS]
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.id for s in starts] == [e.id for e in ends]
    assert all(s.id.startswith("call_") for s in starts)
    for end in ends:
        fragments = [
            a.text for a in events if isinstance(a, ToolCallArguments) and a.call == end.call
        ]
        assert "".join(fragments) == end.arguments
    assert events[-1] == ChoiceEnd(0, "tool_calls")


@given(st.lists(st.integers(min_value=0), max_size=8))
def test_a_generic_answer_is_text(cuts: list[int]) -> None:
    reply = 'It is "sunny" in Paris \u2600'
    text = json.dumps({"response": reply})
    events = run(CallingAnswer.reading(0, "generic"), [Chunk(p) for p in pieces(text, cuts)])
    check_order(events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == reply
    assert events[-1] == ChoiceEnd(0, "stop")


def test_markup_calls_and_text_between_them() -> None:
    call = json.dumps(CALLS[0])
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call>"
    events = run(CallingAnswer.reading(2, "markup"), [Chunk(c) for c in text])
    check_order(events)
    assert all(e.choice == 2 for e in events if not isinstance(e, Finished))
    # Whitespace before a tag is held back, and is no text once the tag comes.
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Let me look."
    (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
    assert json.loads(end.arguments) == CALLS[0]["arguments"]
    assert events[-1] == ChoiceEnd(2, "tool_calls")


def test_an_upstreams_calls_keep_their_ids() -> None:
    chunks = [
        Chunk("", tool_calls=(ToolCallDelta(0, id="call_a", name="get_weather"),)),
        Chunk("", tool_calls=(ToolCallDelta(0, arguments='{"city": '),)),
        Chunk("", tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),)),
        Chunk("", tool_calls=(ToolCallDelta(1, id="call_b", name="convert", arguments="{}"),)),
    ]
    events = run(CallingAnswer.reading(0, "forwarded"), chunks)
    check_order(events)
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.id, e.name, e.arguments) for e in ends] == [
        ("call_a", "get_weather", '{"city": "Paris"}'),
        ("call_b", "convert", "{}"),
    ]


def test_a_call_cut_short_ends_with_length() -> None:
    text = json.dumps({"tool_calls": CALLS})[:30]
    events = run(CallingAnswer.reading(0, "generic"), [Chunk(text)], reason="length")
    check_order(events)
    assert events[-1] == ChoiceEnd(0, "length")


def test_an_echoed_prompt_comes_first_and_offsets_count_from_it() -> None:
    token = TokenLogprob(piece=b" world", logprob=-0.5, offset=0)
    answer = TextAnswer(1, prompt=True)
    events = run(answer, [Chunk("Hello"), Chunk(" world", logprobs=(token,))], reason="abort")
    assert events[0] == TextDelta(1, "Hello", prompt=True)
    assert isinstance(events[1], TextDelta)
    assert events[1].logprobs[0].offset == len("Hello")
    assert events[-1] == ChoiceEnd(1, "stop")  # an abort is a stop to a client
