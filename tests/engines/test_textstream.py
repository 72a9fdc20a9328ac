"""TextStream: stop strings and UTF-8 held back until decided, with byte-level inputs."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.engines.textstream import TextStream


def run(pieces: list[bytes], stop: tuple[str, ...]) -> tuple[list[str], bool]:
    ts = TextStream(stop)
    out = [ts.feed(p) for p in pieces]
    out.append(ts.finish())
    return out, ts.stopped


def test_stop_split_across_pieces() -> None:
    out, stopped = run([b"Hello wo", b"rl", b"d and more"], ("world",))
    assert "".join(out) == "Hello "
    assert stopped


def test_the_matched_stop_string_is_named() -> None:
    ts = TextStream(("never", "rl", "world"))
    assert ts.feed(b"Hello wo") == "Hello "
    assert ts.matched is None
    assert ts.feed(b"rld") == ""  # "world" starts before "rl" does
    assert ts.stopped and ts.matched == "world"
    earlier = TextStream(("world", "lo w"))
    assert earlier.feed(b"Hello world") == "Hel" and earlier.matched == "lo w"
    same_start = TextStream(("ab", "abc"))
    assert same_start.feed(b"xabc") == "x" and same_start.matched == "ab"
    assert TextStream(("zz",)).matched is None


def test_partial_stop_is_released_when_it_diverges() -> None:
    out, stopped = run([b"Hello wo", b"nderful"], ("world",))
    assert "".join(out) == "Hello wonderful"
    assert out[0] == "Hello " and not stopped


def test_multibyte_character_split_across_tokens() -> None:
    data = "héllo 世界 🙂".encode()
    out, _ = run([data[i : i + 1] for i in range(len(data))], ())
    assert all("\ufffd" not in o for o in out)
    assert "".join(out) == "héllo 世界 🙂"


def test_cut_character_at_the_end_is_dropped() -> None:
    out, _ = run(["ab🙂".encode()[:4]], ())
    assert "".join(out) == "ab"


@given(
    text=st.text(min_size=0, max_size=60),
    stop=st.text(min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_matches_reference_for_any_split(text: str, stop: str, cuts: list[int]) -> None:
    data = text.encode()
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    pieces = [data[a:b] for a, b in itertools.pairwise(points)]
    ts = TextStream((stop,))
    out = [ts.feed(p) for p in pieces] + [ts.finish()]
    stopped = ts.stopped
    assert ts.matched == (stop if stopped else None)
    joined = "".join(out)
    if stop in text:
        assert joined == text[: text.index(stop)] and stopped
    else:
        assert joined == text and not stopped
    assert all(stop not in o for o in out)
