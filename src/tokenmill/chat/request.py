"""What an API adapter gives the core: one generation, in no API's shape.

Plain frozen dataclasses, no validation library: the adapter has validated its own
wire format (types, lengths, names' patterns) before building these; the core checks
what only it can judge (see :func:`tokenmill.chat.generation.open_generation`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.engines import Constraint, PromptItem, SamplingParams, ToolCall

__all__ = ["ChatRequest", "FunctionTool", "NamedTool", "ResponseFormat", "ToolChoice", "Turn"]

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of a conversation. An assistant turn may carry the calls it made
    (``tool_calls``: ids, names, arguments as JSON text); a ``tool`` turn is the result
    of one (``tool_call_id``, and the tool's ``name`` where the API gives it)."""

    role: Role  # an API's "developer" is "system"
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A function the model may call. ``parameters``: a JSON Schema of its arguments
    (an object schema; None: it takes none). ``strict`` is passed on to an upstream
    server; here the arguments always follow ``parameters``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class NamedTool:
    """``tool_choice`` naming one function: exactly one call of it."""

    name: str


# "auto": a call or an answer; "required": at least one call; "none": no call (the
# tools stay out of the prompt); a NamedTool: one call of that function.
ToolChoice = Literal["auto", "required", "none"] | NamedTool


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A response format: free ``text``, any ``json_object``, or JSON following
    ``schema`` (``json_schema``, with its ``name``)."""

    kind: Literal["text", "json_object", "json_schema"]
    schema: dict[str, Any] | None = None
    name: str = ""
    strict: bool | None = None

    def constraint(self, param: str = "response_format") -> Constraint | None:
        """The engine's constraint (None for text); ``param`` names the field an error
        about it points at."""
        if self.kind == "json_object":
            return Constraint("json_object", param=param)
        if self.kind == "json_schema":
            text = json.dumps(self.schema or {})
            return Constraint("json_schema", text, self.name, self.strict, param)
        return None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One generation: a chat (``messages``; or ``prompt``, then one user turn) or,
    with ``kind="completion"``, a text completion (``prompt``, ``prompt_tokens`` or
    ``prompts``; ``messages`` are rendered by the template and answered as text).

    ``sampling`` is the engine's, its ``constraint`` included (the structured output:
    a :class:`ResponseFormat`'s, or any grammar). Tools are for chats only. Every
    prompt gets ``n`` choices.
    """

    sampling: SamplingParams
    kind: Literal["chat", "completion"] = "chat"
    messages: tuple[Turn, ...] | None = None
    prompt: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    prompts: tuple[PromptItem, ...] | None = None
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice | None = None  # None: not given ("auto" with tools)
    parallel_tool_calls: bool | None = None  # None: not given (several allowed)
    chat_template: str | None = None  # a Jinja template instead of the model's
    n: int = 1
    # Lines of the system turn that change from one session to the next (a working
    # directory, a git status: tokenmill.chat.layout), placed at the end of the first
    # system turn after everything the core adds to it (the tools' description, a JSON
    # schema), so that what sessions share is a prefix of the prompt.
    session_lines: str = ""
