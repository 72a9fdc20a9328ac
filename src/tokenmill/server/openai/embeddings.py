"""``POST /v1/embeddings``: OpenAI's embeddings API on any llama.cpp deployment.

``input`` is a string, a list of strings, a list of token ids or a list of such
lists (one vector each, in order); ``encoding_format`` is ``float`` (lists of
numbers) or ``base64`` (each vector's little-endian float32 bytes: what the
``openai`` SDK asks for by default, and decodes itself). ``dimensions`` is accepted
only when it is the model's own length: llama.cpp models give vectors of one size.
Vectors are unit length. Inputs are billed as prompt tokens
(:mod:`tokenmill.gateway.embeddings`); ``usage`` says how many. :data:`EMBEDDINGS` is
the endpoint its route and the Batch API's lines serve through.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenmill.engines import EmbeddingInput, EmbeddingRequest, Embeddings
from tokenmill.errors import InvalidRequestError
from tokenmill.gateway import embeddings as gateway_embeddings
from tokenmill.server.endpoint import Call, Endpoint
from tokenmill.server.protocol import TokenId, _integral

# OpenAI's limit on inputs per request.
MAX_INPUTS = 2048

_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
INPUT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS},
        _IDS,
        {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_INPUTS},
    ]
}
Dimensions = Annotated[int, Field(ge=1, strict=True)]


class EmbeddingBody(BaseModel):
    """The body of ``POST /v1/embeddings``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="text, texts, token ids, or lists of token ids: one vector each",
        json_schema_extra=INPUT_SCHEMA,
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="`base64`: each vector's little-endian float32 bytes"
    )
    dimensions: Dimensions | None = Field(
        default=None, description="the vectors' length: only the model's own is accepted"
    )
    user: str | None = None

    @field_validator("dimensions", mode="before")
    @classmethod
    def _whole(cls, v: Any) -> Any:
        return _integral(v)

    @field_validator("input")
    @classmethod
    def _not_empty(
        cls, v: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(v, str):
            if not v:
                raise ValueError("the input is an empty string: nothing to embed")
            return v
        if not v:
            raise ValueError("the input is an empty list: nothing to embed")
        if isinstance(v[0], str | list):
            if len(v) > MAX_INPUTS:
                raise ValueError(f"at most {MAX_INPUTS} inputs are allowed per request")
            if any(len(item) == 0 for item in v if isinstance(item, str | list)):
                raise ValueError("an input is empty: nothing to embed")
        return v

    def inputs(self) -> tuple[EmbeddingInput, ...]:
        """One entry per vector: text, or a tuple of token ids."""
        v = self.input
        if isinstance(v, str):
            return (v,)
        if isinstance(v[0], int):
            return (tuple(t for t in v if isinstance(t, int)),)
        return tuple(item if isinstance(item, str) else tuple(item) for item in v)


# -- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Embedding(_Response):
    object: Literal["embedding"]
    index: int = Field(ge=0, description="the input's position")
    embedding: list[float] | str = Field(
        description="a unit-length vector: numbers, or base64 of little-endian float32"
    )


class EmbeddingUsage(_Response):
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class EmbeddingList(_Response):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encode_vector(vector: tuple[float, ...], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)


def response_body(result: Embeddings, model: str, encoding_format: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(result.vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


@dataclass(frozen=True, slots=True)
class Embedded:
    """The embeddings of a request, computed and billed: an answer that is only whole."""

    body: dict[str, Any]

    async def collect(self) -> dict[str, Any]:
        return self.body

    def events(self) -> AsyncIterator[bytes]:
        raise InvalidRequestError("embeddings are answered whole: leave 'stream' out")

    async def aclose(self) -> None:
        return None


def embeddings(call: Call, body: EmbeddingBody) -> Coroutine[Any, Any, Embedded]:
    """Embed ``body``'s inputs through the gateway (metered): OpenAI's response body.
    An unknown model is refused at once, the embedding awaited."""
    deployment = call.gateway.deployment(body.model)
    request = EmbeddingRequest(
        request_id=call.request_id, inputs=body.inputs(), dimensions=body.dimensions
    )

    async def embed() -> Embedded:
        result = await gateway_embeddings.embed(call.gateway, deployment, request, call.caller)
        model = body.model or deployment.id
        return Embedded(response_body(result, model, body.encoding_format))

    return embed()


EMBEDDINGS = Endpoint("/v1/embeddings", EmbeddingBody, embeddings)

__all__ = ["EMBEDDINGS", "EmbeddingBody", "EmbeddingList", "embeddings"]
