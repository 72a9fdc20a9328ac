"""The Responses API's routes: ``POST /v1/responses`` and the stored responses
(``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``).

Thin: parse the body, ask :mod:`~tokenmill.server.responses.serving`, send one JSON
body or the events; the stream races the client leaving (the generation is then
stopped and settled), as every generation route's does.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from tokenmill.chat.hosted import OMITTED_HEADER, omitted_header
from tokenmill.ledger import ResponseStore
from tokenmill.server.endpoint import call_of
from tokenmill.server.intake import parse_body
from tokenmill.server.openapi import (
    USAGE_LINK,
    errors,
    json_body,
    json_response,
    schema_of,
    typed_event_stream,
)
from tokenmill.server.responses import serving
from tokenmill.server.responses.protocol import (
    DeletedResponse,
    InputItemList,
    InputItemsQuery,
    ResponseObject,
    ResponsesRequest,
    StreamEvent,
)
from tokenmill.server.sse import respond

router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


_STREAM = typed_event_stream(StreamEvent)


@router.post(
    "/v1/responses",
    openapi_extra=json_body(ResponsesRequest),
    responses={
        200: {
            "description": "The response, or with `stream` its events (`event:` names "
            "each), ending with `response.completed`, `response.incomplete` or "
            "`response.failed`",
            "content": {
                "application/json": {"schema": schema_of(ResponseObject, "serialization")},
                "text/event-stream": _STREAM,
            },
            "links": USAGE_LINK,
        },
        **errors(400, 402, 403, 404, 413, 429, 502, 503),
    },
)
async def create_response(request: Request) -> Response:
    endpoint = serving.RESPONSES
    body = await parse_body(request, endpoint.model, endpoint.tags)
    call = call_of(request)
    # The hosted tools left out, for the header: a 400 here, before any stream.
    omitted = serving.check_tools(call.gateway.deployment(body.model), body)
    response = await respond(request, endpoint.serve(call, body), body.stream, endpoint.in_band)
    if omitted:
        response.headers[OMITTED_HEADER] = omitted_header(omitted)
    return response


@router.get(
    "/v1/responses/{response_id}",
    responses={
        200: json_response(ResponseObject, "The stored response"),
        **errors(404),
    },
)
async def get_response(request: Request, response_id: str) -> JSONResponse:
    answer = await serving.get_response(store_of(request), response_id, request.state.caller)
    return JSONResponse(answer)


@router.delete(
    "/v1/responses/{response_id}",
    responses={200: json_response(DeletedResponse, "Deleted"), **errors(404)},
)
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    answer = await serving.delete_response(store_of(request), response_id, request.state.caller)
    return JSONResponse(answer)


@router.get(
    "/v1/responses/{response_id}/input_items",
    responses={
        200: json_response(InputItemList, "The conversation's items up to the response"),
        **errors(400, 404),
    },
)
async def list_input_items(
    request: Request,
    response_id: str,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> JSONResponse:
    query = InputItemsQuery(limit=limit, order=order, after=after)
    answer = await serving.input_items(store_of(request), response_id, request.state.caller, query)
    return JSONResponse(answer)
