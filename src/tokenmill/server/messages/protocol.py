"""Wire models of Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``): the requests it validates and the shapes that
come back (which the OpenAPI document is built from).

A field that asks for something tokenmill does not do (extended thinking, server
tools such as web search, images, MCP servers...) is refused with a 400 naming it;
one that changes nothing about the output (``metadata``, ``cache_control``,
``service_tier``) is accepted; one unknown to tokenmill is ignored. Errors go out in
Anthropic's shape (:func:`tokenmill.server.errors.anthropic_body`). This module knows
the wire format only; what a request means to generation is
:mod:`tokenmill.server.messages.serving`'s business.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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

from tokenmill.server.intake import unsupported

# Anthropic's rule for a tool's name.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 16

Number = Annotated[float, Field(allow_inf_nan=False)]
# The tags of the unions below (a block, a tool picked by its ``type``): a 400 names
# the field without them (tokenmill.server.intake.parse_body).
TAGS = frozenset(
    {"block:text", "block:tool_use", "block:tool_result", "block:other"}
    | {"tool:custom", "tool:other"}
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _kind(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


# -- content blocks -------------------------------------------------------------------


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    """A call the assistant made (an earlier answer, sent back)."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    """The result of a call, by its ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class UnsupportedBlock(_Model):
    """Images, documents, thinking, server tools' blocks...: refused."""

    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise unsupported(
            f"content blocks of type {v!r}", "send text, tool_use and tool_result blocks"
        )


def _block_tag(value: Any) -> str:
    kind = _kind(value)
    return f"block:{kind}" if kind in ("text", "tool_use", "tool_result") else "block:other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("block:text")]
    | Annotated[ToolUseBlock, Tag("block:tool_use")]
    | Annotated[ToolResultBlock, Tag("block:tool_result")]
    | Annotated[UnsupportedBlock, Tag("block:other")],
    Discriminator(_block_tag),
]


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return [b for b in self.content if not isinstance(b, UnsupportedBlock)]


# -- tools ----------------------------------------------------------------------------


class CustomTool(_Model):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema of the input (an object)")


class ServerTool(_Model):
    """Web search, code execution, bash, text editor, computer use...: refused."""

    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise unsupported(f"the server tool {v!r}", "offer custom tools (with input_schema)")


Tool = Annotated[
    Annotated[CustomTool, Tag("tool:custom")] | Annotated[ServerTool, Tag("tool:other")],
    Discriminator(lambda v: "tool:custom" if _kind(v) in (None, "custom") else "tool:other"),
]


class ToolChoice(_Model):
    """``auto`` (a call or an answer), ``any`` (at least one call), ``tool`` (a call
    of ``name``) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_given(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("type 'tool' needs the tool's 'name'")
        return self


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    effort: Any = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, v: Any) -> Any:
        if v is not None:
            raise unsupported("an effort level (the models served do not reason)")
        return v


class ThinkingConfig(_Model):
    type: str

    @field_validator("type")
    @classmethod
    def _disabled_only(cls, v: str) -> str:
        if v != "disabled":
            raise unsupported("extended thinking (the models served do not reason)")
        return v


# -- requests -------------------------------------------------------------------------

# Refused unless absent or null: what each asks for.
REFUSED = {
    "container": "code execution containers",
    "mcp_servers": "MCP servers",
    "context_management": "context management",
}


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt a request would send."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Refused unless null (REFUSED).
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None

    @field_validator(*REFUSED, mode="after")
    @classmethod
    def _absent_only(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        if value is not None:
            raise unsupported(REFUSED[info.field_name])
        return value

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n\n".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, description="required; strict: the output never has more")
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: Number | None = Field(default=None, ge=0.0, le=1.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    # Accepted no-ops.
    metadata: Any = None
    service_tier: Any = None
    inference_geo: Any = None
    cache_control: Any = None


# -- what comes back ------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextContent(_Out):
    type: Literal["text"]
    text: str


class ToolUseContent(_Out):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(_Out):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageObject(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Annotated[TextContent | ToolUseContent, Field(discriminator="type")]]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(_Out):
    input_tokens: int


class AnthropicErrorDetail(_Out):
    type: str
    message: str


class AnthropicError(_Out):
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageStreamEvent(_Out):
    """An event of a streamed message: ``message_start``, ``content_block_start``,
    ``content_block_delta``, ``content_block_stop``, ``message_delta``,
    ``message_stop``, ``ping`` or ``error``, with its fields."""

    model_config = ConfigDict(extra="allow")
    type: str
