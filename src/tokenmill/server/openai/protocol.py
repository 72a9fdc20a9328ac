"""Wire models of what the OpenAI-compatible API accepts: the requests it validates
and turns into the generation core's neutral request. What it sends is
in :mod:`~tokenmill.server.openai.replies`.

Validation errors raised here become 400s naming the parameter. A field of OpenAI's
API that tokenmill does not implement is refused by name (``refused``); a field
unknown to tokenmill is ignored, as OpenAI's clients send fields a given server may
not know.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tokenmill.chat import Turn
from tokenmill.engines import ChatMessage, SamplingParams
from tokenmill.server.openai.structured import StructuredFields
from tokenmill.server.openai.tools import MessageToolCall, ToolFields
from tokenmill.server.protocol import Int, Number, TokenId
from tokenmill.server.refused import RefusedFields

# A stop list longer than this is almost certainly a client bug, and each stop string
# is checked on every token.
MAX_STOP_STRINGS = 16
# Choices a request may ask for (``n``): OpenAI's limit. A replica's slots bound it
# further (the gateway says so with a 400).
MAX_CHOICES = 128
# Prompts in one /v1/completions request (each with ``n`` choices, within the slots).
MAX_PROMPTS = 128
# OpenAI's limits on logit_bias: a bias per token in [-100, 100], 300 tokens at most
# (each is a sampler entry of every step).
MAX_LOGIT_BIAS = 100
MAX_LOGIT_BIAS_TOKENS = 300
# Alternatives reported per token (OpenAI's chat limit; each costs a sort per token).
MAX_TOP_LOGPROBS = 20


TopLogprobs = Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


def _strings(*, min_items: int = 0, max_items: int) -> dict[str, Any]:
    """The schema of a list the validators below limit with a message of their own."""
    schema: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
    if min_items:
        schema["minItems"] = min_items
    return {**schema, "maxItems": max_items}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    """A part of a message's content: text only (the models served read no images)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    # An assistant turn's calls; a tool turn's answer to one (``tool_call_id``).
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_chat_message(self) -> ChatMessage:
        content = self.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=text)

    def to_turn(self) -> Turn:
        """The message as the generation core's turn, its calls included."""
        plain = self.to_chat_message()
        return Turn(
            role="system" if self.role == "developer" else self.role,
            content=plain.content,
            tool_calls=tuple(c.call_made() for c in self.tool_calls or ()),
            tool_call_id=self.tool_call_id,
            name=self.name,
        )


class SamplingFields(StructuredFields, RefusedFields):
    """The sampling fields shared by every generation endpoint.

    The fields tokenmill does not implement are refused by name (see ``refused``).
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Number = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=0)
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number = Field(default=1.0, gt=0.0, le=2.0)
    stop: str | list[str] | None = Field(
        default=None,
        json_schema_extra={
            "anyOf": [{"type": "string"}, _strings(max_items=MAX_STOP_STRINGS), {"type": "null"}]
        },
    )
    seed: Int | None = None
    logit_bias: dict[str, Number] | None = Field(
        default=None,
        description="token id -> bias added to its logit, -100 (a ban) to 100",
        json_schema_extra={
            "anyOf": [
                {
                    "type": "object",
                    "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                    "additionalProperties": {
                        "type": "number",
                        "minimum": -MAX_LOGIT_BIAS,
                        "maximum": MAX_LOGIT_BIAS,
                    },
                    "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                },
                {"type": "null"},
            ]
        },
    )
    n: Int = Field(
        default=1,
        ge=1,
        le=MAX_CHOICES,
        description="choices to generate (per prompt); each samples on its own, with a "
        "`seed` choice i uses seed + i; the prompt is computed and billed once",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template: str | None = None
    user: str | None = None
    ignore_eos: bool = False
    speculative: bool | None = Field(
        default=None,
        description="n-gram drafts verified in the step (true) or a token a step "
        "(false); unset: the deployment's `speculative`",
    )
    # The request's priority class (docs/fairness.md), at most its key's: a name, or
    # vLLM's integer (below 0 interactive, 0 default, above 0 batch); OpenAI's
    # service_tier maps too (flex: batch; priority, scale: interactive).
    priority: Int | str | None = Field(
        default=None,
        description="interactive, default or batch (or vLLM's integer); capped by the key's",
    )
    service_tier: str | None = Field(
        default=None, description="OpenAI's: auto, default, flex (batch), priority, scale"
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased")
        for token, bias in v.items():
            if not (token.isascii() and token.isdigit() and len(token) <= 9):
                raise ValueError(f"keys are token ids (0, 1, 2...), not {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"the bias of token {token} is {bias}; biases are "
                    f"{-MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}"
                )
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return v

    def logprob_alternatives(self) -> int | None:
        """Alternatives to report per token, or None: no log probabilities."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop: tuple[str, ...]
        if self.stop is None:
            stop = ()
        elif isinstance(self.stop, str):
            stop = (self.stop,)
        else:
            stop = tuple(self.stop)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            logprobs=self.logprob_alternatives(),
            echo=self.echoes(),
            constraint=self.constraint(),
        )

    def echoes(self) -> bool:
        """Whether the prompt is to come back before the completion (completions only)."""
        return False


