"""Anthropic's Messages API routes: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Thin: parse the body, ask :mod:`~tokenmill.server.messages.serving`, send one JSON
body or the events. Errors on these paths are in Anthropic's shape
(:func:`tokenmill.server.errors.error_response` picks it by path); the key may come
as ``x-api-key`` (:mod:`tokenmill.server.auth`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenmill.chat.hosted import OMITTED_HEADER, omitted_header
from tokenmill.server.errors import anthropic_body
from tokenmill.server.intake import parse_body, ready_gateway
from tokenmill.server.messages import serving
from tokenmill.server.messages.protocol import (
    TAGS,
    AnthropicError,
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
    MessageStreamEvent,
    TokenCount,
)
from tokenmill.server.openapi import (
    ERROR_DESCRIPTIONS,
    USAGE_LINK,
    json_body,
    schema_of,
    typed_event_stream,
)
from tokenmill.server.sse import InBand, encode_typed_event, respond

router = APIRouter()
# Anthropic's stream has a ping event of its own, and its error event (as its error
# body) ends a stream that waited behind pings.
IN_BAND = InBand(
    ping=encode_typed_event({"type": "ping"}),
    error=lambda error: encode_typed_event(anthropic_body(error)),
)


def anthropic_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Anthropic's error body for each of ``statuses``, for a route's ``responses``."""
    schema = schema_of(AnthropicError, "serialization")
    return {
        status: {
            "description": ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": schema}},
        }
        for status in statuses
    }


_STREAM = typed_event_stream(MessageStreamEvent)


@router.post(
    "/v1/messages",
    openapi_extra=json_body(MessagesRequest),
    responses={
        200: {
            "description": "The message, or with `stream` its events, from "
            "`message_start` to `message_stop`",
            "content": {
                "application/json": {"schema": schema_of(MessageObject, "serialization")},
                "text/event-stream": _STREAM,
            },
            "links": USAGE_LINK,
        },
        **anthropic_errors(400, 402, 403, 404, 413, 429, 502, 503),
    },
)
async def create_message(request: Request) -> Response:
    body = await parse_body(request, MessagesRequest, TAGS)
    gw = ready_gateway(request)
    deployment = gw.deployment(body.model)
    omitted = serving.check_model(deployment, body)  # a 400 before any stream
    opening = serving.open_message(
        gw, deployment, body, request.state.request_id, request.state.caller
    )
    response = await respond(request, opening, body.stream, IN_BAND)
    if omitted:
        response.headers[OMITTED_HEADER] = omitted_header(omitted)
    return response


@router.post(
    "/v1/messages/count_tokens",
    openapi_extra=json_body(CountTokensRequest),
    responses={**anthropic_errors(400, 404, 413, 503)},
    response_model_exclude_none=True,
)
async def count_tokens(request: Request) -> TokenCount:
    body = await parse_body(request, CountTokensRequest, TAGS)
    deployment = ready_gateway(request).deployment(body.model)
    count, original = await serving.count_message(deployment, body)
    if original is None:
        return TokenCount(input_tokens=count)
    return TokenCount(input_tokens=count, context_management={"original_input_tokens": original})
