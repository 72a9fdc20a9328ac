"""ToolCallReader: the generic tool format read incrementally, against a reference
(json.loads of the whole text), for any way the text is cut into pieces."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.chat.toolcalls import (
    ArgumentsDelta,
    CallOpened,
    ContentDelta,
    MarkupReader,
    ToolCallReader,
)


def read(pieces: list[str]) -> tuple[list[Any], ToolCallReader]:
    reader = ToolCallReader()
    events: list[Any] = []
    for p in pieces:
        events += reader.feed(p)
    events += reader.close()
    return events, reader


def assembled(events: list[Any]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls (name, arguments text) the events add up to."""
    content = ""
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content += e.text
        elif isinstance(e, CallOpened):
            assert e.index == len(calls), "calls open in order, each once"
            calls.append([e.name, ""])
        else:
            assert isinstance(e, ArgumentsDelta)
            assert e.index == len(calls) - 1, "arguments come after their call's name"
            calls[e.index][1] += e.text
    return content, [(name, args) for name, args in calls]


def cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def test_calls_stream_name_first_then_argument_fragments() -> None:
    text = (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},'
        ' {"name": "get_time", "arguments": {}}]}'
    )
    events, reader = read([text[i : i + 4] for i in range(0, len(text), 4)])
    assert reader.complete and reader.calls == 2
    assert isinstance(events[0], CallOpened) and events[0].name == "get_weather"
    args = [e for e in events if isinstance(e, ArgumentsDelta) and e.index == 0]
    assert len(args) > 3, "arguments go out as they come, not at the end"
    assert assembled(events) == (
        "",
        [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")],
    )


def test_response_is_decoded_as_it_comes() -> None:
    text = '{"response": "caf\\u00e9 \\ud83d\\ude00 \\"quoted\\"\\n"}'
    events, reader = read(list(text))
    assert reader.complete and reader.calls == 0
    assert assembled(events) == ('café 😀 "quoted"\n', [])
    # One character at a time in, whole characters out: never half a surrogate pair.
    assert all("\ufffd" not in e.text for e in events)


def test_a_name_held_until_whole() -> None:
    reader = ToolCallReader()
    assert reader.feed('{"tool_calls": [{"name": "get_wea') == []
    assert reader.feed('ther", "arg') == [CallOpened(0, "get_weather")]


def test_structured_response_is_its_json_text() -> None:
    events, _ = read(['{"response": {"a": [1, ', "2.5e3]}}"])
    assert assembled(events) == ('{"a": [1, 2.5e3]}', [])


def test_single_call_key_and_arguments_before_name() -> None:
    events, reader = read(['{"tool_call": {"arguments": {"x": true}, ', '"name": "f"}}'])
    assert reader.complete and assembled(events) == ("", [("f", '{"x": true}')])


def test_plain_text_is_content() -> None:
    events, reader = read(["Hello", " there {"])
    assert reader.passthrough and not reader.complete
    assert assembled(events) == ("Hello there {", [])


def test_text_that_stops_being_the_format_keeps_what_was_not_reported() -> None:
    events, _ = read(['{"tool_calls": [{"nam', "e\": 'oops'"])
    assert assembled(events) == ('{"tool_calls": [{"name": \'oops\'', [])
    # Once something was reported, the content goes on from where the format broke.
    events, _ = read(['{"response": "hi"', " and more"])
    assert assembled(events) == ("hiand more", [])


def test_cut_short() -> None:
    events, reader = read(['{"tool_calls": [{"name": "f", "arguments": {"q": "abc'])
    assert not reader.complete and reader.calls == 1
    assert assembled(events) == ("", [("f", '{"q": "abc')])


def test_text_after_the_object_is_ignored() -> None:
    events, reader = read(['{"response": "a"}\n\n', "more"])
    assert reader.complete and assembled(events) == ("a", [])


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**12), max_value=10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
names = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
separators = st.sampled_from([(", ", ": "), (",", ":"), (",\n  ", " : ")])


@given(
    calls=st.lists(
        st.tuples(names, st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
        min_size=1,
        max_size=3,
    ),
    seps=separators,
    ascii_only=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20),
)
def test_calls_match_the_reference_for_any_split(
    calls: list[tuple[str, dict[str, Any]]],
    seps: tuple[str, str],
    ascii_only: bool,
    cuts: list[int],
) -> None:
    body = {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}
    text = json.dumps(body, separators=seps, ensure_ascii=ascii_only)
    events, reader = read(cut(text, cuts))
    content, got = assembled(events)
    assert reader.complete and content == ""
    assert [n for n, _ in got] == [n for n, _ in calls]
    assert [json.loads(a) for _, a in got] == [a for _, a in calls]
    # The arguments are the very text generated: streamed and whole reads agree.
    whole, _ = read([text])
    assert assembled(whole) == (content, got)


@given(
    answer=st.text(max_size=80),
    seps=separators,
    ascii_only=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20),
)
def test_response_matches_the_reference_for_any_split(
    answer: str, seps: tuple[str, str], ascii_only: bool, cuts: list[int]
) -> None:
    text = json.dumps({"response": answer}, separators=seps, ensure_ascii=ascii_only)
    events, reader = read(cut(text, cuts))
    assert reader.complete
    assert assembled(events) == (answer, [])


@given(text=st.text(max_size=40), cuts=st.lists(st.integers(min_value=0, max_value=200)))
def test_text_that_is_not_json_is_all_content(text: str, cuts: list[int]) -> None:
    events, reader = read(cut(text, cuts))
    if text.strip() and not text.lstrip().startswith("{"):
        assert reader.passthrough
        assert assembled(events) == (text, [])


# -- a template's markup ------------------------------------------------------------------


def read_markup(pieces: list[str]) -> tuple[list[Any], MarkupReader]:
    reader = MarkupReader()
    events: list[Any] = []
    for p in pieces:
        events += reader.feed(p)
    events += reader.close()
    return events, reader


def test_markup_calls_stream_and_no_tag_reaches_the_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    events, reader = read_markup(list(text))
    assert reader.complete and reader.calls == 2
    # The whitespace before a tag is no content.
    assert assembled(events) == (
        "Let me check.",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    )
    assert all("<" not in e.text for e in events if isinstance(e, ContentDelta))


def test_a_tag_that_is_no_call_is_content() -> None:
    events, _ = read_markup(["a <tool", "_call> not json", " b"])
    assert assembled(events) == ("a <tool_call> not json b", [])
    events, _ = read_markup(["x <tool_c", "ar> y"])
    assert assembled(events) == ("x <tool_car> y", [])


@given(
    before=st.text(max_size=20).filter(lambda t: "<" not in t),
    calls=st.lists(
        st.tuples(names, st.dictionaries(st.text(max_size=8), json_values, max_size=3)),
        max_size=3,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20),
)
def test_markup_matches_the_reference_for_any_split(
    before: str, calls: list[tuple[str, dict[str, Any]]], cuts: list[int]
) -> None:
    tags = "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )
    text = before + ("\n" if before and calls else "") + tags
    events, reader = read_markup(cut(text, cuts))
    content, got = assembled(events)
    assert reader.complete
    assert content.strip() == before.strip()
    assert [n for n, _ in got] == [n for n, _ in calls]
    assert [json.loads(a) for _, a in got] == [a for _, a in calls]
