"""Bounds on the numbers a JSON-schema constraint lets a model write.

llguidance compiles an unbounded ``integer`` or ``number`` to ``[1-9][0-9]*``: a
greedy model that starts ``3211123200000000000`` may write digits until
``max_tokens`` and never close the object (llama.cpp's own schema-to-grammar bounds
them). :func:`bound_numbers` rewrites a schema so that every number in it has
bounded digits, using only keywords llguidance compiles (llguidance 1.9 has no
digit-limit option, and a hand-written number grammar could not reach inside its
JSON compiler):

- an integer gets the missing side of about ``[-2**63, 2**63 - 1]`` (what a 64-bit
  integer holds, at most 19 digits) as ``minimum``/``maximum``;
- a number gets the missing side of ``[-1e18, 1e18]`` (at most 19 integer digits;
  llguidance's float ranges stop below 2**63) and ``multipleOf: 1e-10`` (at most 10
  fraction digits, the finest ``multipleOf`` llguidance 1.9 compiles). Both keywords
  also leave out the exponent: a bounded number is written in plain decimals;
- a value of any type (``{}``, ``true``, an object's unlisted properties, an array's
  unlisted items, ``json_object``) becomes a reference to one bounded "any value".

The schema's own bounds are never changed: only the sides it leaves open are closed.
A schema with ``$ref``, ``anyOf``, ``oneOf``, ``allOf``, ``not``, ``const`` or
``enum`` gets no keywords beside them (llguidance would intersect the two); its
branches and definitions are bounded in turn. This module is pure (no llguidance):
the server's tool-call format uses it for the schemas it writes into a Lark grammar.
"""

from __future__ import annotations

from typing import Any

# What a 64-bit signed integer holds. llguidance reads bounds as doubles and negates
# a negative one: -(2**63 - 1) would round to -2**63 and overflow, so the lower bound
# is the double next to it (2**63 - 1 rounds up to 2**63, which saturates to itself).
INTEGER_MAX = 2**63 - 1
INTEGER_MIN = -(2**63 - 1024)
# llguidance builds a float range's regex through i64: bounds stay below 2**63.
NUMBER_MAX = 1e18
# The finest step llguidance 1.9 compiles for multipleOf (1e-11 is refused).
NUMBER_STEP = 1e-10
# The definition every "any value" of a bounded schema refers to.
ANY_NAME = "tokenmill_bounded_any"
ANY_REF = f"#/$defs/{ANY_NAME}"

_COMBINED = ("$ref", "anyOf", "oneOf", "allOf", "not", "const", "enum")
_BRANCHES = ("anyOf", "oneOf", "allOf")
_SINGLE = ("additionalProperties", "items", "not", "additionalItems", "contains")
_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def bound_numbers(schema: Any) -> Any:
    """``schema`` with every number's digits bounded (a new object; the input is
    left as it is). A schema that is not an object or a boolean is returned as is,
    for the compiler to refuse."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    uses_any: list[bool] = []
    bounded = _bound(schema, uses_any)
    if uses_any:
        defs = dict(bounded.get("$defs", {}))
        defs[ANY_NAME] = _bound({}, [])
        bounded["$defs"] = defs
    return bounded


def _sub(schema: Any, uses_any: list[bool]) -> Any:
    """A subschema bounded; ``true`` (any value) becomes the bounded any value."""
    if schema is True:
        uses_any.append(True)
        return {"$ref": ANY_REF}
    if isinstance(schema, dict):
        return _bound(schema, uses_any)
    return schema


def _bound(schema: dict[str, Any], uses_any: list[bool]) -> dict[str, Any]:
    out = dict(schema)
    for key in _BRANCHES:
        if isinstance(out.get(key), list):
            out[key] = [_sub(s, uses_any) for s in out[key]]
    for key in _SINGLE:
        if key in out:
            out[key] = _sub(out[key], uses_any)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _sub(s, uses_any) for name, s in out[key].items()}
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [_sub(s, uses_any) for s in out["prefixItems"]]
    if any(key in out for key in _COMBINED):
        return out
    types = out.get("type")
    kinds = set(types) if isinstance(types, list) else {types} if types else None
    if kinds is None or "number" in kinds:
        _close(out, -NUMBER_MAX, NUMBER_MAX)
        out.setdefault("multipleOf", NUMBER_STEP)
    elif "integer" in kinds:
        _close(out, INTEGER_MIN, INTEGER_MAX)
    # What is not listed may hold any value: the bounded one.
    if (kinds is None or "object" in kinds) and "additionalProperties" not in out:
        uses_any.append(True)
        out["additionalProperties"] = {"$ref": ANY_REF}
    if (kinds is None or "array" in kinds) and "items" not in out:
        uses_any.append(True)
        out["items"] = {"$ref": ANY_REF}
    return out


def _close(schema: dict[str, Any], lowest: float, highest: float) -> None:
    """Add the missing side(s) of ``[lowest, highest]``, never against the other side."""
    low = _bounds(schema, "minimum", "exclusiveMinimum")
    high = _bounds(schema, "maximum", "exclusiveMaximum")
    if not low and (not high or min(high) > lowest):
        schema["minimum"] = lowest
    if not high and (not low or max(low) < highest):
        schema["maximum"] = highest


def _bounds(schema: dict[str, Any], *keys: str) -> list[float]:
    # bool is an int to Python, and draft 4's exclusiveMinimum is a bool: not a bound.
    return [
        float(v)
        for v in (schema.get(k) for k in keys)
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
