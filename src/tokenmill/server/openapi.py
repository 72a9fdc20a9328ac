"""The served OpenAPI document, built from the pydantic models the routes validate with.

The routes read their own bodies through :mod:`tokenmill.server.intake` (the size
limit applies before parsing, and a bad body is a 400 naming the parameter, in the
API's own error format), so FastAPI never sees their models. Each route names them
instead: :func:`json_body` for the request, :func:`json_response`,
:func:`event_stream` and :func:`errors` for what comes back.
Their schemas carry the models' definitions in ``$defs``; :func:`document` moves
those into ``components.schemas``, marks the routes that need an API key, and
documents the ``x-request-id`` header every response carries.

Only ``GET /openapi.json`` and ``/docs`` build the document; nothing here runs on
the request path.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenmill.server.auth import needs_api_key
from tokenmill.server.protocol import ErrorBody

_REF = "#/components/schemas/{model}"
# An SSE stream of this API ends with this event, which is not JSON.
DONE_EVENT = "[DONE]"
API_KEY_SCHEME = "apiKey"

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "An invalid value (``param`` names it), a prompt that does not fit the context "
    "window, or a request bigger than its key's tokens-per-minute",
    401: "No API key, or an unknown or revoked one",
    402: "The account's credit does not cover the request",
    403: "The admin API needs the admin key, and generation an account's key (the admin "
    "key bills no account)",
    404: "No such model, deployment, account, key or request",
    413: "The request body is over the size limit",
    429: "A deployment's queue is full, or the key's per-minute limit is used up; "
    "retry after ``Retry-After`` seconds",
    502: "The replica serving the request failed",
    503: "The gateway is loading, shutting down, or no replica came back in time",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying",
        "schema": {"type": "integer", "minimum": 1},
    }
}
_REQUEST_ID = {
    "x-request-id": {
        "description": "The request's id: the caller's own `x-request-id` when it was "
        "well-formed, else a new one; logs and `GET /v1/usage/{request_id}` use it",
        "required": True,
        "schema": {"type": "string"},
    }
}


def schema_of(
    model: type[BaseModel], mode: Literal["validation", "serialization"]
) -> dict[str, Any]:
    """A reference to ``model``, carrying its definitions until :func:`document` hoists them."""
    schema = model.model_json_schema(ref_template=_REF, mode=mode)
    defs = schema.pop("$defs", {})
    defs[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__), "$defs": defs}


def any_of(*models: type[BaseModel]) -> dict[str, Any]:
    """One of several response models (e.g. a chat or a text completion)."""
    return {"anyOf": [schema_of(m, "serialization") for m in models]}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body ``model`` validates."""
    content = {"application/json": {"schema": schema_of(model, "validation")}}
    return {"requestBody": {"required": True, "content": content}}


def json_response(schema: type[BaseModel] | dict[str, Any], description: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        schema = schema_of(schema, "serialization")
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def typed_event_stream(event: type[BaseModel]) -> dict[str, Any]:
    """The ``itemSchema`` of a stream of named events (``event:`` and ``data:`` lines,
    the data one of ``event``'s shapes): Anthropic's Messages and OpenAI's Responses."""
    return {
        "itemSchema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string"},
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": schema_of(event, "serialization"),
                },
            },
        }
    }


def event_stream(*events: type[BaseModel]) -> dict[str, Any]:
    """The media type object of a stream of ``data:`` events, each one of ``events``
    or an in-band error, ending with ``data: [DONE]``."""
    payload = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": any_of(*events, ErrorBody),
    }
    item = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"oneOf": [{"const": DONE_EVENT}, payload]},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
    }
    return {"itemSchema": item}


def link(operation_id: str, **parameters: str) -> dict[str, Any]:
    """An OpenAPI link: ``operation_id`` (a route's function name) called with
    ``parameters`` taken from this response, e.g. ``account_id="$response.body#/id"``."""
    return {"operationId": operation_id, "parameters": parameters}


# A generation's usage record, by the request id every response carries.
USAGE_LINK = {"usage": link("usage", request_id="$response.header.x-request-id")}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAI error body for each of ``statuses``, for a route's ``responses``."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        response = json_response(ErrorBody, ERROR_DESCRIPTIONS[status])
        if status in (429, 503):
            response["headers"] = copy.deepcopy(_RETRY_AFTER)
        out[status] = response
    return out


def document(app: FastAPI, *, api_keys: bool) -> dict[str, Any]:
    """The OpenAPI document of ``app``; ``api_keys``: ``/v1`` and ``/admin`` need a key."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            # A bad path or query parameter is a 400 (declared where one can be bad),
            # never FastAPI's 422 body.
            responses.pop("422", None)
            if api_keys and (needs_api_key(path) or path.startswith("/admin/")):
                operation["security"] = [{API_KEY_SCHEME: []}]
                refusals = (401, 403) if path.startswith("/admin/") else (401,)
                for status, response in errors(*refusals).items():
                    responses.setdefault(str(status), response)
            for response in responses.values():
                response.setdefault("headers", {}).update(copy.deepcopy(_REQUEST_ID))
    components = doc.setdefault("components", {})
    schemas: dict[str, Any] = components.setdefault("schemas", {})
    _hoist_defs(doc["paths"], schemas)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if api_keys:
        components["securitySchemes"] = {
            API_KEY_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "An API key from `POST /admin/keys`, or the admin key",
            }
        }
    return doc


def _hoist_defs(node: Any, schemas: dict[str, Any]) -> None:
    """Move every ``$defs`` under ``node`` into ``schemas``; one name, one schema."""
    for defs in _pop_defs(node):
        for name, schema in defs.items():
            known = schemas.setdefault(name, schema)
            if known != schema:
                raise ValueError(f"two different schemas are both named {name!r}")


def _pop_defs(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        defs = node.pop("$defs", None)
        if defs is not None:
            yield defs
        for value in node.values():
            yield from _pop_defs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _pop_defs(value)
