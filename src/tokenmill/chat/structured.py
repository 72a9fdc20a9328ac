"""Structured outputs in the prompt: a chat under a JSON constraint is told which JSON.

The constraint itself (:class:`~tokenmill.engines.base.Constraint`) masks every token;
a model that is never told which JSON is wanted still produces valid JSON under the
mask, but fills it with worse values. So a chat whose messages do not already ask for
it gets the format in a system message, as OpenAI does.
"""

from __future__ import annotations

import json

from tokenmill.engines import ChatMessage, Constraint

__all__ = ["instruct"]


def instruct(messages: tuple[ChatMessage, ...], c: Constraint) -> tuple[ChatMessage, ...]:
    """``messages`` with the wanted JSON named in the system message, unless they name
    it already: the schema's text for ``json_schema``, the word JSON for
    ``json_object``. Other constraints (grammars, regexes, choices) are the caller's to
    explain: they are no format a model knows by name."""
    if c.kind == "json_object":
        if any("json" in m.content.lower() for m in messages):
            return messages
        line = "Respond with a JSON object only."
    elif c.kind == "json_schema":
        schema = json.loads(c.text)
        forms = {c.text, json.dumps(schema), json.dumps(schema, indent=2)}
        if any(f in m.content for m in messages for f in forms):
            return messages
        line = f"Respond with JSON only, following this JSON schema:\n{json.dumps(schema)}"
    else:
        return messages
    if messages and messages[0].role == "system":
        first = messages[0]
        return (ChatMessage("system", f"{first.content}\n\n{line}"), *messages[1:])
    return (ChatMessage("system", line), *messages)
