"""The client's exceptions, one per kind of failure a caller handles differently.

    TokenmillError
    ├── APIConnectionError        no HTTP answer (refused, reset, timed out) after retries
    ├── APIStatusError            an HTTP error answer; ``status`` and the OpenAI body
    │   ├── BadRequestError       400, 413, 422 and other 4xx: fix the request
    │   ├── AuthenticationError   401
    │   ├── InsufficientCreditError 402
    │   ├── PermissionDeniedError 403
    │   ├── NotFoundError         404
    │   ├── RateLimitError        429, with ``retry_after`` seconds
    │   └── ServerError           5xx
    └── StreamError               a stream broke after it began; ``text`` is what arrived

Each carries the server's message and the request id, so a report can be traced in the
gateway's logs.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any


class TokenmillError(Exception):
    """Base of every error the tokenmill client raises."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        request_id: str | None = None,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.request_id = request_id
        self.type = type
        self.code = code
        self.param = param
        self.body = body

    def __str__(self) -> str:
        parts = [self.message]
        if self.status is not None:
            parts.append(f"(status {self.status})")
        if self.request_id:
            parts.append(f"[request id {self.request_id}]")
        return " ".join(parts)


class APIConnectionError(TokenmillError):
    """The server could not be reached, or did not answer in time."""


class APIStatusError(TokenmillError):
    """The server answered with an HTTP error status."""


class BadRequestError(APIStatusError):
    """400, 413, 422 (and any other 4xx without its own class): the request is wrong."""


class AuthenticationError(APIStatusError):
    """401: no API key, or an unknown one."""


class InsufficientCreditError(APIStatusError):
    """402: the caller's balance does not cover the request."""


class PermissionDeniedError(APIStatusError):
    """403: the key is valid but may not do this."""


class NotFoundError(APIStatusError):
    """404: no such model, deployment or route."""


class RateLimitError(APIStatusError):
    """429: the deployment is at capacity; ``retry_after`` says when to come back."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ServerError(APIStatusError):
    """5xx: the gateway or one of its engines failed; the request may be retried."""


class StreamError(TokenmillError):
    """A stream failed after it began. ``text`` holds everything delivered before the
    failure; the request is never re-sent, so no token is delivered twice."""

    def __init__(self, message: str, *, text: str = "", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.text = text


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: InsufficientCreditError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: BadRequestError,
    422: BadRequestError,
    429: RateLimitError,
}


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: either delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_fields(body: Any) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error body, or ``{}``."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"]  # type: ignore[no-any-return]
    return {}


def status_error(
    status: int,
    content: bytes,
    *,
    request_id: str | None = None,
    retry_after: str | None = None,
) -> APIStatusError:
    """The typed exception for an HTTP error answer with an OpenAI error body."""
    body: Any
    try:
        body = json.loads(content) if content else None
    except ValueError:
        body = content.decode("utf-8", "replace")
    err = error_fields(body)
    message = err.get("message")
    if not isinstance(message, str) or not message:
        text = body if isinstance(body, str) and body.strip() else ""
        message = text.strip()[:500] or f"HTTP {status}"
    kw: dict[str, Any] = {
        "status": status,
        "request_id": request_id,
        "type": err.get("type"),
        "code": err.get("code"),
        "param": err.get("param"),
        "body": body,
    }
    if status == 429:
        return RateLimitError(message, retry_after=parse_retry_after(retry_after), **kw)
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else BadRequestError
    return cls(message, **kw)