class ChatLogprobFields(SamplingFields):
    """Chat's log probability fields: ``logprobs`` on or off, ``top_logprobs`` a count."""

    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        # ``logprobs`` is declared first, so it is validated by now.
        if v and info.data.get("logprobs") is not True:
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs is True else None


class ChatCompletionRequest(ToolFields, ChatLogprobFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


# A prompt given as token ids: at least one (the schema says so too).
TOKEN_IDS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0},
    "minItems": 1,
}


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="the prompt: its text or its token ids (see `POST /tokenize`), or "
        "several prompts (a list of texts or of token-id lists): one choice each (times "
        "`n`), `index` in order",
        json_schema_extra={
            "anyOf": [
                {"type": "string"},
                TOKEN_IDS_SCHEMA,
                _strings(min_items=1, max_items=MAX_PROMPTS),
                {
                    "type": "array",
                    "items": TOKEN_IDS_SCHEMA,
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                },
            ]
        },
    )
    logprobs: TopLogprobs | None = Field(
        default=None, description="log probabilities, with this many alternatives a token"
    )
    echo: bool = Field(
        default=False,
        description="the prompt before the completion (with `logprobs`, its tokens' too)",
    )
    best_of: Int | None = Field(
        default=None, ge=1, le=MAX_CHOICES, description="equal to `n` if given (none is ranked)"
    )
    # best_of equal to n is n (no candidates are ranked); refused otherwise by the route.
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"echo", "best_of"})

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def echoes(self) -> bool:
        return self.echo

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, v: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and isinstance(v[0], str | list) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed per request")
        if isinstance(v, list) and isinstance(v[0], list) and not all(v):
            raise ValueError("a prompt is empty (a token-id list with no ids)")
        return v

    def prompt_items(self) -> tuple[str | tuple[int, ...], ...]:
        """Every prompt, as text or token ids, in order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return (prompt,)
        if isinstance(prompt[0], int):
            return (tuple(t for t in prompt if isinstance(t, int)),)
        return tuple(
            p if isinstance(p, str) else tuple(p) for p in prompt if isinstance(p, str | list)
        )


class PredictRequest(ToolFields, ChatLogprobFields):
    """Body of the deployment predict endpoints: ``prompt`` or ``messages``.

    ``logprobs`` is chat's (``true`` with ``top_logprobs``) or a completion's (a count
    of alternatives), whichever the route; the answer has the route's shape.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    endpoint_type: Literal["chat", "completion"] | None = None
    logprobs: bool | TopLogprobs | None = None  # type: ignore[assignment]

    def logprob_alternatives(self) -> int | None:
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True:
            return self.top_logprobs or 0
        return self.logprobs

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> PredictRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class TokenizeBody(BaseModel):
    """``POST /tokenize``: ``prompt``, or ``messages`` rendered with the chat template."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = Field(
        default=True, description="with `messages`: end with the assistant turn's opening"
    )
    chat_template: str | None = Field(
        default=None, description="with `messages`: a Jinja template instead of the model's"
    )
    add_special_tokens: bool = Field(
        default=True,
        description="the tokens the model's tokenizer adds (BOS where the model wants one), "
        "as a generation's prompt has them; false: the text's own tokens only",
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeBody(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId]
