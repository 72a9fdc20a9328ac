"""The server's exceptions, raised by every layer and mapped once to HTTP by the server.

    ServiceError                         500 server_error
    ├── InvalidRequestError              400 invalid_request_error
    │   └── ContextLengthError           400 (code context_length_exceeded)
    ├── UnauthenticatedError             401 (no API key, or not a live one)
    ├── PaymentRequiredError             402 (the credit does not cover the request)
    ├── ForbiddenError                   403
    ├── ResourceNotFoundError            404 (code model_not_found, ...)
    ├── PayloadTooLargeError             413
    ├── ClientGoneError                  499 (the client left mid-request: nobody reads it)
    ├── OverloadedError                  429 (carries retry_after seconds)
    │   └── ReplicaFullError             429 (a shared replica's slots are all taken:
    │                                         the gateway tries another, or waits)
    ├── EngineError                      502 (a replica failed mid-request)
    └── UnavailableError                 503 (loading, shutting down, no replica)

Messages are written for the caller: they say what was wrong and what to change.
This module imports nothing from the web framework; ``to_openai_body`` builds the
``{"error": {"message", "type", "param", "code"}}`` body.

The client's exceptions (:mod:`tokenmill.client.errors`, exported as ``tokenmill.*``)
are another tree, what a caller of the HTTP API catches: no name is in both, so
``tokenmill.errors.X`` and ``tokenmill.X`` never mean two things.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ServiceError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def to_openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequestError(ServiceError):
    status = 400
    type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    default_code = "context_length_exceeded"


class UnauthenticatedError(ServiceError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class PaymentRequiredError(ServiceError):
    status = 402
    type = "insufficient_quota"
    default_code = "insufficient_credit"


class ForbiddenError(ServiceError):
    status = 403
    type = "permission_error"
    default_code = "forbidden"


class ResourceNotFoundError(ServiceError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class PayloadTooLargeError(ServiceError):
    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class ClientGoneError(ServiceError):
    """The client closed the connection (or was cut off) before its request was read."""

    status = 499
    type = "invalid_request_error"
    default_code = "client_closed_request"


class OverloadedError(ServiceError):
    status = 429
    type = "rate_limit_error"
    default_code = "overloaded"

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return retry_after_header(self.retry_after)


class ReplicaFullError(OverloadedError):
    """A pool's replica refused a request because other gateways hold all its slots.
    The gateway places the request elsewhere or waits for a slot; a caller sees it only
    as its queue timing out."""

    default_code = "replica_full"


class EngineError(ServiceError):
    status = 502
    type = "server_error"
    default_code = "engine_error"


class UnavailableError(ServiceError):
    status = 503
    type = "server_error"
    default_code = "unavailable"

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else retry_after_header(self.retry_after)


def retry_after_header(seconds: float) -> dict[str, str]:
    # Retry-After is whole seconds, rounded up; never advertise 0, clients would spin.
    return {"Retry-After": str(max(1, round(seconds + 0.499)))}
