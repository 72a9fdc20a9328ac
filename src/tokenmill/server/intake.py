"""Taking a request in, for every route that reads a body: its JSON read into its
wire model, and the gateway that serves it. The one way in: the OpenAI routes, the
deployments' predict endpoints, Responses, Messages, embeddings, tokenize and the
admin API all parse here, so a bad body reads the same everywhere.

A bad body is a 400 naming the field (:func:`~tokenmill.server.errors.
from_validation_error`); the tags of the unions that pick an item or a block by its
``type`` are dropped from the name (``input.2.content``, not
``input.2.message.content``). :func:`unsupported` is the error of a field or value
tokenmill does not implement (code ``unsupported_parameter``). What is raised here is
answered in the shape of the API the path belongs to
(:func:`~tokenmill.server.errors.error_response`): Anthropic's on ``/v1/messages``,
OpenAI's everywhere else.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError
from pydantic_core import PydanticCustomError
from starlette.requests import Request

from tokenmill import stages
from tokenmill.errors import InvalidRequestError, ResourceNotFoundError, UnavailableError
from tokenmill.gateway import Deployment, Gateway
from tokenmill.server.errors import from_validation_error, read_body
from tokenmill.server.refused import UNSUPPORTED

M = TypeVar("M", bound=BaseModel)


def other_than(*known: str) -> Any:
    """The ``type`` of a union's catch-all member (what tokenmill refuses or leaves
    out): any string but the ``known`` members' kinds. The served schema says so, so
    that the union's ``oneOf`` matches each body once (a plain string would match the
    known kinds too, and make every body with one of them invalid by the document)."""
    return Field(json_schema_extra={"not": {"enum": list(known)}})


def unsupported(what: str, advice: str = "leave it out") -> PydanticCustomError:
    """The validation error of something tokenmill does not implement."""
    # The message is a template: the JSON braces travel in its context.
    detail = f"tokenmill does not support {what}; {advice}"
    return PydanticCustomError(UNSUPPORTED, "{detail}", {"detail": detail})


async def parse_body(request: Request, model: type[M], tags: Collection[str] = ()) -> M:
    """The request's body as ``model`` (413 over the size limit, 400 when it is not a
    JSON object that validates); ``tags``: the union tags to drop from names."""
    body = await read_body(request, request.app.state.settings.max_body_bytes)
    parsed = parse_json(body, model, tags)
    stages.mark("parsed")
    # What a trace names of the request (its sampling: tokenmill.tracing) is read there.
    request.state.parsed_body = parsed
    return parsed


def parse_json(body: bytes | str, model: type[M], tags: Collection[str] = ()) -> M:
    """``body`` as ``model``, or the 400 that :func:`parse_body` answers (a line of a
    Batch API file is checked by this too)."""
    if not body.strip():
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors()
        if any(err["type"] == "json_invalid" for err in errors):
            raise InvalidRequestError(
                f"the request body is not valid JSON: {errors[0]['msg']}", code="invalid_json"
            ) from None
        if any(err["type"] == "model_type" and not err["loc"] for err in errors):
            raise InvalidRequestError("the request body must be a JSON object") from None
        raise from_validation_error([_untagged(err, tags) for err in errors]) from None
    return parsed


def _untagged(error: Any, tags: Collection[str]) -> dict[str, Any]:
    return {**error, "loc": tuple(p for p in error["loc"] if p not in tags)}


def ready_gateway(request: Request) -> Gateway:
    """The app's gateway, once its models are loaded (a 503 before)."""
    gateway: Gateway = request.app.state.gateway
    if not gateway.ready:
        raise UnavailableError("the gateway is still loading its models; retry shortly")
    return gateway


def deployment_by_id(gateway: Gateway, deployment_id: str) -> Deployment:
    """The deployment a path names (``/v1/deployments/{deployment_id}``), or a 404."""
    try:
        return gateway.deployments[deployment_id]
    except KeyError:
        raise ResourceNotFoundError(
            f"no deployment {deployment_id!r}; see GET /v1/deployments",
            code="deployment_not_found",
        ) from None
