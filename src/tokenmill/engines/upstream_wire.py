"""OpenAI's wire format as the upstream engine speaks it: the body of a
``/chat/completions`` or ``/completions`` request made from a
:class:`~tokenmill.engines.base.GenerationRequest`, and the reading of what comes
back (a streamed event's text, tool calls, log probabilities, finish and usage; an
error body as tokenmill's error).

Pure functions of dicts: no HTTP, no state. The connection, retries and the relay
into a stream are :mod:`tokenmill.engines.upstream`'s.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.engines.base import (
    ChatMessage,
    Constraint,
    FinishReason,
    GenerationRequest,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tokenmill.errors import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    OverloadedError,
    ServiceError,
    UnavailableError,
)

# Constraints an upstream is sent: OpenAI's response_format, and llama-server's (and
# vLLM's) GBNF ``grammar``.
FORWARDED_CONSTRAINTS = frozenset({"json_object", "json_schema", "gbnf"})


def request_body(request: GenerationRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The path (below the upstream's URL) and streamed body that ask for ``request``."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    if s.max_tokens > 0:
        body["max_tokens"] = s.max_tokens
    if s.stop:
        body["stop"] = list(s.stop)
    if s.seed is not None:
        body["seed"] = s.seed
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    # Not in OpenAI's API; llama-server, vLLM and tokenmill take them. Sent only
    # when asked for, so strict upstreams never see them.
    if s.top_k:
        body["top_k"] = s.top_k
    if s.min_p:
        body["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.ignore_eos:
        body["ignore_eos"] = True
    # OpenAI's own fields: an upstream that lacks one refuses it, naming it.
    if s.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    if s.constraint is not None:
        body.update(constraint_fields(s.constraint))
    if request.messages is not None:
        body["messages"] = [_message(m) for m in request.messages]
        if request.tools is not None:  # forwarded as sent
            body["tools"] = json.loads(request.tools.tools)
            if request.tools.choice is not None:
                body["tool_choice"] = json.loads(request.tools.choice)
            if request.tools.parallel is not None:
                body["parallel_tool_calls"] = request.tools.parallel
        if s.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = s.logprobs
        return "/chat/completions", body
    # OpenAI's completions take a prompt as token ids too.
    tokens = request.prompt_tokens
    body["prompt"] = request.prompt if tokens is None else list(tokens)
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
    return "/completions", body


def constraint_fields(c: Constraint) -> dict[str, Any]:
    """The request fields that ask an upstream for constraint ``c``."""
    if c.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if c.kind == "json_schema":
        spec: dict[str, Any] = {"name": c.name or "output", "schema": json.loads(c.text)}
        if c.strict is not None:
            spec["strict"] = c.strict
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    return {"grammar": c.text}


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message in OpenAI's shape, its tool calls and call id included."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["content"] = m.content or None
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def answer_error(status: int, raw: bytes, retry_after: str | None) -> ServiceError:
    """An upstream's error answer (``status``, its body ``raw``) as tokenmill's error."""
    message = raw.decode("utf-8", "replace")[:500]
    param = code = None
    try:
        err = json.loads(raw)["error"]
        message, param, code = str(err.get("message")), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    if status == 429:
        retry = retry_after or "1"
        return OverloadedError(
            f"the upstream is overloaded: {message}",
            retry_after=float(retry) if retry.replace(".", "", 1).isdigit() else 1.0,
        )
    if status == 400 and code == "context_length_exceeded":
        return ContextLengthError(message, param=param)
    if status in (400, 422):
        return InvalidRequestError(f"the upstream refused the request: {message}", param=param)
    if status == 503:
        return UnavailableError(f"the upstream is unavailable: {message}")
    # 401/403/404 mean the deployment is misconfigured, not that the client erred.
    return EngineError(f"the upstream answered {status}: {message}")


def event_error(event: dict[str, Any]) -> EngineError | None:
    """The failure a streamed event reports, if it is one."""
    if "error" not in event:
        return None
    err = event["error"]
    msg = err.get("message") if isinstance(err, dict) else err
    return EngineError(f"the upstream failed mid-stream: {msg}")


def event_usage(event: dict[str, Any]) -> Usage | None:
    """The usage a streamed event carries (the last one, asked for by ``include_usage``)."""
    u = event.get("usage")
    if not u:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Usage(
        int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0), int(cached)
    )


def choice_finish(choice: dict[str, Any]) -> FinishReason | None:
    """A choice's finish, if it ended: every reason but ``length`` reads as a stop."""
    if not choice.get("finish_reason"):
        return None
    return "length" if choice["finish_reason"] == "length" else "stop"


def choice_logprobs(raw: Any, offset: int) -> tuple[TokenLogprob, ...]:
    """The tokens of an upstream chunk (chat's shape or a completion's), at ``offset``.

    Asked for and missing: the upstream ignored the field, and the answer must not.
    """
    if isinstance(raw, dict) and isinstance(raw.get("content"), list):
        out = []
        for e in raw["content"]:
            piece = _piece(e)
            top = tuple(TopLogprob(_piece(t), float(t["logprob"])) for t in e["top_logprobs"])
            out.append(TokenLogprob(piece, float(e["logprob"]), offset, top))
            offset += len(str(e["token"]))
        return tuple(out)
    if isinstance(raw, dict) and isinstance(raw.get("tokens"), list):
        rows = zip(raw["tokens"], raw["token_logprobs"], raw["top_logprobs"], strict=True)
        out = []
        for token, logprob, top in rows:
            ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
            alternatives = tuple(TopLogprob(t.encode(), float(lp)) for t, lp in ranked)
            out.append(TokenLogprob(str(token).encode(), float(logprob), offset, alternatives))
            offset += len(str(token))
        return tuple(out)
    raise EngineError("the upstream sent no logprobs although they were asked for")


def _piece(entry: dict[str, Any]) -> bytes:
    raw = entry.get("bytes")
    return bytes(raw) if isinstance(raw, list) else str(entry["token"]).encode()


def choice_tool_calls(choice: dict[str, Any]) -> tuple[ToolCallDelta, ...]:
    """The pieces of tool calls in a streamed chat choice (OpenAI's delta shape)."""
    delta = choice.get("delta")
    raw = delta.get("tool_calls") if isinstance(delta, dict) else None
    if not isinstance(raw, list):
        return ()
    out = []
    for i, call in enumerate(raw):
        function = call.get("function") or {}
        out.append(
            ToolCallDelta(
                index=int(call.get("index", i)),
                id=call.get("id"),
                name=function.get("name"),
                arguments=str(function.get("arguments") or ""),
            )
        )
    return tuple(out)


def choice_text(choice: dict[str, Any]) -> str:
    """A choice's new text: a chat delta's content, or a completion's text."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")
