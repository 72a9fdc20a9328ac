"""The one mapping from exceptions to OpenAI error responses. Never a stack trace."""

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
    TokenmillError,
)
from tokenmill.server.protocol import error_param
from tokenmill.server.refused import UNSUPPORTED

log = logging.getLogger("tokenmill.server")


def error_response(exc: TokenmillError) -> JSONResponse:
    return JSONResponse(exc.to_openai_body(), status_code=exc.status, headers=exc.headers())


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


async def handle_tokenmill_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, TokenmillError)
    return error_response(exc)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(TokenmillError("internal error; the request was not processed"))
