"""Every number a JSON constraint allows has bounded digits (issue 29).

The constraint is compiled as the engine compiles it (``grammar_text``) and run by
llguidance over a vocabulary of single bytes, without a model. A walker writes what
a runaway model would: once in a number, a digit whenever the grammar allows one
(then a point, an exponent, a sign); elsewhere what hypothesis draws among the
allowed bytes, closing strings at once. If any number were unbounded the walk would
never end; bounded, it ends in valid JSON whose every number has at most 19 integer
digits, at most 10 fraction digits and no exponent.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.engines import Constraint
from tokenmill.engines.json_numbers import INTEGER_MAX, INTEGER_MIN, bound_numbers
from tokenmill.engines.llamacpp.grammar import grammar_text

EOS = 256
# Bytes drawn freely before the walker steers to the end (closing what is open).
EXPLORE = 200
# Far beyond any bounded walk (EXPLORE, then closing: a number is <= 31 bytes).
MAX_BYTES = 1000
NUMBER = re.compile(r"-?(0|[1-9][0-9]{0,18})(\.[0-9]{1,10})?")
DIGITS = b"0123456789"
# Inside a number, what a runaway model writes next, best first.
RUNAWAY = [DIGITS, b".", b"eE", b"+-"]
CLOSERS = b'"]}'


class Bytes:
    """A tokenizer whose tokens are the 256 bytes, and an end-of-sequence token."""

    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def matcher(constraint: Constraint) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(TOKENIZER, grammar_text(constraint), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def allowed(m: llguidance.LLMatcher) -> list[int]:
    mask = m.compute_bitmask()
    return [t for t in range(EOS + 1) if mask[t // 8] >> (t % 8) & 1]


def walk(m: llguidance.LLMatcher, data: st.DataObject) -> str:
    """Write until the grammar allows nothing but the end: a runaway model's text.

    Inside a number it always writes more (a digit, else a point, an exponent, a
    sign) while the grammar allows it; elsewhere hypothesis draws among the allowed
    bytes, and after ``EXPLORE`` bytes the walker closes what is open.
    """
    out = bytearray()
    in_string = escaped = in_number = False
    while len(out) < MAX_BYTES:
        options = allowed(m)
        assert options, (m.get_error(), out)
        if options == [EOS]:
            return out.decode()
        choices = [t for t in options if t != EOS]
        if in_number:
            choices = next(
                ([b for b in bs if b in choices] for bs in RUNAWAY if set(bs) & set(choices)),
                choices,
            )
        elif in_string and ord('"') in choices:
            choices = [ord('"')]
        elif len(out) > EXPLORE and set(CLOSERS) & set(choices):
            choices = [b for b in CLOSERS if b in choices][:1]
        pick = data.draw(st.sampled_from(choices))
        assert m.consume_token(pick), m.get_error()
        out.append(pick)
        if not in_string:
            in_number = (in_number and pick in b"0123456789.eE+-") or pick in b"-0123456789"
        if in_string and not escaped and pick == ord('"'):
            in_string = False
        elif not in_string and pick == ord('"'):
            in_string = True
        escaped = in_string and not escaped and pick == ord("\\")
    raise AssertionError(f"no end after {MAX_BYTES} bytes: {out[:200]!r}…{out[-200:]!r}")


def numbers(text: str) -> list[str]:
    """Every number of a JSON text, as written."""
    found: list[str] = []

    def keep(raw: str) -> str:
        found.append(raw)
        return raw

    json.loads(text, parse_int=keep, parse_float=keep)
    return found


# Schemas whose numbers nothing bounds: no bound, or one side only, at any depth.
one_sided = st.sampled_from(
    [{}, {"minimum": 0}, {"exclusiveMinimum": -3}, {"maximum": 7}, {"exclusiveMaximum": 2.5}]
)
number = st.builds(
    lambda kind, bound: {"type": kind, **bound},
    st.sampled_from(["integer", "number", ["number", "null"], ["integer", "string"]]),
    one_sided,
)
leaf = st.one_of(number, st.just({}), st.just({"type": "object"}), st.just({"type": "array"}))


def containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = st.sampled_from(["a", "b", "c", "n"])
    return st.one_of(
        st.builds(
            lambda props, closed: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                **({"additionalProperties": False} if closed else {}),
            },
            st.dictionaries(names, inner, min_size=1, max_size=3),
            st.booleans(),
        ),
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 3}, inner),
        st.builds(lambda options: {"anyOf": options}, st.lists(inner, min_size=1, max_size=3)),
    )


schemas = st.recursive(leaf, containers, max_leaves=6)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, data=st.data())
def test_every_number_a_schema_allows_is_bounded(schema: Any, data: st.DataObject) -> None:
    constraint = Constraint("json_schema", json.dumps(schema))
    text = walk(matcher(constraint), data)
    for raw in numbers(text):
        assert NUMBER.fullmatch(raw), (raw, schema)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_json_object_numbers_are_bounded(data: st.DataObject) -> None:
    text = walk(matcher(Constraint("json_object")), data)
    assert isinstance(json.loads(text), dict)
    assert all(NUMBER.fullmatch(raw) for raw in numbers(text)), text


def test_integers_reach_what_64_bits_hold_and_no_further() -> None:
    m = matcher(Constraint("json_schema", json.dumps({"type": "integer"})))
    for fits, text in [
        (True, str(INTEGER_MAX)),
        (False, str(INTEGER_MAX + 1)),
        (True, str(INTEGER_MIN)),
        (False, str(INTEGER_MIN - 1)),
    ]:
        probe = m.deep_copy()
        consumed = probe.try_consume_tokens(list(text.encode()))
        assert (consumed == len(text) and probe.is_accepting()) == fits, text


def test_a_schemas_own_bounds_are_kept() -> None:
    given_bounds = {"type": "integer", "minimum": 3, "exclusiveMaximum": 10}
    assert bound_numbers(given_bounds) == given_bounds
    assert bound_numbers({"type": "number", "maximum": 5, "multipleOf": 0.5}) == {
        "type": "number",
        "maximum": 5,
        "multipleOf": 0.5,
        "minimum": -1e18,
    }
    # Beyond the default range, the open side stays open rather than contradict it.
    assert bound_numbers({"type": "integer", "minimum": 10**20}) == {
        "type": "integer",
        "minimum": 10**20,
    }
    # Alongside $ref/anyOf/const/enum nothing is added: the branches are bounded.
    tagged = {"anyOf": [{"type": "integer"}], "enum": [1, 2]}
    assert bound_numbers(tagged) == {
        "anyOf": [{"type": "integer", "minimum": INTEGER_MIN, "maximum": INTEGER_MAX}],
        "enum": [1, 2],
    }
