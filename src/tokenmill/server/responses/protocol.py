"""Wire models of OpenAI's Responses API (``POST /v1/responses``): the request it
validates, the items a conversation is made of, and the shapes that come back (which
the OpenAPI document is built from).

A field that asks for something tokenmill does not do (``background``, a conversation
object...) is refused with a 400 naming it (code ``unsupported_parameter``), unless
its value asks for nothing; one that asks nothing of a model that does not reason
(``reasoning``, ``include: ["reasoning.encrypted_content"]``) or changes nothing about
the output (``user``, ``service_tier``...) is accepted; one unknown to tokenmill is
ignored, as OpenAI's clients send fields a given server may not know. A ``namespace``
tool is the function tools it groups. Built-in tools (web search...) are kept apart
(:class:`BuiltinToolParam`): the deployment's ``hosted_tools`` decides, in serving,
whether they are refused or left out. This module knows the wire format only: what a request
means to generation is :mod:`tokenmill.server.responses.serving`'s business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tokenmill.server.intake import other_than, unsupported

# OpenAI's rule for a function's name: what the model writes and the client dispatches on.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# Tools one request may offer (OpenAI's limit); each is a branch of the grammar.
MAX_TOOLS = 128
# Items one request may send (its own input, not the stored conversation).
MAX_INPUT_ITEMS = 2048
# OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA = 16

Number = Annotated[float, Field(allow_inf_nan=False)]
# The tags of the unions below (an item, a part, a tool picked by its ``type``): a
# 400 names the field without them (tokenmill.server.intake.parse_body).
TAGS = frozenset(
    {"part:text", "part:refusal", "part:other", "item:message", "item:function_call"}
    | {"item:function_call_output", "item:other", "tool:function", "tool:namespace"}
    | {"tool:other"}
    | {"choice:str", "choice:dict"}
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- content parts and input items -------------------------------------------------


class TextPart(_Model):
    """Text in a message: ``input_text`` (user, system) or ``output_text`` (an
    assistant's earlier answer, as the API returned it)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Model):
    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(_Model):
    """Images, files and audio: the models served read text only."""

    type: str = other_than("input_text", "output_text", "text", "refusal")

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise unsupported(f"content parts of type {v!r} (text only)", "send input_text")


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("input_text", "output_text", "text"):
        return "part:text"
    return "part:refusal" if kind == "refusal" else "part:other"


ContentPart = Annotated[
    Annotated[TextPart, Tag("part:text")]
    | Annotated[RefusalPart, Tag("part:refusal")]
    | Annotated[UnsupportedPart, Tag("part:other")],
    Discriminator(_part_tag),
]


def _text(content: str | list[TextPart | RefusalPart | UnsupportedPart]) -> str:
    if isinstance(content, str):
        return content
    # (An UnsupportedPart never gets this far: its validation refuses it.)
    return "".join(
        p.text if isinstance(p, TextPart) else p.refusal
        for p in content
        if isinstance(p, TextPart | RefusalPart)
    )


class MessageItem(_Model):
    """A message: ``{"role", "content"}`` (``type: "message"`` may be left out), its
    content a string or a list of text parts."""

    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: str | None = None

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(_Model):
    """A call the model made (an earlier response's output, sent back)."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str
    namespace: str | None = None  # the namespace tool the function belongs to
    arguments: str
    status: str | None = None


class FunctionCallOutputItem(_Model):
    """The result of a call, by its ``call_id``."""

    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    status: str | None = None

    def text(self) -> str:
        return _text(self.output)


# Its validator raises whatever the ``type``, and validation is the only way one is
# made (nothing builds these models with ``model_construct``): no validated request
# ever holds one, so a request's items are always of the three kinds above.
class UnsupportedItem(_Model):
    """Items of built-in tools, reasoning, references to stored items...: refused."""

    type: str = other_than("message", "function_call", "function_call_output")

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise unsupported(
            f"input items of type {v!r}",
            "send messages, function_call and function_call_output items",
        )


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    known = kind in ("message", "function_call", "function_call_output")
    return f"item:{kind}" if known else "item:other"


if TYPE_CHECKING:
    # What a validated request holds (see UnsupportedItem): all the type checker sees.
    InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
else:
    InputItem = Annotated[
        Annotated[MessageItem, Tag("item:message")]
        | Annotated[FunctionCallItem, Tag("item:function_call")]
        | Annotated[FunctionCallOutputItem, Tag("item:function_call_output")]
        | Annotated[UnsupportedItem, Tag("item:other")],
        Discriminator(_item_tag),
    ]


# -- tools and formats -----------------------------------------------------------------


class FunctionToolParam(_Model):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema of the arguments (an object)"
    )
    strict: bool | None = Field(
        default=None, description="accepted; the arguments always match `parameters`"
    )


class NamespaceToolParam(_Model):
    """A group of function tools under one name (Codex CLI's ``multi_agent_v1``...):
    the model is offered its functions, and a call of one names the namespace in its
    item's ``namespace``, as OpenAI's do."""

    type: Literal["namespace"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    tools: list[FunctionToolParam] = Field(min_length=1, max_length=MAX_TOOLS)


class BuiltinToolParam(_Model):
    """Web search, file search, code interpreter, computer use, MCP...: tools OpenAI's
    servers run. Refused or left out of the prompt, as the deployment's
    ``hosted_tools`` says (serving decides)."""

    type: str = other_than("function", "namespace")


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"tool:{kind}" if kind in ("function", "namespace") else "tool:other"


ToolParam = Annotated[
    Annotated[FunctionToolParam, Tag("tool:function")]
    | Annotated[NamespaceToolParam, Tag("tool:namespace")]
    | Annotated[BuiltinToolParam, Tag("tool:other")],
    Discriminator(_tool_tag),
]


class NamedFunctionChoice(_Model):
    """``{"type": "function", "name": ...}``: one call of this function."""

    type: Literal["function"]
    name: str


ToolChoiceParam = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("choice:str")]
    | Annotated[NamedFunctionChoice, Tag("choice:dict")],
    Discriminator(lambda v: "choice:str" if isinstance(v, str) else "choice:dict"),
]


class TextFormat(_Model):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its
    ``name`` and ``schema`` (flat, unlike chat's ``response_format``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("type 'json_schema' needs its 'name' and 'schema'")
        return self


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(
        default=None, description="`medium` only (the model's one verbosity)"
    )


# -- the request ----------------------------------------------------------------------

# Fields refused unless their value asks for nothing: what they ask for, and the
# values that ask for nothing (besides null).
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "background": ("background responses", (False,)),
    "conversation": ("the Conversations API (continue with previous_response_id)", ()),
    "prompt": ("stored prompt templates", ()),
    "max_tool_calls": ("a limit on built-in tool calls", ()),
    "top_logprobs": ("log probabilities", (0,)),
    "truncation": ("truncating the conversation", ("disabled",)),
    "context_management": ("context management", ()),
    "moderation": ("moderation", ()),
    "image": ("image generation", ()),
}
# ``include`` values that ask for nothing tokenmill could add: there are no reasoning
# items to carry encrypted content.
NEUTRAL_INCLUDES = frozenset({"reasoning.encrypted_content"})


class ReasoningParam(_Model):
    """How a reasoning model reasons: a model that does not reason has no reasoning
    to spend effort on or summarise, so every value is served the same (no reasoning
    items), as OpenAI's API serves it to such models."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    max_output_tokens: int | None = Field(
        default=None, ge=1, description="strict: the output never has more tokens"
    )
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[ToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=MAX_METADATA
    )
    user: str | None = None
    include: list[str] | None = None
    reasoning: ReasoningParam | None = Field(
        default=None, description="accepted; no effect on a model that does not reason"
    )
    # Accepted no-ops: bookkeeping for OpenAI's platform (and Codex's own).
    service_tier: Any = None
    client_metadata: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    stream_options: Any = None
    # Refused unless neutral (REFUSED).
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None

    @field_validator(*REFUSED, mode="after")
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        what, neutral = REFUSED[info.field_name]
        if value is None or any(type(value) is type(n) and value == n for n in neutral):
            return value
        raise unsupported(what)

    @field_validator("include", mode="after")
    @classmethod
    def _includes(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name not in NEUTRAL_INCLUDES:
                raise unsupported(f"including {name!r}")
        return value

    @field_validator("metadata", mode="after")
    @classmethod
    def _metadata_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and any(len(k) > 64 for k in value):
            raise ValueError("metadata keys are at most 64 characters")
        return value

    def functions(self) -> list[tuple[FunctionToolParam, str | None]]:
        """The function tools offered, each with its namespace (None: a tool alone)."""
        out: list[tuple[FunctionToolParam, str | None]] = []
        for tool in self.tools or []:
            if isinstance(tool, FunctionToolParam):
                out.append((tool, None))
            elif isinstance(tool, NamespaceToolParam):
                out += [(t, tool.name) for t in tool.tools]
        return out

    def builtin_tools(self) -> list[tuple[int, BuiltinToolParam]]:
        """The built-in tools offered, with their index in ``tools``."""
        return [(i, t) for i, t in enumerate(self.tools or []) if isinstance(t, BuiltinToolParam)]

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


class InputItemsQuery(BaseModel):
    """``GET /v1/responses/{id}/input_items``' query."""

    model_config = ConfigDict(extra="ignore")

    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
    include: list[str] | None = None


# -- what comes back ------------------------------------------------------------------
# Declared for the OpenAPI document and checked against real answers by the tests.


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(_Out):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(_Out):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseError(_Out):
    code: Literal["server_error", "rate_limit_exceeded"]
    message: str


class ResponseObject(_Out):
    """A response, as created, stored and read back."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: ResponseError | None
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str]
    user: str | None
    background: bool
    reasoning: dict[str, Any] | None
    truncation: Literal["disabled"]


class StoredItem(_Out):
    """An input item as ``input_items`` lists it: the item as sent, with an ``id``."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: str


class InputItemList(_Out):
    object: Literal["list"]
    data: list[StoredItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(_Out):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class StreamEvent(_Out):
    """An event of a streamed response: ``type`` (``response.created``,
    ``response.output_text.delta``...), its ``sequence_number`` from 0, and its fields."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int
