"""The OpenAI-compatible routes: chat completions, completions, the deployments'
predict endpoints (which answer in the same shapes), embeddings, the models list, and
vLLM's tokenizer routes that OpenAI-compatible clients of vLLM read.

Thin: parse the body (:mod:`tokenmill.server.intake`), ask the serving module
(:mod:`~tokenmill.server.openai.serving`, :mod:`~tokenmill.server.openai.embeddings`,
:mod:`~tokenmill.server.openai.tokenizing`), and send one JSON body or the
server-sent events; the routes a Batch API line may call go through their
:class:`~tokenmill.server.endpoint.Endpoint`, as the line does. All logic lives below
this layer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from tokenmill.errors import InvalidRequestError
from tokenmill.gateway import Deployment, Gateway
from tokenmill.server.endpoint import answer, call_of
from tokenmill.server.intake import deployment_by_id, parse_body, ready_gateway
from tokenmill.server.openai import embeddings, tokenizing
from tokenmill.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    PredictRequest,
    SamplingFields,
    TokenizeBody,
)
from tokenmill.server.openai.replies import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Detokenized,
    Tokenized,
    TokenizerInfoBody,
)
from tokenmill.server.openai.serving import CHAT, COMPLETIONS, Route, open_generation
from tokenmill.server.openapi import (
    USAGE_LINK,
    any_of,
    errors,
    event_stream,
    json_body,
    json_response,
    schema_of,
)
from tokenmill.server.protocol import ModelCard, ModelList
from tokenmill.server.sse import EventStreamResponse, respond

router = APIRouter()

# The predict endpoints' ``route`` header: which of the two shapes to answer in.
ROUTE_HEADERS: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "chat": "chat",
    "completion": "completion",
    "completions": "completion",
}


# What can go wrong with a generation request, before streaming begins.
GENERATION_ERRORS = errors(400, 402, 403, 404, 413, 429, 502, 503)


def _generated(
    body: type[SamplingFields], json: type[BaseModel] | None, *events: type[BaseModel]
) -> dict[str, Any]:
    """The OpenAPI declarations of a generation route: its body and what it answers."""
    content: dict[str, Any] = {}
    if json is not None:
        content["application/json"] = {"schema": schema_of(json, "serialization")}
    content["text/event-stream"] = event_stream(*events)
    description = "One JSON body, or with `stream` server-sent events ending `data: [DONE]`"
    if json is None:
        description = "Server-sent events ending with `data: [DONE]`"
    return {
        "openapi_extra": json_body(body),
        "responses": {
            200: {"description": description, "content": content, "links": USAGE_LINK},
            **GENERATION_ERRORS,
        },
    }


@router.post(
    "/v1/chat/completions",
    **_generated(ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
)
async def chat_completions(request: Request) -> Response:
    return await answer(request, CHAT)


@router.post("/v1/completions", **_generated(CompletionRequest, Completion, CompletionChunk))
async def completions(request: Request) -> Response:
    return await answer(request, COMPLETIONS)


@router.post(
    "/tokenize",
    openapi_extra=json_body(TokenizeBody),
    responses={**errors(400, 404, 413, 503)},
)
async def tokenize(request: Request) -> Tokenized:
    body = await parse_body(request, TokenizeBody)
    return await tokenizing.tokenize(ready_gateway(request).deployment(body.model), body)


@router.post(
    "/detokenize",
    openapi_extra=json_body(DetokenizeBody),
    responses={**errors(400, 404, 413, 503)},
)
async def detokenize(request: Request) -> Detokenized:
    body = await parse_body(request, DetokenizeBody)
    return await tokenizing.detokenize(ready_gateway(request).deployment(body.model), body)


@router.get("/tokenizer_info", responses={**errors(400, 404, 503)})
async def tokenizer_info(request: Request, model: str | None = None) -> TokenizerInfoBody:
    # vLLM's route, where lm-evaluation-harness's remote tokenizer looks first: the
    # single deployment's unless ``?model=`` names one, as ``/tokenize`` picks it.
    return await tokenizing.tokenizer_info(ready_gateway(request).deployment(model))


@router.post(
    "/v1/embeddings",
    openapi_extra=json_body(embeddings.EmbeddingBody),
    responses={
        200: {
            **json_response(embeddings.EmbeddingList, "One unit-length vector per input"),
            "links": USAGE_LINK,
        },
        **errors(400, 402, 403, 404, 413, 429, 502, 503),
    },
)
async def create_embeddings(request: Request) -> Response:
    return await answer(request, embeddings.EMBEDDINGS)


async def _predict(request: Request, deployment_id: str, stream: bool) -> Response:
    deployment = deployment_by_id(ready_gateway(request), deployment_id)
    body = await parse_body(request, PredictRequest)
    route: Route = deployment.config.endpoint_type
    header = request.headers.get("route")
    if header is not None:
        if header.strip() not in ROUTE_HEADERS:
            raise InvalidRequestError(
                f"unknown route header {header!r}: use /v1/chat/completions or /v1/completions",
                param="route",
            )
        route = ROUTE_HEADERS[header.strip()]
    if body.endpoint_type is not None:
        route = body.endpoint_type
    body.stream = stream
    if body.model is None:
        body.model = deployment.id
    opening = open_generation(
        call_of(request), deployment, body, route, prompt=body.prompt, messages=body.messages
    )
    return await respond(request, opening, body.stream)


@router.post(
    "/v1/deployments/{deployment_id}/predict",
    openapi_extra=json_body(PredictRequest),
    responses={
        200: {
            **json_response(
                any_of(ChatCompletion, Completion),
                "A chat or a text completion, by the deployment's `endpoint_type`",
            ),
            "links": USAGE_LINK,
        },
        **GENERATION_ERRORS,
    },
)
async def predict(request: Request, deployment_id: str) -> Response:
    return await _predict(request, deployment_id, stream=False)


@router.post(
    "/v1/deployments/{deployment_id}/predictWithResponseStream",
    response_class=EventStreamResponse,
    status_code=200,
    **_generated(PredictRequest, None, ChatCompletionChunk, CompletionChunk),
)
async def predict_stream(request: Request, deployment_id: str) -> Response:
    return await _predict(request, deployment_id, stream=True)


def _card(d: Deployment) -> ModelCard:
    return ModelCard(id=d.id, object="model", created=d.created, owned_by="tokenmill")


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    gw: Gateway = request.app.state.gateway
    return ModelList(object="list", data=[_card(d) for d in gw.deployments.values()])


@router.get("/v1/models/{model_id:path}", responses=errors(404))
async def model(request: Request, model_id: str) -> ModelCard:
    gw: Gateway = request.app.state.gateway
    return _card(gw.deployment(model_id))
