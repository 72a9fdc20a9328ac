"""Wire models of tool calling: the ``tools`` a chat request offers, its
``tool_choice``, the ``tool_calls`` of an assistant turn, and the shapes of the calls
that come back (whole, and as stream deltas).

Imported by :mod:`tokenmill.server.openai.protocol` and
:mod:`~tokenmill.server.openai.replies`, so it imports nothing of them.
Each model says what it is to the generation core (:mod:`tokenmill.chat.request`);
what the fields mean to generation is :mod:`tokenmill.chat.tools`' business.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from tokenmill import chat
from tokenmill.engines import ToolCall as CallMade

# OpenAI's rule for a function's name: the name is what the model writes, and what
# the client dispatches on.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# Tools one request may offer: OpenAI's limit. Each is described in the prompt and is
# a branch of the grammar every token is checked against.
MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema of the arguments (an object); none: no arguments"
    )
    strict: bool | None = Field(
        default=None, description="accepted; the arguments always match `parameters`"
    )


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition

    def function_tool(self) -> chat.FunctionTool:
        f = self.function
        return chat.FunctionTool(f.name, f.description, f.parameters, f.strict)


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this tool."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionName


def _choice_kind(value: Any) -> str:
    # Tagged by the JSON type so that an error names "tool_choice.function.name", not
    # the model's class (the server's error mapping drops these tags).
    return "str" if isinstance(value, str) else "dict"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("dict")],
    Discriminator(_choice_kind),
]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class MessageToolCall(BaseModel):
    """A call an assistant turn made (a message of the request)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def call_made(self) -> CallMade:
        return CallMade(self.id or "", self.function.name, self.function.arguments)


class ToolFields(BaseModel):
    """The tool fields of a chat request. A mixin of the request models that take
    them; ``IMPLEMENTED`` lifts their refusal (:mod:`tokenmill.server.refused`)."""

    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})

    tools: list[Tool] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description="functions the model may call (chat only)",
    )
    tool_choice: ToolChoice | None = Field(
        default=None,
        description="`auto` (the default with tools): a call or an answer; `required`: "
        "at least one call; a named function: a call of it; `none`: no call",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one call a turn (default: several)"
    )


def tool_choice(choice: Literal["none", "auto", "required"] | NamedToolChoice) -> chat.ToolChoice:
    if isinstance(choice, NamedToolChoice):
        return chat.NamedTool(choice.function.name)
    return choice


# -- responses ------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalledFunction(_Response):
    name: str
    arguments: str = Field(description="the arguments as JSON text, valid against the schema")


class ToolCall(_Response):
    """A call in a response's ``message.tool_calls``."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    """A piece of a streamed call: ``id``, ``type`` and ``function.name`` come once
    (with ``arguments: ""``), then ``function.arguments`` fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta
