"""What the client returns: plain dataclasses over the OpenAI bodies, raw body kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0

    @classmethod
    def from_body(cls, body: Any) -> Usage | None:
        if not isinstance(body, dict):
            return None
        details = body.get("prompt_tokens_details") or {}
        prompt = int(body.get("prompt_tokens") or 0)
        completion = int(body.get("completion_tokens") or 0)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=int(body.get("total_tokens") or prompt + completion),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )


def _choice_text(choice: dict[str, Any]) -> str:
    """Text of a choice in any of the shapes: chat message, chat delta, completion."""
    for key in ("message", "delta"):
        part = choice.get(key)
        if isinstance(part, dict):
            return str(part.get("content") or "")
    return str(choice.get("text") or "")


@dataclass(frozen=True)
class Response:
    """A whole (non-streamed) completion."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    request_id: str | None
    model: str | None
    id: str | None
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_body(cls, body: dict[str, Any], request_id: str | None) -> Response:
        choices = body.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        return cls(
            text=_choice_text(choice),
            finish_reason=choice.get("finish_reason"),
            usage=Usage.from_body(body.get("usage")),
            request_id=request_id,
            model=body.get("model"),
            id=body.get("id"),
            raw=body,
        )


@dataclass(frozen=True)
class Chunk:
    """One piece of a stream: ``text`` is the delta. The last chunk carries the
    ``finish_reason`` and, when the server reported it, the ``usage``."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    request_id: str | None
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_event(cls, event: dict[str, Any], request_id: str | None) -> Chunk:
        choices = event.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        return cls(
            text=_choice_text(choice),
            finish_reason=choice.get("finish_reason"),
            usage=Usage.from_body(event.get("usage")),
            request_id=request_id,
            raw=event,
        )


@dataclass(frozen=True)
class Model:
    id: str
    owned_by: str | None
    created: int | None
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Model:
        return cls(
            id=str(body.get("id")),
            owned_by=body.get("owned_by"),
            created=body.get("created"),
            raw=body,
        )
