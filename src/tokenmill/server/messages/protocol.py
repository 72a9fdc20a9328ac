"""Wire models of Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``): the requests it validates and the shapes that
come back (which the OpenAPI document is built from).

A field that asks for something tokenmill does not do (a thinking budget, images, MCP
servers...) is refused with a 400 naming it; one that asks nothing of a model that
does not reason (``thinking`` ``adaptive`` or ``disabled``, ``output_config.effort``)
or changes nothing about the output (``metadata``, ``cache_control``,
``service_tier``) is accepted, as Anthropic's API accepts them; one unknown to
tokenmill is ignored. Server tools (web search...) are kept apart
(:class:`ServerTool`): the deployment's ``hosted_tools`` decides, in serving, whether
they are refused or left out. Errors go out in
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

from tokenmill.server.intake import other_than, unsupported

# Anthropic's rule for a tool's name.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 16

Number = Annotated[float, Field(allow_inf_nan=False)]
# The tags of the unions below (a block, a tool picked by its ``type``): a 400 names
# the field without them (tokenmill.server.intake.parse_body).
TAGS = frozenset(
    {"block:text", "block:tool_use", "block:tool_result", "block:thinking", "block:other"}
    | {"tool:custom", "tool:other", "edit:clear_tool_uses", "edit:clear_thinking"}
    | {"edit:other"}
)
# Effort levels Anthropic's API takes (output_config.effort).
EFFORTS = ("low", "medium", "high", "xhigh", "max")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _kind(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


# -- content blocks -------------------------------------------------------------------


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    # A prompt-caching breakpoint: read as where the client's stable prefix ends
    # (tokenmill.chat.layout), whatever its value; never refused.
    cache_control: Any = None


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


class ThinkingBlock(_Model):
    """An earlier answer's thinking (``thinking`` or ``redacted_thinking``), sent back.
    Accepted in assistant messages and never shown to the model: Anthropic's API
    drops earlier turns' thinking from the prompt too, and a model that does not
    reason has none of its own."""

    type: Literal["thinking", "redacted_thinking"]


class UnsupportedBlock(_Model):
    """Images, documents, server tools' blocks...: refused."""

    type: str = other_than("text", "tool_use", "tool_result", "thinking", "redacted_thinking")

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise unsupported(
            f"content blocks of type {v!r}", "send text, tool_use and tool_result blocks"
        )


def _block_tag(value: Any) -> str:
    kind = _kind(value)
    if kind in ("thinking", "redacted_thinking"):
        return "block:thinking"
    return f"block:{kind}" if kind in ("text", "tool_use", "tool_result") else "block:other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("block:text")]
    | Annotated[ToolUseBlock, Tag("block:tool_use")]
    | Annotated[ToolResultBlock, Tag("block:tool_result")]
    | Annotated[ThinkingBlock, Tag("block:thinking")]
    | Annotated[UnsupportedBlock, Tag("block:other")],
    Discriminator(_block_tag),
]
Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class InputMessage(_Model):
    """A turn. ``system``: an instruction in the middle of the conversation (Claude
    Code's mid-conversation system messages), rendered in its place."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[Block]:
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
    """Web search, code execution, bash, text editor, computer use...: tools the
    server would run. Refused or left out of the prompt, as the deployment's
    ``hosted_tools`` says (serving decides)."""

    type: str = other_than("custom")
    name: str | None = None


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
    # How hard the model thinks: a model that does not reason has one effort, so
    # every level is served the same (as Anthropic's API takes it on such models).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ThinkingConfig(_Model):
    """``adaptive`` (the model decides whether to think: one that does not reason
    never does) and ``disabled`` are served with no thinking blocks; ``enabled`` asks
    for a thinking budget, which serving refuses naming the model."""

    type: Literal["adaptive", "disabled", "enabled"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted", "updates"] | None = None


# -- context management (Anthropic's context editing) ------------------------------


class TokensValue(_Model):
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUsesValue(_Model):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ClearToolUses(_Model):
    """``clear_tool_uses_20250919``: past ``trigger`` (input tokens, default 100,000;
    or tool uses), the oldest tool results are replaced by a placeholder, all but the
    last ``keep`` tool uses (default 3), unless that clears fewer than
    ``clear_at_least`` tokens; ``clear_tool_inputs``: the calls' inputs too."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[TokensValue | ToolUsesValue, Field(discriminator="type")] = TokensValue(
        type="input_tokens", value=100_000
    )
    keep: ToolUsesValue = ToolUsesValue(type="tool_uses", value=3)
    clear_at_least: TokensValue | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ThinkingTurns(_Model):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class AllTurns(_Model):
    type: Literal["all"]


