"""The one mapping from exceptions to error responses. Never a stack trace.

Every route answers OpenAI's body (``{"error": {"message", "type", "param",
"code"}}``) except Anthropic's Messages API (``/v1/messages...``), which answers
Anthropic's (``{"type": "error", "error": {"type", "message"}}``): its clients read
no other. The status is the same either way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from tokenmill.errors import (
    ClientGoneError,
    InvalidRequestError,
    PayloadTooLargeError,
    ServiceError,
)
from tokenmill.server.protocol import error_param
from tokenmill.server.refused import UNSUPPORTED

log = logging.getLogger("tokenmill.server")


# Anthropic's error type for each status tokenmill answers with.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether ``path`` is Anthropic's Messages API, whose errors are in its shape."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_body(exc: ServiceError) -> dict[str, Any]:
    """``exc`` as Anthropic's error body (also its stream's ``error`` event). The body
    has no ``param``: the message names the field, as Anthropic's do
    (``messages.1.content: ...``)."""
    kind = ANTHROPIC_TYPES.get(exc.status, "api_error")
    message = exc.message
    if exc.param and f"'{exc.param}'" not in message:
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: ServiceError, path: str = "") -> JSONResponse:
    """The response to ``exc`` on ``path``, in the shape that path's API speaks."""
    body = anthropic_body(exc) if speaks_anthropic(path) else exc.to_openai_body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers())


def from_validation_error(errors: Sequence[Mapping[str, Any]]) -> InvalidRequestError:
    """A 400 naming the parameter of the first of pydantic's ``errors``.

    A value that fits no member of a union (``content``: a string or a list of parts)
    has an error per member; the deepest says most ("messages.0.content.0.type").
    """
    field = tuple(errors[0]["loc"])[:1]
    first = max((e for e in errors if tuple(e["loc"])[:1] == field), key=lambda e: len(e["loc"]))
    param = error_param(tuple(first["loc"]))
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "this field is required"
    elif msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
    text = f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"
    code = UNSUPPORTED if first["type"] == UNSUPPORTED else "invalid_value"
    return InvalidRequestError(text, param=param, code=code)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing more than ``max_bytes`` without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLargeError(
            f"the request body is {declared} bytes; the limit is {max_bytes} bytes"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLargeError(
                    f"the request body exceeds the limit of {max_bytes} bytes"
                )
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the listener's deadline: not our error
        raise ClientGoneError("the client left before its request body arrived") from None
    return b"".join(chunks)


async def handle_service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return error_response(exc, request.url.path)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    error = ServiceError("internal error; the request was not processed")
    return error_response(error, request.url.path)
