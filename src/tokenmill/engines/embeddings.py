"""Embeddings: an optional engine capability, and what travels with it.

An engine that can embed (the llama.cpp engine, see
:mod:`tokenmill.engines.llamacpp.embedder`) implements :class:`EmbeddingEngine`. It works
like a generation without completion tokens, in two calls, so that the gateway can
hold credit between them:

* ``prepare_embeddings`` tokenizes every input, refuses what cannot be embedded
  (``InvalidRequestError`` naming ``input`` or ``dimensions``; ``ContextLengthError``
  for an input longer than the model's window) and returns the token count, which is
  billed as prompt tokens;
* ``embed`` computes one unit-length vector per input, in input order.

Vectors are unit length (L2-normalized), as OpenAI's are, so a dot product is the
cosine similarity. This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# An input: text, or token ids already tokenized with the model's tokenizer.
EmbeddingInput = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """Inputs to embed, one vector each. ``dimensions``: the length the caller wants
    (None: the model's own); an engine refuses any length its model cannot give."""

    request_id: str
    inputs: tuple[EmbeddingInput, ...]
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("an embedding request needs at least one input")


@dataclass(frozen=True, slots=True)
class EmbeddingInfo:
    """What admission and metering need before the vectors are computed."""

    prompt_tokens: int  # all inputs together: billed as prompt tokens
    dimensions: int  # the length of every vector


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One unit-length vector per input, in input order, and the tokens they took."""

    vectors: tuple[tuple[float, ...], ...]
    prompt_tokens: int


@runtime_checkable
class EmbeddingEngine(Protocol):
    """An optional capability: vectors of the model's own (``/v1/embeddings``).

    An engine without it (an upstream proxy, the scripted test engine) is refused
    with ``InvalidRequestError`` naming ``model``.
    """

    async def prepare_embeddings(self, request: EmbeddingRequest) -> EmbeddingInfo:
        """Tokenize and check every input; remembered for ``embed`` by request id."""
        ...

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """The vectors of ``request``'s inputs."""
        ...


def cannot_embed(engine_name: str) -> str:
    """The message of the 400 for a deployment whose engine has no embeddings."""
    return (
        f"this model's {engine_name} engine cannot compute embeddings; use a deployment "
        'served by llama.cpp (engine = "llamacpp")'
    )


__all__ = [
    "EmbeddingEngine",
    "EmbeddingInfo",
    "EmbeddingInput",
    "EmbeddingRequest",
    "Embeddings",
    "cannot_embed",
]
