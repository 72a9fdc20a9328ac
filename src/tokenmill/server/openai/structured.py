"""Structured outputs: the request fields that constrain a generation to a grammar.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), llama-server's
``grammar`` (GBNF) and ``json_schema``, vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and ``structured_outputs``: each becomes one
:class:`~tokenmill.engines.base.Constraint` that names the field it came from, so a
grammar the engine cannot compile is a 400 naming that field. A request may carry one
of them; two are a 400 (which would win is not obvious).

A chat whose messages do not already ask for it gets the format in a system message
(:func:`tokenmill.chat.structured.instruct`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tokenmill.engines import Constraint

__all__ = ["ResponseFormat", "StructuredFields"]


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``: a named JSON Schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or
    ``json_schema`` (with its ``json_schema``)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs its 'json_schema' ({name, schema})")
        return self


def _schema_object(v: dict[str, Any] | str) -> dict[str, Any]:
    """A schema sent as JSON text (vLLM takes either), as the object it stands for."""
    if not isinstance(v, str):
        return v
    try:
        schema = json.loads(v)
    except ValueError:
        raise ValueError("a JSON schema as text must be a JSON object") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema as text must be a JSON object")
    return schema


# A JSON Schema sent as an object or as its JSON text (vLLM takes either): the object.
SchemaObject = Annotated[dict[str, Any] | str, AfterValidator(_schema_object)]


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``."""

    model_config = ConfigDict(extra="ignore")

    json_: SchemaObject | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _one_part(self) -> StructuredOutputs:
        self.constraint()
        return self

    def constraint(self) -> Constraint | None:
        given = [
            c
            for c in (
                None if self.json_ is None else _schema(self.json_, "structured_outputs"),
                None if self.regex is None else Constraint("regex", self.regex),
                None if self.choice is None else Constraint("choice", json.dumps(self.choice)),
                None if self.grammar is None else Constraint("gbnf", self.grammar),
            )
            if c is not None
        ]
        if len(given) > 1:
            raise ValueError("give one of json, regex, choice and grammar")
        if not given:
            return None
        return replace(given[0], param="structured_outputs")


def _schema(value: dict[str, Any] | str, param: str, name: str = "") -> Constraint:
    text = value if isinstance(value, str) else json.dumps(value)
    return Constraint("json_schema", text, name=name, param=param)


class StructuredFields(BaseModel):
    """The structured-output fields of a generation request (a mixin of the request
    models; see the module docstring)."""

    response_format: ResponseFormat | None = Field(
        default=None,
        description="`json_object`, or `json_schema` with {name, schema, strict}: the "
        "output is constrained to it, token by token",
    )
    grammar: str | None = Field(
        default=None, description="a GBNF grammar the output follows (llama-server's)"
    )
    json_schema: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema the output follows (llama-server's)"
    )
    guided_json: SchemaObject | None = Field(
        default=None, description="a JSON Schema the output follows (vLLM's)"
    )
    guided_regex: str | None = Field(
        default=None, description="a regular expression the output matches (vLLM's)"
    )
    guided_choice: list[str] | None = Field(
        default=None, min_length=1, description="the output is one of these strings (vLLM's)"
    )
    guided_grammar: str | None = Field(
        default=None, description="a GBNF grammar the output follows (vLLM's)"
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's: one of json, regex, choice, grammar"
    )

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredFields:
        named = [name for name in _FIELDS if _given(self, name)]
        if len(named) > 1:
            raise ValueError(f"{' and '.join(named)} each constrain the output; send one of them")
        return self

    def constraint(self) -> Constraint | None:
        """The request's constraint, or None."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return Constraint("json_object")
        if rf is not None and rf.json_schema is not None:
            spec = rf.json_schema
            c = _schema(spec.schema_, "response_format", spec.name)
            return Constraint(c.kind, c.text, c.name, spec.strict, c.param)
        if self.grammar:
            return Constraint("gbnf", self.grammar, param="grammar")
        if self.json_schema is not None:
            return _schema(self.json_schema, "json_schema")
        if self.guided_json is not None:
            return _schema(self.guided_json, "guided_json")
        if self.guided_regex is not None:
            return Constraint("regex", self.guided_regex, param="guided_regex")
        if self.guided_choice is not None:
            return Constraint("choice", json.dumps(self.guided_choice), param="guided_choice")
        if self.guided_grammar is not None:
            return Constraint("gbnf", self.guided_grammar, param="guided_grammar")
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return None


_FIELDS = (
    "response_format",
    "grammar",
    "json_schema",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def _given(body: StructuredFields, name: str) -> bool:
    value = getattr(body, name)
    if name == "response_format":
        return value is not None and value.type != "text"
    if name == "grammar":
        return bool(value)  # llama-server's clients send "" for none
    return value is not None
