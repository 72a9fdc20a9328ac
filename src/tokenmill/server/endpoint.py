"""What a route and a Batch API line both go through: an :class:`Endpoint`.

An endpoint is a POST route's three parts, as vLLM's ``run_batch`` reaches its serving
classes: the wire model its body is read into (with the union tags dropped from a bad
field's name), its serving function, and how its event stream pings and tells an
error once the head went out (:class:`~tokenmill.server.sse.InBand`). The serving
function takes a :class:`Call` and the parsed body, refuses at once what it knows
without waiting (an unknown model: a 404 whatever a stream's keep-alive), and returns
the coroutine that opens an :class:`~tokenmill.server.sse.Answer`, shaped by its API's
pure encoder: sent as events or collected into one body.

A route (:func:`answer`) reads the body through the one intake, makes the
:class:`Call` from the HTTP request (:func:`call_of`: its caller, as auth resolved it,
and request id) and responds; the batch runner (:mod:`tokenmill.server.batches.
runner`) reads a line's stored body with the same intake and makes the :class:`Call`
from the line (the batch's owner, in the ``batch`` class): no HTTP request, no second
parse of anything.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.gateway import Gateway
from tokenmill.identity import Caller
from tokenmill.ledger import ResponseStore
from tokenmill.server.intake import parse_body, ready_gateway
from tokenmill.server.sse import OPENAI, Answer, InBand, respond

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Call:
    """Who asks and where, as a serving function needs it (never the HTTP request)."""

    gateway: Gateway
    caller: Caller
    request_id: str
    # Where the Responses API keeps the responses it stores (and reads a
    # previous_response_id from).
    responses: ResponseStore
    # The ``x-session-id`` header: a routing affinity hint (a body's ``user`` else).
    session: str | None = None


def call_of(request: Request) -> Call:
    """The call an HTTP request makes: its caller and request id, the ready gateway
    (a 503 while it loads)."""
    return Call(
        ready_gateway(request),
        request.state.caller,
        request.state.request_id,
        request.app.state.responses,
        request.headers.get("x-session-id"),
    )


# Refuses what it knows at once; returns the opening.
Serve = Callable[[Call, M], Coroutine[Any, Any, Answer]]


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[M]):
    """A POST route's wire model, serving function and stream framing."""

    path: str
    model: type[M]
    serve: Serve[M]
    tags: Collection[str] = ()  # union tags dropped from a bad field's name
    in_band: InBand = OPENAI


async def answer(request: Request, endpoint: Endpoint[M]) -> Response:
    """A route's response: the body read, served, sent whole or as events (``stream``)."""
    body = await parse_body(request, endpoint.model, endpoint.tags)
    opening = endpoint.serve(call_of(request), body)
    return await respond(request, opening, bool(getattr(body, "stream", False)), endpoint.in_band)


__all__ = ["Call", "Endpoint", "answer", "call_of"]
