"""Request fields tokenmill does not implement: refused by name, never silently dropped.

OpenAI's API (and vLLM's and llama-server's extensions of it) has fields that change
what comes back: tools, structured output, beam search... A server that accepted such
a field and ignored it would answer a question that was not asked. So each one is
declared here and refused with a 400 naming it, unless its value asks for nothing
(``tools: []``, ``response_format: {"type": "text"}``): clients and SDKs send those.

Fields that change nothing about the output (``user``, ``metadata``, ``store``...)
are declared as accepted no-ops. A field in neither list is unknown to tokenmill and
ignored, as OpenAI's clients send fields a given server may not know.

The OpenAPI document shows each refused field with its neutral values only, so a
client generated from it never sends one that would be refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

# The pydantic error type of a refusal; the 400 carries it as its ``code``.
UNSUPPORTED = "unsupported_parameter"


@dataclass(frozen=True)
class Refused:
    """A field tokenmill does not implement: what it asks for, and its neutral values."""

    what: str
    neutral: tuple[Any, ...]

    def accepts(self, value: Any) -> bool:
        return value is None or any(_same(value, n) for n in self.neutral)

    def schema(self) -> dict[str, Any]:
        options: list[dict[str, Any]] = [_const_schema(n) for n in self.neutral]
        return {"anyOf": [*options, {"type": "null"}]}


def _same(value: Any, neutral: Any) -> bool:
    # JSON's true is not 1, nor false 0 (Python's == says they are).
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(neutral, int | float):
        return isinstance(value, int | float) and value == neutral
    return type(value) is type(neutral) and bool(value == neutral)


def _const_schema(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {k: _const_schema(v) for k, v in value.items()},
            "required": list(value),
            "additionalProperties": False,
        }
    if isinstance(value, list):
        return {"type": "array", "maxItems": len(value), "minItems": len(value)} | (
            {"items": _const_schema(value[0])} if value else {}
        )
    if isinstance(value, bool):
        return {"type": "boolean", "const": value}
    if isinstance(value, int | float):
        return {"type": "number", "const": value}
    return {"type": "string", "const": value}


# The fields of every generation endpoint that tokenmill refuses unless neutral.
REFUSED: dict[str, Refused] = {
    "echo": Refused("echoing the prompt outside /v1/completions", (False,)),
    "best_of": Refused("best-of sampling", (1,)),
    "suffix": Refused("insertion (a suffix)", ("",)),
    "tools": Refused("tool calling", ([],)),
    "tool_choice": Refused("tool calling", ("none", "auto")),
    "functions": Refused("function calling", ([],)),
    "function_call": Refused("function calling", ("none", "auto")),
    "audio": Refused("audio output", ()),
    "modalities": Refused("output modalities other than text", (["text"],)),
    "reasoning_effort": Refused("reasoning effort", ()),
    "verbosity": Refused("verbosity", ()),
    "web_search_options": Refused("web search", ()),
    # vLLM's and llama-server's extensions of the API.
    "min_tokens": Refused("a minimum length", (0,)),
    "stop_token_ids": Refused("stop token ids", ([],)),
    "bad_words": Refused("banned words", ([],)),
    "allowed_token_ids": Refused("allowed token ids", ()),
    "include_stop_str_in_output": Refused("returning the stop string", (False,)),
    "skip_special_tokens": Refused("returning special tokens", (True,)),
    "use_beam_search": Refused("beam search", (False,)),
    "length_penalty": Refused("beam search", (1,)),
    "prompt_logprobs": Refused("prompt log probabilities", ()),
    "add_generation_prompt": Refused("rendering without a generation prompt", (True,)),
    "continue_final_message": Refused("continuing the final message", (False,)),
    "typical_p": Refused("typical sampling", (1,)),
    "mirostat": Refused("mirostat sampling", (0,)),
    "n_probs": Refused("token probabilities", (0,)),
}

# Accepted and changing nothing: bookkeeping for the caller or for OpenAI's platform.
NO_OPS = (
    "user",
    "metadata",
    "store",
    "prompt_cache_key",
    "safety_identifier",
    "parallel_tool_calls",
    "prediction",
)


def _refused_field(name: str) -> Any:
    spec = REFUSED[name]
    return Field(
        default=None,
        description=f"Not supported ({spec.what}): refused unless neutral",
        json_schema_extra=spec.schema(),
    )


class RefusedFields(BaseModel):
    """The refused fields, declared so that the schema and the 400s name them.

    A request model that implements one of them (completions' ``echo``) declares it
    anew and names it in ``IMPLEMENTED``.
    """

    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset()

    echo: Any = _refused_field("echo")
    best_of: Any = _refused_field("best_of")
    suffix: Any = _refused_field("suffix")
    tools: Any = _refused_field("tools")
    tool_choice: Any = _refused_field("tool_choice")
    functions: Any = _refused_field("functions")
    function_call: Any = _refused_field("function_call")
    audio: Any = _refused_field("audio")
    modalities: Any = _refused_field("modalities")
    reasoning_effort: Any = _refused_field("reasoning_effort")
    verbosity: Any = _refused_field("verbosity")
    web_search_options: Any = _refused_field("web_search_options")
    min_tokens: Any = _refused_field("min_tokens")
    stop_token_ids: Any = _refused_field("stop_token_ids")
    bad_words: Any = _refused_field("bad_words")
    allowed_token_ids: Any = _refused_field("allowed_token_ids")
    include_stop_str_in_output: Any = _refused_field("include_stop_str_in_output")
    skip_special_tokens: Any = _refused_field("skip_special_tokens")
    use_beam_search: Any = _refused_field("use_beam_search")
    length_penalty: Any = _refused_field("length_penalty")
    prompt_logprobs: Any = _refused_field("prompt_logprobs")
    add_generation_prompt: Any = _refused_field("add_generation_prompt")
    continue_final_message: Any = _refused_field("continue_final_message")
    typical_p: Any = _refused_field("typical_p")
    mirostat: Any = _refused_field("mirostat")
    n_probs: Any = _refused_field("n_probs")

    # No-ops: any value, nothing changes.
    metadata: Any = None
    store: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None

    @field_validator(*REFUSED, mode="after")
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        assert name is not None
        if name in cls.IMPLEMENTED:
            return value
        spec = REFUSED[name]
        if not spec.accepts(value):
            neutral = " or ".join(json.dumps(n) for n in spec.neutral)
            allowed = f"; send {neutral} or leave it out" if neutral else "; leave it out"
            detail = f"tokenmill does not support {spec.what}{allowed}"
            # The message is a template: the JSON braces travel in its context.
            raise PydanticCustomError(UNSUPPORTED, "{detail}", {"detail": detail})
        return value
