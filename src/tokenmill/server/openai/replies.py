"""Wire models of what the OpenAI-compatible API sends: the bodies and stream chunks
of chat completions and completions, and the tokenizer routes' answers.

Declared for the OpenAPI document and checked against real responses by the tests.
The generation routes build these shapes as dicts (one per token on the hot path, in
:mod:`~tokenmill.server.openai.events`); ``extra="forbid"`` makes the served schema
say that nothing else is sent. What the API accepts is
:mod:`~tokenmill.server.openai.protocol`'s.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tokenmill.server.openai.tools import ToolCall, ToolCallDelta
from tokenmill.server.protocol import _Response

PublicFinishReason = Literal["stop", "length", "error", "tool_calls"]


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(ge=0, description="prompt tokens served from the prefix cache")


class CompletionUsage(_Response):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(_Response):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls")
    tool_calls: list[ToolCall] | None = None


Logprob = Annotated[float, Field(le=0.0, description="natural log of the probability")]


class TopLogprob(_Response):
    token: str
    logprob: Logprob
    bytes: list[int]


class ChatTokenLogprob(_Response):
    """A token of the answer: its text, bytes, log probability and likeliest rivals."""

    token: str
    logprob: Logprob
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(_Response):
    """A text completion's tokens, in OpenAI's legacy shape (one list per attribute)."""

    tokens: list[str]
    token_logprobs: list[Logprob | None]
    top_logprobs: list[dict[str, Logprob] | None]
    text_offset: list[int]


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: PublicFinishReason | None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: PublicFinishReason | None


class ChatCompletionChunk(_Response):
    """One ``data:`` event of a chat stream; the last, with ``include_usage``, has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: PublicFinishReason | None


class Completion(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class CompletionChunk(_Response):
    """One ``data:`` event of a completion stream (OpenAI names it ``text_completion`` too)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class Tokenized(_Response):
    tokens: list[int] = Field(description="the prompt's token ids")
    count: int = Field(ge=0, description="how many tokens")
    max_model_len: int = Field(ge=0, description="tokens a sequence may hold, prompt included")


class Detokenized(_Response):
    prompt: str = Field(description="the text of the tokens")


class TokenizerInfoBody(_Response):
    """``GET /tokenizer_info``: vLLM's shape, as far as a GGUF tokenizer fills it."""

    tokenizer_class: str = Field(description="llama.cpp and its vocabulary type (BPE, SPM, ...)")
    eos_token: str | None = Field(description="the end-of-sequence token's text")
    bos_token: str | None = Field(description="the beginning-of-sequence token's text")
    pad_token: str | None = Field(description="the padding token's text")
    chat_template: str | None = Field(description="the model's own Jinja chat template")
    model_max_length: int = Field(ge=0, description="tokens a sequence may hold")
