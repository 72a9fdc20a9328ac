"""Wire models of the OpenAI-compatible API (requests only; responses are built as dicts).

Validation errors raised here become 400s naming the parameter. Unknown fields are
ignored, as OpenAI's clients send fields a given server may not know.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenmill.engines.base import ChatMessage, SamplingParams

# A stop list longer than this is almost certainly a client bug, and each stop string
# is checked on every token.
MAX_STOP_STRINGS = 16
DEFAULT_MAX_TOKENS = 256

Number = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[_ContentPart] | None = None

    def to_chat_message(self) -> ChatMessage:
        content = self.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content parts of type {part.type!r} are not supported")
                parts.append(part.text)
            text = "".join(parts)
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=text)


class SamplingFields(BaseModel):
    """The sampling fields shared by every generation endpoint."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Number = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number = Field(default=1.0, gt=0.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template: str | None = None
    user: str | None = None
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return v

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
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field()
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt is supported per request")
        return v

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class PredictRequest(SamplingFields):
    """Body of the deployment predict endpoints: ``prompt`` or ``messages``."""

    prompt: str | None = None
    messages: list[Message] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    endpoint_type: Literal["chat", "completion"] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> PredictRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def error_param(loc: tuple[Any, ...]) -> str | None:
    """The OpenAI ``param`` for a pydantic error location, e.g. ``messages.0.role``."""
    parts: list[str] = []
    for p in loc:
        text = str(p)
        # Union members show up in locations as type tags ("str", "list[str]").
        if text in _TYPE_TAGS or "[" in text or text == "body":
            continue
        parts.append(text)
    return ".".join(parts) if parts else None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})