class ClearThinking(_Model):
    """``clear_thinking_20251015``: the thinking of all but the last ``keep``
    assistant turns that have some (default 1; ``all``: none cleared)."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns | AllTurns = ThinkingTurns(type="thinking_turns", value=1)


class UnsupportedEdit(_Model):
    """Server-side compaction (``compact_...``) and edits not known: refused."""

    type: str = other_than("clear_tool_uses_20250919", "clear_thinking_20251015")

    @field_validator("type")
    @classmethod
    def _refuse(cls, v: str) -> str:
        raise unsupported(
            f"the context edit {v!r}", "send clear_tool_uses_20250919 or clear_thinking_20251015"
        )


def _edit_tag(value: Any) -> str:
    kind = _kind(value)
    if kind == "clear_tool_uses_20250919":
        return "edit:clear_tool_uses"
    return "edit:clear_thinking" if kind == "clear_thinking_20251015" else "edit:other"


Edit = Annotated[
    Annotated[ClearToolUses, Tag("edit:clear_tool_uses")]
    | Annotated[ClearThinking, Tag("edit:clear_thinking")]
    | Annotated[UnsupportedEdit, Tag("edit:other")],
    Discriminator(_edit_tag),
]


class ContextManagement(_Model):
    edits: list[Edit] = Field(default_factory=list)


# -- requests -------------------------------------------------------------------------

# Refused unless absent or null: what each asks for.
REFUSED = {
    "container": "code execution containers",
    "mcp_servers": "MCP servers",
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
    context_management: ContextManagement | None = None
    # Refused unless null (REFUSED).
    container: Any = None
    mcp_servers: Any = None

    @field_validator(*REFUSED, mode="after")
    @classmethod
    def _absent_only(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        if value is not None:
            raise unsupported(REFUSED[info.field_name])
        return value

    @field_validator("messages", mode="after")
    @classmethod
    def _starts_with_a_turn(cls, value: list[InputMessage]) -> list[InputMessage]:
        if value and value[0].role == "system":
            raise ValueError(
                "messages.0.role is 'system': a system message may come after the first "
                "turn (mid-conversation instructions); put the opening one in 'system'"
            )
        return value

    def server_tools(self) -> list[tuple[int, ServerTool]]:
        """The server tools offered, with their index in ``tools``."""
        return [(i, t) for i, t in enumerate(self.tools or []) if isinstance(t, ServerTool)]

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


# ``model_context_window_exceeded``: max_tokens reached past what the context left,
# and the answer ended at the window.
StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]


class AppliedEdit(_Out):
    type: Literal["clear_tool_uses_20250919", "clear_thinking_20251015"]
    cleared_input_tokens: int
    cleared_tool_uses: int | None = None
    cleared_thinking_turns: int | None = None


class ContextManagementResponse(_Out):
    applied_edits: list[AppliedEdit]


class MessageObject(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Annotated[TextContent | ToolUseContent, Field(discriminator="type")]]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    context_management: ContextManagementResponse | None = None


class TokenCount(_Out):
    input_tokens: int
    context_management: dict[str, int] | None = Field(
        default=None, description="`original_input_tokens`: the count before context edits"
    )


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
