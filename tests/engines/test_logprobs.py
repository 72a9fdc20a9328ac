"""TokenAligner: a token's log probability leaves with its text, never before or without it."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.engines import TokenLogprob
from tokenmill.engines.logprobs import MIN_LOGPROB, TokenAligner
from tokenmill.engines.textstream import TextStream


def run(pieces: list[bytes], stop: tuple[str, ...]) -> list[tuple[str, tuple[TokenLogprob, ...]]]:
    """(text, tokens) per chunk as an engine emits them, the flush at the end included."""
    stream, aligner = TextStream(stop), TokenAligner()
    out = []
    for i, piece in enumerate(pieces):
        text = stream.feed(piece)
        aligner.add(piece, -float(i), (), stream.decoded, stream.partial)
        out.append((text, aligner.release(len(text))))
        if stream.stopped:
            return out
    text = stream.finish()
    out.append((text, aligner.release(len(text))))
    return out


def joined(chunks: list[tuple[str, tuple[TokenLogprob, ...]]]) -> tuple[str, bytes]:
    text = "".join(t for t, _ in chunks)
    return text, b"".join(tok.piece for _, toks in chunks for tok in toks)


def test_tokens_leave_with_their_text() -> None:
    chunks = run([b"Hello", b" wo", b"rld"], ())
    assert [(t, [tok.piece for tok in toks]) for t, toks in chunks] == [
        ("Hello", [b"Hello"]),
        (" wo", [b" wo"]),
        ("rld", [b"rld"]),
        ("", []),
    ]
    assert [tok.offset for _, toks in chunks for tok in toks] == [0, 5, 8]


def test_held_back_text_holds_its_tokens_back() -> None:
    # " wo" may begin "world": held, and its token with it, until "nder" decides.
    chunks = run([b"Hello", b" wo", b"nder"], ("world",))
    assert chunks[1] == (" ", ())
    assert chunks[2][0] == "wonder"
    assert [tok.piece for tok in chunks[2][1]] == [b" wo", b"nder"]


def test_tokens_a_stop_string_swallows_are_dropped() -> None:
    chunks = run([b"Hello", b" wo", b"rld", b"!"], ("world",))
    text, pieces = joined(chunks)
    # " wo" begins the stop string: its " " is returned, the token is not.
    assert text == "Hello " and pieces == b"Hello"


def test_a_character_split_across_tokens_leaves_with_the_token_that_ends_it() -> None:
    euro = "€".encode()
    chunks = run([b"a", euro[:1], euro[1:], b"b"], ())
    assert chunks[1] == ("", ())
    assert chunks[2][0] == "€"
    assert [tok.piece for tok in chunks[2][1]] == [euro[:1], euro[1:]]
    assert [tok.offset for tok in chunks[2][1]] == [1, 1]


def test_a_token_ending_inside_a_stop_string_is_not_reported() -> None:
    # One token holds "a€" and the first byte of "é"; the next completes "é", which is
    # the stop string: "a€" is returned, but the first token's text never was in full.
    data = "a€é".encode()
    chunks = run([data[:5], data[5:]], ("é",))
    assert "".join(text for text, _ in chunks) == "a€"
    assert [tok for _, toks in chunks for tok in toks] == []


def test_a_character_finished_by_the_stop_token_takes_its_first_token_along() -> None:
    # "€" is split across two tokens; the second also holds "é", the stop string. "€"
    # is returned, but neither token is: the second holds the stop string's start, and
    # the first ends inside "€", so it could only leave with the second. (Found by the
    # property test below.)
    data = "€é".encode()
    chunks = run([data[:2], data[2:]], ("é",))
    assert joined(chunks) == ("€", b"")


def test_no_infinite_logprobs() -> None:
    aligner = TokenAligner()
    aligner.add(b"x", float("-inf"), (), 1)
    assert aligner.release(1)[0].logprob == MIN_LOGPROB


@given(
    st.text(alphabet="ab x\u00e9\u20ac\U0001f642", max_size=12),
    st.lists(st.integers(min_value=1, max_value=30), max_size=12),
    st.lists(st.sampled_from(["ab", "\u00e9", "b\u20ac", "x "]), max_size=2),
)
def test_reported_tokens_are_exactly_the_returned_text(
    source: str, cuts: list[int], stops: list[str]
) -> None:
    data = source.encode()
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    chunks = run(pieces, tuple(stops))
    text, reported = joined(chunks)
    # Only tokens whose text was returned, in order, from the start: a prefix of it...
    assert text.encode().startswith(reported)
    # ...short of the text by less than the one token a stop string began in, plus the
    # first bytes (at most 3) of a character that token completes: the tokens holding
    # them leave with that character, so with it they are not reported either.
    unreported = len(text.encode()) - len(reported)
    assert unreported == 0 or unreported < max(len(p) for p in pieces) + 3
    if not any(s in source for s in stops):
        assert reported == data and text == source
